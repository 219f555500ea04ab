"""Smoke tests of ``jagg bench speed | fidelity | quality`` at their tiniest settings, through ``jagg.cli.main``.

They check that each sub-command runs, writes the documented JSON keys and sane values, and that the
counts match the cost model exactly. They time nothing: speed is measured by the benchmark itself.
"""

import json

import pytest
import torch

from jagg.bench.common import spearman
from jagg.cost import cost_limit
from jagg.cli import main




def test_cost_model_and_spearman():
    assert cost_limit(4, "interp") == 2.0 and cost_limit(8, "interp") == 4.0
    assert cost_limit(4, "fresh") == pytest.approx(12 / 8) and cost_limit(8, "fresh") == pytest.approx(24 / 12)
    assert cost_limit(2, "fresh") == cost_limit(2, "interp") == 1.0
    assert cost_limit(4, "interp", steps=10) == pytest.approx(10 / 6)       # groups 4, 4, 2
    # routing: half of each eligible group through JAGG; exact first/last groups count as exact
    assert cost_limit(4, "interp", steps=8, jagg_frac=0.5) == pytest.approx(24 / (2 * (0.5 * 6 + 0.5 * 12)))
    assert cost_limit(4, "interp", steps=10, exact_first=1) == pytest.approx(30 / (12 + 6 + 6))
    assert cost_limit(4, "interp", steps=10, knots="shared") == pytest.approx(10 / 4)    # knots 0, 3, 6, 9
    assert cost_limit(4, "fresh", steps=10, knots="shared") == pytest.approx(30 / (12 + 6))
    assert cost_limit(4, "interp", steps=8, correction_p=0.25) == pytest.approx(8 / (4 + 0.25 * 4))
    assert cost_limit(4, "interp", steps=8, correction_probs=[0.25, 0.0]) == pytest.approx(8 / (4 + 0.25 * 2))
    assert cost_limit(4, "interp", steps=10, exact_last=1) == pytest.approx(10 / 8)  # the last group JAGG could take
    # interval subsampling: m of n intervals kept; exact's is n / m; a knot shared with a drawn neighbour counts once
    assert cost_limit(5, "interp", steps=20, interval_frac=0.6) == pytest.approx(20 / 4)      # 2 of 4 step groups
    assert cost_limit(4, "interp", steps=10, jagg_frac=0.0, interval_frac=0.5) == pytest.approx(1.5)
    assert cost_limit(4, "interp", steps=10, knots="shared", interval_frac=0.67) == pytest.approx(10 / (10 / 3))
    assert cost_limit(4, "interp", steps=8, correction_probs=[0.5, 0.0]) == pytest.approx(8 / (4 + 0.5 * 2))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)       # ties get average ranks


@pytest.mark.parametrize("est", [
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.5, correction_p=0.25),
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.67, correction_p=0.0, intermediate="fresh"),
    dict(mode="jagg", window=5, interval_frac=0.6, correction_p=0.5, exact_last_intervals=1),
    dict(mode="jagg", window=4, correction_probs=[0.5, 0.25, 1.0, 0.0], intermediate="fresh"),
    dict(mode="jagg", window=4, knots="shared", correction_p=0.5, interval_frac=0.5),
    dict(mode="exact", window=4, knots="shared", interval_frac=0.4),
])
def test_cost_model_expects_the_rows_the_plans_run(est):
    """estimator_limit's expected rows (B = 2F) against the mean over 400 plans of what they run (rows with grad,
    no-grad inner rows), for interval subsampling and the corrections on 14 trained steps."""
    from jagg import EstimatorConfig
    from jagg.cost import estimator_limit
    from jagg.knots import plan_update
    from toy import Nonlinear, sampled_traj

    torch.manual_seed(0)
    traj = sampled_traj(Nonlinear(batch=4), B=4, T=14)
    cfg = EstimatorConfig(micro_batch=64, **est)
    gen, cost = torch.Generator().manual_seed(0), []
    for _ in range(400):
        plan = plan_update(traj, cfg, generator=gen)
        rows = plan.rows
        nograd = sum(t.source[1] >= 0 for b in plan.bundles for t in b.terms) if cfg.intermediate == "fresh" else 0
        cost.append(3 * rows + nograd)
    assert 14 * 3 * 4 / (sum(cost) / len(cost)) == pytest.approx(estimator_limit(cfg, 14), rel=0.02)


