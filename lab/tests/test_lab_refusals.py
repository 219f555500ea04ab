"""The lab's tools end as the jagg commands do: a refusal is one line naming its culprit and exit 2, before any work
and with nothing written; Ctrl-C is one line and exit 130; an output is never replaced without --overwrite."""

from __future__ import annotations

from pathlib import Path

import json

import pytest

import reward_plugins
from command_line import files_under, refused, run
from jagg.checks import SEED_MAX
from jagg.cli import main as jagg
from lab.__main__ import main

PROG = "python -m lab"


def _lab(argv, capsys):
    return run(main, argv, capsys, PROG)


def _refused(argv, capsys, *culprits, code=2):
    return refused(main, argv, capsys, *culprits, code=code, prog=PROG)


@pytest.mark.parametrize("argv,culprit", [
    (["paired", "CK", "CK", "--seed", str(SEED_MAX + 1)], "--seed"),
    (["quality", "--first-seed", "-2"], "--first-seed"),
    (["fidelity", "--fracs", "1e39"], "--fracs"),
    (["paired", "CK", "CK", "--threads", "5000"], "--threads"),
])
def test_numbers_are_checked_in_the_dtype_they_are_used_in(argv, culprit, tmp_path, tiny_ckpt, capsys):
    before = files_under(tmp_path)
    _refused([tiny_ckpt if a == "CK" else a for a in argv], capsys, culprit)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("argv,culprit", [
    (["quality", "--variant", "a:window=2", "--variant", "a:window=3"], "'a' is given twice"),
    (["quality", "--variant", "exact", "--variant", "exact"], "'exact' is given twice"),
    (["quality", "--variant", "jagg_fresh:window=8"], "'jagg_fresh' is a built-in name"),
    (["quality", "--variant", "w:window=4,window=5"], "'window' is given twice"),
    (["e2e", "--variants", "jagg_interp", "jagg_interp"], "'jagg_interp' is given twice"),
    (["signal", "--rewards", "geneval", "geneval"], "'geneval' is given twice"),
])
def test_duplicate_and_reserved_names_are_refused(argv, culprit, tmp_path, capsys):
    before = files_under(tmp_path)
    fixed = ["--set", "estimator.mode=jagg"] if argv[0] == "signal" else []      # the main job runs auto
    _refused([*argv, "--quick", *fixed, "--json", str(tmp_path / "out.json")], capsys, culprit)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("name,argv", [
    ("paired.json", lambda ck, p: ["paired", ck, ck, "--quick", "--json", p]),
    ("q/quality.json", lambda ck, p: ["quality", "--quick", "--out", str(Path(p).parent)]),
    ("q.png", lambda ck, p: ["quality", "--quick", "--plot", p]),
    ("w.json", lambda ck, p: ["weight-changes", ck, "--json", p]),           # tools that parse their own options:
    ("t.json", lambda ck, p: ["trace-file-changes", "--json", p]),          # the --overwrite they name exists
])
def test_outputs_are_never_replaced_without_overwrite(name, argv, tmp_path, tiny_ckpt, capsys):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the user's data")
    before = files_under(tmp_path)
    _refused(argv(tiny_ckpt, str(path)), capsys, str(path), "--overwrite")
    assert files_under(tmp_path) == before


def _interrupt(*a, **k):
    raise KeyboardInterrupt


@pytest.mark.parametrize("tool,target", [("paired", "lab.paired.generate"),
                                         ("quality", "jagg.trainers.shapes_trainer.load_model")])   # a run's setup
