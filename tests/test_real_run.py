"""The real-model trainer as a Flow-GRPO user runs it, on a tiny random SD3 pipeline (CPU, no downloads): a ``.jsonl``
prompt set whose metadata reaches the reward through a reward server, a test set beside it evaluated with the EMA
weights (records, captioned grids, TensorBoard images), a bit-identical resume with the EMA, adapters that diffusers'
and peft's loaders read, a peft adapter as the starting point, ``jagg eval`` / ``jagg sample`` on the run directory,
and the refusals that come before the model's weights load and leave nothing behind (model-directory files of the
wrong shape among them)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import SD3Transformer2DModel  # noqa: E402
from tiny_runs import free_port  # noqa: E402

from jagg.cli import main  # noqa: E402
from jagg.integrations.model_dir import check_model  # noqa: E402
from jagg.integrations.config import PipelineConfig  # noqa: E402
from jagg.trainers import diffusers_trainer as real_train  # noqa: E402

TRAIN = [{"prompt": "a red cube", "tag": "colors", "include": [{"class": "cube", "count": 1}]},
         {"prompt": "a blue ball", "tag": "colors", "include": [{"class": "ball", "count": 1}]},
         {"prompt": "a green cone", "tag": "single_object", "include": [{"class": "cone", "count": 1}]}]
TEST = [{"prompt": "a red ball", "tag": "colors"}, {"prompt": "two blue cubes", "tag": "counting"}]
SEEN: list[list[dict]] = []                        # the metadata every call of metadata_reward received


def metadata_reward(images, prompts, metadata):
    """A reward that needs each prompt's metadata (as GenEval's does): it fails without it, and scores the image's
    brightness, plus 0.1 for the 'colors' tag."""
    assert metadata is not None and len(metadata) == len(prompts), "no metadata"
    assert all(m["prompt"] == p for p, m in zip(prompts, metadata)), "metadata of another prompt"
    SEEN.append(list(metadata))
    bright = np.asarray(images, dtype=np.float32).mean(axis=(1, 2, 3)) / 255.0
    return bright + 0.1 * np.array([m["tag"] == "colors" for m in metadata], dtype=np.float32), {}


def _serve(reward_fn):
    from jagg.rewards.server import make_server

    server = make_server(reward_fn, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def write_dataset(root: Path) -> Path:
    """Flow-GRPO's layout: train_metadata.jsonl and test_metadata.jsonl side by side; returns the training file."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train_metadata.jsonl", TRAIN), ("test_metadata.jsonl", TEST)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "train_metadata.jsonl"


def write_config(tmp_path: Path, model_dir: Path, reward: str, iterations: int = 3) -> Path:
    cfg = tmp_path / "sd3.yaml"
    cfg.write_text(f"""\
pipeline: {{family: sd3, path: {model_dir}, dtype: fp32, device: cpu, resolution: 128, num_steps: 4, eval_num_steps: 3,
           cfg_scale: 4.5, max_sequence_length: 8, lora: {{enabled: true, rank: 2}}}}
{reward}
sample: {{prompts_file: {write_dataset(tmp_path / "geneval")}, prompts_per_iter: 2, group_size: 2, micro_batch: 4}}
estimator: {{mode: jagg, window: 3, micro_batch: 4, clip_range: 0.2}}
optim: {{lr: 0.01, ema_decay: 0.8}}
grpo: {{iterations: {iterations}, updates_per_epoch: 2, drop_zero_spread: false}}
eval: {{every: 2, grid_size: 2}}
log: {{checkpoint_every: 1, keep_last: 2, progress: false, sample_images: 2}}
threads: 1
""")
    return cfg


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture
def trainers(monkeypatch):
    """Every DiffusersTrainer that `jagg train` runs, and its trainable weights when training starts."""
    seen = []
    original = real_train.DiffusersTrainer.train

    def train(self):
        seen.append((self, {n: p.detach().clone() for n, p in self.named_params.items()}))
        return original(self)

    monkeypatch.setattr(real_train.DiffusersTrainer, "train", train)
    return seen


