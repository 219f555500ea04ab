"""``estimator.mode: auto`` and the meter's verdict: the rule on constructed meter results (unknown, a low end below the
margin, an off-policy position that fails, a position not measured: exact; a clear win: the candidate), the candidate
list refused by name at load, and the measurement while training in the shapes trainer: the decision recorded
(screen, preflight.json, metrics), its seconds in the run's clocks, a measurement that picks exact leaving the run
identical to an exact run, sized to the run, re-checked, kept on resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tiny_runs import records, tiny_train_args
from jagg import EstimatorConfig
from jagg.cli import main
from jagg.verdict import position_failure, prediction, verdict


def rec(name: str, err: float, se: float = 0.0, ratio: float = 1.5, z: float = 0.0, update: int = 0,
        projected: float | None = 1.4) -> dict:
    """A meter record as ``jagg bench meter`` writes it: the terms :func:`jagg.verdict.prediction` reads."""
    return {"estimator": name, "update": update, "error_to_noise": err, "error_to_noise_se": se, "iter_ratio": ratio,
            "bias_z": z, "projected_iter_ratio": projected}


def job(*per_position: list[dict]) -> list[dict]:
    return [{**r, "update": u} for u, recs in enumerate(per_position) for r in recs]


def test_a_clear_win_is_the_candidate_with_the_highest_low_end():
    """Two candidates clear 1 + margin at every position: the one whose low end (rate range x iteration ratio, mean
    over the positions) is higher is recommended, with its projected range and the reason on one line."""
    u0 = [rec("exact", 0.0, ratio=1.0), rec("a", 0.05, 0.01, ratio=1.6), rec("b", 0.02, 0.005, ratio=1.3)]
    u1 = [rec("exact", 0.0, ratio=1.0), rec("a", 0.08, 0.01, ratio=1.7), rec("b", 0.03, 0.005, ratio=1.3)]
    v = verdict(job(u0, u1), updates=2, margin=0.1, cost="flow_grpo_sd35")
    a = next(c for c in v["candidates"] if c["estimator"] == "a")
    lo = (prediction(u0[1])["time_rate_lo"] + prediction(u1[1])["time_rate_lo"]) / 2
    assert v["estimator"] == "a" and a["passes"] and a["time_rate_lo"] == pytest.approx(lo)
    assert a["projected_lo"] == pytest.approx((prediction(u0[1])["rate_lo"] + prediction(u1[1])["rate_lo"]) / 2 * 1.4)
    assert v["line"].startswith(f"train with a: projected {a['time_rate_lo']:.2f}-{a['time_rate_hi']:.2f} x exact's "
                                "progress per second on this machine (flow_grpo_sd35 projected: ")
    assert "clears 1.10" in v["line"] and "\n" not in v["line"]
    assert [line.split(":")[0] for line in v["lines"]] == ["a", "b"] and all("clears the bar" in x for x in v["lines"])


@pytest.mark.parametrize("case, why", [
    ("unknown", "unknown (a significant repeating error)"),
    ("unresolved", "unknown (the error is not resolved)"),
    ("below", "low end"),
    ("off_policy", "update 1: low end"),
    ("off_policy_unknown", "update 1: unknown"),
    ("missing", "update 1: not measured (the budget ran out)"),
])
def test_any_doubt_gives_exact(case, why):
    """unknown (a repeating error, an unresolved one), a low end below 1 + margin, an off-policy position that fails
    while the on-policy one clears, and a position not measured: each gives exact, with the reason named."""
    win = rec("a", 0.02, 0.005, ratio=1.6)                               # clears 1.1 easily: 1.6 x 0.96
    u0 = {"unknown": rec("a", 0.02, 0.005, ratio=1.6, z=2.5), "unresolved": rec("a", 1.0, 0.5, ratio=3.0),
          "below": rec("a", 0.02, 0.005, ratio=1.1)}.get(case, win)
    u1 = {"off_policy": rec("a", 0.9, 0.05, ratio=1.6), "off_policy_unknown": rec("a", 5.0, 4.0, ratio=1.6)}.get(case, win)
    recs = job([rec("exact", 0.0, ratio=1.0), u0], [rec("exact", 0.0, ratio=1.0), u1])
    if case == "missing":
        recs = [r for r in recs if not (r["estimator"] == "a" and r["update"] == 1)]
    v = verdict(recs, updates=2, margin=0.1, missing="the budget ran out")
    assert v["estimator"] == "exact" and v["line"].startswith("train with exact: ")
    assert why in v["reason"], v["reason"]
    assert position_failure(win) is None and verdict(job([rec("exact", 0.0), win], [rec("exact", 0.0), win]),
                                                     2)["estimator"] == "a"


def test_the_margin_and_the_sizes_of_the_verdict():
    """The bar is 1 + margin on the low end: a candidate just below it is refused, just above it chosen; a job of one
    update per iteration needs that one position; no candidate means exact."""
    lo = prediction(rec("a", 0.1, 0.0))["rate_lo"]                            # SGD's model at 0.1: 1 / 1.1
    for ratio, chosen in ((1.2 / lo * 0.999, "exact"), (1.2 / lo * 1.001, "a")):
        assert verdict([rec("exact", 0.0), rec("a", 0.1, ratio=ratio)], 1, margin=0.2)["estimator"] == chosen
    assert verdict([rec("exact", 0.0)], 1)["reason"] == "no candidate was measured"
    assert verdict([rec("exact", 0.0), rec("a", 0.02, update=1, ratio=2.0)], 1)["estimator"] == "exact"
    nan = verdict([rec("exact", math.nan), rec("a", math.nan, math.nan)], 1)
    assert nan["estimator"] == "exact" and nan["lines"] == ["a: unknown (the error is not resolved)"]
    with pytest.raises(ValueError, match="updates must be an integer >= 1"):
        verdict([], 0)


@pytest.mark.parametrize("candidates, culprit", [
    ('["g4:window=4", "g4:window=5"]', "'g4:window=5': the name is given twice"),
    ('["a:kl_beta=0.1"]', "'a:kl_beta=0.1': 'kl_beta' is not a candidate's to set"),
    ('["a:mode=auto"]', "'mode' is not a candidate's"),
    ('["a:windw=4"]', "did you mean 'window'"),
    ('["a:knots=curved"]', "knots must be one of"),
    ('[a:window=4,knots=shared]', "a YAML list splits at commas"),
    ('["w9:window=9"]', "'w9:window=9': estimator.window=9 is more than the 4 trained steps"),
])
def test_a_bad_candidate_list_is_refused_by_name_at_load(tmp_path, tiny_ckpt, capsys, candidates, culprit):
    out = tmp_path / "run"
    argv = tiny_train_args(tiny_ckpt, out, 2, "estimator.mode=auto", f"estimator.candidates={candidates}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "estimator.candidates" in err and culprit in err, err
    assert not out.exists()                                   # refused before the run directory is written
    with pytest.raises(ValueError, match="preflight_batches must be an integer >= 3"):
        EstimatorConfig(mode="auto", preflight_batches=2)
    with pytest.raises(ValueError, match="preflight_margin must be a finite number >= 0"):
        EstimatorConfig(preflight_margin=-0.1)


# a seconds-long auto run: 2 updates per iteration, a reward with spread in every prompt group (tests/reward_plugins.py)
def test_the_default_candidates_adapt_to_the_job_and_a_given_list_does_not():
    """A default candidate whose layout does not fit the trained steps is left out, with why; the same candidate in a
    list the config gives is refused by name."""
    from jagg.trainers.sections import auto_candidates

    fitting, left_out = auto_candidates(EstimatorConfig(mode="auto"), 4, "sample.num_steps=4")
    assert list(fitting) == ["exact", "g4", "s4", "g4u"] and list(left_out) == ["s5u"]
    assert "estimator.window=5 is more than the 4 trained steps" in left_out["s5u"]
    assert list(auto_candidates(EstimatorConfig(mode="auto"), 8, "")[0]) == ["exact", "g4", "s4", "g4u", "s5u"]
    with pytest.raises(ValueError, match="estimator.candidates: 's5:window=5'"):
        auto_candidates(EstimatorConfig(mode="auto", candidates=["s5:window=5"]), 4, "sample.num_steps=4")


AUTO = ["estimator.mode=auto", "estimator.preflight_batches=3", "estimator.preflight_share=1",
        "estimator.candidates=[\"g4:window=4\", \"u4:window=4,correction_p=0.5\"]", "grpo.updates_per_epoch=2",
        "sample.prompts_per_iter=2", "sample.group_size=4", "reward.name=reward_plugins:brightness", "sample.num_steps=6"]


def auto_args(ckpt: str, out, iterations: int, *extra: str) -> list[str]:
    """:func:`tiny_train_args` with :data:`AUTO` and ``extra`` (a later key replaces an earlier one)."""
    sets = {s.split("=", 1)[0]: s for s in [*AUTO, *extra]}
    return tiny_train_args(ckpt, out, iterations, *sets.values())


def weights(out) -> dict:
    return torch.load(sorted((out / "checkpoints").glob("ckpt_*.pt"))[-1], weights_only=False)["model"]


def test_auto_that_picks_exact_trains_exactly_as_exact_and_pays_its_time(tmp_path, bench_ckpt, capsys, monkeypatch):
    """A measurement that picks exact (a margin no candidate clears) is, update for update, an exact run on the same
    batching (whole groups, the candidates'): the same rewards, losses and rows and bit-identical weights (the
    candidates run beside exact's updates on the same minibatches, their picks on a generator of their own, exact's
    gradient restored before each step); the candidates' seconds are in the run's clocks; the decision is on the
    screen, in preflight.json and in a preflight metrics record, with every position measured on every measured
    iteration; from then on exact's own cut (grpo.minibatches auto: shuffled samples)."""
    import jagg.trainers.auto as auto_mod

    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_costly", lambda self: None)   # sized by the next test
    auto, exact = tmp_path / "auto", tmp_path / "exact"
    assert main(auto_args(bench_ckpt, exact, 3, "estimator.mode=exact", "grpo.minibatches=groups")) == 0
    capsys.readouterr()
    assert main(auto_args(bench_ckpt, auto, 5, "estimator.preflight_margin=100", "log.keep_last=5")) == 0
    screen = capsys.readouterr().out
    assert "the first 3 iterations train exact and measure g4, u4 beside each of exact's updates" in screen
    assert "measured 3 iterations x 2 of 2 update position(s), on minibatches of groups" in screen
    assert "\ntrain with exact: " in screen
    assert "its updates cut samples from then on (grpo.minibatches auto: the measurement cut groups" in screen
    decision = json.loads((auto / "preflight.json").read_text())
    assert decision["train_with"] == "exact" and decision["measured_iterations"] == 3 and decision["updates"] == 2
    assert decision["minibatches"] == "groups" and decision["cpu_seconds"] > 0
    assert sorted((r["estimator"], r["update"]) for r in decision["records"]) == sorted(
        (n, u) for n in ("exact", "g4", "u4") for u in (0, 1))
    assert not any(c["passes"] for c in decision["candidates"])     # a margin of 100
    a, e = records(auto), records(exact)
    pre = [r for r in a if r["kind"] == "preflight"]
    assert len(pre) == 1 and pre[0]["train_with"] == "exact" and pre[0]["preflight_cpu_s"] > 0
    train_a, train_e = [r for r in a if r["kind"] == "train"], [r for r in e if r["kind"] == "train"]
    for ra, re_ in zip(train_a[:3], train_e, strict=True):
        assert (ra["reward_mean"], ra["loss"], ra["grad_norm"], ra["backward_items"]) == (
            re_["reward_mean"], re_["loss"], re_["grad_norm"], re_["backward_items"])
    assert pre[0]["cpu_s"] >= pre[0]["preflight_cpu_s"]
    third = torch.load(auto / "checkpoints" / "ckpt_000003.pt", weights_only=False)["model"]
    we = weights(exact)
    assert third.keys() == we.keys() and all(torch.equal(third[k], we[k]) for k in third)


