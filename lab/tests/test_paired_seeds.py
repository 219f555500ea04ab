"""`python -m lab quality`: paired GRPO runs of exact and a variant over seeds, compared at equal updates and
equal time (smoke runs and the statistics on synthetic runs)."""

import json
import math

import numpy as np
import pytest

from tiny_runs import GENERIC
from jagg.cost import PRESETS
from lab.__main__ import main


def test_bench_quality_smoke_and_resume(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "quality"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=4", "sample.prompts_per_iter=2",
            "sample.group_size=2", "eval.num_prompts=4", "eval.num_steps=3", "estimator.micro_batch=4",
            "grpo.drop_zero_spread=false", "threads=1", "grpo.updates_per_epoch=2", "sample.sde_window=null"]
    args = ["quality", "--quick", "--out", str(out), "--variant", "exact", "--variant", "jagg_fresh",
            "--variant", "unb:knots=shared,correction_p=0.5"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    recs = json.loads((out / "quality.json").read_text())
    runs = [r for r in recs if r["kind"] == "run"]
    assert {(r["variant"], r["seed"]) for r in runs} == {(v, s) for v in ("exact", "jagg_fresh", "unb") for s in (0, 1)}
    for r in runs:
        assert r["updates"] == 8 and len(r["train_curve"]) == 4 and len(r["test_curve"]) == 3   # evals at 0, 2, 4
        assert (out / r["variant"] / f"seed{r['seed']}" / "result.json").is_file()
        assert r["load"]["samples"] >= 2 and 0 <= r["load"]["mean"] <= r["load"]["max"] and r["load"]["cpus"] >= 1
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
                   "to lower final", "held-out evaluations: 3 per run", "load"):
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
    assert main(["quality", "--variant", "bad name:x=1"]) == 2
    assert main(["quality", "--variant", "nosuch"]) == 2


