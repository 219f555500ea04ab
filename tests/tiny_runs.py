"""What the tests train and measure with: the arguments of seconds-long runs on the tiny checkpoints of conftest.py
(``jagg train``, ``jagg pretrain``, ``jagg bench meter``), real-model trainer configs (a model directory that does
not exist, or the ``sd3_dir`` fixture's tiny SD3), a run's records, and a free port for a launcher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from gradient_checks import assert_on_scale

# what the lab's smoke tests assume instead of the main job's layout and reward (step groups of 4 everywhere, geneval)
GENERIC = ["estimator.mode=jagg", "estimator.window=4", "estimator.exact_last_intervals=0", "reward.weights=null"]
ADVANTAGE_SCALE = 1.0        # group-normalised advantages: the size of one term of a record's loss
SD3_PROMPTS = ["a red cube", "a blue ball", "a green cone"]         # the prompts of :func:`write_sd3_config`


def config_leaves(cls, prefix: str = ""):
    """``(key, annotation)`` of every leaf field of the config dataclass ``cls`` (e.g. ``("sample.group_size", int)``)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from config_leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def meter_sets(ckpt: str) -> list[str]:
    """``--set`` strings for a seconds-long `jagg bench meter` on ``ckpt`` (the ``bench_ckpt`` fixture): unbiased JAGG
    with step groups of 4 on 8 steps, 2 prompts x 4, a brightness reward with spread in every prompt group."""
    return ["estimator.exact_last_intervals=0", "estimator.correction_p=0.25", "reward.weights=null",
            f"model.checkpoint={ckpt}", "sample.num_steps=8", "sample.prompts_per_iter=2", "sample.group_size=4",
            "estimator.micro_batch=8", "threads=1", "sample.sde_window=null", "estimator.window=4",
            "grpo.drop_zero_spread=false", "reward.name=reward_plugins:brightness"]


def real_model_config(tmp_path, model_dir: str = "model"):
    """A real-model (`pipeline:`) trainer config whose model directory ``tmp_path/model_dir`` does not exist: enough
    for the CLI's parsing, help and run-directory paths, which come before the model is loaded."""
    (tmp_path / "prompts.txt").write_text("a red cube\na blue ball\n")
    cfg = tmp_path / "real.yaml"
    cfg.write_text(f"pipeline: {{family: sd3, path: {tmp_path / model_dir}, num_steps: 4}}\n"
                   f"reward: {{name: jpeg_compressibility}}\n"
                   f"sample: {{prompts_file: {tmp_path / 'prompts.txt'}, prompts_per_iter: 2, group_size: 2}}\n")
    return cfg


def tiny_train_args(ckpt: str, out, iterations: int = 3, *extra: str) -> list[str]:
    """`jagg train` arguments for a seconds-long run of a JAGG estimator (the main job's ``mode: auto`` chooses at a
    run's start: tests/test_auto.py)."""
    sets = ["estimator.mode=jagg", f"model.checkpoint={ckpt}", f"grpo.iterations={iterations}", "sample.num_steps=4",
            "sample.prompts_per_iter=2", "sample.group_size=2", "sample.sde_window=null", "eval.every=2", "eval.num_prompts=4",
            "eval.images_per_prompt=1", "eval.num_steps=3", "eval.grid_size=4", "log.checkpoint_every=1",
            "log.progress=false", "estimator.micro_batch=4", "estimator.window=2", "grpo.drop_zero_spread=false",
            "optim.lr=0.01", "threads=1", "model.trainable=all", "reward.weights=null", "estimator.exact_last_intervals=0",
            "grpo.updates_per_epoch=1", "optim.ema_decay=0",
            *extra]
    return ["train", "--output-dir", str(out)] + [a for s in sets for a in ("--set", s)]


def no_eval_train_args(ckpt: str, out, iterations: int, *extra: str) -> list[str]:
    """:func:`tiny_train_args` of a run that never evaluates (``eval.every=0``)."""
    return tiny_train_args(ckpt, out, iterations, "eval.every=0", *extra)


def pretrain_args(out: str, *extra: str) -> list[str]:
    """`jagg pretrain` arguments for a 2-step pretraining of a tiny TinyDiT into ``out``; ``extra``: more ``--set``."""
    sets = ["train.steps=2", "train.batch_size=2", "train.log_every=1", "train.warmup=0", "model.dim=32", "model.depth=1",
            "model.heads=2", "model.text_dim=16", "model.text_depth=1", "model.text_heads=2", "model.patch_size=8"]
    return ["pretrain", "--out", out, *[a for s in [*sets, *extra] for a in ("--set", s)]]


def write_sd3_config(tmp_path: Path, model_dir: Path | str) -> Path:
    """A real-model trainer config (``tmp_path/sd3.yaml``) of 2 JAGG iterations with LoRA on the tiny SD3 directory
    ``model_dir`` (the ``sd3_dir`` fixture), its prompts in ``tmp_path/prompts.txt``."""
    (tmp_path / "prompts.txt").write_text("\n".join(SD3_PROMPTS) + "\n\n")
    cfg = tmp_path / "sd3.yaml"
    cfg.write_text(f"""\
pipeline:
  family: sd3
  path: {model_dir}
  dtype: fp32
  device: cpu
  resolution: 128
  num_steps: 4
  cfg_scale: 4.5
  max_sequence_length: 8
  lora: {{enabled: true, rank: 2}}
reward:
  name: jpeg_compressibility
sample:
  prompts_file: {tmp_path / "prompts.txt"}
  prompts_per_iter: 2
  group_size: 2
  micro_batch: 4
estimator: {{mode: jagg, window: 3, intermediate: interp, micro_batch: 4, clip_range: 0.2, kl_beta: 0.01, correction_p: 0.0}}
optim: {{lr: 0.01}}
grpo: {{iterations: 2, updates_per_epoch: 2, drop_zero_spread: false}}
log: {{output_dir: {tmp_path / "default_run"}, checkpoint_every: 1, keep_last: 2, tensorboard: false, progress: false}}
threads: 1
""")
    return cfg


def records(out: Path) -> list[dict]:
    """The records of the run directory ``out`` (its metrics.jsonl), in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def assert_same_update(got: dict, want: dict, tol: float = 1e-4) -> None:
    """Two runs' records of the same update (another process count, engine or float path): the reward, the KL and the
    gradient norm within ``tol`` relative; the loss, ``surrogate + kl_beta x KL`` where the on-policy surrogate is a
    sum of normalised advantages (terms of size ~1) times ratios of ~1 that cancels to rounding, within ``tol`` of that
    scale (its relative difference is the noise of a cancellation: 30% between 1 and 2 processes on some CPUs)."""
    for k in ("reward_mean", "kl", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=tol, abs=1e-9), k
    assert_on_scale(got["loss"], want["loss"], ADVANTAGE_SCALE, tol, "loss")


def run_launch(argv: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` for a launcher (torchrun, accelerate
    launch) in a session of its own: on a timeout the whole process group is killed, its workers too (a plain run's
    kill stops the launcher alone and leaves a hung collective's workers spinning), then TimeoutExpired is raised."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a launcher's rendezvous, or a server that is not there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_env(config_file: Path | str, *extra: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file <config_file> <extra>` gives each process (the variables it
    sets for jagg to read)."""
    import os

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), *extra, "x.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and k not in os.environ}