def test_ctrl_c_anywhere_is_one_line_and_exit_130(tool, target, tmp_path, tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(target, _interrupt)
    argv = {"paired": ["paired", tiny_ckpt, tiny_ckpt, "--quick"],
            "quality": ["quality", "--quick", "--set", f"model.checkpoint={tiny_ckpt}"]}[tool]
    code, line, _ = _lab(argv, capsys)
    assert code == 130 and line == f"{PROG} {tool}: interrupted"


def test_every_path_runs_the_same_checks(tmp_path, tiny_ckpt, capsys):
    """paired refuses the seeds eval refuses, word for word; a quality refusal speaks of its own flags; an empty
    --out is refused, not replaced by a default."""
    for seed in ("-1", str(SEED_MAX + 1), "1.5"):
        a = refused(jagg, ["eval", "--seed", seed], capsys, "--seed")
        b = _refused(["paired", tiny_ckpt, tiny_ckpt, "--seed", seed], capsys, "--seed")
        assert a.split("error: ", 1)[1] == b.split("error: ", 1)[1]
    out = tmp_path / "q"
    (out / "exact").mkdir(parents=True)
    (out / "exact" / "seed0").write_text("a file where a run directory goes")
    line = _refused(["quality", "--quick", "--out", str(out), "--set", f"model.checkpoint={tiny_ckpt}"],
                    capsys, str(out / "exact" / "seed0"), "--out")
    assert "--resume" not in line and "--output-dir" not in line and "--overwrite" not in line
    _refused(["quality", "--out", ""], capsys, "--out is empty")


@pytest.mark.parametrize("option,value,message", [
    ("--images-per-prompt", "0", "must be >= 1"), ("--bootstrap", "0", "must be >= 1"),
    ("--guidance-scale", "nan", "expected a finite number"), ("--guidance-scale", "inf", "expected a finite number"),
    ("--steps", "0", "must be >= 1"), ("--shift", "0", "must be > 0"), ("--seed", "-1", "must be an integer in"),
    ("--images-per-prompt", "two", "expected an integer"),
])
def test_bench_paired_refuses_what_eval_refuses_and_quick_keeps_explicit_flags(option, value, message, tiny_ckpt,
                                                                                capsys, monkeypatch):
    """paired's options are eval's (the same refusals, word for word), and --quick fills only the options not
    given."""
    from lab import paired

    line = _refused(["paired", tiny_ckpt, tiny_ckpt, "--quick", option, value], capsys, option, message)
    if option != "--bootstrap":
        assert refused(jagg, ["eval", option, value], capsys).split("error: ", 1)[1] == line.split("error: ", 1)[1]
    seen = {}
    monkeypatch.setattr(paired, "compare", lambda args: seen.update(vars(args)) or {})
    assert main(["paired", tiny_ckpt, tiny_ckpt, "--quick", "--images-per-prompt", "3", "--steps", "5"]) == 0
    assert (seen["images_per_prompt"], seen["steps"], seen["bootstrap"]) == (3, 5, paired.QUICK["bootstrap"])


def test_an_interrupted_bench_quality_writes_no_result_and_continues(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Ctrl-C in a quality run's last iteration: the run saves, the tool exits 130 without that run's result.json or a
    comparison, and the same command continues it."""
    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "SIGINT_AT", 7)         # exact's evaluations 0, 2 and iterations 1, 2;
    out = tmp_path / "q"                                         # then config's evaluation 0, iteration 1 and 2
    sets = [f"model.checkpoint={tiny_ckpt}", "reward.weights=null", "reward.name=reward_plugins:sigint_at",
            "eval.every=2", "eval.num_prompts=2", "eval.images_per_prompt=1", "eval.num_steps=2", "eval.grid_size=2",
            "sample.num_steps=4", "sample.sde_window=null", "model.trainable=all", "threads=1", "grpo.iterations=2",
            "estimator.micro_batch=4", "sample.prompts_per_iter=2", "sample.group_size=2"]
    argv = ["quality", "--out", str(out), "--seeds", "1"] + [a for s in sets for a in ("--set", s)]
    code, line, stdout = _lab(argv, capsys)
    assert code == 130 and line.startswith(f"{PROG} quality: interrupted") and "rerun the same" in line
    assert "--resume" not in stdout + line
    assert (out / "exact" / "seed0" / "result.json").is_file() and not (out / "config" / "seed0" / "result.json").exists()
    assert (out / "config" / "seed0" / "checkpoints" / "ckpt_000002.pt").is_file() and not (out / "quality.json").exists()
    code, line, _ = _lab(argv, capsys)
    assert code == 0, line
    assert (out / "config" / "seed0" / "result.json").is_file() and (out / "quality.json").is_file()


def test_bench_quality_refuses_a_test_target_without_evaluations_before_training(tmp_path, tiny_ckpt, capsys,
                                                                                 monkeypatch):
    from lab import quality

    monkeypatch.setattr(quality, "run_one", lambda *a, **k: pytest.fail("trained before the --target check"))
    for extra in (["--eval-every", "0"], ["--set", "eval.every=0"]):
        _refused(["quality", "--quick", "--target", "test", "--out", str(tmp_path / "q"), *extra,
                  "--set", f"model.checkpoint={tiny_ckpt}"], capsys, "--target test", "--eval-every")
    assert not (tmp_path / "q").exists()


def test_a_finished_bench_quality_run_is_not_reused_under_other_eval_settings(tmp_path, monkeypatch):
    from lab import quality
    from jagg.infra.config_loader import to_dict

    q = quality.QualityConfig(config=None, sets=["grpo.iterations=2"], variants=quality.parse_variants(["exact"]),
                              seeds=[0], out=str(tmp_path / "q"))
    cfg = q.train_config("exact", 0)
    done = q.run_dir("exact", 0) / "result.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"iterations": 2, "train_curve": [], "test_curve": [], "config": to_dict(cfg),
                                "final_test_reward": None, "final_test_reward_std": None, "rows_per_update": 8.0,
                                "nograd_per_update": 0.0, "iter_s": 1.0, "train_s": 0.5, "wall_s": 2.0}))
    assert quality.run_one(q, "exact", 0)["iterations"] == 2                   # the same settings: reused
    for sets in (["eval.every=1"], ["eval.num_prompts=3"], ["eval.images_per_prompt=1"]):
        q.sets = ["grpo.iterations=2", *sets]
        with pytest.raises(ValueError, match=f"was trained with another config .*'{sets[0].split('=')[0]}'"):
            quality.run_one(q, "exact", 0)


def test_an_unfinished_bench_quality_run_continues_only_under_the_same_eval_settings(tmp_path, tiny_ckpt, capsys,
                                                                                      monkeypatch):
    import reward_plugins

    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "SIGINT_AT", 4)         # exact's evaluation 0, iterations 1, 2: stopped at 2
    out = tmp_path / "q"
    sets = [f"model.checkpoint={tiny_ckpt}", "reward.weights=null", "reward.name=reward_plugins:sigint_at",
            "eval.num_prompts=2", "eval.images_per_prompt=1", "eval.num_steps=2", "eval.grid_size=2",
            "sample.num_steps=4", "sample.sde_window=null", "threads=1", "grpo.iterations=3",
            "estimator.micro_batch=4", "sample.prompts_per_iter=2", "sample.group_size=2", "log.checkpoint_every=1"]
    argv = ["quality", "--out", str(out), "--seeds", "1"] + [a for s in sets for a in ("--set", s)]
    code, line, _ = _lab([*argv, "--eval-every", "0"], capsys)
    assert code == 130, line
    _refused([*argv, "--eval-every", "1"], capsys, str(out / "exact" / "seed0"), "eval.every")
    monkeypatch.setattr(reward_plugins, "SIGINT_AT", -1)
    code, line, _ = _lab([*argv, "--eval-every", "0"], capsys)                # the same settings continue it
    assert code == 0, line


def test_sizes_beyond_the_machine_are_refused_with_an_estimate(tmp_path, tiny_ckpt, capsys):
    for argv, culprit in ((["paired", tiny_ckpt, tiny_ckpt, "--images-per-prompt", "99999999999"],
                           "--images-per-prompt"),
                          (["paired", tiny_ckpt, tiny_ckpt, "--bootstrap", str(10**12)], "--bootstrap")):
        _refused(argv, capsys, culprit, "more than this machine's")
    assert not list(tmp_path.iterdir())


def test_a_gpu_bench_json_is_checked_before_training(tmp_path, capsys, monkeypatch):
    from lab import quality

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps([{"costs": []}]))
    monkeypatch.setattr(quality, "run_quality", lambda *a, **k: pytest.fail("trained before --gpu-bench-json"))
    _refused(["quality", "--quick", "--out", str(tmp_path / "q"), "--gpu-bench-json", str(path)], capsys, str(path),
             "must hold a JSON object")


def test_sampling_options_that_break_the_schedule_are_refused(tiny_ckpt, capsys):
    _refused(["paired", tiny_ckpt, tiny_ckpt, "--shift", "1e30"], capsys, "--shift=1e+30", "--steps")


def test_the_reward_help_of_paired_names_the_main_job_s_reward(capsys):
    from jagg.arguments import MAIN_JOB_REWARD

    with pytest.raises(SystemExit):
        main(["paired", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"main job's reward (reward: of jagg/shapes/main_job.yaml), {MAIN_JOB_REWARD}]" in text


@pytest.mark.parametrize("argv,culprit", [
    (["regime-map", "--set", "sample.eta=0.5"], "--set sample.eta=0.5: python -m lab regime-map sets sample.eta"),
    (["regime-map", "--set", "sample.num_steps=20"], "sets sample.num_steps itself, from its regimes"),
    (["regime-map", "--set", "sample.sde_type=cps"], "sets sample.sde_type"),
    (["regime-map", "--set", "sample.sde_window=[0, 4]"], "sets sample.sde_window"),
    (["regime-map", "--set", "sample={eta: 0.5}"], "sets sample.num_steps"),              # a section holding them
    (["e2e", "--set", "estimator.mode=exact"], "e2e sets estimator.mode itself, from its variants (--variants)"),
    (["e2e", "--set", "estimator.intermediate=fresh"], "sets estimator.intermediate"),
    (["quality", "--set", "seed=7"], "quality sets seed itself, from --first-seed and --seeds"),
    (["quality", "--set", "log.output_dir=/tmp/x"], "sets log.output_dir itself, from --out"),
    (["quality", "--set", "log={output_dir: x}"], "sets log.output_dir"),
])
def test_a_set_of_what_the_tool_varies_is_refused(argv, culprit, tmp_path, capsys):
    """A --set of a key the tool sets itself per regime, variant or run: with regime-map's every row would be the
    same measurement under the regimes' labels; with e2e's and quality's the --set would be dropped without a word.
    Refused by name before any work, nothing written."""
    before = files_under(tmp_path)
    out = ["--json", str(tmp_path / "m.json")] if argv[0] != "quality" else ["--out", str(tmp_path / "q")]
    line = _refused([*argv, *out], capsys, culprit, "Leave it out")
    assert "\n" not in line and files_under(tmp_path) == before


def test_a_refused_traced_run_is_a_refusal_not_a_path(capsys):
    """trace-file-changes on a run jagg train refuses (--correction-p 2) counted the refusal's path as the
    trainer's and exited 0; it exits 2 with the refusal and counts nothing. A negative value is refused by the
    option itself."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    assert main(["trace-file-changes", "--correction-p", "2"]) == 2
    out, err = capsys.readouterr()
    refusal, line = err.strip().splitlines()[-2:]                # jagg train's refusal, then the tool's
    assert refusal.startswith("jagg train: error: ") and "correction_p" in refusal and "Traceback" not in err
    assert line.startswith(f"{PROG} trace-file-changes: error: ") and "before its first optimizer step" in line
    assert "source-file changes" not in out
    _refused(["trace-file-changes", "--correction-p", "-1"], capsys, "--correction-p", "must be >= 0")