def transformer_output(model, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return model(hidden_states=torch.randn(2, 4, 16, 16, generator=g), timestep=torch.tensor([800.0, 300.0]),
                     encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
                     pooled_projections=torch.randn(2, 8, generator=g), return_dict=False)[0]


def test_jsonl_metadata_evaluation_ema_adapters_and_resume(tmp_path, sd3_dir, trainers, capsys):
    from peft import PeftModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    SEEN.clear()
    server = _serve(metadata_reward)
    reward = f"reward_server: {{url: 'http://127.0.0.1:{server.server_address[1]}'}}"
    try:
        cfg, out = write_config(tmp_path, sd3_dir, reward), tmp_path / "run"
        assert main(["train", "--config", str(cfg), "--output-dir", str(out)]) == 0
        first = capsys.readouterr().out
        assert "jagg train: new run" in first and "estimator  jagg" in first and "rows back-propagated" in first
        assert "pipeline's: FlowMatchEulerDiscreteScheduler" in first and "3 prompts with metadata" in first
        # every reward call, rollouts and evaluations, got each prompt's own metadata through the server
        assert SEEN and {m["tag"] for call in SEEN for m in call} == {"colors", "single_object", "counting"}
        train, evals = records(out, "train"), records(out, "eval")
        assert [r["iteration"] for r in train] == [1, 2, 3]
        assert [r["iteration"] for r in evals] == [0, 2, 3]                 # the start, every 2, the end
        assert all(r["ema"] and r["images"] == 2 and np.isfinite(r["reward_mean"]) for r in evals)
        grid = (out / "samples" / "eval_000003.txt").read_text().splitlines()
        assert (out / "samples" / "eval_000003.png").is_file() and len(grid) == 2
        assert grid[0].startswith("0: a red ball (reward ") and "two blue cubes (reward" in grid[1]
        assert "(reward " in (out / "samples" / "iter_000003.txt").read_text()   # rollout grids: rewards too
        tb = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
        tb.Reload()
        assert {"images/eval", "images/rollouts"} <= set(tb.Tags()["images"])
        assert "eval/reward_mean" in tb.Tags()["scalars"]

        # the adapter: diffusers' loader, peft's loader and the trained policy give one transformer output
        trainer, _ = trainers[0]
        adapter = out / "checkpoints" / "adapter_000003"
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer"), scheduler=None, vae=None,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
            tokenizer_3=None)
        pipe.load_lora_weights(str(adapter))
        peft_model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer"),
                                               str(adapter))
        want = transformer_output(trainer.policy.bare)
        torch.testing.assert_close(transformer_output(pipe.transformer), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(transformer_output(peft_model), want, rtol=1e-5, atol=1e-5)
        # its ema/ holds the EMA of the checkpoint, in both formats as well
        ema = torch.load(out / "checkpoints" / "ckpt_000003.pt", weights_only=False)["ema"]
        ema_model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer"),
                                              str(adapter / "ema"))
        loaded = {n.removeprefix("base_model.model."): p for n, p in ema_model.named_parameters() if "lora_" in n}
        assert set(loaded) == set(ema) and all(torch.equal(loaded[n], ema[n]) for n in ema)
        assert any(not torch.equal(ema[n], p) for n, p in trainer.named_params.items())   # not the raw weights

        # jagg eval on the run directory: the trainer's last evaluation (EMA weights, its steps, seed and reward)
        assert main(["eval", "--checkpoint", str(out), "--json", str(tmp_path / "eval.json")]) == 0
        got = json.loads((tmp_path / "eval.json").read_text())
        assert got["weights"] == "EMA" and got["num_prompts"] == 2
        assert got["reward_mean"] == pytest.approx(evals[-1]["reward_mean"], abs=1e-6)
        assert main(["sample", "--checkpoint", str(out), "--prompt", "a red cube", "--num-per-prompt", "2",
                     "--out", str(tmp_path / "s.png")]) == 0
        assert (tmp_path / "s.png").is_file() and "a red cube" in (tmp_path / "s.txt").read_text()

        # resume with the EMA: stopped after 2 iterations, resumed to 3, equal to the uninterrupted run bit for bit
        stopped = tmp_path / "stopped"
        assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--set", "grpo.iterations=2"]) == 0
        assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--resume"]) == 0
        resumed = torch.load(stopped / "checkpoints" / "ckpt_000003.pt", weights_only=False)
        straight = torch.load(out / "checkpoints" / "ckpt_000003.pt", weights_only=False)
        for entry in ("model", "ema"):
            assert all(torch.equal(resumed[entry][n], straight[entry][n]) for n in straight[entry])
        assert [r["reward_mean"] for r in records(stopped, "eval")] == [r["reward_mean"] for r in evals]
    finally:
        server.shutdown()


