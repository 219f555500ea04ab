"""`jagg` CLI boundaries (issue #11): malformed YAML and corrupt checkpoints exit 2 with one line naming the file,
GRPO groups of one image are rejected, the main job ships inside the package (`jagg train` runs it from any
directory), `jagg train --print-config` round-trips, and image grids are captioned with prompt and reward."""

import fnmatch
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import real_model_config, tiny_train_args
from jagg.cli import main
from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import load_latest, save_checkpoint
from jagg.infra.metrics import CAPTION_MIN_WIDTH, save_grid

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jagg {command}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _truncated(path: Path, data: bytes) -> str:
    path.write_bytes(data[: len(data) // 2])
    return str(path)


# ---------------------------------------------------------------------------------------------- malformed YAML


def test_malformed_yaml_names_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nsample:\n  num_steps: 4\n   eta: 1.0\n")
    for extra in ([], ["--print-config"]):
        assert main(["train", "--config", str(bad), *extra]) == 2
        err = _one_line_error(capsys, "train")
        assert str(bad) in err and "not valid YAML" in err and "line 4, column 7" in err
    assert main(["train", "--set", "sample.sde_window=[0,", "--print-config"]) == 2
    assert "sample.sde_window=[0," in _one_line_error(capsys, "train")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert main(["train", "--config", str(tmp_path / "list.yaml")]) == 2
    assert "must hold a mapping" in _one_line_error(capsys, "train")


# ---------------------------------------------------------------------------------------------- corrupt checkpoints


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
            err = _one_line_error(capsys, argv[0])
            assert path in err and "not a loadable checkpoint" in err


def test_load_latest_still_skips_unreadable_checkpoints(tmp_path, tiny_ckpt, capsys):
    run = tmp_path / "run"
    assert main(tiny_train_args(tiny_ckpt, run, 1, "eval.every=0")) == 0
    good = run / "checkpoints" / "ckpt_000001.pt"
    newer = _truncated(run / "checkpoints" / "ckpt_000002.pt", good.read_bytes())
    capsys.readouterr()
    state, path = load_latest(run / "checkpoints")
    assert path == good and state["iteration"] == 1
    assert re.search(rf"warning: skipping unreadable checkpoint.*{re.escape(newer)}", capsys.readouterr().out)
    assert main(["sample", "--checkpoint", str(run), "--prompt", "a red circle", "--num-per-prompt", "1",
                 "--steps", "2", "--out", str(tmp_path / "s.png")]) == 0
    save_checkpoint({"model": {}}, run / "checkpoints", 3, keep_last=5)          # newest, but no TinyDiT
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "ckpt_000003.pt")]) == 2
    assert "not a loadable TinyDiT checkpoint" in _one_line_error(capsys, "eval")


# ---------------------------------------------------------------------------------------------- group size


def test_group_of_one_image_is_rejected_in_both_trainers(tmp_path, capsys):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        configuration.load(ShapesTrainConfig, None, ["sample.group_size=1"])
    assert main(["train", "--set", "sample.group_size=1", "--print-config"]) == 2
    assert "sample.group_size must be >= 2" in _one_line_error(capsys, "train")
    cfg = _real_config(tmp_path)                                                 # the real-model trainer's config
    assert main(["train", "--config", str(cfg), "--print-config"]) == 0
    assert main(["train", "--config", str(cfg), "--set", "sample.group_size=1", "--print-config"]) == 2
    assert "sample.group_size must be >= 2" in _one_line_error(capsys, "train")


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-.inf"])
def test_non_finite_numbers_are_rejected_by_name(value, capsys):
    for key in ("optim.lr", "sample.eta", "estimator.correction_p"):
        assert main(["train", "--set", f"{key}={value}", "--print-config"]) == 2
        error = _one_line_error(capsys, "train")
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


def _real_config(tmp_path: Path) -> Path:
    return real_model_config(tmp_path, "model")


# ---------------------------------------------------------------------------------------------- the main job


def test_one_main_job_file_for_jagg_train_make_train_and_benchmarks():
    main_job = main_job_path().resolve()
    assert main_job.parent == (REPO / "src" / "jagg" / "shapes").resolve()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch("main_job.yaml", g) for g in package_data["jagg.shapes"])   # shipped in the wheel
    recipe = (REPO / "Makefile").read_text().split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"--config\s+(\S+)", recipe)
    assert "jagg train" in recipe and all((REPO / n).resolve() == main_job for n in named)
    if (REPO / "configs" / "default.yaml").exists():                           # may stay only as a link to it
        assert (REPO / "configs" / "default.yaml").resolve() == main_job
    from jagg.bench.common import default_config_path

    assert Path(default_config_path()).resolve() == main_job


