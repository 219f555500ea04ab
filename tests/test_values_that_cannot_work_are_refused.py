"""A value is refused at load, by name, when it cannot work where it is used, before a model loads or anything is
written: a number beyond the dtype it is used in (float32, int64, a seed's 32 bits), a size beyond the machine's
memory (with an estimate), a count larger than what it counts (rates for more intervals than the layout has, a window
longer than the trained steps, more prompts than the test split), a value in range that breaks the run (AdamW's first
step, a sigma schedule squeezed to nothing), a GRPO group of one image, a number that is not finite."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import pytest

from command_line import files_under, one_line_error, refused, run as run_cli, train_refused_alike
from jagg.checks import FLOAT32_MAX, SEED_MAX
from jagg.cli import main
from jagg.infra import config_loader as configuration
from jagg.trainers.shapes_config import ShapesTrainConfig
from tiny_runs import config_leaves, no_eval_train_args, real_model_config


_leaves = config_leaves


def _too_big(tp) -> str | None:
    """A YAML value of type ``tp`` that its Python type holds and its dtype does not (None: not a number)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    origin = typing.get_origin(base)
    if base is float:
        return "1.0e39"
    if base is int:
        return str(2**63)
    if origin in (list, tuple) and typing.get_args(base) and typing.get_args(base)[0] in (int, float):
        return f"[{'1.0e39' if typing.get_args(base)[0] is float else 2**63}, 1]"
    if origin is dict and typing.get_args(base)[1] in (int, float):
        return "{jpeg_compressibility: 1.0e39}"
    return None


def test_every_number_is_checked_in_the_dtype_it_is_used_in(tmp_path, tiny_ckpt, capsys):
    """Values that would pass a range check and then crash: every float and int key of every config dataclass (both
    trainers', jagg pretrain's) is refused at load beyond float32 / int64, seeds outside [0, 2**32 - 1] and every
    numeric option of sample, eval and the benches likewise; nothing is written (no checkpoint, no metrics.jsonl)."""
    from jagg.cli import PretrainRunConfig
    from jagg.trainers.diffusers_config import DiffusersTrainConfig
    from jagg.trainers.shapes_config import ShapesTrainConfig

    real = real_model_config(tmp_path)
    checked = 0
    for cls, path in ((ShapesTrainConfig, None), (DiffusersTrainConfig, real), (PretrainRunConfig, None)):
        for key, tp in _leaves(cls):
            value = _too_big(tp)
            if value is None:
                continue
            with pytest.raises(ValueError) as e:
                configuration.load(cls, path, [f"{key}={value}"])
            assert key in str(e.value) and ("float32" in str(e.value) or "64-bit" in str(e.value)), (key, e.value)
            checked += 1
    assert checked > 60
    before = files_under(tmp_path)
    run = tmp_path / "run"
    for sets, culprit in ((["sample.eta=1e300"], "sample.eta"), (["optim.lr=1e39"], "optim.lr"),
                          (["estimator.correction_p=1e-50"], "estimator.correction_p"),
                          ([f"sample.prompts_per_iter={10**19 + 7}"], "sample.prompts_per_iter"),
                          ([f"sample.eta=1{'0' * 400}"], "sample.eta"), (["seed=-1"], "seed"),
                          ([f"seed={SEED_MAX + 1}"], "seed"), (["eval.seed=-3"], "eval.seed"),
                          (["reward.name=null", "reward.weights={jpeg_compressibility: 1.0e39}"], "reward.weights.jpeg_compressibility"),
                          ([f"threads={2**40}"], "threads must be in [0, 1024]")):
        line = refused(main, no_eval_train_args(tiny_ckpt, run, 1, *sets), capsys, culprit)
        assert len(line) < 400
    assert files_under(tmp_path) == before and not run.exists()
    for argv, culprit in ((["eval", "--seed", str(10**20)], "--seed"), (["eval", "--seed", "-1"], "--seed"),
                          (["sample", "--prompt", "a red circle", "--guidance-scale", "1e39"], "--guidance-scale"),
                          (["sample", "--prompt", "a red circle", "--steps", str(2**63)], "--steps"),
                          (["bench", "speed", "--batch", str(10**20)], "--batch"),
                          (["bench", "meter", "--batches", str(2**63)], "--batches"),
                          (["pretrain", "--out", "x.safetensors", "--set", "train.seed=-1"], "train.seed"),
                          (["pretrain", "--out", "x.safetensors", "--set", f"model.dim={2**63}"], "model.dim")):
        refused(main, argv, capsys, culprit)
    assert files_under(tmp_path) == before
    assert 1e38 < FLOAT32_MAX                                  # large values that do fit still load
    assert configuration.load(ShapesTrainConfig, None, ["optim.lr=1e37", "optim.weight_decay=0",   # AdamW's first
                                                        f"seed={SEED_MAX}"]).seed == SEED_MAX      # step: 1e38


