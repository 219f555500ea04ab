"""End-to-end smoke runs of the CLI: train, resume, pretrain, sample, eval; config errors."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tiny_runs import records, tiny_train_args
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import list_checkpoints, load_latest
from jagg.cli import main
from jagg.trainers.diffusers_config import DiffusersTrainConfig
from jagg.trainers.shapes_config import ShapesTrainConfig


def _params(out):
    state, _ = load_latest(out / "checkpoints")
    return state["model"]


def test_train_smoke(tmp_path, tiny_ckpt):
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 3, "estimator.mode=jagg")) == 0
    recs = records(tmp_path)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert [r["iteration"] for r in evals] == [0, 2, 3]
    for r in train:
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["backward_items"] == 4 * 4  # 4 samples x 4 steps, window 2 -> 2 rows per 2-step group
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["skipped"] == 0
        assert r["train_s"] > 0 and r["sample_s"] > 0
    for r in evals:
        assert 0.0 <= r["reward_mean"] <= 1.0 and "accuracy" in r
    assert Image.open(tmp_path / "reward_curve.png").size[0] > 100
    grid = Image.open(tmp_path / "samples" / "eval_000003.png")
    assert grid.size[0] > 4 * 32
    assert (tmp_path / "samples" / "eval_000003.txt").read_text().count("\n") == 4
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["ckpt_000002.pt", "ckpt_000003.pt"]
    state, _ = load_latest(tmp_path / "checkpoints")
    assert state["iteration"] == 3 and "optimizer" in state and "rng" in state
    assert state["config"]["estimator"]["mode"] == "jagg" and state["manifest"]["jagg_version"]
    assert list((tmp_path / "tensorboard").iterdir())


def test_a_run_reports_hacking_signs_warns_once_and_draws_a_before_after_comparison(tmp_path, tiny_ckpt, monkeypatch,
                                                                                     capsys):
    """Every evaluation logs the signs of reward hacking; a collapse warning is printed once per kind, however often
    it fires; the end of the run writes samples/comparison.png (the starting model above the trained one, same prompts
    and noise) with its captions."""
    import jagg.trainers.shapes_trainer as shapes_trainer

    calls = []

    def fake_warnings(evals, drop, empty, background):
        calls.append((len(evals), drop, empty, background))
        return ["the held-out reward fell to 0.1, more than 0.05 below its best 0.2"] if len(evals) >= 2 else []

    monkeypatch.setattr(shapes_trainer, "collapse_warnings", fake_warnings)
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 4, "eval.every=1", "eval.warn_empty=0.2")) == 0
    evals = [r for r in records(tmp_path) if r["kind"] == "eval"]
    for r in evals:
        assert {"empty_frac", "objects_mean", "asked_mean", "count_error", "background_rms"} <= set(r)
        assert 0 <= r["empty_frac"] <= 1 and r["background_rms"] >= 0
    assert calls[-1] == (5, 0.05, 0.2, 5.0)
    out = capsys.readouterr().out
    assert out.count("the held-out reward fell to 0.1") == 1
    lines = (tmp_path / "samples" / "comparison.txt").read_text().splitlines()
    assert len(lines) == 8 and "iteration 0:" in lines[0] and "iteration 4:" in lines[4]
    assert lines[0].split(";")[0] == lines[4].split(";")[0].replace("4: ", "0: ")     # the same prompt above and below
    assert Image.open(tmp_path / "samples" / "comparison.png").size[0] > 4 * 32


def test_training_changes_weights_and_is_deterministic(tmp_path, tiny_ckpt):
    a, b = tmp_path / "a", tmp_path / "b"
    jpeg = "reward.name=jpeg_compressibility"  # a random model scores 0 on geneval: no advantage, no gradient
    assert main(tiny_train_args(tiny_ckpt, a, 2, jpeg)) == 0
    assert main(tiny_train_args(tiny_ckpt, b, 2, jpeg)) == 0
    ra = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records(a)]
    rb = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records(b)]
    assert ra == rb
    from jagg.shapes.dit import load_pretrained

    init = load_pretrained(tiny_ckpt).state_dict()
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], init[k]) for k in pa)
    c = tmp_path / "c"  # only the matching parameters move when model.trainable restricts them
    assert main(tiny_train_args(tiny_ckpt, c, 2, jpeg, "model.trainable=final")) == 0
    pc = _params(c)
    assert {k for k in pc if not torch.equal(pc[k], init[k])} <= {k for k in pc if "final" in k}
    assert any(not torch.equal(pc[k], init[k]) for k in pc)


@pytest.mark.parametrize("extra", [(), ("optim.ema_decay=0.9", "estimator.mode=exact")])
def test_resume_continues_as_if_never_stopped(tmp_path, tiny_ckpt, extra):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_train_args(tiny_ckpt, straight, 4, *extra)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 2, *extra)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 4, *extra) + ["--resume"]) == 0
    p1, p2 = _params(straight), _params(split)
    for k in p1:
        assert torch.allclose(p1[k], p2[k], rtol=1e-5, atol=1e-7), k
    r1 = [r["reward_mean"] for r in records(straight) if r["kind"] == "train"]
    r2 = [r["reward_mean"] for r in records(split) if r["kind"] == "train"]
    assert r1 == r2 and len(r1) == 4


def test_resume_refuses_incompatible_config(tmp_path, tiny_ckpt, capsys):
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 1)) == 0
    code = main(tiny_train_args(tiny_ckpt, tmp_path, 2, "estimator.window=4") + ["--resume"])
    assert code == 2
    assert "estimator.window" in capsys.readouterr().err


def test_pretrain_sample_eval_smoke(tmp_path, capsys):
    out = tmp_path / "p.safetensors"
    assert main(["pretrain", "--out", str(out), "--set", "train.steps=3", "--set", "train.batch_size=4",
                 "--set", "train.log_every=1", "--set", "train.warmup=1",
                 "--set", "model={dim: 32, depth: 1, heads: 2, text_dim: 16, text_depth: 1, text_heads: 2}"]) == 0
    assert out.is_file()
    logged = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    assert len(logged) == 3 and all(math.isfinite(r["loss"]) for r in logged)
    png = tmp_path / "grid.png"
    assert main(["sample", "--checkpoint", str(out), "--prompt", "a red circle", "--prompt", "two blue squares",
                 "--num-per-prompt", "3", "--steps", "2", "--out", str(png)]) == 0
    img = np.asarray(Image.open(png))
    assert img.shape[0] > img.shape[1] / 2 and img.shape[2] == 3  # 2 rows x 3 columns
    js = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out), "--num-prompts", "3", "--images-per-prompt", "1",
                 "--steps", "2", "--json", str(js)]) == 0
    m = json.loads(js.read_text())          # the main job's reward: the GenEval-like score
    assert 0 <= m["reward_mean"] <= 1 and "accuracy" in m and "empty_frac" in m
    assert main(["eval", "--checkpoint", str(out), "--num-prompts", "3", "--images-per-prompt", "1",
                 "--steps", "2", "--reward", "jpeg_compressibility", "--json", str(js), "--overwrite"]) == 0
    assert json.loads(js.read_text())["reward_mean"] < 0                  # minus kB


def test_sample_rejects_unknown_words(tmp_path, tiny_ckpt, capsys):
    assert main(["sample", "--checkpoint", tiny_ckpt, "--prompt", "a purple circle", "--out",
                 str(tmp_path / "x.png")]) == 2
    assert "purple" in capsys.readouterr().err


def test_config_unknown_key_suggests_closest():
    with pytest.raises(ValueError, match="did you mean 'window'"):
        configuration.load(ShapesTrainConfig, None, ["estimator.windw=4"])
    with pytest.raises(ValueError, match="estimator.*jagg_frac"):
        configuration.load(ShapesTrainConfig, None, ["estimator.jagg_frac=2"])
    with pytest.raises(ValueError, match="expected an integer"):
        configuration.load(ShapesTrainConfig, None, ["sample.num_steps=ten"])
    with pytest.raises(ValueError, match="divisible"):
        configuration.load(ShapesTrainConfig, None, ["sample.prompts_per_iter=3", "sample.group_size=3"])


def test_default_config_loads_and_round_trips():
    cfg = configuration.load(ShapesTrainConfig, Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    again = configuration.from_dict(ShapesTrainConfig, configuration.to_dict(cfg))
    assert again == cfg
    assert cfg.estimator.mode == "auto" and len(cfg.estimator.candidate_configs()) == 5    # exact and 4 candidates


def test_shipped_shapes_configs_load_and_the_authors_recipe_trains(tmp_path):
    """Every configs/*.yaml of the shapes trainer (no pipeline: section) loads and round-trips; the authors' recipe
    (configs/authors_recipe.yaml: interval subsampling of step groups of 4) trains two iterations as shipped, 3 of its
    5 step groups per sample: 6 knot rows of each sample kept, over 12 updates of shuffled samples."""
    from jagg.trainers.diffusers_config import has_pipeline_section

    root = Path(__file__).resolve().parents[1] / "configs"
    shapes = [p for p in sorted(root.glob("*.yaml")) if not has_pipeline_section(p)]
    assert {p.name for p in shapes} >= {"default.yaml", "geneval_flow_grpo.yaml", "authors_recipe.yaml"}
    for path in shapes:
        cfg = configuration.load(ShapesTrainConfig, path)
        assert configuration.from_dict(ShapesTrainConfig, configuration.to_dict(cfg)) == cfg, path.name
    recipe = configuration.load(ShapesTrainConfig, root / "authors_recipe.yaml").estimator
    assert (recipe.window, recipe.alpha, recipe.interval_frac, recipe.correction_p) == (4, "index", 0.6, 0.0)
    out = tmp_path / "recipe"
    assert main(["train", "--config", str(root / "authors_recipe.yaml"), "--set", "grpo.iterations=2", "--set",
                 "eval.every=0", "--set", "threads=1", "--set", "log.progress=false", "--output-dir", str(out)]) == 0
    train = [r for r in records(out) if r["kind"] == "train"]
    assert len(train) == 2 and all(r["backward_items"] == 6 * r["trained_samples"] for r in train)


def test_the_main_job_trains_the_geneval_like_reward_through_the_text_encoder(tmp_path, tiny_ckpt):
    """The shipped main job is prompt alignment. It trains the GenEval-like reward (a score in [0, 1],
    no JPEG term) and changes the text encoder's weights only; the JPEG job trains minus kB (negative)."""
    from safetensors.torch import load_file
    from jagg.trainers.shapes_config import main_job_path

    cfg = configuration.load(ShapesTrainConfig, main_job_path())
    assert (cfg.reward.name, cfg.reward.weights, cfg.model.trainable) == ("geneval", None, "^text")
    small = [f"model.checkpoint={tiny_ckpt}", "grpo.iterations=2", "sample.num_steps=4", "sample.prompts_per_iter=2",
             "sample.sde_window=null", "eval.every=0", "threads=1", "log.progress=false", "grpo.drop_zero_spread=false",
             "optim.lr=0.01", "log.checkpoint_every=1", "log.tensorboard=false"]
    out = tmp_path / "main"
    assert main(["train", "--output-dir", str(out)] + [a for s in small for a in ("--set", s)]) == 0
    train = [r for r in records(out) if r["kind"] == "train"]
    assert len(train) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 and r["trained_samples"] > 0 for r in train)
    before, after = load_file(tiny_ckpt), _params(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("text") for k in changed)
    assert any(k.startswith("text") for k in before) and any(not k.startswith("text") for k in before)

    jpeg = tmp_path / "jpeg"
    root = Path(__file__).resolve().parents[1] / "configs"
    assert main(["train", "--config", str(root / "jpeg_compressibility.yaml"), "--output-dir", str(jpeg)]
                + [a for s in small[:1] + ["grpo.iterations=1"] + small[2:] for a in ("--set", s)]) == 0
    assert all(r["reward_mean"] < 0 for r in records(jpeg) if r["kind"] == "train")


def test_train_help_config_lists_every_key_and_help_points_to_it(capsys):
    assert main(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    for key, _, _ in configuration.describe(ShapesTrainConfig) + configuration.describe(DiffusersTrainConfig):
        assert key in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "jagg train --help-config" in text and "estimator.window" not in text