def test_bench_quality_resumes_a_run_only_under_its_evaluation_schedule(tmp_path, bench_ckpt, capsys):
    """An unfinished run (here: a finished one extended by --iterations) continues only with the evaluation
    settings it was recorded with, so that its test curve has one schedule; with them it continues."""
    out = tmp_path / "q"
    sets = [*GENERIC, f"model.checkpoint={bench_ckpt}", "sample.num_steps=4", "sample.prompts_per_iter=2",
            "sample.group_size=2", "eval.num_prompts=4", "eval.num_steps=3", "estimator.micro_batch=4",
            "threads=1", "sample.sde_window=null", "log.checkpoint_every=1"]
    args = ["quality", "--quick", "--out", str(out), "--seeds", "1", "--variant", "exact",
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

    from lab.statistics import smooth, time_to_target

    assert smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    r = np.linspace(0, 1, 100)[None].repeat(3, 0)
    wall = np.arange(1, 101, dtype=float)[None].repeat(3, 0)
    t_ex, ok = time_to_target(r, wall, 0.9, 1)
    t_fast, ok2 = time_to_target(r, wall / 2, 0.9, 1)
    assert ok and ok2 and t_ex / t_fast == pytest.approx(2.0)
    assert time_to_target(r, wall, 2.0, 1) == (100.0, False)


def _run(variant, seed, speed, per_iter):
    """A synthetic bench-quality run: the held-out reward rises by 0.01 x speed per iteration, each iteration costs
    ``per_iter`` seconds (wall and CPU)."""
    its = list(range(1, 21))
    test = [[i, i * per_iter, 0.5 + 0.01 * speed * i] for i in (0, 5, 10, 15, 20)]
    return {"kind": "run", "variant": variant, "seed": seed, "updates": 20,
            "train_curve": [[i, i * per_iter, 0.5 + 0.01 * speed * i, i * per_iter] for i in its],
            "test_curve": test, "final_test_reward": test[-1][2], "final_test_reward_std": 0.1, "eval_images": 100,
            "sample_s": 0.5, "reward_s": 0.0, "train_s": per_iter - 0.5, "iter_s": per_iter, "iter_cpu_s": per_iter,
            "rows_per_update": 8 if variant == "exact" else 4, "nograd_per_update": 0, "wall_s": 20 * per_iter}


def test_quality_time_to_the_held_out_target():
    """exact reaches its final held-out reward (0.70) at iteration 20; a variant that learns 2x faster per update gets
    there at iteration 10, and with 1.5 s instead of 2 s per iteration that is 40 / 15 = 2.67x sooner in seconds;
    one that learns at half the speed never gets there."""
    from lab.quality_compare import compare
    from lab.statistics import time_to_test_target

    curve = np.array([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    clock = np.array([[0.0, 10.0, 20.0], [0.0, 10.0, 20.0]])
    assert time_to_test_target(curve, clock, 0.65) == (pytest.approx(15.0), True)     # interpolated
    assert time_to_test_target(curve, clock, 0.9) == (20.0, False)
    runs = [_run("exact", s, 1.0, 2.0) for s in (0, 1, 2)] + [_run("fast", s, 2.0, 1.5) for s in (0, 1, 2)] + \
        [_run("slow", s, 0.5, 1.0) for s in (0, 1, 2)]
    out = {r["variant"]: r for r in compare(runs, ["exact", "fast", "slow"], [0, 1, 2], "cpu", "test")}
    assert out["exact"]["time_to_target_ratio"] == pytest.approx(1.0)
    assert out["fast"]["time_to_target_ratio"] == pytest.approx(40 / 15) and out["fast"]["reached"]
    assert out["fast"]["updates_to_target_ratio"] == pytest.approx(2.0)
    assert out["fast"]["time_ratio_estimate"] == pytest.approx(2.0 * 2.0 / 1.5)
    assert out["fast"]["test_gain"] == pytest.approx(0.4) and out["exact"]["test_gain"] == pytest.approx(0.2)
    assert not out["slow"]["reached"] and out["slow"]["not_reached_share"] == 1.0
    # at the highest held-out reward both reach, the updates ratio is the speed of learning per update (0.5 for
    # "slow", which ends at 0.60, where exact is at iteration 10), times the CPU iteration ratio 2 / 1
    assert out["slow"]["efficiency_to_lower_final"] == pytest.approx(0.5)
    assert out["slow"]["time_efficiency_to_lower_final"] == pytest.approx(0.5 * 2.0)
    assert out["fast"]["efficiency_to_lower_final"] == pytest.approx(2.0) and out["exact"]["efficiency_to_lower_final"] == 1
    assert out["fast"]["efficiency_to_lower_final_lo"] == pytest.approx(2.0)          # every resample alike here
    with pytest.raises(ValueError, match="--target"):
        compare(runs, ["exact", "fast"], [0, 1, 2], "cpu", "best")


def test_quality_intervals_skip_undefined_resamples():
    """A resample whose target every variant meets at the start has an undefined ratio (0 / 0): the interval comes
    from the others, and the share of undefined resamples is reported."""
    from lab.statistics import interval as _interval

    lo, hi = _interval(np.array([1.0, np.nan, 2.0, 3.0, np.nan]))
    assert 1.0 <= lo < hi <= 3.0
    assert all(math.isnan(x) for x in _interval(np.array([np.nan, np.nan])))


def test_bench_quality_sets_the_meter_and_the_projection_beside_the_measurement():
    """Synthetic runs (:func:`_run`): a variant that learns at half exact's speed per update with half
    its rows; its runs' last audits predicted 0.6 per update; the projection multiplies the measured 0.5 by the
    structure's iteration ratio for half the rows."""
    from lab.quality_compare import compare

    runs = []
    for s in (0, 1, 2):
        runs.append({**_run("exact", s, 1.0, 2.0), "meter": None})
        slow = _run("slow", s, 0.5, 1.0)
        slow["meter"] = {"audits": 10, "rows_ratio": 2.0, "predicted_efficiency": 1.0, "predicted_adam_efficiency": 1.2,
                         "predicted_adam_tensor_efficiency": 1.1, "predicted_adam_time_efficiency": 1.3 + 0.1 * s,
                         "bias_z": 0.5}
        runs.append(slow)
    cost = PRESETS["flow_grpo_sd35_full"]
    out = {r["variant"]: r for r in compare(runs, ["exact", "slow"], [0, 1, 2], "cpu", "test", cost)}
    slow = out["slow"]
    assert slow["efficiency_to_lower_final"] == pytest.approx(0.5)
    assert (slow["meter_efficiency"], slow["meter_adam_efficiency"], slow["meter_adam_tensor_efficiency"]) == \
        pytest.approx((0.5, 0.6, 0.55))
    assert slow["meter_adam_time_efficiency"] == pytest.approx(1.4) and slow["meter_bias_z"] == 0.5
    assert "correction_p" not in slow and math.isnan(out["exact"]["meter_efficiency"])
    assert slow["projected_iter_ratio"] == pytest.approx(cost.iteration_ratio(0.5))
    assert slow["projected_time_efficiency"] == pytest.approx(0.5 * cost.iteration_ratio(0.5))
    assert out["exact"]["projected_iter_ratio"] == 1.0
    assert "projected_iter_ratio" not in compare(runs, ["exact", "slow"], [0, 1, 2], "cpu", "test")[1]


def test_bench_quality_checks_every_variant_before_training(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quality", "--quick", "--out", str(out), "--variant", "bad:knots=xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m lab quality: error: ") and "\n" not in err, err
    assert "variant 'bad'" in err and not out.exists()


def test_variant_specs_take_lists():
    from lab.quality_runs import parse_variant

    assert parse_variant("r:correction_probs=[0.4, 0.1],window=5")[1] == [
        "estimator.mode=jagg", "estimator.correction_probs=[0.4, 0.1]", "estimator.window=5"]
    with pytest.raises(ValueError, match="--variant 'r:window': 'window' is not KEY=VALUE"):
        parse_variant("r:window")