def test_bench_speed_smoke(tmp_path, bench_ckpt):
    out = tmp_path / "speed.json"
    B, T = 2, 8
    assert main(["bench", "speed", "--models", "tiny_dit", "--tiny-checkpoint", bench_ckpt,
                 "--windows", "2", "4", "8", "--batch", str(B), "--steps", str(T), "--micro-batch", "4",
                 "--repeats", "1", "--threads", "1", "--subsample", "0.5", "0.25", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    sub = {r["window"]: r for r in recs if r["knots"] == "subsample"}   # random timestep subsampling, timed too
    assert set(sub) == {0.5, 0.25} and all(r["mode"] == "subsample" for r in sub.values())
    for f, m in ((0.5, 4), (0.25, 2)):                          # round(f 8) of the 8 steps: limit 8 / m
        assert sub[f]["backward_items_jagg"] == B * m and sub[f]["limit"] == sub[f]["limit_measured"] == T / m
    recs = [r for r in recs if r["knots"] != "subsample"]
    variants = [r for r in recs if r["variant"]]                # interval subsampling and the correction, W > 2
    assert {(r["knots"], r["window"], r["intermediate"], r["variant"]) for r in variants} == {
        (k, w, i, v) for k in ("groups", "shared") for w in (4, 8) for i in ("fresh", "interp")
        for v in ("interval_frac=0.5", "correction_p=0.25")}
    by = {(r["knots"], r["window"], r["intermediate"], r["variant"]): r for r in variants}
    half = by[("groups", 4, "interp", "interval_frac=0.5")]     # one of the 2 step groups per sample: 2 of 8 rows
    assert half["backward_items_jagg"] == B * 2 and half["limit"] == pytest.approx(4.0)
    fix = by[("groups", 4, "interp", "correction_p=0.25")]      # 4 units at 0.25: one corrected, by its 2 inner rows
    assert fix["backward_items_jagg"] == B * 4 + 2 and fix["limit"] == pytest.approx(8 / (4 + 0.25 * 4))
    recs = [r for r in recs if not r["variant"]]
    pairs = {(w, i) for w in (2, 4, 8) for i in ("fresh", "interp")}
    assert {(r["window"], r["intermediate"]) for r in recs} == pairs
    assert len(recs) == 2 * len(pairs)                          # groups, shared
    for r in recs:
        if r["knots"] != "groups":                              # knots every W - 1 steps: 1 + ceil(7 / (W - 1))
            W = r["window"]
            assert r["backward_items_jagg"] == B * (T if W == 2 else 1 + -(-(T - 1) // (W - 1)))
    recs = [r for r in recs if r["knots"] == "groups"]
    for r in recs:
        assert {"model", "mode", "intermediate", "window", "exact_s", "jagg_s", "speedup", "limit",
                "backward_items_exact", "backward_items_jagg", "limit_measured", "peak_mem_exact_mb"} <= set(r)
        W, fresh = r["window"], r["intermediate"] == "fresh"
        # limit_measured comes from measured forward/backward times: any positive value on a busy machine
        assert r["exact_s"] > 0 and r["jagg_s"] > 0 and r["speedup"] > 0 and r["limit_measured"] > 0
        groups = B * T // W                                     # (sample, group) pairs
        assert r["backward_items_exact"] == groups * W          # exact: W backward rows per group per sample
        assert r["backward_items_jagg"] == groups * 2           # JAGG: 2
        assert r["forward_nograd_items_jagg"] == (groups * (W - 2) if fresh else 0)
        assert r["limit"] == pytest.approx(1.0 if W == 2 else (3 * W / (W + 4) if fresh else W / 2))


