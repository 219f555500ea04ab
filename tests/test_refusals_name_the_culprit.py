"""A refusal names its culprit: a command, config or file that cannot be used is refused with exit 2 and one line
naming the key, option or file (and its line, for a file that does not parse) with what to do, never a traceback;
before any work, with nothing written, and the same by every path (``--print-config`` and a run, the benches before
they measure). Names given twice or taking a built-in name, binary or missing prompt files, a directory where a file
goes, malformed YAML and a key given twice in it, corrupt checkpoints, broken JSON in a model directory, a GPU bench
JSON of the wrong shape, a reward's options, a prompt of unknown or too many words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from command_line import files_under, one_line_error, refused, train_refused_alike
from jagg.cli import main
from jagg.infra import config_loader as configuration
from jagg.trainers.shapes_config import ShapesTrainConfig


@pytest.mark.parametrize("argv,culprit", [
    (["bench", "meter", "--estimator", "w8:window=8", "--estimator", "w8:window=4"], "'w8' is given twice"),
    (["bench", "meter", "--estimator", "plain", "--estimator", "plain"], "'plain' is given twice"),
    (["bench", "meter", "--estimator", "exact:mode=jagg,window=8"], "'exact' is a built-in name"),
    (["bench", "meter", "--estimator", "subsample:subsample_frac=0.3"], "'subsample' is a built-in name"),
    (["bench", "meter", "--by-interval", "config:window=3"], "--by-interval 'config:window=3'"),
])
def test_duplicate_and_reserved_names_are_refused(argv, culprit, tmp_path, capsys):
    """A name given twice, or a definition taking a built-in name, never silently replaces the other: one line, exit
    2, before any batch (nothing written)."""
    before = files_under(tmp_path)
    refused(main, [*argv, "--quick", "--json", str(tmp_path / "out.json")], capsys, culprit)
    assert files_under(tmp_path) == before


def test_errors_name_their_culprit(tmp_path, tiny_ckpt, capsys):
    """A negative seed, a binary or missing prompt file, a directory or a name without a suffix as an image, a binary
    config file, a checkpoint suffix as pretrain's --out: each error names the key, option or file."""
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"a red circle\n\xff\xfe\x00\x81")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"a red circle\n\x00\x00\n")
    (tmp_path / "grids").mkdir()
    yaml_binary = tmp_path / "c.yaml"
    yaml_binary.write_bytes(b"seed: 0\n\xff")
    sample = ["sample", "--checkpoint", tiny_ckpt, "--steps", "2"]
    for argv, culprits in (
            (["train", "--set", "seed=-1", "--print-config"], ("seed must be an integer in [0, 4294967295]",)),
            (["train", "--set", "eval.seed=-1", "--print-config"], ("eval.seed",)),
            ([*sample, "--prompt-file", str(binary)], ("--prompt-file", str(binary), "not a UTF-8 text file", "line 2")),
            ([*sample, "--prompt-file", str(nul)], ("--prompt-file", str(nul), "binary", "line 2")),
            ([*sample, "--prompt-file", str(tmp_path / "missing.txt")], ("--prompt-file", "missing.txt")),
            ([*sample, "--prompt", "a red circle", "--out", str(tmp_path / "grids")], ("--out", "is a directory")),
            ([*sample, "--prompt", "a red circle", "--out", str(tmp_path / "grid")], ("--out", "must end in")),
            (["train", "--set", f"sample.prompts_file={binary}", "--print-config"], ("sample.prompts_file", str(binary))),
            (["train", "--config", str(yaml_binary), "--print-config"], ("config file", str(yaml_binary))),
            (["pretrain", "--out", str(tmp_path / "w.pt")], ("--out", ".safetensors")),
            (["eval", "--json", str(tmp_path / "grids")], ("--json", "is a directory"))):
        refused(main, argv, capsys, *culprits)
    assert not list(tmp_path.glob("grid*.png"))


