"""A run that fails or is stopped loses nothing and ends with one line: SIGKILL mid-checkpoint keeps the previous
checkpoint and the resumed run matches an uninterrupted one; SIGTERM finishes the iteration, saves and exits 0;
Ctrl-C anywhere is one line and exit 130; non-finite updates are skipped, then the run aborts; a failing reward saves
the last iteration, says how to continue (and that a changed key needs a new run), and the resume retries it; a run
that has nothing to learn from says why, saves and stops."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reward_plugins
from command_line import run as run_cli
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import list_checkpoints, load_latest
from jagg.cli import main
from tiny_runs import no_eval_train_args, pretrain_args, tiny_train_args
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.trainers.shapes_trainer import ShapesTrainer

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))

KILL_MID_SAVE = """
import os, sys, time, torch
from jagg.cli import main
real_save, calls = torch.save, [0]
def slow_save(obj, f, *a, **k):
    calls[0] += 1
    if calls[0] == 2:                      # the second checkpoint: write half, then hang
        f.write(b"partial" * 10000); f.flush()
        open(os.environ["MARKER"], "w").close()
        time.sleep(600)
    return real_save(obj, f, *a, **k)
torch.save = slow_save
sys.exit(main(sys.argv[1:]))
"""


def _params(out):
    return load_latest(out / "checkpoints")[0]["model"]


def _wait_for(pred, timeout=120):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(0.1)


def test_sigkill_during_checkpoint_write_keeps_previous_and_resume_matches(tmp_path, tiny_ckpt):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    marker = tmp_path / "marker"
    args = tiny_train_args(tiny_ckpt, killed, 3, "eval.every=0")
    proc = subprocess.Popen([sys.executable, "-c", KILL_MID_SAVE, *args], env=dict(ENV, MARKER=str(marker)),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(marker.exists)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(killed / "checkpoints")] == ["ckpt_000001.pt"]
    assert any(p.name.endswith(".tmp") for p in (killed / "checkpoints").iterdir())  # the torn write
    state, _ = load_latest(killed / "checkpoints")
    assert state["iteration"] == 1
    assert main(args + ["--resume"]) == 0
    assert main(tiny_train_args(tiny_ckpt, straight, 3, "eval.every=0")) == 0
    a, b = _params(killed), _params(straight)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def test_sigterm_saves_and_exits_cleanly(tmp_path, tiny_ckpt):
    args = tiny_train_args(tiny_ckpt, tmp_path, 1000, "eval.every=0", "log.checkpoint_every=0")
    proc = subprocess.Popen([sys.executable, "-m", "jagg.cli", *args], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "--resume" in out
    n = len([l for l in metrics.read_text().splitlines() if json.loads(l)["kind"] == "train"])
    state, path = load_latest(tmp_path / "checkpoints")
    assert state["iteration"] == n and n < 1000


def test_nonfinite_gradient_skips_update_and_aborts(tmp_path, tiny_ckpt, monkeypatch):
    import jagg.trainers.shapes_trainer as tr

    real = tr.policy_gradient

    def poisoned(*a, **k):
        stats = real(*a, **k)
        next(p for p in a[0].model.parameters()).grad.fill_(float("nan"))
        return stats

    monkeypatch.setattr(tr, "policy_gradient", poisoned)
    sets = tiny_train_args(tiny_ckpt, tmp_path, 3)[4::2] + [f"log.output_dir={tmp_path}"]
    data = configuration.apply_overrides({}, sets)
    data["grpo"]["max_consecutive_skips"] = 0
    data["grpo"]["updates_per_epoch"] = 2          # two updates per iteration, both skipped
    trainer = ShapesTrainer(configuration.from_dict(ShapesTrainConfig, data))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    records = [r for r in trainer.train() if r["kind"] == "train"]
    assert [r["skipped"] for r in records] == [2, 2, 2] and records[-1]["skipped_total"] == 6
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for st in trainer.opt.state.values():
        assert all(torch.isfinite(v).all() for v in st.values() if torch.is_tensor(v))

    data["grpo"]["max_consecutive_skips"] = 3
    data["log"]["output_dir"] = str(tmp_path / "abort")
    with pytest.raises(RuntimeError, match="3 consecutive updates"):
        ShapesTrainer(configuration.from_dict(ShapesTrainConfig, data)).train()


def test_failing_reward_saves_and_resume_retries_the_iteration(tmp_path, tiny_ckpt, monkeypatch, capsys):
    failed, straight = tmp_path / "failed", tmp_path / "straight"
    extra = ("eval.every=0", "reward.name=reward_plugins:flaky_geneval")
    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "FAIL_AT", 2)
    assert main(tiny_train_args(tiny_ckpt, failed, 3, *extra)) == 2
    err = capsys.readouterr().err
    assert "reward_plugins:flaky_geneval" in err and "ConnectionError" in err
    assert load_latest(failed / "checkpoints")[0]["iteration"] == 1
    monkeypatch.setattr(reward_plugins, "FAIL_AT", -1)
    assert main(tiny_train_args(tiny_ckpt, failed, 3, *extra) + ["--resume"]) == 0
    assert main(tiny_train_args(tiny_ckpt, straight, 3, *extra)) == 0
    a, b = _params(failed), _params(straight)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.mark.parametrize("sets,reason", [
    (["reward.name=null", "reward.weights={jpeg_compressibility: 0.0, geneval: 0.0}"], "every reward weight is 0"),
    (["reward.name=reward_plugins:constant"], "no prompt group had any reward spread"),
    (["sample.sde_type=dance", "sample.eta=1e30"], "no prompt group had any reward spread"),     # NaN images
])
def test_a_run_that_trains_nothing_says_why_and_stops(sets, reason, tmp_path, tiny_ckpt, capsys):
    """A run that cannot learn never finishes with exit 0 and no word: the first iteration that trains no sample
    is warned about once, with its reason, and after grpo.max_empty_iterations in a row the run saves and stops with
    exit 1 and one line; 0 = never stop."""
    run = tmp_path / "run"
    code, line, out = run_cli(main, no_eval_train_args(tiny_ckpt, run, 5, *sets, "grpo.max_empty_iterations=2"), capsys)
    assert code == 1 and line.startswith("jagg train: aborted: 2 iterations in a row had nothing to learn from: ")
    assert reason in line
    assert out.count("nothing to learn from: every advantage was 0 (the 4 samples trained with "
                     "grpo.drop_zero_spread=false") == 1 and reason in out and "grpo.max_empty_iterations" in out
    assert [json.loads(l)["iteration"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "checkpoints" / "ckpt_000002.pt").is_file()                 # saved: nothing lost
    never = tmp_path / "never"
    code, _, out = run_cli(main, no_eval_train_args(tiny_ckpt, never, 3, *sets, "grpo.max_empty_iterations=0"), capsys)
    assert code == 0 and out.count("nothing to learn from") == 1


def _interrupt(*a, **k):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where,target", [
    ("train", "jagg.trainers.shapes_trainer.load_model"),                       # the trainer's setup
    ("eval", "jagg.shapes.evaluation.evaluate"),
    ("sample", "jagg.shapes.evaluation.generate"),
    ("pretrain", "jagg.shapes.pretrain.pretrain"),
    ("bench meter", "jagg.bench.meter_command.ShapesSampler"),
])
def test_ctrl_c_anywhere_is_one_line_and_exit_130(where, target, tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Ctrl-C in a trainer's setup, an evaluation, sampling, pretraining and the benches: one line
    `jagg ...: interrupted`, exit 130, never a traceback."""
    monkeypatch.setattr(target, _interrupt)
    argv = {"train": no_eval_train_args(tiny_ckpt, tmp_path / "run", 1),
            "eval": ["eval", "--checkpoint", tiny_ckpt],
            "sample": ["sample", "--checkpoint", tiny_ckpt, "--prompt", "a red circle"],
            "pretrain": pretrain_args("w.safetensors"),
            "bench meter": ["bench", "meter", "--quick"]}[where]
    code, line, _ = run_cli(main, argv, capsys)
    assert code == 130 and line == f"jagg {where}: interrupted"


def test_a_failed_iteration_says_that_a_changed_key_needs_a_new_run(tmp_path, tiny_ckpt, capsys, monkeypatch):
    import reward_plugins

    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "FAIL_AT", 2)              # in iteration 2: iteration 1 is kept
    code, line, out = run_cli(main, no_eval_train_args(tiny_ckpt, tmp_path / "run", 2, "reward.weights=null",
                                   "reward.name=reward_plugins:flaky_geneval"), capsys)
    assert code == 2 and "reward server went away" in line
    assert "continue with --resume" in out and "needs a new run: start over with --overwrite" in out