def test_a_measurement_the_run_cannot_win_back_stops_after_its_first_iteration(tmp_path, bench_ckpt, capsys):
    """Sized to the run: with a budget of 1% of the run, what the candidates cost in the first measured iteration
    stops the measurement there: the run trains exact, saying why."""
    out = tmp_path / "run"
    assert main(auto_args(bench_ckpt, out, 5, "estimator.preflight_share=0.01")) == 0
    screen = capsys.readouterr().out
    assert "train with exact: measuring the candidates costs" in screen and "preflight_share=0.01" in screen
    decision = json.loads((out / "preflight.json").read_text())
    assert decision["train_with"] == "exact" and decision["measured_iterations"] == 1 and decision["records"] == []


def _picks_g4(monkeypatch):
    import jagg.trainers.auto as auto_mod

    real = auto_mod.verdict

    def picks_g4(records, updates, *a, **k):                   # the rule itself is tested on constructed results
        v = real(records, updates, *a, **k)
        return {**v, "estimator": "g4", "reason": "test", "line": "train with g4: test"}

    monkeypatch.setattr(auto_mod, "verdict", picks_g4)
    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_costly", lambda self: None)
    return auto_mod


def test_auto_trains_with_the_chosen_candidate_and_a_resume_keeps_it(tmp_path, bench_ckpt, capsys, monkeypatch):
    """When the verdict picks a candidate the updates after the measurement use it (its rows per update), the
    checkpoint keeps the decision, and a resumed run trains on with it without measuring again."""
    auto_mod = _picks_g4(monkeypatch)
    out = tmp_path / "run"
    argv = auto_args(bench_ckpt, out, 5)
    assert main(argv) == 0
    assert "train with g4: test (from iteration 4)" in capsys.readouterr().out
    first = [r["backward_items"] for r in records(out) if r["kind"] == "train"]
    assert first == [8 * 6] * 3 + [8 * 4] * 2    # exact: 6 steps; g4: 6 steps in groups of 4 and 2: 2 + 2 rows

    monkeypatch.setattr(auto_mod.Measurement, "add", lambda *a, **k: pytest.fail("a resumed run measured again"))
    argv[argv.index("grpo.iterations=5")] = "grpo.iterations=6"
    assert main(argv + ["--resume"]) == 0
    assert "training with g4, the decision of the run's measurement (kept on resume)" in capsys.readouterr().out
    train = [r for r in records(out) if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6] and train[-1]["backward_items"] == 8 * 4
    assert len([r for r in records(out) if r["kind"] == "preflight"]) == 1


