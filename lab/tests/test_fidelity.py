"""`python -m lab fidelity`: the cosine and relative error of an estimator's gradient against exact, per knot layout."""

import json

import pytest

from tiny_runs import GENERIC
from lab.__main__ import main


def test_bench_fidelity_smoke(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "fidelity.json"
    sets = [*GENERIC, "sample.num_steps=7", "sample.prompts_per_iter=2", "sample.group_size=2", "estimator.micro_batch=4",
            "estimator.intermediate=interp", "sample.sde_window=null"]
    args = ["fidelity", "--checkpoint", bench_ckpt, "--advantages", "random", "--windows", "2", "4",
            "--fracs", "0.5", "1.0", "--threads", "1", "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    assert "Pareto" in capsys.readouterr().out
    recs = json.loads(out.read_text())
    tot = {(r["policy"], r["knots"], r["window"], r["intermediate"]): r for r in recs if r["kind"] == "fidelity"}
    assert set(tot) == {(p, k, w, i) for p in ("on", "off") for k in ("groups", "shared") for w in (2, 4)
                        for i in ("fresh", "interp")}
    for (policy, knots, W, inter), r in tot.items():
        assert -1 <= r["cosine"] <= 1 + 1e-9 and r["rel_err"] >= 0
        assert {"cos_noisy", "cos_middle", "cos_clean"} <= set(r)
        if W == 2:                                              # a knot at every step: exact
            assert r["cosine"] == pytest.approx(1.0, abs=1e-5) and r["rel_err"] < 1e-3
            assert r["backward_items_jagg"] == r["backward_items_exact"] == r["samples"] * 7
    assert tot[("on", "groups", 4, "interp")]["backward_items_jagg"] == 4 * 4      # groups 0-3, 4-6: 2 + 2 rows
    assert tot[("on", "shared", 4, "interp")]["backward_items_jagg"] == 4 * 3      # knots 0, 3, 6
    on4 = tot[("on", "groups", 4, "interp")]["cosine"]
    assert on4 == pytest.approx(tot[("on", "groups", 4, "fresh")]["cosine"], abs=1e-4)   # interp is exact on-policy
    sp = [r for r in recs if r["kind"] == "spearman"]
    assert {r["score"] for r in sp} == {"cosine"}
    assert all(r["pairs"] == 8 for r in sp)                     # 4 samples x 2 groups of > 2 steps
    full = [r for r in recs if r["kind"] == "routing" and r["jagg_frac"] == 1.0 and r["exact_first_intervals"] == 0]
    assert full and full[0]["cosine"] == pytest.approx(on4, abs=1e-6)  # routing everything = JAGG everywhere


def test_pareto_front():
    from lab.fidelity import pareto

    recs = [dict(checkpoint="c", policy="on", backward_items_jagg=r, cosine=c, name=n)
            for n, r, c in (("a", 10, 0.9), ("b", 12, 0.95), ("c", 12, 0.93), ("d", 8, 0.8), ("e", 10, 0.85))]
    assert {r["name"] for r in pareto(recs)} == {"a", "b", "d"}
