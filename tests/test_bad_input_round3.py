"""Bad input, third round (issue #36): the classes a new-user probe of this turn's features found, one test (or a
few) per class, each over more than the one input that found it. A refusal is exit 2 with one line naming its
culprit and nothing written (:func:`test_bad_input._refused`)."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import real_model_config, tiny_train_args
from jagg.cli import main
from test_bad_input import _files, _jagg, _refused


def _train(ckpt: str, out: Path, iterations: int, *extra: str) -> list[str]:
    return tiny_train_args(ckpt, out, iterations, "eval.every=0", *extra)


def _both(sets: list[str], capsys, tmp_path, *culprits: str) -> str:
    """``sets`` refused the same by ``--print-config`` and by ``train`` (which writes nothing)."""
    argv = ["train", *[a for s in sets for a in ("--set", s)]]
    printed = _refused([*argv, "--print-config"], capsys, *culprits)
    run = tmp_path / "run"
    assert _refused([*argv, "--output-dir", str(run)], capsys, *culprits) == printed
    assert not run.exists()
    return printed


# ---------------------------------------------------------------------------------------------- 1. wandb start-up


@pytest.mark.parametrize("sets,env,culprit", [
    (["log.wandb_project=a/b:c"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_project 'a/b:c'"),
    ([f"log.wandb_project={'p' * 129}"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_project"),
    (["log.wandb_entity=team#1"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_entity"),
    ([], {"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus'"),
    ([], {}, "needs a W&B API key"),                                         # online, no key, no netrc
    (["log.wandb_mode=online"], {"WANDB_MODE": "offline"}, "needs a W&B API key"),
])
def test_wandb_start_up_errors_are_one_line_before_anything_is_written(sets, env, culprit, tmp_path, capsys,
                                                                        monkeypatch):
    import fake_wandb

    fake_wandb.install(monkeypatch)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL", "WANDB_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))      # no settings file with a key
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _both(["log.wandb=true", *sets], capsys, tmp_path, culprit)


def test_wandb_start_up_passes_offline_or_with_a_key(tmp_path, capsys, monkeypatch):
    import fake_wandb

    from jagg.infra.wandb_run import check_start
    from jagg.trainers.sections import LogSection

    fake_wandb.install(monkeypatch)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    config_dir = tmp_path / "wandb_config"
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(config_dir))
    check_start(LogSection(wandb=True, wandb_mode="offline"))
    check_start(LogSection(wandb=True, wandb_mode="disabled"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_start(LogSection(wandb=True))
    monkeypatch.delenv("WANDB_MODE")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    check_start(LogSection(wandb=True))                                          # `wandb login`'s entry
    monkeypatch.delenv("NETRC")
    with pytest.raises(ValueError, match="needs a W&B API key"):
        check_start(LogSection(wandb=True))
    config_dir.mkdir()
    (config_dir / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    check_start(LogSection(wandb=True))                                          # wandb's settings file


def test_a_wandb_init_failure_is_one_line_naming_log_wandb(monkeypatch):
    import fake_wandb

    from jagg.infra.wandb_run import WandbRun
    from jagg.trainers.sections import LogSection

    fake_wandb.install(monkeypatch)

    class UsageError(Exception):
        pass

    def refuse(**kwargs):
        raise UsageError("Invalid project name\nwith a second line")

    monkeypatch.setattr(sys.modules["wandb"], "init", refuse)
    with pytest.raises(ValueError) as e:
        WandbRun(LogSection(wandb=True, wandb_mode="offline"), "id", Path("."), {})
    assert str(e.value).startswith("log.wandb: wandb could not start (UsageError: Invalid project name with")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- 2. reward return values


def _returns(value):
    return lambda images, prompts, metadata: value(len(prompts)) if callable(value) else value


@pytest.mark.parametrize("value,message", [
    (lambda n: (float(i) for i in range(n)), None),                          # a generator: coerced
    (lambda n: [True, False] * (n // 2), None),                              # bools: 1 and 0
    (lambda n: np.arange(n, dtype=np.int64), None),
    (lambda n: torch.arange(n, dtype=torch.float64), None),
    (lambda n: (x for x in iter(int, 1)), "shape (5,)"),                      # an endless generator: too many
    (lambda n: ["1.0"] * n, "must be real numbers, not strings"),
    (lambda n: [0.5] * (n - 1) + ["x"], "not strings"),
    (lambda n: [0.5] * (n - 1) + [object()], "of type object"),
    (lambda n: "0.5", "returned a str"),
    (lambda n: None, "returned a NoneType"),
    (lambda n: np.ones(n) * (1 + 2j), "complex scores"),
    (lambda n: torch.ones(n, dtype=torch.complex64), "complex scores"),
    (lambda n: [1e39] * n, "beyond float32"),
    (lambda n: [float("nan")] * n, "scores must be finite"),
    (lambda n: [0.5] * (n + 1), "one score per image"),
    (lambda n: [[0.5]] * n, "one score per image"),
    (lambda n: {"a": 1}, "returned a dict"),
])
def test_a_reward_s_return_value_is_coerced_or_refused_naming_the_reward(value, message):
    from jagg.rewards.registry import get_reward

    reward = get_reward(_returns(value))
    images = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    if message is None:
        scores, info = reward(images, ["a"] * 4)
        assert scores.dtype == np.float32 and scores.shape == (4,) and info == {}
        return
    with pytest.raises(ValueError) as e:
        reward(images, ["a"] * 4)
    assert "reward '<lambda>'" in str(e.value) and message in str(e.value), e.value
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("plugin,message", [("generator", None), ("strings", "not strings"),
                                            ("complex", "complex scores")])
def test_a_user_reward_s_return_value_in_train_and_eval(plugin, message, tmp_path, tiny_ckpt, capsys, monkeypatch):
    module = types.ModuleType("round3_rewards")
    module.generator = lambda images, prompts, metadata: (float(i % 3) for i in range(len(prompts)))
    module.strings = lambda images, prompts, metadata: ["0.5"] * len(prompts)
    module.complex = lambda images, prompts, metadata: np.ones(len(prompts)) * 1j
    monkeypatch.setitem(sys.modules, "round3_rewards", module)
    spec = f"round3_rewards:{plugin}"
    code, line, _ = _jagg(_train(tiny_ckpt, tmp_path / "run", 1, "reward.weights=null", f"reward.name={spec}"), capsys)
    evaluated, eline, _ = _jagg(["eval", "--checkpoint", tiny_ckpt, "--reward", spec, "--num-prompts", "2",
                                 "--images-per-prompt", "1", "--steps", "2"], capsys)
    if message is None:
        assert code == 0 and evaluated == 0, (line, eline)
        return
    for got, text in ((code, line), (evaluated, eline)):
        assert got == 2 and f"reward '{spec}'" in text and message in text, text


# ---------------------------------------------------------------------------------------------- 3. --gpu-bench-json


GOOD = {"costs": [{"model": "sd35m", "resolution": 512, "b_over_f": 1.7}], "config": {"lora": True}, "env": {}}


@pytest.mark.parametrize("data,culprit", [
    ({**GOOD, "costs": [1.0, 2.0]}, "'costs' must be a list of records"),
    ({**GOOD, "costs": {"sd35m": 1.7}}, "'costs' must be a list of records"),
    ({**GOOD, "config": ["lora"]}, "'config' must be an object"),
    ({**GOOD, "env": "gpu"}, "'env' must be an object"),
    ({"costs": [{**GOOD["costs"][0], "b_over_f": "fast"}]}, "costs[0].b_over_f"),
    ({"costs": [{**GOOD["costs"][0], "b_over_f": -1.0}]}, "costs[0].b_over_f"),
    ({"costs": [{**GOOD["costs"][0], "b_over_f": float("nan")}]}, "costs[0].b_over_f"),
    ({"costs": [{**GOOD["costs"][0], "b_over_f": True}]}, "costs[0].b_over_f"),
    ([GOOD], "must hold a JSON object"),
])
def test_gpu_bench_json_is_checked_by_key_in_both_benches(data, culprit, tmp_path, capsys, monkeypatch):
    from jagg.bench import meter as efficiency
    from jagg.cost import PRESETS, resolve

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        resolve("flow_grpo_sd35", PRESETS["flow_grpo_sd35"], str(path))
    assert f"--gpu-bench-json {str(path)!r}" in str(e.value) and culprit in str(e.value), e.value
    monkeypatch.setattr(efficiency, "measure", lambda *a, **k: pytest.fail("measured before --gpu-bench-json"))
    _refused(["bench", "meter", "--quick", "--gpu-bench-json", str(path)], capsys, str(path), culprit)
    path.write_text(json.dumps(GOOD))
    cost, line = resolve("flow_grpo_sd35", PRESETS["flow_grpo_sd35"], str(path))
    assert cost.B_F == 1.7 and "B/F 1.70" in line


# ---------------------------------------------------------------------------------------------- 4. sizes beyond the machine


def test_sizes_that_fit_int64_but_not_the_machine_are_refused_with_an_estimate(tmp_path, tiny_ckpt, capsys):
    big = 2**63 - 1
    for sets, culprit in ((["sample.group_size=9223372036854775807"], "sample.group_size=9223372036854775807"),
                          ([f"sample.prompts_per_iter={10**11}"], "sample.prompts_per_iter=100000000000"),
                          (["eval.images_per_prompt=100000000000000"], "eval.images_per_prompt")):
        line = _both(sets, capsys, tmp_path, culprit, "more than this machine's", "of memory")
        assert len(line) < 400
    for argv, culprit in ((["sample", "--prompt", "a red circle", "--num-per-prompt", str(big)], "--num-per-prompt"),
                          (["sample", "--prompt", "a", "--prompt", "b", "--num-per-prompt", "99999999999"],
                           "--num-per-prompt 99999999999"),
                          (["eval", "--images-per-prompt", "99999999999"], "--images-per-prompt")):
        _refused([*argv, "--checkpoint", tiny_ckpt], capsys, culprit,
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


# ---------------------------------------------------------------------------------------------- 5, 6. counts and the layout


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
    _both(["estimator.mode=jagg", *sets], capsys, tmp_path, culprit)


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


def test_bench_efficiency_names_the_estimator_whose_rates_do_not_fit(tmp_path, capsys, monkeypatch):
    from jagg.bench import meter as efficiency

    monkeypatch.setattr(efficiency, "measure", lambda *a, **k: pytest.fail("measured before the estimators' checks"))
    _refused(["bench", "meter", "--quick", "--estimator", "r3:correction_probs=[0.1,0.2,0.3]"], capsys,
             "--estimator 'r3:correction_probs=[0.1,0.2,0.3]'", "correction_probs has 3 rates")


def test_eval_refuses_more_prompts_than_the_test_split_and_records_its_count(tmp_path, tiny_ckpt, capsys):
    for n in ("100000", "70"):
        _refused(["eval", "--checkpoint", tiny_ckpt, "--num-prompts", n], capsys, f"--num-prompts {n}",
                 "69 prompts of the test split")
    out = tmp_path / "e.json"
    code, line, _ = _jagg(["eval", "--checkpoint", tiny_ckpt, "--num-prompts", "3", "--images-per-prompt", "1",
                           "--steps", "2", "--json", str(out)], capsys)
    assert code == 0, line
    got = json.loads(out.read_text())
    assert got["num_prompts"] == 3 and got["images_per_prompt"] == 1


# ---------------------------------------------------------------------------------------------- 7. errors name their option


def test_reward_options_are_checked_at_load_by_name(tmp_path, capsys):
    for spec, culprits in (("pickscore:path=/m,batch_size=-1", ("option batch_size", "-1")),
                           ("clip_score:path=/m,batch_size=0", ("option batch_size",)),
                           ("hpsv2:path=/m,dtype=float", ("option dtype",)),
                           ("pickscore:batch_size=4", ("option path= is required",)),
                           ("aesthetic:path=/m", ("option head= is required", "sac+logos")),
                           ("aesthetic:head=/h", ("option path= is required",))):
        _both(["reward.weights=null", f"reward.name={spec}"], capsys, tmp_path, f"reward '{spec}'", *culprits)
    _both(["reward.name=null", "reward.weights={'pickscore:path=/m,batch_size=-2': 1.0}"], capsys, tmp_path,
          "option batch_size")


def test_a_long_prompt_is_a_short_error(tmp_path, tiny_ckpt, capsys):
    for words in (17, 600_000):
        prompts = tmp_path / f"p{words}.txt"
        prompts.write_text(" ".join(["red"] * words) + "\n")
        line = _refused(["sample", "--checkpoint", tiny_ckpt, "--steps", "2", "--num-per-prompt", "1",
                         "--prompt-file", str(prompts), "--out", str(tmp_path / "g.png")], capsys,
                        f"--prompt-file {prompts}: ", f"{words} words", "more than the 16")
        assert len(line) < 300 and "max_len" not in line and "raise" not in line
    _refused(["sample", "--checkpoint", tiny_ckpt, "--prompt", "a mauve circle", "--out", str(tmp_path / "g.png")],
             capsys, "--prompt: ", "'mauve'")


# ---------------------------------------------------------------------------------------------- 8. JSON in a model directory


def test_broken_json_inside_a_model_directory_names_the_file(tmp_path):
    from jagg.integrations.pipeline import check_model_dir
    from jagg.rewards.registry import get_reward

    model = tmp_path / "sd3"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline",
                                                        "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    for broken, text in (("transformer/config.json", '{"in_channels": 16,'), ("model_index.json", "{"),
                         ("scheduler/scheduler_config.json", "not json")):
        (model / "transformer" / "config.json").write_text('{"in_channels": 16}')
        (model / broken).parent.mkdir(exist_ok=True)
        good = (model / broken).read_text() if (model / broken).exists() else None
        (model / broken).write_text(text)
        with pytest.raises(ValueError) as e:
            check_model_dir(model, "sd3")
        assert str(model / broken) in str(e.value) and "is not valid JSON (line" in str(e.value)
        if good is not None:
            (model / broken).write_text(good)
        else:
            (model / broken).unlink()
    check_model_dir(model, "sd3")
    clip = tmp_path / "clip"
    clip.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (clip / "config.json").write_text(json.dumps({"model_type": "clip"}))
        (clip / name).write_text('{"model_type": "clip"')
        with pytest.raises(ValueError) as e:
            get_reward(f"pickscore:path={clip}")
        assert str(clip / name) in str(e.value) and "is not valid JSON" in str(e.value)


# ---------------------------------------------------------------------------------------------- 10. values that break the run


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
    _both(sets, capsys, tmp_path, culprit)


def test_sampling_options_that_break_the_schedule_are_refused(tiny_ckpt, capsys):
    for argv in (["sample", "--prompt", "a red circle"], ["eval"]):
        _refused([*argv, "--shift", "1e30"], capsys, "--shift=1e+30", "--steps")


def test_a_failed_iteration_says_that_a_changed_key_needs_a_new_run(tmp_path, tiny_ckpt, capsys, monkeypatch):
    import reward_plugins

    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "FAIL_AT", 2)              # in iteration 2: iteration 1 is kept
    code, line, out = _jagg(_train(tiny_ckpt, tmp_path / "run", 2, "reward.weights=null",
                                   "reward.name=reward_plugins:flaky_geneval"), capsys)
    assert code == 2 and "reward server went away" in line
    assert "continue with --resume" in out and "needs a new run: start over with --overwrite" in out


# ---------------------------------------------------------------------------------------------- 11. misleading texts


@pytest.mark.parametrize("text,key", [
    ("seed: 1\nseed: 2\n", "'seed' is given twice (line 1 and line 2)"),
    ("optim:\n  lr: 0.1\n  betas: [0.9, 0.99]\n  lr: 0.2\n", "'lr' is given twice (line 2 and line 4)"),
    ("sample: {group_size: 2, group_size: 4}\n", "'group_size' is given twice"),
])
def test_a_duplicated_yaml_key_is_refused_naming_the_key_and_the_file(text, key, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _refused(["train", "--config", str(path), "--print-config"], capsys, str(path), key)
    _refused(["train", "--set", "reward.name=null", "--set", "reward.weights={geneval: 1.0, geneval: 0.5}",
              "--print-config"], capsys,
             "--set", "'geneval' is given twice")


def test_the_reward_help_of_eval_names_the_main_job_s_reward(capsys):
    from jagg.arguments import MAIN_JOB_REWARD
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path

    assert configuration.load(ShapesTrainConfig, str(main_job_path()), []).reward.spec == MAIN_JOB_REWARD
    for argv in (["eval", "--help"],):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert f"main job's reward (reward: of jagg/shapes/main_job.yaml), {MAIN_JOB_REWARD}]" in text
        assert "jpeg_compressibility with geneval" not in text


# ---------------------------------------------------------------------------------------------- 12. run.json on --resume


@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory, tiny_ckpt):
    run = tmp_path_factory.mktemp("r3") / "run"
    assert main(_train(tiny_ckpt, run, 1)) == 0
    return run


@pytest.mark.parametrize("damage,what", [
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_text('{"run_id": "2026'), "cannot be read"),
    (lambda f: f.write_bytes(b"\xff\xfe"), "cannot be read"),
    (lambda f: f.write_text('{"started": "x"}'), "holds no run id"),
    (lambda f: f.write_text("[1, 2]"), "holds no run id"),
])
def test_an_unreadable_or_deleted_run_json_is_refused_on_resume(damage, what, one_iteration, tmp_path, tiny_ckpt,
                                                                capsys):
    run = tmp_path / "run"
    shutil.copytree(one_iteration, run)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    damage(run / "run.json")
    before = _files(run)
    line = _refused(_train(tiny_ckpt, run, 2) + ["--resume"], capsys, f"{run / 'run.json'} {what}", "nothing was changed")
    assert run_id in line and "echo" in line
    assert _files(run) == before
    (run / "run.json").write_text(json.dumps({"run_id": run_id}))           # the recovery the message gives
    code, line, _ = _jagg(_train(tiny_ckpt, run, 2) + ["--resume"], capsys)
    assert code == 0, line
    (run / "run.json").write_text(json.dumps({"run_id": "another-run"}))    # the run-id check stays
    _refused(_train(tiny_ckpt, run, 3) + ["--resume"], capsys, "mixes two runs")