def test_a_chosen_candidate_that_no_longer_clears_the_bar_is_dropped_for_exact(tmp_path, bench_ckpt, capsys,
                                                                              monkeypatch):
    """estimator.meter_every: the chosen candidate is re-measured beside exact (on the last measured iterations), and
    dropped for exact, with an auto_switch record, when a position fails the bar."""
    auto_mod = _picks_g4(monkeypatch)
    calls = []

    def fails(rec, margin=None):
        calls.append(rec["estimator"])
        return "low end 0.50 x exact's progress per second, below 1.10"

    monkeypatch.setattr(auto_mod, "position_failure", fails)
    out = tmp_path / "run"
    assert main(auto_args(bench_ckpt, out, 6, "estimator.meter_every=1")) == 0
    assert "training with exact from now on: g4 re-measured at iteration 4: update 0: low end 0.50" in (
        capsys.readouterr().out)
    rec = records(out)
    switch = [r for r in rec if r["kind"] == "auto_switch"]
    assert len(switch) == 1 and switch[0]["from"] == "g4" and switch[0]["iteration"] == 4
    assert [r["backward_items"] for r in rec if r["kind"] == "train"] == [48] * 3 + [32] + [48] * 2
    assert set(calls) == {"g4"}
    saved = torch.load(sorted((out / "checkpoints").glob("ckpt_*.pt"))[-1], weights_only=False)
    assert saved["estimator_decision"]["train_with"] == "exact"
    assert saved["estimator_decision"]["switched"]["from"] == "g4"