def test_sizes_that_fit_int64_but_not_the_machine_are_refused_with_an_estimate(tmp_path, tiny_ckpt, capsys):
    big = 2**63 - 1
    for sets, culprit in ((["sample.group_size=9223372036854775807"], "sample.group_size=9223372036854775807"),
                          ([f"sample.prompts_per_iter={10**11}"], "sample.prompts_per_iter=100000000000"),
                          (["eval.images_per_prompt=100000000000000"], "eval.images_per_prompt")):
        line = train_refused_alike(main, sets, capsys, tmp_path, culprit, "more than this machine's", "of memory")
        assert len(line) < 400
    for argv, culprit in ((["sample", "--prompt", "a red circle", "--num-per-prompt", str(big)], "--num-per-prompt"),
                          (["sample", "--prompt", "a", "--prompt", "b", "--num-per-prompt", "99999999999"],
                           "--num-per-prompt 99999999999"),
                          (["eval", "--images-per-prompt", "99999999999"], "--images-per-prompt")):
        refused(main, [*argv, "--checkpoint", tiny_ckpt], capsys, culprit,
                 "more than this machine's")
    assert not list(tmp_path.iterdir())


def test_the_memory_estimate_passes_what_the_main_job_and_the_real_configs_need(tmp_path):
    from jagg.infra import config_loader as configuration
    from jagg.trainers.diffusers_config import load_config
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
    from jagg.infra.sizes import check_memory, machine_memory, shown_bytes

    configuration.load(ShapesTrainConfig, str(main_job_path()), [])
    load_config(real_model_config(tmp_path), ["sample.prompts_per_iter=48", "sample.group_size=24"])
    check_memory(machine_memory() / 2, "half", "")
    with pytest.raises(ValueError, match="need about .* more than this machine's"):
        check_memory(machine_memory() * 2, "twice", "lower it")
    assert shown_bytes(2.5e9) == "2.5 GB" and shown_bytes(12) == "12 bytes"


@pytest.mark.parametrize("sets,culprit", [
    (["estimator.correction_probs=[0.1, 0.2, 0.3]"], "estimator.correction_probs has 3 rates, but the layout has 2"),
    (["estimator.correction_probs=[0.1]"], "estimator.correction_probs has 1 rate, but the layout has 2"),
    (["estimator.knots=shared", "estimator.correction_probs=[0.5, 0.5]"], "the layout has 3 intervals"),
    (["estimator.window=100"], "estimator.window=100 is more than the 8 trained steps"),
    (["estimator.window=9"], "estimator.window=9"),
    (["sample.sde_window=[0, 10]", "estimator.window=11"], "the 10 trained steps"),
    (["estimator.exact_first_intervals=5"], "estimator.exact_first_intervals=5 is more than the 2 intervals"),
    (["estimator.exact_last_intervals=3"], "estimator.exact_last_intervals=3"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=4", "sample.sde_window_stride=5"],
     "sample.sde_window_stride=5 is more than the 4 steps"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window=[0, 4]",
      "sample.sde_window_stride=3"], "sample.sde_window_stride=3 is more than the 2 steps"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=8"], "sample.sde_window_size=8 fills the 8 steps"),
    (["eval.num_prompts=100000"], "eval.num_prompts=100000 is more than the 69 prompts"),
    (["eval.num_prompts=70"], "eval.num_prompts=70"),
])
def test_counts_larger_than_what_they_count_are_refused_at_load(sets, culprit, tmp_path, capsys):
    """The main job's layout in mode jagg: 8 trained steps (sde_window [0, 8]) in step groups of 4, two intervals."""
    train_refused_alike(main, ["estimator.mode=jagg", *sets], capsys, tmp_path, culprit)


def test_counts_that_fit_still_load_and_the_diffusers_config_checks_them_too(tmp_path):
    from jagg.infra import config_loader as configuration
    from jagg.trainers.diffusers_config import load_config
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path

    main_job = str(main_job_path())
    for sets in (["estimator.correction_probs=[0.4, 0.1]"], ["estimator.window=8"], ["estimator.exact_first_intervals=2"],
                 ["estimator.mode=exact", "estimator.window=100"], ["eval.num_prompts=69"],
                 ["sample.sde_window_schedule=sliding", "sample.sde_window_size=4", "sample.sde_window_stride=4"]):
        configuration.load(ShapesTrainConfig, main_job, sets)
    cfg = real_model_config(tmp_path)                                       # pipeline.num_steps: 4
    load_config(cfg, ["estimator.window=4"])
    with pytest.raises(ValueError, match=r"estimator.window=5 is more than the 4 trained steps .*pipeline.num_steps=4"):
        load_config(cfg, ["estimator.window=5"])
    with pytest.raises(ValueError, match="correction_probs has 2 rates, but the layout has 1 interval"):
        load_config(cfg, ["estimator.correction_probs=[0.5, 0.5]"])


