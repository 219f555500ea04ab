"""A count that fits int64 but not the work is refused at config load, naming its key and the bound, before a model
loads or a run directory is written: every count key of both trainers' configs that sizes the work (steps, batch,
evaluation, passes, the pre-flight, resolution, text length, LoRA rank) and the counts of `jagg bench meter`,
`jagg eval` and `jagg sample`, each from an estimate (:mod:`jagg.infra.sizes`: the memory the arrays need, a lower
bound of the time at a microsecond per model evaluation, the steps a float32 schedule keeps apart). No refusal prints
more than a screen: a long value is shown by its ends and its length."""

from __future__ import annotations

import pytest
import torch

from command_line import refused, train_refused_alike
from jagg.cli import main
from tiny_runs import config_leaves, real_model_config

BIG, STEPS = 10**12, 10**8
SCREEN = 2000

# (--set values, what the refusal names) of the shapes trainer (the main job: estimator.mode auto)
SHAPES = [
    (["sample.prompts_per_iter"], "sample.prompts_per_iter="),
    (["sample.group_size"], "sample.group_size="),
    ([f"sample.num_steps={STEPS}"], "sample.num_steps="),
    ([f"eval.num_steps={STEPS}"], "eval.num_steps="),
    (["eval.images_per_prompt"], "eval.images_per_prompt="),
    (["eval.num_prompts"], "eval.num_prompts="),
    ([f"eval.grid_size={BIG // 8 * 8}"], "eval.grid_size="),
    (["grpo.inner_epochs"], "grpo.inner_epochs="),
    (["estimator.preflight_batches"], "estimator.preflight_batches="),
    (["estimator.preflight_draws"], "estimator.preflight_draws="),
]
# the same of the diffusers trainer (a real-model config whose model directory does not exist: the refusal comes first)
REAL = [
    ([f"pipeline.num_steps={STEPS}"], "pipeline.num_steps="),
    ([f"pipeline.eval_num_steps={STEPS}"], "pipeline.eval_num_steps="),
    (["pipeline.resolution"], "pipeline.resolution="),
    (["pipeline.width"], "pipeline.width="),
    (["sample.prompts_per_iter"], "sample.prompts_per_iter="),
    (["sample.group_size"], "sample.group_size="),
    (["eval.images_per_prompt", "eval.prompts_file={prompts}"], "eval.images_per_prompt"),
    (["grpo.inner_epochs"], "grpo.inner_epochs="),
    (["estimator.preflight_batches", "estimator.mode=auto"], "estimator.preflight_batches="),
    (["estimator.preflight_draws", "estimator.mode=auto"], "estimator.preflight_draws="),
    (["pipeline.max_sequence_length"], "pipeline.max_sequence_length="),
    (["pipeline.lora.rank", "pipeline.lora.enabled=true"], "pipeline.lora.rank="),
]


def _sets(keys: list[str], **paths) -> list[str]:
    return [k.format(**paths) if "=" in k else f"{k}={BIG}" for k in keys]


@pytest.mark.parametrize("keys, culprit", SHAPES, ids=[k[0].split("=")[0] for k, _ in SHAPES])
def test_a_huge_count_of_the_shapes_trainer_is_refused_at_load(keys, culprit, tmp_path, capsys):
    line = train_refused_alike(main, _sets(keys), capsys, tmp_path, culprit, "lower")
    assert len(line) < SCREEN


@pytest.mark.parametrize("keys, culprit", REAL, ids=[k[0].split("=")[0] for k, _ in REAL])
def test_a_huge_count_of_the_diffusers_trainer_is_refused_before_the_model_loads(keys, culprit, tmp_path, capsys):
    cfg, out = real_model_config(tmp_path), tmp_path / "run"
    sets = [a for s in _sets(keys, prompts=tmp_path / "prompts.txt") for a in ("--set", s)]
    printed = refused(main, ["train", "--config", str(cfg), *sets, "--print-config"], capsys, culprit, "lower")
    line = refused(main, ["train", "--config", str(cfg), *sets, "--output-dir", str(out)], capsys, culprit)
    assert line == printed and len(line) < SCREEN and not out.exists()
    assert "model" not in line.split("lower")[-1]          # not the missing model directory's refusal


