"""The lab's tools that reuse stored results never mix results made under other settings: the regime map refuses a
file made with another config, --set, spec, --batches or --draws (naming the setting, before measuring anything) and
measures a newly requested estimator; the plateau tool refuses a variant whose seeds were trained alike but for
their seed no longer, and a pair evaluated differently."""

from __future__ import annotations

import json

import pytest

from command_line import files_under, refused
from lab import regime_map as rm
from lab.__main__ import main
from constructed_runs import constructed_run, exact_curve

PROG = "python -m lab"
SMALL = ["--steps", "10", "--sde", "cps", "--no-cuts", "--batches", "3", "--draws", "1"]     # 2 regimes


@pytest.fixture
def fake_measure(monkeypatch):
    """The meter replaced by records of the right shape (what is measured, not how, is under test here): each call's
    estimator specs are kept in ``calls``."""
    calls = []

    def measure(cfg, specs, batches, draws, target):
        calls.append(list(specs))
        names = ["exact", *[s.partition(":")[0] for s in specs]]
        return [{"estimator": n, "rows_per_sample": 4.0, "error_to_noise": 0.1, "error_to_noise_se": 0.01,
                 "bias_z": 0.5, "prediction_range": "0.90-0.95", "linearity": 0.7, "linearity_min": 0.6}
                for n in names]

    monkeypatch.setattr(rm, "measure", measure)
    monkeypatch.setattr(rm, "linearity", lambda cfg, batches: {"linearity": 0.7, "linearity_min": 0.6})
    return calls


def _map(argv, capsys):
    code = main(["regime-map", *argv])
    capsys.readouterr()
    return code


def test_a_map_of_other_settings_is_refused_before_anything_is_measured(tmp_path, capsys, fake_measure):
    path = tmp_path / "map.jsonl"
    assert _map([*SMALL, "--estimator", "w3:window=3", "--json", str(path)], capsys) == 0
    assert fake_measure == [["w3:window=3"], ["w3:window=3"]]
    before = files_under(tmp_path)
    for extra, culprit in ((["--set", "sample.prompts_per_iter=4"], "--set/--config sample.prompts_per_iter"),
                           (["--batches", "4"], "--batches 3, not 4"),
                           (["--estimator", "w3:window=4"], "'w3' was measured as 'w3:window=3', not 'w3:window=4'")):
        spec = [] if extra[0] == "--estimator" else ["--estimator", "w3:window=3"]
        refused(main, ["regime-map", *SMALL, *spec, *extra, "--json", str(path)], capsys, str(path), culprit,
                prog=PROG)
    assert len(fake_measure) == 2 and files_under(tmp_path) == before       # nothing measured, nothing written


def test_a_newly_requested_estimator_is_measured_and_the_rest_reused(tmp_path, capsys, fake_measure):
    path = tmp_path / "map.jsonl"
    assert _map([*SMALL, "--estimator", "config", "--json", str(path)], capsys) == 0
    assert _map([*SMALL, "--estimator", "config", "--estimator", "s3:window=3", "--json", str(path)], capsys) == 0
    assert fake_measure == [["config"], ["config"], ["s3:window=3"], ["s3:window=3"]]
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for eta in (0.3, 0.7):                                     # per regime: exact once, config, and the new one
        assert sorted(r["estimator"] for r in recs if r["eta"] == eta) == ["config", "exact", "s3"]
    s3 = next(r for r in recs if r["estimator"] == "s3")
    assert s3["settings"]["spec"] == "s3:window=3" and s3["settings"]["config"]["sample"]["sde_type"] == "cps"
    assert _map([*SMALL, "--estimator", "config", "--estimator", "s3:window=3", "--json", str(path)], capsys) == 0
    assert len(fake_measure) == 4                              # everything there: nothing measured again


def test_records_that_do_not_say_their_settings_are_refused(tmp_path, capsys, fake_measure):
    path = tmp_path / "map.jsonl"
    assert _map([*SMALL, "--estimator", "config", "--json", str(path)], capsys) == 0
    old = [{k: v for k, v in json.loads(line).items() if k != "settings"} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    refused(main, ["regime-map", *SMALL, "--estimator", "config", "--json", str(path)], capsys,
            "does not say what it was measured with", "--summary", prog=PROG)
    assert _map(["--json", str(path), "--summary"], capsys) == 0          # its table can still be printed


def test_a_window_longer_than_a_regimes_trained_steps_is_refused_before_measuring(tmp_path, capsys, fake_measure):
    """The cut windows train 4 steps: an estimator with window 5 was clamped to one interval of every step."""
    refused(main, ["regime-map", "--steps", "10", "--sde", "dance", "--estimator", "w5:window=5", "--batches", "3",
                   "--json", str(tmp_path / "m.jsonl")], capsys, "--estimator 'w5:window=5'",
            "more than the 4 trained steps", prog=PROG)
    assert fake_measure == [] and not (tmp_path / "m.jsonl").exists()


# ----------------------------------------------------------------------------- the plateau tool


def _results(tmp_path, config_of) -> str:
    for variant in ("exact", "slow"):
        for seed in range(3):
            d = tmp_path / "out" / variant / f"seed{seed}"
            d.mkdir(parents=True)
            r = constructed_run(variant, seed, exact_curve, offset=0.01 * seed)
            r["config"] = config_of(variant, seed, r["config"])
            (d / "result.json").write_text(json.dumps(r))
    return str(tmp_path / "out")


@pytest.mark.parametrize("config_of,culprits", [
    (lambda v, s, c: {**c, "sample": {"eta": 0.3 if s == 2 else 0.7}},
     ["exact/seed2/result.json", "other settings than", "sample.eta: 0.3 and 0.7"]),
    (lambda v, s, c: {**c, "eval": {"every": 5 if v == "slow" else 10}},
     ["--pair slow:exact", "evaluated differently", "eval.every"]),
])
def test_the_plateau_tool_refuses_results_of_other_settings(config_of, culprits, tmp_path, capsys):
    out = _results(tmp_path, config_of)
    refused(main, ["plateau", "--out", out, "--seeds", "3", "--pair", "slow:exact"], capsys, *culprits, prog=PROG)


def test_the_plateau_tool_compares_seeds_that_differ_in_their_seed_alone(tmp_path, capsys):
    out = _results(tmp_path, lambda v, s, c: c)                          # seed and log.output_dir differ: fine
    assert main(["plateau", "--out", out, "--seeds", "3", "--pair", "slow:exact"]) == 0
    assert "slow - exact" in capsys.readouterr().out