def test_a_run_too_short_to_measure_trains_exact_unmeasured(tmp_path, bench_ckpt, capsys, monkeypatch):
    import jagg.trainers.auto as auto_mod

    monkeypatch.setattr(auto_mod.Measurement, "add", lambda *a, **k: pytest.fail("measured a too-short run"))
    out = tmp_path / "run"
    assert main(auto_args(bench_ckpt, out, 3)) == 0                    # 3 iterations, 3 to measure: none left
    assert "train with exact: the run's 3 remaining iterations leave none to train a candidate in" in (
        capsys.readouterr().out)
    assert json.loads((out / "preflight.json").read_text())["measured_iterations"] == 0


def test_a_measurement_the_machine_cannot_hold_trains_exact_unmeasured(tmp_path, bench_ckpt, capsys, monkeypatch):
    """The measurement holds one float32 gradient per estimator draw, update position and measured iteration on the
    host (here 3 iterations x 2 positions x 3 estimators = 18); up to half the machine's memory it measures, a byte
    more and the run trains exact from iteration 0, unmeasured, saying how much and what to change."""
    import jagg.infra.sizes as sizes
    import jagg.trainers.auto as auto_mod

    real = auto_mod.AutoEstimator._too_large

    def at_the_boundary(self):
        one = 4 * sum(p.numel() for p in self.params)                  # bytes of one float32 gradient
        monkeypatch.setattr(sizes, "machine_memory", lambda: 2 * 18 * one)
        assert real(self) is None                                     # exactly half: it fits
        monkeypatch.setattr(sizes, "machine_memory", lambda: 2 * 18 * one - 1)
        return real(self)

    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_large", at_the_boundary)
    monkeypatch.setattr(auto_mod.Measurement, "add", lambda *a, **k: pytest.fail("measured what it cannot hold"))
    out = tmp_path / "run"
    assert main(auto_args(bench_ckpt, out, 5)) == 0
    screen = capsys.readouterr().out
    assert "train with exact: measuring holds 18 flat gradients of the" in screen, screen
    assert "more than half this machine's" in screen and "pipeline.lora" in screen
    decision = json.loads((out / "preflight.json").read_text())
    assert decision["train_with"] == "exact" and decision["measured_iterations"] == 0


