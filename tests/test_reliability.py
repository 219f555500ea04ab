"""Failures lose nothing: signals, SIGKILL mid-checkpoint, non-finite updates, failing rewards, bad prompt files."""

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
from conftest import tiny_train_args
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import list_checkpoints, load_latest
from jagg.cli import main
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.trainers.shapes import ShapesTrainer

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
    import jagg.trainers.shapes as tr

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


def test_prompt_files_are_checked_at_load(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("a red circle\n\nthree blue squares\n")
    cfg = configuration.load(ShapesTrainConfig, None, [f"sample.prompts_file={good}"])
    assert cfg.sample.prompts() == ["a red circle", "three blue squares"]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="holds no prompt"):
        configuration.load(ShapesTrainConfig, None, [f"sample.prompts_file={empty}"])
    with pytest.raises(ValueError, match="does not exist"):
        configuration.load(ShapesTrainConfig, None, [f"sample.prompts_file={tmp_path / 'missing.txt'}"])
    bad = tmp_path / "bad.txt"
    bad.write_text("a red circle\na purple circle\n")
    with pytest.raises(ValueError, match="line 2.*purple"):
        configuration.load(ShapesTrainConfig, None, [f"sample.prompts_file={bad}"])
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="bin.txt' is not a UTF-8 text file"):
        configuration.load(ShapesTrainConfig, None, [f"sample.prompts_file={binary}"])
