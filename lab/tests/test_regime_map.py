"""`python -m lab regime-map`: the grid, a smoke-sized map on the main job that resumes, its summary and
the linearity score's rank correlation, and its refusals."""

import json

import pytest

from lab import regime_map as rm

SMALL = ["--batches", "3", "--draws", "1", "--estimator", "config", "--set", "sample.prompts_per_iter=4",
         "--set", "sample.group_size=4"]


def test_the_grid():
    grid = rm.regimes([10, 20], list(rm.SDE_NOISE), cuts=True)
    assert len(grid) == 2 * 7 + 3 and len({rm.key(r) for r in grid}) == len(grid)
    assert {tuple(r["sde_window"]) for r in grid if r["num_steps"] == 20} == {(0, 16)}
    assert rm.regimes([20], ["cps"], cuts=True) == [{"num_steps": 20, "sde_type": "cps", "eta": e,
                                                     "sde_window": [0, 16]} for e in (0.3, 0.7)]
    assert rm.overrides(grid[-1]) == ["sample.num_steps=10", "sample.sde_type=dance", "sample.eta=1.0",
                                      "sample.sde_window=[2, 8]"]


def test_spearman():
    assert rm.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rm.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rm.spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)          # ties take average ranks


def test_a_small_map_resumes_and_summarises(tmp_path, capsys):
    path = tmp_path / "map.jsonl"
    argv = ["--steps", "10", "--sde", "flow_grpo", "--no-cuts", *SMALL, "--json", str(path)]
    assert rm.main(argv) == 0
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["eta"], r["estimator"]) for r in recs] == [(0.3, "exact"), (0.3, "config"), (1.0, "exact"),
                                                         (1.0, "config")]
    for r in recs:
        assert 0 < r["linearity_min"] <= r["linearity"] <= 1          # cosines of a curved path, mean above min
        assert r["sde_window"] == [0, 8] and r["num_steps"] == 10 and "tensors" not in r
    plain = [r for r in recs if r["estimator"] == "config"]
    assert all(r["error_to_noise"] > 0 and r["rows_per_sample"] == 4 for r in plain)
    assert all(r["prediction_range"] == "unknown" or "-" in r["prediction_range"] for r in plain)
    assert rm.main(argv) == 0                                            # both regimes done: nothing measured again
    assert len(path.read_text().splitlines()) == 4
    capsys.readouterr()
    assert rm.main(["--json", str(path), "--summary"]) == 0
    assert "| 10 | 0-7 | flow_grpo, 0.3 |" in capsys.readouterr().out


def test_the_fallback_score_is_the_meters():
    """Without ``config`` among the estimators the map draws the rollouts itself: the same seeded rollouts, so the
    same score the meter gives the config's layout."""
    r = rm.regimes([10], ["flow_grpo"], cuts=False)[0]
    sets = ["sample.prompts_per_iter=4", "sample.group_size=4"]
    with_config = rm.run_regime(r, None, sets, ["config"], 3, 1)
    without = rm.run_regime(r, None, sets, ["subsample"], 3, 1)
    assert {rec["estimator"] for rec in without} == {"exact", "subsample"}
    assert without[0]["linearity"] == pytest.approx(with_config[0]["linearity"], rel=1e-6)
    assert without[0]["linearity_min"] == pytest.approx(with_config[0]["linearity_min"], rel=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--batches", "2"], "--batches must be >= 3"),
    (["--summary"], "no records"),
    (["--estimator", "w:window=4,window=5"], "option 'window' is given twice"),
])
def test_bad_input_is_refused(tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        rm.main(["--json", str(tmp_path / "none.jsonl"), *args])