def test_jagg_train_outside_the_repository_runs_the_main_job(tmp_path, tiny_ckpt, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)                                                # no configs/ here
    main_job = configuration.load(ShapesTrainConfig, main_job_path())
    assert main(["train", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == configuration.to_dict(main_job)
    assert printed["sample"]["guidance_scale"] == 1.0 and printed["eval"]["every"] == 25  # not the dataclass defaults
    assert main(tiny_train_args(tiny_ckpt, tmp_path / "run", 1, "eval.every=1")) == 0
    state, _ = load_latest(tmp_path / "run" / "checkpoints")
    assert state["config"]["sample"]["guidance_scale"] == main_job.sample.guidance_scale
    assert state["config"]["estimator"]["jagg_frac"] == main_job.estimator.jagg_frac
    # the evaluation grid is captioned with each image's prompt and reward (also in the sidecar .txt)
    lines = (tmp_path / "run" / "samples" / "eval_000001.txt").read_text().splitlines()
    assert len(lines) == 4 and all(re.fullmatch(r"\d+: [a-z ]+ \(reward -?\d\.\d{3}\)", l) for l in lines)
    assert _caption_has_ink(np.asarray(Image.open(tmp_path / "run" / "samples" / "eval_000001.png")), ncol=4)


# ---------------------------------------------------------------------------------------------- --print-config


def test_print_config_round_trips_and_trains_nothing(tmp_path, capsys):
    sets = ["seed=7", "estimator.window=2", "sample.sde_window=null", "sample.timestep_fraction=0.5",
            "reward.name=null", "reward.weights={geneval: 1.0, jpeg_compressibility: 0.1}", "optim.lr=3e-5", "model.trainable=ada|final"]
    argv = ["train", *[a for s in sets for a in ("--set", s)], "--output-dir", str(tmp_path / "run"), "--print-config"]
    assert main(argv) == 0
    first = tmp_path / "first.yaml"
    first.write_text(capsys.readouterr().out)
    expected = configuration.load(ShapesTrainConfig, main_job_path(), sets + [f"log.output_dir={tmp_path / 'run'}"])
    assert configuration.load(ShapesTrainConfig, first) == expected
    assert expected.optim.lr == 3e-5 and expected.sample.sde_window is None
    assert main(["train", "--config", str(first), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(first.read_text())
    assert not (tmp_path / "run").exists()


def test_print_config_of_a_real_model_config_round_trips(tmp_path, capsys):
    cfg = _real_config(tmp_path)                 # a pipeline: section: the real-model trainer's keys and defaults
    assert main(["train", "--config", str(cfg), "--set", "grpo.iterations=3", "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    data = yaml.safe_load(printed.read_text())
    assert data["pipeline"]["family"] == "sd3" and data["grpo"]["iterations"] == 3
    assert data["reward"]["name"] == "jpeg_compressibility" and data["reward_server"] is None
    assert data["log"]["output_dir"] == "runs/real"                          # DiffusersLogSection's default, not TinyDiT's
    assert main(["train", "--config", str(printed), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == data


# ---------------------------------------------------------------------------------------------- captions


def _caption_has_ink(grid: np.ndarray, ncol: int) -> bool:
    """True when every column of cells has dark (text) pixels between the bottom of its first image and the
    next row (images are square: the cell width gives their height)."""
    scale = int(np.argmax(grid[:, :, 0].min(axis=1) < 255))                   # the top white border
    cell = (grid.shape[1] - scale) // ncol - scale
    band = grid[scale + cell + 1:scale + cell + 12]
    return all((band[:, scale + c * (cell + scale):scale + c * (cell + scale) + cell] < 100).any() for c in range(ncol))


def test_save_grid_captions_prompt_and_reward(tmp_path, capsys, tiny_ckpt):
    images = np.full((4, 32, 32, 3), 40, dtype=np.uint8)
    save_grid(images, tmp_path / "plain.png", ncol=4)
    plain = np.asarray(Image.open(tmp_path / "plain.png"))
    assert plain.shape[:2] == (4 * 34, 4 * (4 * 33 + 1)) and not (tmp_path / "plain.txt").exists()
    assert not _caption_has_ink(plain, ncol=4)
    prompts = ["a red circle", "two blue squares", "a yellow triangle to the right of a white square", "a circle"]
    save_grid(images, tmp_path / "cap.png", ncol=2, prompts=prompts, rewards=[0.25, 0.5, 0.75, 1.0])
    cap = np.asarray(Image.open(tmp_path / "cap.png"))
    assert cap.shape[1] >= 2 * CAPTION_MIN_WIDTH and _caption_has_ink(cap, ncol=2)
    assert (tmp_path / "cap.txt").read_text().splitlines()[1] == "1: two blue squares (reward 0.500)"
    with pytest.raises(ValueError, match="3 prompts for 4 images"):
        save_grid(images, tmp_path / "x.png", prompts=prompts[:3])
    out = tmp_path / "sample.png"
    assert main(["sample", "--checkpoint", tiny_ckpt, "--prompt", "a red circle", "--prompt", "a blue square",
                 "--num-per-prompt", "2", "--steps", "2", "--out", str(out)]) == 0
    assert _caption_has_ink(np.asarray(Image.open(out)), ncol=2)


def test_eval_defaults_are_the_main_jobs_evaluation():
    """`jagg eval --checkpoint runs/default` evaluates as the trainer did: same guidance, steps, images, seed."""
    from jagg.arguments import main_job_defaults
    from jagg.cli import build_parser
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
    from jagg.infra import config_loader

    main = config_loader.load(ShapesTrainConfig, str(main_job_path()), [])
    a = build_parser().parse_args(["eval"])
    main_job_defaults(a, eval_seed=True)
    assert (a.guidance_scale, a.steps, a.images_per_prompt, a.seed, a.shift) == (
        main.sample.guidance_scale, main.eval.num_steps, main.eval.images_per_prompt, main.eval.seed, main.sample.shift)
    s = build_parser().parse_args(["sample", "--prompt", "a red circle", "--guidance-scale", "2.5"])
    main_job_defaults(s, eval_seed=False)
    assert s.guidance_scale == 2.5 and s.seed == 0 and s.steps == main.eval.num_steps


# ---------------------------------------------------------------------------------------------- --help shows what runs


def _help(argv: list[str], capsys) -> dict[str, str]:
    """``jagg ... --help`` as {config key: its line}."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    lines = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"  ([a-z_][\w.]*)\s{2,}", line)
        if m:
            lines.setdefault(m.group(1), line)
    return lines


def test_train_help_shows_the_main_jobs_values_beside_the_dataclass_defaults(tmp_path, capsys):
    """Issue #18: --help showed the dataclass defaults as "[default: ...]" while plain `jagg train` ran the main job
    (lr 1e-4 not 3e-4, 200 iterations not 100, eta 1.0 not 0.7, guidance 1.0 not 3.0, ...)."""
    from jagg.cli import _value
    from jagg.rewards.client import RewardClient
    import dataclasses

    main_job = configuration.load(ShapesTrainConfig, main_job_path())
    lines = _help(["train", "--help"], capsys)
    for key, default, _ in configuration.describe(ShapesTrainConfig):
        value = repr(_value(main_job, key))
        assert lines[key].endswith(f"[{value}]" if value == default else f"[{value}; dataclass default: {default}]"), key
    assert lines["optim.lr"].endswith("[0.0001; dataclass default: 0.0003]")
    assert lines["grpo.iterations"].endswith("[150; dataclass default: 100]")
    assert lines["sample.eta"].endswith("[1.0; dataclass default: 0.7]")
    assert lines["sample.guidance_scale"].endswith("[1.0; dataclass default: 3.0]")
    assert lines["model.trainable"].endswith("['^text'; dataclass default: 'all']")
    # the real-model keys (dataclass defaults), reward_server naming every RewardClient argument, token included
    assert all(f.name in lines["reward_server"] for f in dataclasses.fields(RewardClient))
    assert "token" in lines["reward_server"]

    # --config and --set given before --help: that config's values
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("optim: {lr: 0.002}\nsample: {eta: 0.5}\n")
    lines = _help(["train", "--config", str(cfg), "--set", "grpo.iterations=7", "--help"], capsys)
    assert lines["optim.lr"].endswith("[0.002; dataclass default: 0.0003]")
    assert lines["grpo.iterations"].endswith("[7; dataclass default: 100]")
    assert lines["sample.guidance_scale"].endswith("[3.0]")                    # left out: the dataclass default
    lines = _help(["train", "--config", str(_real_config(tmp_path)), "--help"], capsys)
    assert lines["pipeline.num_steps"].endswith("[4; dataclass default: 10]") and "model.trainable" not in lines
    # a config that does not load yet (no prompts file given): its values as written
    lines = _help(["train", "--config", str(REPO / "configs" / "sd35_medium.yaml"), "--help"], capsys)
    assert lines["pipeline.path"].endswith("['/models/stable-diffusion-3.5-medium'; dataclass default: '']")
    lines = _help(["train", "--config", str(tmp_path / "missing.yaml"), "--help"], capsys)
    assert lines["optim.lr"].endswith("[default: 0.0003]")                     # unloadable: the defaults, said so


def test_print_config_marks_unset_required_inputs_instead_of_refusing(tmp_path, capsys):
    """configs/qwen_image.yaml leaves sample.prompts_file unset: --print-config prints the config with that key marked
    REQUIRED (exit 0), training refuses it (exit 2), and the printed YAML loads back once the key is set."""
    config = REPO / "configs" / "qwen_image.yaml"
    assert main(["train", "--config", str(config), "--print-config"]) == 0
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if "REQUIRED" in line and not line.startswith("#")]
    assert len(marked) == 1 and marked[0].lstrip().startswith("prompts_file: null  # REQUIRED, unset:")
    assert "1 required input(s) unset" in out.splitlines()[0]
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "run")]) == 2
    assert "sample.prompts_file must be set" in capsys.readouterr().err and not (tmp_path / "run").exists()
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    (tmp_path / "printed.yaml").write_text(out)
    from jagg.trainers.diffusers_config import load_config

    again = load_config(tmp_path / "printed.yaml", [f"sample.prompts_file={tmp_path / 'prompts.txt'}"])
    assert again.sample.prompts_file == str(tmp_path / "prompts.txt")
    assert main(["train", "--print-config"]) == 0 and "REQUIRED" not in capsys.readouterr().out   # nothing unset