def test_each_process_picks_a_random_candidate_s_corrections_with_its_own_stream():
    """Unbiased JAGG's picks in the measurement come from a stream of each process's own (as the trained estimator's
    do), the main process's unchanged; the streams differ from process to process."""
    from jagg.trainers.auto import PICK_SEED, pick_seed

    assert pick_seed(3) == pick_seed(3, 0) == 3 + PICK_SEED
    draws = [torch.rand(8, generator=torch.Generator().manual_seed(pick_seed(3, r))) for r in range(4)]
    assert all(not torch.equal(draws[i], draws[j]) for i in range(4) for j in range(i))


def test_bench_meter_prints_the_verdict_and_quick_none(tmp_path, tiny_ckpt, capsys):
    """``jagg bench meter`` ends with a line per candidate and the recommendation (the JSON's ``verdict`` record);
    ``--quick`` says it is a smoke test and gives none; on an auto config it measures the candidates."""
    sets = [f"model.checkpoint={tiny_ckpt}", "sample.num_steps=6", "sample.sde_window=null", "sample.prompts_per_iter=2",
            "sample.group_size=2", "estimator.micro_batch=4", "grpo.drop_zero_spread=false", "threads=1",
            "model.trainable=all", "reward.weights=null", "estimator.exact_last_intervals=0", "grpo.updates_per_epoch=1",
            "estimator.mode=auto", "estimator.candidates=[\"g4:window=4\"]"]
    argv = ["bench", "meter", "--batches", "3", "--draws", "1", "--json", str(tmp_path / "m.json"),
            *[a for s in sets for a in ("--set", s)]]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "verdict (the rule of estimator.mode: auto)" in text and "\n  g4: " in text and "\ntrain with " in text
    v = [r for r in json.loads((tmp_path / "m.json").read_text()) if r.get("kind") == "verdict"]
    assert len(v) == 1 and v[0]["train_with"] in ("exact", "g4") and v[0]["line"] in text
    assert main(argv[:-2 * len(sets)] + ["--quick", "--overwrite", *[a for s in sets for a in ("--set", s)]]) == 0
    text = capsys.readouterr().out
    assert "--quick is a smoke test of the command" in text and "train with" not in text


