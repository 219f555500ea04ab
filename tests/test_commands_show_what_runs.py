"""What a command shows is what runs: plain ``jagg train``, ``jagg eval`` and the benches run the one main job shipped
in the package, from any directory; ``jagg train --help-config`` shows its values beside the dataclass defaults (or a
given config's); every command's ``--help`` fits a screen or two;
``--print-config`` prints the config that would train, marks the inputs left to set, trains nothing and round-trips;
image grids are captioned with each image's prompt and reward."""

import fnmatch
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from jagg.cli import main
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import load_latest
from jagg.infra.metrics import CAPTION_MIN_WIDTH, save_grid
from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
from tiny_runs import real_model_config, tiny_train_args

REPO = Path(__file__).resolve().parents[1]


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


def _help(argv: list[str], capsys) -> dict[str, str]:
    """``jagg train ... --help-config`` as {config key: its line}."""
    assert main(argv) == 0
    lines = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"  ([a-z_][\w.]*)\s{2,}", line)
        if m:
            lines.setdefault(m.group(1), line)
    return lines


@pytest.mark.parametrize("command", [["train"], ["bench", "meter"], ["bench", "speed"], ["eval"], ["sample"],
                                     ["pretrain"]])
def test_each_help_fits_in_80_lines(command, capsys, monkeypatch):
    """Usage, the options with a line or two each, the docs page for the rest: at most 80 lines at 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: jagg {' '.join(command)}") and len(text.splitlines()) <= 80, \
        f"jagg {' '.join(command)} --help is {len(text.splitlines())} lines"


def test_help_config_shows_the_main_jobs_values_beside_the_dataclass_defaults(tmp_path, capsys):
    """--help-config shows the value plain `jagg train` runs with (the main job's: lr 1e-4, eta 1.0, guidance 1.0,
    ...) beside the dataclass default where they differ, or the values of the --config and --set given with it."""
    from jagg.cli import _value
    from jagg.rewards.client import RewardClient
    import dataclasses

    main_job = configuration.load(ShapesTrainConfig, main_job_path())
    lines = _help(["train", "--help-config"], capsys)
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

    # --config and --set given with it: that config's values
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("optim: {lr: 0.002}\nsample: {eta: 0.5}\n")
    lines = _help(["train", "--help-config", "--config", str(cfg), "--set", "grpo.iterations=7"], capsys)
    assert lines["optim.lr"].endswith("[0.002; dataclass default: 0.0003]")
    assert lines["grpo.iterations"].endswith("[7; dataclass default: 100]")
    assert lines["sample.guidance_scale"].endswith("[3.0]")                    # left out: the dataclass default
    lines = _help(["train", "--config", str(real_model_config(tmp_path)), "--help-config"], capsys)
    assert lines["pipeline.num_steps"].endswith("[4; dataclass default: 10]") and "model.trainable" not in lines
    # a config that does not load yet (no prompts file given): its values as written
    lines = _help(["train", "--config", str(REPO / "configs" / "sd35_medium.yaml"), "--help-config"], capsys)
    assert lines["pipeline.path"].endswith("['/models/stable-diffusion-3.5-medium'; dataclass default: '']")
    lines = _help(["train", "--config", str(tmp_path / "missing.yaml"), "--help-config"], capsys)
    assert lines["optim.lr"].endswith("[default: 0.0003]")                     # unloadable: the defaults, said so


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
    cfg = real_model_config(tmp_path)                 # a pipeline: section: the real-model trainer's keys and defaults
    assert main(["train", "--config", str(cfg), "--set", "grpo.iterations=3", "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    data = yaml.safe_load(printed.read_text())
    assert data["pipeline"]["family"] == "sd3" and data["grpo"]["iterations"] == 3
    assert data["reward"]["name"] == "jpeg_compressibility" and data["reward_server"] is None
    assert data["log"]["output_dir"] == "runs/real"                          # DiffusersLogSection's default, not TinyDiT's
    assert main(["train", "--config", str(printed), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == data


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