def test_a_peft_adapter_starts_a_run(tmp_path, sd3_dir, trainers):
    """A peft-format adapter (adapter_config.json + adapter_model.safetensors, as Flow-GRPO's checkpoint-N/lora/
    holds) as pipeline.lora.path: the run starts from its weights (pipeline.lora.rank null: the adapter's own)."""
    from peft import LoraConfig, get_peft_model

    base = SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer")
    flow_grpo = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                target_modules=["attn.to_q", "attn.to_k", "attn.to_v"]))
    with torch.no_grad():
        for n, p in flow_grpo.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    flow_grpo.save_pretrained(str(tmp_path / "lora"))
    cfg = write_config(tmp_path, sd3_dir, "reward: {name: jpeg_compressibility}", iterations=1)
    assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "run"), "--set",
                 f"pipeline.lora.path={tmp_path / 'lora'}", "--set", "pipeline.lora.rank=null", "--set",
                 "eval.every=0"]) == 0
    _, start = trainers[0]
    saved = {n.removeprefix("base_model.model."): p for n, p in flow_grpo.named_parameters() if "lora_" in n}
    assert set(start) == set(saved) and all(torch.equal(start[n], saved[n]) for n in saved)


def test_failures_before_the_weights_load_name_the_culprit_and_leave_nothing(tmp_path, sd3_dir, monkeypatch,
                                                                             capsys):
    """An unreachable reward server, a resolution over the transformer's position embeddings and a missing adapter
    each fail before the weights load, exit 2 naming the key, and leave no run directory: the same command with the
    cause fixed then starts without --overwrite."""
    loads = []
    original = real_train.load_model
    monkeypatch.setattr(real_train, "load_model", lambda cfg, *a: loads.append(cfg) or original(cfg, *a))
    cfg = write_config(tmp_path, sd3_dir, "reward: {name: jpeg_compressibility}", iterations=1)
    out = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--output-dir", str(out), "--set", "eval.every=0"]
    for sets, culprit in ((["reward=null", f"reward_server.url=http://127.0.0.1:{free_port()}"],
                           "reward_server.url"),
                          (["pipeline.resolution=512"], "pipeline.resolution=512 is more than this SD3 transformer"),
                          ([f"pipeline.lora.path={tmp_path / 'no_adapter'}"], "pipeline.lora.path")):
        assert main(args + [a for s in sets for a in ("--set", s)]) == 2
        err = capsys.readouterr().err
        assert culprit in err and len(err.strip().splitlines()) == 1, err
        assert not loads and not out.exists()
    assert main(args) == 0 and loads                                     # fixed: starts, no --overwrite


def broken_reward(images, prompts, metadata):
    raise RuntimeError("the reward model is not on this machine")


def test_a_failure_in_the_first_iteration_removes_what_the_run_wrote(tmp_path, sd3_dir, capsys):
    cfg = write_config(tmp_path, sd3_dir, "reward: {name: test_real_run:broken_reward}", iterations=1)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")                                 # the user's file stays
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)]) == 2
    captured = capsys.readouterr()
    assert "the reward model is not on this machine" in captured.err
    assert "nothing was trained" in captured.out and "the same command starts a new run" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--set", "reward.name=jpeg_compressibility",
                 "--set", "eval.every=0"]) == 0