def test_the_main_job_runs_auto_and_the_benches_of_one_estimator_refuse_it(capsys):
    """The main job ships with estimator.mode auto; a lab tool that measures the config's estimator as it is (signal,
    fidelity) refuses auto by name, before any model loads."""
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
    from lab.__main__ import main as lab

    assert configuration.load(ShapesTrainConfig, main_job_path()).estimator.mode == "auto"
    for tool in ("signal", "fidelity"):
        assert lab([tool, "--quick"]) == 2
        err = capsys.readouterr().err
        assert f"python -m lab {tool}: error: estimator.mode is 'auto'" in err and "--set estimator.mode=jagg" in err


def _tiny_config(ckpt: str, *extra: str):
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig

    sets = {s.split("=", 1)[0]: s for s in [*tiny_train_args(ckpt, "unused", 300)[4::2], *AUTO, *extra]}
    return configuration.load(ShapesTrainConfig, None, [s for k, s in sets.items() if not k.startswith("log.")])


def test_every_position_on_the_same_batches_is_the_measurement_of_that_position_alone(bench_ckpt):
    """``--update all`` draws the batches once: each position's records are those ``--update N`` gives alone (same
    batches, same seeds, the same AdamW steps before it), timings aside."""
    from jagg.bench.meter_command import measure, measure_job

    cfg = _tiny_config(bench_ckpt, "estimator.mode=jagg", "estimator.window=4", "estimator.correction_p=0.5",
                       "optim.lr=1e-3")
    job = measure_job(cfg, ["config"], 3, 2, None)
    for u in (0, 1):
        alone = {r["estimator"]: r for r in measure(cfg, ["config"], 3, 2, None, update=u)}
        for r in job[u]:
            for key in ("error_to_noise", "bias_to_noise", "noise", "clip_frac", "rows_per_sample"):
                assert r[key] == alone[r["estimator"]][key], (u, r["estimator"], key)


def test_a_run_stopped_while_measuring_measures_again_where_it_resumes(tmp_path, bench_ckpt, capsys,
                                                                        monkeypatch):
    """A signal during the measurement stops the run after its iteration like any other (checkpoint saved); the
    resumed run measures from where it resumes and decides after as many measured iterations."""
    import jagg.trainers.auto as auto_mod
    from jagg.trainers.loop import GRPOTrainer

    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_costly", lambda self: None)
    real = GRPOTrainer.stop_requested
    monkeypatch.setattr(GRPOTrainer, "stop_requested", lambda self: self.iteration == 2 or real(self))
    out = tmp_path / "run"
    argv = auto_args(bench_ckpt, out, 6)
    assert main(argv) == 0
    assert not (out / "preflight.json").exists()                       # stopped after 2 of 3 measured iterations
    monkeypatch.setattr(GRPOTrainer, "stop_requested", real)
    assert main(argv + ["--resume"]) == 0
    assert "the first 3 iterations train exact and measure" in capsys.readouterr().out
    decision = json.loads((out / "preflight.json").read_text())
    assert decision["measured_iterations"] == 3 and decision["iteration"] == 5    # iterations 3-5 (1-based)


def test_a_candidate_that_cannot_clear_the_bar_is_no_longer_measured(tmp_path, bench_ckpt, capsys, monkeypatch):
    """From the third measured iteration on, a candidate whose high end of projected progress per second is below
    the bar at some position is no longer measured (it cannot be chosen); when none is left the run decides at once,
    exact, with every measured record kept."""
    import jagg.trainers.auto as auto_mod

    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_costly", lambda self: None)
    measured = []
    real_add = auto_mod.Measurement.add

    def add(self, u, iteration, name, *a):
        measured.append((iteration, name))
        return real_add(self, u, iteration, name, *a)

    monkeypatch.setattr(auto_mod.Measurement, "add", add)
    real_records = auto_mod.Measurement.records

    def records_known(self, *a):                      # every range known, whatever the tiny batches resolve
        return [{**r, "prediction": "range"} for r in real_records(self, *a)]

    monkeypatch.setattr(auto_mod.Measurement, "records", records_known)
    out = tmp_path / "run"
    assert main(auto_args(bench_ckpt, out, 8, "estimator.preflight_batches=6", "estimator.preflight_margin=100")) == 0
    decision = json.loads((out / "preflight.json").read_text())
    assert decision["train_with"] == "exact" and decision["measured_iterations"] == 3      # not 6
    assert {n for it, n in measured} == {"exact", "g4", "u4"} and max(it for it, _ in measured) == 2
    assert {r["estimator"] for r in decision["records"]} == {"exact", "g4", "u4"}