def test_every_path_runs_the_same_checks(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Every path runs the same checks: --print-config refuses what train refuses; --by-interval and --json are
    checked before the computation; an empty --output-dir, --config or --out is refused, not replaced by a default
    (the lab's tools: lab/tests/test_lab_refusals.py)."""
    for sets, culprit in ((["reward.weights={jpeg_compressibility: .nan}"], "reward.weights.jpeg_compressibility"),
                          (["reward.name=null", "reward.weights={nosuch: 1.0}"], "unknown reward 'nosuch'"),
                          (["reward.weights=null", "reward.name=nosuch"], "unknown reward 'nosuch'"),
                          (["reward.weights=null", "reward.name=no_such_module:f"], "no_such_module"),
                          (["reward.weights={}"], "reward.weights is empty"), (["reward.weights=null", "reward.name="],
                                                                               "reward.name is empty")):
        argv = ["train", *[a for s in sets for a in ("--set", s)]]
        printed = refused(main, [*argv, "--print-config"], capsys, culprit)
        assert refused(main, [*argv, "--output-dir", str(tmp_path / "run")], capsys, culprit) == printed
    from jagg.bench import meter_command as bench_meter

    monkeypatch.setattr(bench_meter, "measure", lambda *a, **k: pytest.fail("computed before the arguments' checks"))
    refused(main, ["bench", "meter", "--quick", "--by-interval", "w:window=3,knots=nosuch"], capsys, "knots")
    refused(main, ["bench", "meter", "--quick", "--by-interval", "subsample"], capsys, "--by-interval")
    refused(main, ["bench", "meter", "--quick", "--json", str(tmp_path)], capsys, "--json", "is a directory")
    (tmp_path / "file").write_text("")
    refused(main, ["bench", "meter", "--quick", "--json", str(tmp_path / "file" / "x.json")], capsys, "is a file")

    before = files_under(tmp_path)
    for argv, culprit in ((["train", "--output-dir", "", "--print-config"], "log.output_dir"),
                          (["train", "--config", "", "--print-config"], "config file ''"),
                          (["sample", "--prompt", "a red circle", "--out", ""], "--out is empty"),
                          (["pretrain", "--out", ""], "--out is empty"),
                          (["eval", "--json", ""], "--json is empty"),
                          (["bench", "meter", "--json", ""], "--json is empty")):
        refused(main, argv, capsys, culprit)
    assert files_under(tmp_path) == before and not Path("runs").exists()


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


def test_reward_name_and_weights_together_are_refused_by_name():
    from jagg.trainers.shapes_config import main_job_path

    main_job = str(main_job_path())                                                  # it sets reward.name
    jpeg = str(Path(__file__).resolve().parents[1] / "configs" / "jpeg_compressibility.yaml")   # reward.weights
    with pytest.raises(ValueError, match="reward.name or reward.weights, not both.*reward.weights=null"):
        configuration.load(ShapesTrainConfig, jpeg, ["reward.name=geneval"])
    with pytest.raises(ValueError, match="reward.name or reward.weights, not both.*reward.weights=null"):
        configuration.load(ShapesTrainConfig, main_job, ["reward.weights={geneval: 1.0}"])
    cfg = configuration.load(ShapesTrainConfig, main_job, ["reward.name=null", "reward.weights={geneval: 1.0}"])
    assert cfg.reward.name is None and cfg.reward.weights == {"geneval": 1.0}
    cfg = configuration.load(ShapesTrainConfig, jpeg, ["reward.weights=null", "reward.name=jpeg_compressibility"])
    assert cfg.reward.name == "jpeg_compressibility" and cfg.reward.weights is None
    cfg = configuration.load(ShapesTrainConfig, jpeg, ["reward.weights=null"])
    assert cfg.reward.name == "geneval"                                               # neither set: geneval


def test_reward_options_are_checked_at_load_by_name(tmp_path, capsys):
    for spec, culprits in (("pickscore:path=/m,batch_size=-1", ("option batch_size", "-1")),
                           ("clip_score:path=/m,batch_size=0", ("option batch_size",)),
                           ("hpsv2:path=/m,dtype=float", ("option dtype",)),
                           ("pickscore:batch_size=4", ("option path= is required",)),
                           ("aesthetic:path=/m", ("option head= is required", "sac+logos")),
                           ("aesthetic:head=/h", ("option path= is required",))):
        train_refused_alike(main, ["reward.weights=null", f"reward.name={spec}"], capsys, tmp_path,
                            f"reward '{spec}'", *culprits)
    train_refused_alike(main, ["reward.name=null", "reward.weights={'pickscore:path=/m,batch_size=-2': 1.0}"], capsys,
                        tmp_path, "option batch_size")


def test_a_long_prompt_is_a_short_error(tmp_path, tiny_ckpt, capsys):
    for words in (17, 600_000):
        prompts = tmp_path / f"p{words}.txt"
        prompts.write_text(" ".join(["red"] * words) + "\n")
        line = refused(main, ["sample", "--checkpoint", tiny_ckpt, "--steps", "2", "--num-per-prompt", "1",
                         "--prompt-file", str(prompts), "--out", str(tmp_path / "g.png")], capsys,
                        f"--prompt-file {prompts}: ", f"{words} words", "more than the 16")
        assert len(line) < 300 and "max_len" not in line and "raise" not in line
    refused(main, ["sample", "--checkpoint", tiny_ckpt, "--prompt", "a mauve circle", "--out", str(tmp_path / "g.png")],
             capsys, "--prompt: ", "'mauve'")


@pytest.mark.parametrize("text,key", [
    ("seed: 1\nseed: 2\n", "'seed' is given twice (line 1 and line 2)"),
    ("optim:\n  lr: 0.1\n  betas: [0.9, 0.99]\n  lr: 0.2\n", "'lr' is given twice (line 2 and line 4)"),
    ("sample: {group_size: 2, group_size: 4}\n", "'group_size' is given twice"),
])
def test_a_duplicated_yaml_key_is_refused_naming_the_key_and_the_file(text, key, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    refused(main, ["train", "--config", str(path), "--print-config"], capsys, str(path), key)
    refused(main, ["train", "--set", "reward.name=null", "--set", "reward.weights={geneval: 1.0, geneval: 0.5}",
              "--print-config"], capsys,
             "--set", "'geneval' is given twice")


def test_malformed_yaml_names_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nsample:\n  num_steps: 4\n   eta: 1.0\n")
    for extra in ([], ["--print-config"]):
        assert main(["train", "--config", str(bad), *extra]) == 2
        err = one_line_error(capsys, "train")
        assert str(bad) in err and "not valid YAML" in err and "line 4, column 7" in err
    assert main(["train", "--set", "sample.sde_window=[0,", "--print-config"]) == 2
    assert "sample.sde_window=[0," in one_line_error(capsys, "train")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert main(["train", "--config", str(tmp_path / "list.yaml")]) == 2
    assert "must hold a mapping" in one_line_error(capsys, "train")


def _truncated(path: Path, data: bytes) -> str:
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def test_corrupt_checkpoints_exit_2_naming_the_file(tmp_path, tiny_ckpt, capsys):
    full = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.zeros(256)}, "manifest": {}}, full)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    bad = [_truncated(tmp_path / "cut.pt", full.read_bytes()),
           _truncated(tmp_path / "cut.safetensors", Path(tiny_ckpt).read_bytes()),
           str(tmp_path / "list.pt")]
    for path in bad:
        for argv in (["sample", "--checkpoint", path, "--prompt", "a red circle", "--out", str(tmp_path / "s.png")],
                     ["eval", "--checkpoint", path],
                     ["train", "--set", f"model.checkpoint={path}", "--output-dir", str(tmp_path / "run")]):
            assert main(argv) == 2
            err = one_line_error(capsys, argv[0])
            assert path in err and "not a loadable checkpoint" in err


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
    from jagg.bench import meter_command as bench_meter
    from jagg.cost import PRESETS, resolve

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        resolve("flow_grpo_sd35", PRESETS["flow_grpo_sd35"], str(path))
    assert f"--gpu-bench-json {str(path)!r}" in str(e.value) and culprit in str(e.value), e.value
    monkeypatch.setattr(bench_meter, "measure", lambda *a, **k: pytest.fail("measured before --gpu-bench-json"))
    refused(main, ["bench", "meter", "--quick", "--gpu-bench-json", str(path)], capsys, str(path), culprit)
    path.write_text(json.dumps(GOOD))
    cost, line = resolve("flow_grpo_sd35", PRESETS["flow_grpo_sd35"], str(path))
    assert cost.B_F == 1.7 and "B/F 1.70" in line