@pytest.mark.parametrize("argv, culprit", [
    (["bench", "meter", "--batches", str(STEPS)], "--batches"),
    (["bench", "meter", "--draws", str(BIG)], "--draws"),
    (["eval", "--steps", str(STEPS)], "--steps"),
    (["eval", "--images-per-prompt", str(BIG)], "--images-per-prompt"),
    (["sample", "--prompt", "a red circle", "--steps", str(STEPS)], "--steps"),
    (["sample", "--prompt", "a red circle", "--num-per-prompt", str(BIG)], "--num-per-prompt"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, list) else a)
def test_a_huge_count_of_a_command_is_refused_before_its_work(argv, culprit, tmp_path, capsys):
    if argv[0] == "sample":
        argv = [*argv, "--out", str(tmp_path / "grid.png")]
    line = refused(main, argv, capsys, culprit, "lower", prog=f"jagg {argv[0]}")
    assert len(line) < SCREEN and not (tmp_path / "grid.png").exists()


def test_a_long_value_in_a_refusal_is_shown_by_its_ends():
    """A schedule of 10**6 sigmas that is not decreasing is named by its first and last sigmas and its length, and
    any refusal a command prints is bounded to a screen."""
    from jagg.arguments import run_command
    from jagg.checks import shown
    from jagg.checks.sampling import check_sigmas

    with pytest.raises(ValueError) as e:
        check_sigmas(torch.linspace(0, 1, 10**6))
    assert len(str(e.value)) < 300 and "(1000000 values)" in str(e.value)
    assert shown(list(range(10))) == "[0, 1, 2, ..., 8, 9] (10 values)" and shown([1, 2]) == "[1, 2]"

    def refuse(_):
        raise ValueError("x" * 10**6)

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_command("jagg train", refuse, None) == 2
    assert len(err.getvalue()) < SCREEN and "characters cut" in err.getvalue()


# int keys whose size is no work of its own, with why: each is a threshold or a schedule counted in iterations (a
# long run trains and checkpoints as it goes), or a chunk size clamped to what it chunks
UNBOUNDED = {
    "grpo.iterations": "a long run trains and checkpoints as it goes; Ctrl-C stops it with a checkpoint",
    "grpo.max_consecutive_skips": "a threshold", "grpo.max_empty_iterations": "a threshold",
    "estimator.meter_every": "iterations between audits", "eval.every": "iterations between evaluations",
    "eval.dense_iterations": "iterations", "eval.dense_every": "iterations between evaluations",
    "log.checkpoint_every": "iterations between checkpoints", "log.keep_last": "checkpoints kept, at most all",
    "sample.sde_window_every": "iterations between moves", "estimator.micro_batch": "clamped to the batch",
    "sample.micro_batch": "clamped to the batch", "estimator.meter_samples": "clamped to the batch",
    "eval.grid_size": "clamped to the evaluation's images (the shapes trainer's is bounded by its test split)",
    "log.sample_images": "clamped to the evaluation's images",
    "sample.sde_window_stride": "steps a sliding window moves: refused above the steps it can move (sliding only)",
}


def _int_keys(cls):
    import typing

    return [key for key, tp in config_leaves(cls) if tp is int or typing.get_args(tp) == (int, type(None))]


@pytest.mark.parametrize("trainer", ["shapes", "diffusers"])
def test_every_int_key_is_bounded_at_load_or_does_no_work_of_its_own(trainer, tmp_path):
    """Every integer key of the trainer's config (with ``estimator.mode: jagg``; the pre-flight's with ``auto``, which
    runs it), set to 10**12, is refused at load naming it (by a bound, a range, or what it counts), unless it is in
    :data:`UNBOUNDED` with why; a new count key must join one or the other."""
    from jagg.infra import config_loader as configuration
    from jagg.trainers.diffusers_config import DiffusersTrainConfig
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path

    cls, path = ((ShapesTrainConfig, main_job_path()) if trainer == "shapes" else
                 (DiffusersTrainConfig, real_model_config(tmp_path)))
    extra = [f"eval.prompts_file={tmp_path / 'prompts.txt'}"] if trainer == "diffusers" else []
    unrefused = []
    for key in _int_keys(cls):
        if key in UNBOUNDED:
            continue
        try:
            mode = "auto" if key.startswith("estimator.preflight") else "jagg"
            configuration.load(cls, path, [*extra, f"estimator.mode={mode}", f"{key}={BIG}"])
        except ValueError as e:
            assert key.rsplit(".", 1)[-1] in str(e) and len(str(e)) < SCREEN, (key, str(e))
            continue
        unrefused.append(key)
    assert not unrefused
