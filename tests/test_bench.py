"""Smoke tests of ``jagg bench speed | fidelity | quality`` at their tiniest settings, through ``jagg.cli.main``.

They check that each sub-command runs, writes the documented JSON keys and sane values, and that the
counts match the cost model exactly. They time nothing: speed is measured by the benchmark itself.
"""

import argparse
import json

import pytest
import torch

from jagg.bench.common import spearman
from jagg.bench.projection import cost_limit
from jagg.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    """The benchmarks run with one torch thread here (tiny models; robust on a busy machine); restore after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# what these smoke tests assume instead of the main job's layout and reward (step groups of 4 everywhere, geneval)
GENERIC = ["estimator.mode=jagg", "estimator.window=4", "estimator.exact_last_intervals=0", "reward.weights=null"]


@pytest.fixture(scope="module")
def bench_ckpt(tmp_path_factory):
    """A tiny TinyDiT whose zero-initialised layers are randomised (non-zero velocities and gradients)."""
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, image_size=16, dim=32, depth=1, heads=2,
                              text_dim=16, text_depth=1, text_heads=2, patch_size=4))
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.normal_(std=0.05)
    path = tmp_path_factory.mktemp("bench_ckpt") / "tiny.safetensors"
    save_pretrained(model, path)
    return str(path)


def efficiency_sets(ckpt: str) -> list[str]:
    """``--set`` strings for a seconds-long `jagg bench meter` on ``ckpt`` (:func:`bench_ckpt`): unbiased JAGG with
    step groups of 4 on 8 steps, 2 prompts x 4, a brightness reward with spread in every prompt group."""
    return ["estimator.exact_last_intervals=0", "estimator.correction_p=0.25", "reward.weights=null",
            f"model.checkpoint={ckpt}", "sample.num_steps=8", "sample.prompts_per_iter=2", "sample.group_size=4",
            "estimator.micro_batch=8", "threads=1", "sample.sde_window=null", "estimator.window=4",
            "grpo.drop_zero_spread=false", "reward.name=reward_plugins:brightness"]


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
    assert cost_limit(4, "interp", steps=8, correction_rates=[0.25, 0.0]) == pytest.approx(8 / (4 + 0.25 * 2))
    assert cost_limit(4, "interp", steps=10, exact_last=1) == pytest.approx(10 / 8)  # the last group JAGG could take
    # interval subsampling: m of n intervals kept; exact's is n / m; a knot shared with a drawn neighbour counts once
    assert cost_limit(5, "interp", steps=20, interval_frac=0.6) == pytest.approx(20 / 4)      # 2 of 4 step groups
    assert cost_limit(4, "interp", steps=10, jagg_frac=0.0, interval_frac=0.5) == pytest.approx(1.5)
    assert cost_limit(4, "interp", steps=10, knots="shared", interval_frac=0.67) == pytest.approx(10 / (10 / 3))
    assert cost_limit(4, "interp", steps=8, correction_rates=[0.5, 0.0]) == pytest.approx(8 / (4 + 0.5 * 2))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)       # ties get average ranks


@pytest.mark.parametrize("est", [
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.5, correction_p=0.25),
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.67, correction_p=0.0, intermediate="fresh"),
    dict(mode="jagg", window=5, interval_frac=0.6, correction_p=0.5, exact_last_intervals=1),
    dict(mode="jagg", window=4, correction_rates=[0.5, 0.25, 1.0, 0.0], intermediate="fresh"),
    dict(mode="jagg", window=4, knots="shared", correction_p=0.5, interval_frac=0.5),
    dict(mode="exact", window=4, knots="shared", interval_frac=0.4),
])
def test_cost_model_expects_the_rows_the_plans_run(est):
    """estimator_limit's expected rows (B = 2F) against the mean over 400 plans of what they run (rows with grad,
    no-grad inner rows), for interval subsampling and the corrections on 14 trained steps."""
    from jagg import EstimatorConfig
    from jagg.bench.projection import estimator_limit
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


def test_bench_fidelity_smoke(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "fidelity.json"
    sets = [*GENERIC, "sample.num_steps=7", "sample.prompts_per_iter=2", "sample.group_size=2", "estimator.micro_batch=4",
            "estimator.intermediate=interp", "sample.sde_window=null"]
    args = ["bench", "fidelity", "--checkpoint", bench_ckpt, "--advantages", "random", "--windows", "2", "4",
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
    from jagg.bench.fidelity import pareto

    recs = [dict(checkpoint="c", policy="on", backward_items_jagg=r, cosine=c, name=n)
            for n, r, c in (("a", 10, 0.9), ("b", 12, 0.95), ("c", 12, 0.93), ("d", 8, 0.8), ("e", 10, 0.85))]
    assert {r["name"] for r in pareto(recs)} == {"a", "b", "d"}


def test_bench_quality_smoke_and_resume(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "quality"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=4", "sample.prompts_per_iter=2",
            "sample.group_size=2", "eval.num_prompts=4", "eval.num_steps=3", "estimator.micro_batch=4",
            "grpo.drop_zero_spread=false", "threads=1", "grpo.updates_per_epoch=2", "sample.sde_window=null"]
    args = ["bench", "quality", "--quick", "--out", str(out), "--variant", "exact", "--variant", "jagg_fresh",
            "--variant", "unb:knots=shared,correction_p=0.5"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    recs = json.loads((out / "quality.json").read_text())
    runs = [r for r in recs if r["kind"] == "run"]
    assert {(r["variant"], r["seed"]) for r in runs} == {(v, s) for v in ("exact", "jagg_fresh", "unb") for s in (0, 1)}
    for r in runs:
        assert r["updates"] == 8 and len(r["train_curve"]) == 4 and len(r["test_curve"]) == 3   # evals at 0, 2, 4
        assert (out / r["variant"] / f"seed{r['seed']}" / "result.json").is_file()
    rows = {r["variant"]: r["rows_per_update"] for r in runs}
    assert rows["jagg_fresh"] < rows["exact"] and rows["unb"] < rows["exact"]
    assert [r["estimator"]["correction_p"] for r in runs if r["variant"] == "unb"] == [0.5, 0.5]
    # paired: a seed's first batch has the same prompts and noise in every variant (same first training reward)
    first = {(r["variant"], r["seed"]): r["train_curve"][0][2] for r in runs}
    assert first[("exact", 0)] == first[("jagg_fresh", 0)] == first[("unb", 0)]
    var = {r["variant"]: r for r in recs if r["kind"] == "variant"}
    assert var["exact"]["iter_ratio"] == pytest.approx(1.0) and var["exact"]["time_to_target_ratio"] == 1.0
    for v in ("jagg_fresh", "unb"):
        r = var[v]
        assert r["iter_ratio"] > 0 and 1.0 < r["iter_ratio_ideal"] <= r["limit"]
        assert r["ratio_lo"] <= r["time_to_target_ratio"] <= r["ratio_hi"] or r["not_reached_share"] > 0
        assert r["final_test_lo"] <= r["final_test_mean"] <= r["final_test_hi"] and r["eval_se"] > 0
        assert {"diff_vs_exact", "train_start", "train_end", "drifted", "within_exact_interval"} <= set(r)
    for v in ("exact", "jagg_fresh", "unb"):                   # rate, plateau and equal budget, with intervals
        r = var[v]
        assert {"rate", "rate_lo", "rate_hi", "rate_25", "rate_50", "rate_75", "rate_status", "plateau_gap",
                "plateau_gap_lo", "plateau_gap_hi", "plateau_evals", "budget", "budget_diff", "budget_diff_lo",
                "efficiency_to_lower_final", "projected_rate", "projected_budget_diff"} <= set(r)
        assert r["plateau_evals"] == 2 and r["evaluations"] == 3
    assert var["exact"]["plateau_gap"] == 0 and var["exact"]["budget_diff"] == 0
    assert all(r["evaluations"] == 3 and r["eval_s"] > 0 for r in runs)
    printed = capsys.readouterr().out
    for column in ("rate 25%", "rate 50%", "rate 75%", "rate (geo. mean)", "plateau gap", "CPU budget s",
                   "to lower final", "held-out evaluations: 3 per run"):
        assert column in printed, column
    assert (out / "quality.png").stat().st_size > 0
    assert main(args) == 2                                      # the comparison's files are not replaced ...
    assert "--overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0                    # ... unless asked; finished runs are skipped
    assert capsys.readouterr().out.count("already done") == 6
    assert main(args + ["--overwrite", "--set", "optim.lr=0.5"]) == 2   # ... but not reused under another config
    assert "optim.lr" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--eval-dense", "2:1"]) == 2    # ... nor under another evaluation schedule
    assert "eval.dense_every" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--eval-dense", "2"]) == 2
    assert "--eval-dense '2': give N:EVERY" in capsys.readouterr().err
    assert main(args + ["--train-only", "jagg_fresh"]) == 0     # one variant's runs (already done: skipped)
    assert capsys.readouterr().out.count("already done") == 2
    assert main(args + ["--train-only", "nosuch"]) == 2
    assert main(["bench", "quality", "--variant", "bad name:x=1"]) == 2
    assert main(["bench", "quality", "--variant", "nosuch"]) == 2


def test_bench_quality_resumes_a_run_only_under_its_evaluation_schedule(tmp_path, bench_ckpt, capsys):
    """An unfinished run (here: a finished one extended by --iterations) continues only with the evaluation
    settings it was recorded with, so that its test curve has one schedule; with them it continues."""
    out = tmp_path / "q"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=4", "sample.prompts_per_iter=2",
            "sample.group_size=2", "eval.num_prompts=4", "eval.num_steps=3", "estimator.micro_batch=4",
            "threads=1", "sample.sde_window=null", "log.checkpoint_every=1"]
    args = ["bench", "quality", "--quick", "--out", str(out), "--seeds", "1", "--variant", "exact",
            "--train-only", "exact"] + [a for s in sets for a in ("--set", s)]
    assert main(args + ["--iterations", "2"]) == 0
    capsys.readouterr()
    assert main(args + ["--iterations", "3", "--eval-every", "1"]) == 2
    err = capsys.readouterr().err
    assert "eval.every" in err and "the bench keeps a run's evaluation settings" in err
    assert main(args + ["--iterations", "3"]) == 0
    result = json.loads((out / "exact" / "seed0" / "result.json").read_text())
    assert result["iterations"] == 3 and [p[0] for p in result["test_curve"]] == [0, 2, 3]

def test_time_to_target_statistics():
    """smooth is a trailing mean; a curve that is the exact curve compressed in time by 2 reaches the target in
    half the time."""
    import numpy as np

    from jagg.bench.statistics import smooth, time_to_target

    assert smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    r = np.linspace(0, 1, 100)[None].repeat(3, 0)
    wall = np.arange(1, 101, dtype=float)[None].repeat(3, 0)
    t_ex, ok = time_to_target(r, wall, 0.9, 1)
    t_fast, ok2 = time_to_target(r, wall / 2, 0.9, 1)
    assert ok and ok2 and t_ex / t_fast == pytest.approx(2.0)
    assert time_to_target(r, wall, 2.0, 1) == (100.0, False)


def test_agreement_statistic_on_synthetic_gradients():
    from jagg.bench.signal import agreement, samples_for_half

    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(2000, generator=gen, dtype=torch.float64)
    # K estimates = mu + noise with tr(Cov) = 4 |mu|^2 -> expected c = 1 / 5
    est = mu + 2 * torch.randn(12, 2000, generator=gen, dtype=torch.float64) * mu.norm() / 2000 ** 0.5
    c, se = agreement(est)
    assert c == pytest.approx(0.2, abs=0.03) and 0 < se < 0.05
    noise = torch.randn(12, 2000, generator=gen, dtype=torch.float64)
    c0, se0 = agreement(noise)
    assert abs(c0) < 3 * se0 + 0.01
    assert samples_for_half(0.2, 0.01, 32) == (pytest.approx(128.0), False)   # N (1 - c) / c
    assert samples_for_half(0.0, 0.01, 32)[1] is True                       # not significant: a lower bound


def test_bench_signal_separates_a_learnable_reward_from_noise(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "signal.json"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=4", "sample.prompts_per_iter=8",
            "sample.group_size=4", "estimator.micro_batch=8", "threads=1", "model.trainable=final.bias",
            "sample.sde_window=null"]
    args = ["bench", "signal", "--batches", "8", "--rewards", "reward_plugins:brightness", "reward_plugins:coin",
            "--json", str(out)] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    recs = {r["reward"]: r for r in json.loads(out.read_text())}
    bright, coin = recs["reward_plugins:brightness"], recs["reward_plugins:coin"]
    assert bright["samples_per_batch"] == 32 and bright["batches"] == 8
    assert bright["cosine"] > 2 * bright["cosine_se"] and bright["cosine"] > coin["cosine"] + 0.1
    assert abs(coin["cosine"]) < 3 * coin["cosine_se"] + 0.05
    assert bright["lower_bound"] is False and bright["samples_for_cosine_0.5"] > 0
    assert "N for cos 0.5" in capsys.readouterr().out


def test_bench_e2e_round_robin(tmp_path, bench_ckpt, capsys):
    from jagg.bench.e2e import routed_limit
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig

    out = tmp_path / "e2e.json"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=8", "sample.prompts_per_iter=2", "sample.group_size=2",
            "estimator.micro_batch=4", "estimator.window=4", "estimator.jagg_frac=1.0", "threads=1",
            "grpo.drop_zero_spread=false", "sample.sde_window=null", "estimator.correction_p=0"]
    args = ["bench", "e2e", "--iterations", "2", "--variants", "jagg_fresh", "jagg_interp", "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"exact", "jagg_fresh", "jagg_interp"}
    assert recs["exact"]["iter_ratio"] == pytest.approx(1.0) and recs["exact"]["limit"] == 1.0
    # 8 trained steps, W=4: 32 backward rows exact, 16 with JAGG (two endpoints per group)
    assert recs["exact"]["backward_items"] == 32 and recs["jagg_interp"]["backward_items"] == 16
    for v in ("jagg_fresh", "jagg_interp"):
        r = recs[v]
        assert r["iter_s"] > 0 and r["sample_s"] > 0 and 1.0 < r["iter_ratio_ideal"] < r["limit"]
    assert recs["jagg_interp"]["limit"] == pytest.approx(2.0) and recs["jagg_fresh"]["limit"] == pytest.approx(1.5)
    half = configuration.load(ShapesTrainConfig, None, ["estimator.jagg_frac=0.5", "sample.num_steps=8",
                                                  "sample.sde_window=null", "estimator.window=4",
                                                  "estimator.correction_p=0", "estimator.intermediate=interp"])
    assert routed_limit(half) == pytest.approx(1 / (0.5 + 0.5 / 2))        # half the groups at the W/2 limit
    unb = configuration.load(ShapesTrainConfig, None, ["sample.num_steps=8", "sample.sde_window=null",
                                                 "estimator.intermediate=interp", "estimator.correction_p=0.25"])
    assert routed_limit(unb) == pytest.approx(8 / (4 + 0.25 * 4))           # unbiased, p = 0.25
    # intermediate auto: fresh inner forwards (one F each, a row costs F + 2F) in all but the first of U updates
    for u in (1, 4):
        auto = configuration.load(ShapesTrainConfig, None, ["sample.num_steps=8", "sample.sde_window=null",
                                                      "estimator.correction_p=0", "estimator.intermediate=auto",
                                                      f"grpo.updates_per_epoch={u}", "grpo.inner_epochs=1"])
        assert routed_limit(auto) == pytest.approx(8 * 3 / (4 * 3 + 4 * (u - 1) / u))
    assert "ideal" in capsys.readouterr().out


def test_bench_signal_compares_estimators_on_the_same_batches(tmp_path, bench_ckpt):
    out = tmp_path / "signal.json"
    base = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=8", "sample.prompts_per_iter=2",
            "sample.group_size=4", "estimator.micro_batch=8", "threads=1", "sample.sde_window=null",
            "estimator.window=4", "estimator.jagg_frac=1.0"]
    for mode, same in (("exact", True), ("jagg", False)):
        args = ["bench", "signal", "--batches", "3", "--rewards", "reward_plugins:brightness", "--estimators",
                "config", "exact", "--json", str(out), "--overwrite"]
        assert main(args + [a for s in base + [f"estimator.mode={mode}"] for a in ("--set", s)]) == 0
        recs = {r["estimator"]: r for r in json.loads(out.read_text())}
        assert set(recs) == {"config", "exact", "config x exact", "error (config - exact)"}
        cross = recs["config x exact"]["same_batch_cosine"]
        err = recs["error (config - exact)"]
        assert err["exact_cosine"] == pytest.approx(recs["exact"]["cosine"], abs=1e-9)
        if same:     # exact vs exact on the same batch: the same gradient, no error
            assert cross == pytest.approx(1.0, abs=1e-9)
            assert recs["config"]["cosine"] == pytest.approx(recs["exact"]["cosine"], abs=1e-9)
            assert err["rel_err"] < 1e-9
        else:        # JAGG: close to exact on the same batch, not equal (8 steps, W=4: two JAGG groups)
            assert 0.5 < cross < 1 - 1e-6
            assert 0 < err["rel_err"] < 1 and -1 <= err["cosine"] <= 1 and err["cosine_se"] >= 0


def test_bench_paired(tiny_ckpt, tmp_path):
    """jagg bench paired (and benchmarks/paired_eval.py, which forwards to it): a checkpoint against itself differs
    by exactly 0; against another model the difference is non-zero, inside its interval, and the whole split is the
    prompt-weighted mean of its parts."""
    import importlib.util
    from pathlib import Path

    from jagg.bench import paired
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    spec = importlib.util.spec_from_file_location(
        "paired_eval", Path(__file__).resolve().parents[1] / "benchmarks" / "paired_eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    js_same = tmp_path / "same.json"
    assert main(["bench", "paired", tiny_ckpt, tiny_ckpt, "--quick", "--json", str(js_same)]) == 0
    same = json.loads(js_same.read_text())["results"]
    assert all(r["diff"] == 0 and r["ci95"] == [0, 0] for r in same.values())
    assert same["all"]["prompts"] == same["seen_pairs"]["prompts"] + same["held_out_pairs"]["prompts"] == 69

    torch.manual_seed(1)
    other = tmp_path / "other.safetensors"
    m = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, dim=32, depth=1, heads=2, text_dim=16, text_depth=1,
                          text_heads=2, patch_size=8))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)          # a non-zero output layer: images differ from tiny_ckpt's
    save_pretrained(m, other)
    js = tmp_path / "paired.json"
    args = [tiny_ckpt, str(other), "--images-per-prompt", "1", "--steps", "2", "--reward", "jpeg_compressibility"]
    assert mod.main(args + ["--json", str(js)]) == 0
    r = paired.compare(paired.resolve(paired.add_arguments(argparse.ArgumentParser()).parse_args(args)))
    a, s, h = r["all"], r["seen_pairs"], r["held_out_pairs"]
    assert a["diff"] != 0 and a["ci95"][0] <= a["diff"] <= a["ci95"][1]
    assert abs(a["diff"] * 69 - s["diff"] * s["prompts"] - h["diff"] * h["prompts"]) < 1e-9
    assert json.loads(js.read_text())["results"]["all"]["diff"] == pytest.approx(a["diff"])


def test_bench_signal_row_of_a_reward_does_not_depend_on_the_other_rewards(tmp_path, monkeypatch):
    """Issue #18: adding a second reward changed the geneval row (cos 0.0098 -> -0.0160 on the main job) with the
    same batches: unbiased JAGG's picks drew from torch's global RNG, which the second reward's gradients advanced.
    Each (reward, batch) now draws its picks from an RNG of the seed and the batch alone."""
    from jagg.bench import signal
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
    from jagg.infra import config_loader as configuration

    cfg = configuration.load(ShapesTrainConfig, main_job_path(), [
        "sample.prompts_per_iter=2", "sample.group_size=4", "threads=1", "log.progress=false", "estimator.mode=jagg",
        "log.tensorboard=false", "estimator.correction_p=0.5", f"log.output_dir={tmp_path / 'scratch'}"])
    assert cfg.estimator.mode == "jagg" and cfg.model.checkpoint == "builtin:tiny_dit"

    def geneval_row(rewards):
        rows = [r for r in signal.measure(cfg, rewards, 3) if r["reward"] == "geneval"]
        return {k: v for k, v in rows[0].items()}

    alone = geneval_row(["geneval"])
    assert alone["grad_norm"] > 0 and alone["prompt_groups_with_spread"] > 0      # a gradient, so picks matter
    assert geneval_row(["geneval", "jpeg_compressibility"]) == alone
    assert geneval_row(["jpeg_compressibility", "geneval"]) == alone
    # the setting catches the bug: with the global RNG (no generator) the second reward changes the row
    monkeypatch.setattr(signal, "pick_generator", lambda seed, batch: None)
    assert geneval_row(["geneval", "jpeg_compressibility"])["cosine"] != geneval_row(["geneval"])["cosine"]