def _model_dir(root: Path, family: str, transformer: dict, index: dict | list | None = None) -> Path:
    """A model directory of config files only (no weights): what the checks before loading read."""
    classes = {"flux2": ("Flux2Pipeline", "Flux2Transformer2DModel"), "wan": ("WanPipeline", "WanTransformer3DModel"),
               "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel")}
    pipe, model = classes[family]
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    index = {"_class_name": pipe, "transformer": ["diffusers", model]} if index is None else index
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "transformer" / "config.json").write_text(json.dumps(transformer))
    return root


def test_model_directory_settings_are_checked_before_loading(tmp_path, capsys):
    """model_index.json, transformer and scheduler configs of the wrong shape are named with what was
    expected; FLUX.2 [dev] without pipeline.guidance_embed is refused naming the key and FLUX.2's 4.0; Wan frames
    beyond the transformer's rotary positions are refused naming pipeline.num_frames; and the frame count is part of
    the memory estimate (--print-config refuses num_frames=400001)."""
    sd3 = _model_dir(tmp_path / "sd3", "sd3", {"patch_size": 2, "pos_embed_max_size": 16})
    config = PipelineConfig(family="sd3", path=str(sd3), resolution=128)
    check_model(config)
    for index, expected in (([], "holds a JSON list; expected a JSON object with '_class_name'"),
                            ({}, "holds an empty object; expected a JSON object with '_class_name'"),
                            ({"transformer": ["diffusers", "SD3Transformer2DModel"]}, "has no '_class_name'"),
                            ({"_class_name": "StableDiffusion3Pipeline"}, "has 'transformer': None; expected a")):
        (sd3 / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="model_index.json") as e:
            check_model(config)
        assert expected in str(e.value)
    _model_dir(sd3, "sd3", [1, 2])
    with pytest.raises(ValueError, match=r"transformer/config.json holds a JSON list; expected the transformer's"):
        check_model(config)
    _model_dir(sd3, "sd3", {"patch_size": 2, "pos_embed_max_size": 16})
    (sd3 / "scheduler").mkdir()
    (sd3 / "scheduler" / "scheduler_config.json").write_text('"FlowMatchEulerDiscreteScheduler"')
    with pytest.raises(ValueError, match=r"scheduler_config.json holds a JSON str; expected the scheduler's config"):
        check_model(config)

    flux2 = _model_dir(tmp_path / "flux2", "flux2", {"guidance_embeds": True, "in_channels": 128})
    with pytest.raises(ValueError, match=r"pipeline.guidance_embed is required.*guidance_embeds: true.*"
                                         r"pipeline.guidance_embed: 4.0"):
        check_model(PipelineConfig(family="flux2", path=str(flux2), cfg_scale=1.0))
    check_model(PipelineConfig(family="flux2", path=str(flux2), cfg_scale=1.0, guidance_embed=4.0))

    wan = _model_dir(tmp_path / "wan", "wan", {"patch_size": [1, 2, 2], "rope_max_seq_len": 32})
    check_model(PipelineConfig(family="wan", path=str(wan), resolution=64, num_frames=125))      # 32 latent frames
    with pytest.raises(ValueError, match=r"pipeline.num_frames=129 \(33 latent frames\).*rope_max_seq_len.*at most "
                                         r"125"):
        check_model(PipelineConfig(family="wan", path=str(wan), resolution=64, num_frames=129))
    # through jagg train: refused before anything is written
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    yaml = tmp_path / "wan.yaml"
    yaml.write_text(f"pipeline: {{family: wan, path: {wan}, resolution: 64, num_frames: 129}}\n"
                    f"reward: {{name: jpeg_compressibility}}\n"
                    f"sample: {{prompts_file: {tmp_path / 'prompts.txt'}, prompts_per_iter: 1, group_size: 2}}\n")
    assert main(["train", "--config", str(yaml), "--output-dir", str(tmp_path / "run")]) == 2
    assert "pipeline.num_frames=129" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["train", "--config", str(yaml), "--set", "pipeline.num_frames=400001", "--set",
                 "pipeline.resolution=512", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.num_frames=400001" in err and "lower pipeline.num_frames" in err