def test_the_verdict_says_when_the_signal_is_not_resolved():
    """``signal not resolved`` (with what it means for the choice) where exact's |E g|^2 / V_b reaches 0 within 2 SE at
    some position; nothing where it is resolved everywhere or not measured."""
    from jagg.verdict import signal_note

    def ex(u, s, se):
        return {"estimator": "exact", "update": u, "signal_to_noise": s, "signal_to_noise_se": se}

    note = signal_note([ex(0, 0.23, 0.23), ex(1, 0.9, 0.1), rec("g4", 0.1)])
    assert note.startswith("signal not resolved: exact's |E g|^2 / V_b reaches 0 within 2 SE (update 0: 0.23 +- 0.23)")
    assert "update 1" not in note and "only an estimator unbiased by construction can be chosen" in note
    assert signal_note([ex(0, 0.9, 0.1), ex(1, 0.5, 0.2)]) is None
    assert signal_note([rec("g4", 0.1)]) is None and signal_note([]) is None


def test_a_repeating_error_must_be_small_against_the_signal():
    """Adam integrates a bias as it integrates the signal: a candidate that is not unbiased by construction is judged
    unknown (so exact) where its bias's upper end exceeds MAX_BIAS_TO_SIGNAL x the signal's lower end, or where the
    signal is not resolved, however small its error against the noise; an unbiased one is judged on the noise alone;
    a record without these terms as before."""
    from jagg.verdict import MAX_BIAS_TO_SIGNAL, bias_against_signal

    def measured(config: EstimatorConfig, bias: float, signal: float, signal_se: float = 0.01) -> dict:
        return {**rec("a", 0.03, 0.004, ratio=1.6), "estimator_config": config.to_dict(), "bias_to_noise": bias,
                "bias_to_noise_se": 0.003, "signal_to_noise": signal, "signal_to_noise_se": signal_se}

    plain = EstimatorConfig(mode="jagg", window=4, knots="shared", correction_p=0.0)
    unbiased = EstimatorConfig(mode="jagg", window=5, knots="shared", correction_p=0.1)
    # the J20 job's auto measurement: plain shared knots, bias^2/V_b 0.0058 +- 0.0034, signal -0.004 +- 0.013
    j20 = measured(plain, 0.0058, -0.0038, 0.0134)
    assert prediction(j20)["prediction"].startswith("unknown: a repeating error against a signal not resolved")
    assert verdict([rec("exact", 0.0), j20], 1)["estimator"] == "exact"
    assert position_failure(j20) == "unknown (a repeating error against a signal not resolved)"
    # a resolved signal: bias_hi = 0.0058 + 0.006 = 0.0118; passes at signal_lo >= 0.0118 / 0.21, fails below
    bias_hi = 0.0058 + 2 * 0.003
    strong, weak = bias_hi / MAX_BIAS_TO_SIGNAL + 0.02 + 0.001, bias_hi / MAX_BIAS_TO_SIGNAL + 0.02 - 0.001
    assert bias_against_signal(measured(plain, 0.0058, strong)) is None
    assert verdict([rec("exact", 0.0), measured(plain, 0.0058, strong)], 1)["estimator"] == "a"
    assert "above 0.21" in bias_against_signal(measured(plain, 0.0058, weak))
    # unbiased by construction (every interval corrected, subsampling, exact): the noise alone decides
    for config in (unbiased, EstimatorConfig(mode="subsample", subsample_frac=0.5), EstimatorConfig(mode="exact")):
        assert config.unbiased and bias_against_signal(measured(config, 0.0058, -0.0038, 0.0134)) is None
    assert verdict([rec("exact", 0.0), measured(unbiased, 0.0058, -0.0038, 0.0134)], 1)["estimator"] == "a"
    assert not EstimatorConfig(mode="jagg", correction_probs=[0.5, 0.0]).unbiased
    assert bias_against_signal(rec("a", 0.03, 0.004)) is None           # no terms: judged as before
