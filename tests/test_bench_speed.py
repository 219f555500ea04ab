"""``jagg bench speed`` at its tiniest settings: every knot layout, window, inner-velocity mode, variant (interval
subsampling, the correction) and random timestep subsampling is timed against exact, the JSON holds the documented
keys, and the rows each ran (backward with grad, forward without) are exactly the cost model's. It times nothing
itself: a busy machine only changes the measured seconds."""

import json

import pytest

from jagg.cli import main


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
