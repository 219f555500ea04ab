"""Unbiased JAGG's per-interval rates (``correction_probs``, :func:`jagg.knots.budget_probs`) beside ``correction_p``:
the mean of many draws is exact, rate 1 is exact, a zero rate leaves plain JAGG (float64 toys); and the retired
options are unknown keys."""

import math

import pytest
import torch

from jagg import EstimatorConfig
from jagg.knots import budget_probs
from tiny_runs import meter_sets
from gradient_checks import assert_mean_is
from toy import Nonlinear, perturb, run, sampled_traj

TIGHT = dict(rtol=1e-10, atol=1e-13)


def _case(B=4, T=12, seed=0, adv=None):
    torch.manual_seed(seed)
    model = Nonlinear(batch=B)
    traj = sampled_traj(model, B=B, T=T)
    perturb(model, 0.05)
    adv = torch.linspace(-1.2, 1.5, B, dtype=torch.float64) if adv is None else adv
    return model, traj, adv


def _base(**kw):
    return {"mode": "jagg", "window": 4, "clip_range": 0.05, **kw}


def _draws(model, traj, adv, cfg, n, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([run(model, traj, adv, cfg, generator=gen, **kw)[0] for _ in range(n)])


# ----------------------------------------------------------------------------- per-interval rates


def test_rates_of_one_everywhere_are_exact_and_a_zero_rate_leaves_plain_jagg_there():
    """correction_probs [1, 1, 1] (three step groups of 4) is exact; [0.5, 0, 1] corrects the first and the last step
    group and leaves the middle one plain: its mean over draws is exact on steps 0-3 and 8-11, plain JAGG on 4-7."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    g1, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_probs=[1.0, 1.0, 1.0])),
                generator=torch.Generator().manual_seed(0))
    assert torch.allclose(g1, exact, **TIGHT)
    middle = list(range(4, 8))
    ex_mid, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05), only_steps=middle)
    plain_mid, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_p=0.0)), only_steps=middle)
    target = exact - ex_mid + plain_mid
    cfg = EstimatorConfig(**_base(correction_probs=[0.5, 0.0, 1.0]))
    grads = _draws(model, traj, adv, cfg, 300)
    assert_mean_is(grads, target, exact)
    st = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(3))[1]
    assert st.intervals_corrected == 2 + 4                                 # half of the first group's, all the last's


def test_rates_must_fit_the_layout_and_be_probabilities():
    model, traj, adv = _case()
    with pytest.raises(ValueError, match="correction_probs has 2 rates.*3 intervals"):
        run(model, traj, adv, EstimatorConfig(**_base(correction_probs=[0.5, 0.5])))
    for bad, match in (([1.5], r"correction_probs\[0\]"), ([], "non-empty"), ("0.5", "non-empty"),
                       ([0.2, float("nan")], r"correction_probs\[1\]")):
        with pytest.raises(ValueError, match=match):
            EstimatorConfig(correction_probs=bad)
    # exact mode ignores rates laid out for JAGG's intervals (K single steps there)
    run(model, traj, adv, EstimatorConfig(mode="exact", correction_probs=[0.5, 0.5]))


def test_budget_probs_minimise_the_variance_at_the_budget():
    D, r = [4.0, 1.0, 0.0], [2.0, 2.0, 2.0]
    p = budget_probs(D, r, 2.0)
    assert p == pytest.approx([2 / 3, 1 / 3, 0.0]) and sum(a * b for a, b in zip(p, r)) == pytest.approx(2.0)
    cost = lambda q: sum((1 / x - 1) * d for x, d in zip(q, D) if d > 0)
    grid = [(x, (2.0 - 2 * x) / 2) for x in (i / 1000 for i in range(1, 1000)) if 0 < (2.0 - 2 * x) / 2 <= 1]
    best = min(grid, key=lambda q: cost(q))
    assert cost(p) <= cost(best) + 1e-9 and p[0] == pytest.approx(best[0], abs=2e-3)
    assert budget_probs([100.0, 1.0], [1.0, 1.0], 1.5) == pytest.approx([1.0, 0.5])       # capped, budget passed on
    assert budget_probs([3.0, 1.0], [2.0, 1.0], 10.0) == [1.0, 1.0]
    assert budget_probs([0.0, 0.0], [2.0, 2.0], 1.0) == [0.0, 0.0]
    assert budget_probs([2.0, -0.1], [2.0, 0.0], 1.0) == pytest.approx([0.5, 0.0])
    for args, match in ((([1.0], [1.0, 2.0], 1.0), "one error per interval"), (([1.0], [-1.0], 1.0), ">= 0"),
                        (([math.nan], [1.0], 1.0), "finite")):
        with pytest.raises(ValueError, match=match):
            budget_probs(*args)


# ----------------------------------------------------------------------------- in the trainers


def test_trainer_trains_with_rates_and_interval_subsampling(tmp_path, tiny_ckpt):
    """Per-interval rates and interval subsampling with the correction train through `jagg train`."""
    from tiny_runs import records, tiny_train_args
    from jagg.cli import main

    for name, sets in (("rates", ("estimator.correction_probs=[0.5]",)),
                       ("frac", ("estimator.window=3", "estimator.correction_p=0", "estimator.interval_frac=0.5"))):
        out = tmp_path / name
        assert main(tiny_train_args(tiny_ckpt, out, 2, "estimator.window=4", "estimator.correction_p=0.5", *sets)) == 0
        train = [r for r in records(out) if r["kind"] == "train"]
        assert len(train) == 2 and all(r["backward_items"] > 0 for r in train)
        if name == "frac":                       # step groups 0-2 and 3: one of the two per sample, 1 or 2 rows
            assert all(4 <= r["backward_items"] <= 8 for r in train)


@pytest.mark.parametrize("key, close", [("control_variate", None), ("correction_intervals", "correction_probs"),
                                        ("correction", "correction_p"), ("score", None)])
def test_retired_estimator_keys_are_unknown(tmp_path, key, close):
    """The retired options (the control variate, the step correction, correction_intervals, the routing scores) are
    unknown keys: a YAML or --set that still names one fails with the unknown-key error and its suggestion."""
    from jagg.cli import main
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.infra import config_loader

    cfg = tmp_path / "old.yaml"
    cfg.write_text(f"estimator:\n  {key}: 1\n")
    with pytest.raises(ValueError, match=f"unknown.*{key}" + (f".*did you mean.*{close}" if close else "")):
        config_loader.load(ShapesTrainConfig, str(cfg), [])
    assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- in jagg bench meter


def test_estimator_specs_take_lists_and_budget_probs():
    from jagg.bench.meter_command import parse_estimator, wants_budget_probs
    from jagg.checks import parse_spec

    assert parse_spec("r:correction_probs=[0.4,0.1],window=5", "--estimator") == (
        "r", {"correction_probs": "[0.4,0.1]", "window": "5"})
    name, est = parse_estimator("r:correction_probs=[0.4, 0.1],window=5", EstimatorConfig())
    assert name == "r" and est.correction_probs == [0.4, 0.1] and est.window == 5
    assert wants_budget_probs("r:correction_probs=by_interval,window=5")
    assert not wants_budget_probs("r:correction_probs=[0.5]") and not wants_budget_probs("config")
    assert parse_estimator("r:correction_probs=by_interval", EstimatorConfig())[1].correction_probs is None
    assert parse_estimator("plain", EstimatorConfig(correction_probs=[0.2]))[1].corrects is False


def test_bench_meter_measures_the_new_estimators(tmp_path, bench_ckpt, capsys):
    """Budget rates from the per-interval error (a pilot of its own) and interval subsampling, through `jagg bench
    efficiency` on the tiny checkpoint."""
    import json

    from jagg.cli import main

    out = tmp_path / "eff.json"
    sets = meter_sets(bench_ckpt)
    args = ["bench", "meter", "--batches", "3", "--draws", "2",
            "--estimator", "rates:correction_probs=by_interval", "--estimator", "half:interval_frac=0.5",
            "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["estimator"]: r for r in json.loads(out.read_text()) if r.get("kind") is None}
    assert list(recs) == ["exact", "rates", "half"]
    # 8 steps, step groups of 4: 4 knot rows
    assert 2 <= recs["half"]["rows_per_sample"] <= 3           # one group's 2 knots, + 2 inner rows if corrected
    rates = recs["rates"]["estimator_config"]["correction_probs"]
    assert len(rates) == 2 and sum(rates) * 2 == pytest.approx(0.25 * 4, abs=1e-3)      # the uniform rate's rows
    assert "rates: correction_probs" in capsys.readouterr().out
    assert all(math.isfinite(r["error_to_noise"]) for r in recs.values())