def test_bench_meter_names_the_estimator_whose_rates_do_not_fit(tmp_path, capsys, monkeypatch):
    from jagg.bench import meter_command as bench_meter

    monkeypatch.setattr(bench_meter, "measure", lambda *a, **k: pytest.fail("measured before the estimators' checks"))
    refused(main, ["bench", "meter", "--quick", "--estimator", "r3:correction_probs=[0.1,0.2,0.3]"], capsys,
             "--estimator 'r3:correction_probs=[0.1,0.2,0.3]'", "correction_probs has 3 rates")


def test_eval_refuses_more_prompts_than_the_test_split_and_records_its_count(tmp_path, tiny_ckpt, capsys):
    for n in ("100000", "70"):
        refused(main, ["eval", "--checkpoint", tiny_ckpt, "--num-prompts", n], capsys, f"--num-prompts {n}",
                 "69 prompts of the test split")
    out = tmp_path / "e.json"
    code, line, _ = run_cli(main, ["eval", "--checkpoint", tiny_ckpt, "--num-prompts", "3", "--images-per-prompt", "1",
                           "--steps", "2", "--json", str(out)], capsys)
    assert code == 0, line
    got = json.loads(out.read_text())
    assert got["num_prompts"] == 3 and got["images_per_prompt"] == 1


@pytest.mark.parametrize("sets,culprit", [
    (["optim.lr=3e38"], "optim.lr=3e+38: AdamW's first step size"),
    (["optim.lr=1e38"], "optim.lr=1e+38"),
    (["optim.lr=1e38", "optim.betas=[0.0, 0.999]"], "optim.weight_decay"),      # fits the step, not the decay
    (["optim.weight_decay=1e30"], "optim.weight_decay=1e+30 with optim.lr=0.0001"),
    (["optim.weight_decay=10000"], "optim.weight_decay=10000"),
    (["sample.shift=1e30"], "sample.shift=1e+30 squeezes the sigma schedule of sample.num_steps=10"),
    (["sample.shift=1e-37"], "sample.shift=1e-37"),
    (["sample.shift=1e8", "sample.num_steps=4", "sample.sde_window=null", "eval.num_steps=1000"], "sample.shift"),
])
def test_values_in_range_that_break_the_run_are_refused_at_load(sets, culprit, tmp_path, capsys):
    train_refused_alike(main, sets, capsys, tmp_path, culprit)


def test_sampling_options_that_break_the_schedule_are_refused(tiny_ckpt, capsys):
    for argv in (["sample", "--prompt", "a red circle"], ["eval"]):
        refused(main, [*argv, "--shift", "1e30"], capsys, "--shift=1e+30", "--steps")


def test_group_of_one_image_is_rejected_in_both_trainers(tmp_path, capsys):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        configuration.load(ShapesTrainConfig, None, ["sample.group_size=1"])
    assert main(["train", "--set", "sample.group_size=1", "--print-config"]) == 2
    assert "sample.group_size must be >= 2" in one_line_error(capsys, "train")
    cfg = real_model_config(tmp_path)                                                 # the real-model trainer's config
    assert main(["train", "--config", str(cfg), "--print-config"]) == 0
    assert main(["train", "--config", str(cfg), "--set", "sample.group_size=1", "--print-config"]) == 2
    assert "sample.group_size must be >= 2" in one_line_error(capsys, "train")


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-.inf"])
def test_non_finite_numbers_are_rejected_by_name(value, capsys):
    for key in ("optim.lr", "sample.eta", "estimator.correction_p"):
        assert main(["train", "--set", f"{key}={value}", "--print-config"]) == 2
        error = one_line_error(capsys, "train")
        assert f"{key}: expected a finite number" in error, error


@pytest.mark.parametrize("command,args,msg", [
    ("eval", ["--images-per-prompt", "0"], "argument --images-per-prompt: must be >= 1"),
    ("eval", ["--guidance-scale", "nan"], "argument --guidance-scale: expected a finite number"),
    ("eval", ["--num-prompts", "-1"], "argument --num-prompts: must be >= 0"),
    ("sample", ["--prompt", "x", "--steps", "0"], "argument --steps: must be >= 1"),
    ("sample", ["--prompt", "x", "--shift", "0"], "argument --shift: must be > 0"),
    ("sample", ["--prompt", "x", "--num-per-prompt", "two"], "argument --num-per-prompt: expected an integer"),
])
def test_sampling_options_are_checked_by_the_parser(command, args, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, *args])
    assert exc.value.code == 2 and msg in capsys.readouterr().err
