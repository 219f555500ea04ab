"""Wan 2.1 text-to-video (``family: wan``) on tiny random models: no downloads, CPU, seconds.

Against diffusers' own ``WanPipeline`` (Euler scheduler): jagg's Euler steps through the adapter equal the pipeline's
denoising loop on 5-D video latents, and the decoded videos equal the pipeline's. Through the jagg estimators: the
on-policy ratio is 1 and JAGG with 2-step groups equals exact (the exactness test the other families pass), LoRA
adapters saved by jagg load into ``WanPipeline``. ``jagg train`` on a tiny Wan directory trains two iterations with
JAGG and with exact, writes an animated GIF grid of the rollouts, and ``--resume`` continues bit-identically. Image
rewards score videos frame by frame; a ``module:function`` gets the videos. ``configs/wan_t2v.yaml`` resolves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from gradient_checks import assert_window_two_is_exact  # noqa: E402
from tiny_pipelines import tiny_wan, tiny_wan_vae  # noqa: E402
from reward_plugins import video_brightness  # noqa: E402
from tiny_runs import records  # noqa: E402

import jagg  # noqa: E402
from jagg.cli import main  # noqa: E402
from jagg.integrations import (LoraSettings, PipelineConfig, Policy, PromptEmbeddings, VelocityConfig,  # noqa: E402
                               add_lora, save_lora, velocity_adapter)
from jagg.integrations.schedules import default_shift  # noqa: E402
from jagg.rewards.registry import get_reward, jpeg_compressibility  # noqa: E402
from jagg.trainers import diffusers_trainer as real_train  # noqa: E402
from jagg.infra.metrics import save_grid  # noqa: E402

C, L, D = 4, 5, 16                     # latent channels, text tokens, text width (tiny_pipelines')
HEIGHT, WIDTH, FRAMES = 64, 96, 5      # pixels; 5 frames = 2 latent frames: latents [C, 2, 8, 12]
LATENT = (C, 2, 8, 12)
PROMPTS = ["a red cube", "a blue ball"]


def embeds(seed=0, prompts=tuple(PROMPTS)) -> tuple[PromptEmbeddings, PromptEmbeddings]:
    """UMT5-like embeddings: L tokens each (zero-padded in WanPipeline), no pooled part; the negative prompt ''."""
    g = torch.Generator().manual_seed(seed)
    cond = PromptEmbeddings(torch.randn(len(prompts), L, D, generator=g), None, list(prompts))
    return cond, PromptEmbeddings(torch.randn(1, L, D, generator=g), None, [""])


def wan_config(path="unused", **kw) -> PipelineConfig:
    return PipelineConfig(**{**dict(family="wan", path=str(path), dtype="fp32", device="cpu", resolution=HEIGHT,
                                    width=WIDTH, num_frames=FRAMES, num_steps=3, cfg_scale=4.5,
                                    lora=LoraSettings(enabled=False)), **kw})


def test_euler_steps_and_videos_equal_the_pipeline():
    """WanPipeline's denoising loop (3 Euler steps with shift 3, CFG 4.5 with a negative prompt, 5 frames at 64 x 96)
    from the same noise equals jagg's Euler steps with the policy's sigmas and velocity on latents [N, C, F, h, w],
    and its decoded videos equal the policy's uint8 frames."""
    cond, neg = embeds()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)     # WanPipeline calls set_timesteps(n): the policy too
    pipe = diffusers.WanPipeline(transformer=tiny_wan(), vae=tiny_wan_vae(), scheduler=scheduler, text_encoder=None,
                                 tokenizer=None)
    policy = Policy(wan_config(), pipe.transformer, pipe.vae, pipe, dict(scheduler.config),
                    PromptEmbeddings.cat([cond, neg]))
    assert policy.latent_shape == LATENT and policy.shift == 3.0
    noise = policy.noise(2, torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=neg.prompt_embeds.expand(2, -1, -1),
                guidance_scale=4.5, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=3,
                latents=noise)
    with torch.no_grad():
        want = pipe(**call, output_type="latent").frames
        want_video = pipe(**call, output_type="np").frames               # [2, 5, 64, 96, 3] in [0, 1]
        sigmas = policy.sigmas()
        torch.testing.assert_close(sigmas, scheduler.sigmas, rtol=0, atol=1e-6)
        v = policy.velocity(PROMPTS)
        x = noise
        for k in range(3):
            x = x + (sigmas[k + 1] - sigmas[k]) * v(x, sigmas[k].expand(2), torch.arange(2))
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    video = policy.decode(x)
    assert video.shape == (2, FRAMES, HEIGHT, WIDTH, 3) and video.dtype == np.uint8
    assert np.abs(video.astype(int) - np.round(want_video * 255).astype(int)).max() <= 1
    with pytest.raises(ValueError, match=r"Wan latents must be \[N, C, F, H, W\]"):
        v(x[:, :, 0], sigmas[:2], torch.arange(2))


def test_on_policy_ratio_is_one_and_jagg_pairs_equal_exact():
    """The exactness test of the image families (tests/test_diffusers.py) on video latents: JAGG's 2-step groups
    give exact's gradient through the Wan transformer, with CFG's both branches."""
    model = tiny_wan()
    cond, neg = embeds()
    v = velocity_adapter(model, cond.select([0, 0, 1, 1]), neg, VelocityConfig(cfg_scale=4.5))
    g = torch.Generator().manual_seed(0)
    traj = jagg.sample_trajectories(v, torch.randn(4, *LATENT, generator=g), jagg.flow_sigmas(6, shift=3.0), 0.7,
                                    generator=g)
    assert traj.latents.shape == (4, 7, *LATENT)
    assert_window_two_is_exact(model, v, traj)


def test_lora_targets_and_adapter_loads_into_wan_pipeline(tmp_path):
    """Flow-GRPO's Wan LoRA (r 32, alpha 64 on to_q/k/v/out of both attentions) by default; a saved adapter loads
    with WanPipeline.load_lora_weights and gives the same velocity."""
    assert LoraSettings().resolved("wan") == (32, 64.0, ("to_q", "to_k", "to_v", "to_out.0"))
    model = tiny_wan()
    add_lora(model, LoraSettings(rank=2, alpha=8.0))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("attn1.to_q.lora_A" in n for n in names) and any("attn2.to_out.0.lora_B" in n for n in names)
    assert not any("ffn" in n for n in names)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_lora(model, tmp_path / "adapter", "wan")
    cond, neg = embeds()
    x, s, i = torch.randn(2, *LATENT), torch.tensor([0.8, 0.4]), torch.tensor([0, 1])
    pipe = diffusers.WanPipeline(transformer=tiny_wan(), vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                                 text_encoder=None, tokenizer=None)
    pipe.load_lora_weights(str(tmp_path / "adapter"))
    with torch.no_grad():
        want = velocity_adapter(model, cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
        got = velocity_adapter(pipe.transformer, cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
        base = velocity_adapter(tiny_wan(), cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want - base).abs().max() > 1e-4


def tiny_umt5():
    """A word-level tokenizer (UMT5's is a sentencepiece model; WanPipeline only calls it) and a 1-layer UMT5 encoder
    of width D."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "cube", "blue", "ball", "on", "table"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    return tok, UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=D, d_kv=8, d_ff=32, num_layers=1,
                                            num_heads=2)).eval()


def test_umt5_prompt_embeddings_cache_and_a_policy_without_the_encoder(tmp_path, capsys):
    """With its text encoder the policy embeds each prompt as WanPipeline.encode_prompt does (zero-padded to
    max_sequence_length, no mask); the cache builder writes them with the negative prompt, and a policy loaded from
    that cache, without the encoder, has the same embeddings."""
    from jagg.integrations import load_model, pipeline

    tok, te = tiny_umt5()
    pipe = diffusers.WanPipeline(transformer=tiny_wan(), vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                                 text_encoder=te, tokenizer=tok)
    pipe.save_pretrained(tmp_path / "wan")
    prompts = ["a red cube", "a blue ball on a table"]
    cfg = wan_config(tmp_path / "wan", max_sequence_length=8)
    policy = load_model(cfg)
    emb = policy.embeddings(prompts)
    assert emb.prompt_embeds.shape == (2, 8, D) and emb.mask is None and emb.pooled is None
    want, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=8, device="cpu")
    torch.testing.assert_close(emb.prompt_embeds, want)
    assert emb.prompt_embeds[0, 3:].abs().max() == 0                    # 3 tokens, then zeros (WanPipeline)
    yaml_path = tmp_path / "wan.yaml"
    yaml_path.write_text(f"pipeline: {{family: wan, path: {tmp_path / 'wan'}, dtype: fp32, device: cpu, "
                         f"resolution: {HEIGHT}, num_frames: {FRAMES}, max_sequence_length: 8}}\n")
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    assert pipeline.main(["cache", "--config", str(yaml_path), "--prompts", str(tmp_path / "prompts.txt"),
                          "--out", str(tmp_path / "cache.safetensors")]) == 0
    assert "wrote 2 prompt embeddings" in capsys.readouterr().out
    cached = load_model(PipelineConfig(**{**vars(cfg), "prompt_cache": str(tmp_path / "cache.safetensors")}))
    assert not cached.can_encode
    torch.testing.assert_close(cached.embeddings(prompts).prompt_embeds, emb.prompt_embeds)
    torch.testing.assert_close(cached.negative().prompt_embeds, policy.negative().prompt_embeds)


def test_config_frames_width_and_shift():
    """num_frames is 4k + 1 for Wan and 1 for the image families; the width defaults to the resolution; the model's
    own shift is its UniPC scheduler's flow_shift."""
    assert wan_config().size == (HEIGHT, WIDTH) and wan_config(width=None).size == (HEIGHT, HEIGHT)
    assert wan_config(num_frames=None).frames == 81 and PipelineConfig().frames == 1       # WanPipeline's default
    with pytest.raises(ValueError, match="num_frames must be 4k \\+ 1 for wan"):
        wan_config(num_frames=6)
    with pytest.raises(ValueError, match="num_frames is for video families"):
        PipelineConfig(family="sd3", num_frames=5)
    with pytest.raises(ValueError, match="pipeline.width must be a positive multiple of 16"):
        wan_config(width=100)
    assert default_shift("wan", 99, {"_class_name": "UniPCMultistepScheduler", "flow_shift": 5.0}) == 5.0
    assert default_shift("wan", 99, {"shift": 3.0}) == 3.0


def test_image_rewards_score_videos_frame_by_frame(tmp_path):
    """A registered image reward (and each image reward of a weighted sum) scores every frame and averages per
    video, its per-frame info too; a module:function gets the videos; save_grid writes them as an animated GIF."""
    from PIL import Image

    videos = np.random.default_rng(0).integers(0, 256, (3, 4, 16, 24, 3), dtype=np.uint8)
    videos[1] //= 8                                                        # less detail: a smaller JPEG
    prompts = ["a", "b", "c"]
    scores, info = get_reward("jpeg_compressibility")(videos, prompts)
    per_frame = np.stack([jpeg_compressibility(videos[:, f], prompts)[0] for f in range(4)], 1)
    np.testing.assert_allclose(scores, per_frame.mean(1), rtol=1e-6)
    assert info["jpeg_kb"].shape == (3,) and scores[1] > scores[0]
    mixed, parts = get_reward({"jpeg_compressibility": 1.0, "reward_plugins:video_brightness": 2.0})(videos, prompts)
    np.testing.assert_allclose(parts["scores/reward_plugins:video_brightness"], video_brightness(videos, prompts, None))
    np.testing.assert_allclose(mixed, scores + 2 * video_brightness(videos, prompts, None), rtol=1e-5)
    save_grid(videos, tmp_path / "v.gif", ncol=2, scale=1, prompts=prompts)
    gif = Image.open(tmp_path / "v.gif")
    assert gif.n_frames == 4 and gif.is_animated
    assert (tmp_path / "v.txt").read_text().splitlines()[0] == "0: a"
    with pytest.raises(ValueError, match="videos .* are written as .gif"):
        save_grid(videos, tmp_path / "v.png")


# ---------------------------------------------------------------------------------------------------------------
# jagg train on a tiny Wan directory
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    """A tiny random Wan pipeline without text encoder (prompts come from a cache) saved as a diffusers directory,
    with the prompt cache beside it."""
    pipe = diffusers.WanPipeline(transformer=tiny_wan(), vae=tiny_wan_vae(),
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=None,
                                 tokenizer=None)
    path = tmp_path_factory.mktemp("models") / "wan"
    pipe.save_pretrained(path)
    cond, neg = embeds(prompts=tuple(PROMPTS))
    PromptEmbeddings.cat([cond, neg]).save(path.parent / "wan_cache.safetensors")
    return path


def write_config(tmp_path: Path, model_dir: Path, mode: str = "jagg") -> Path:
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = tmp_path / "wan.yaml"
    cfg.write_text(f"""\
pipeline:
  family: wan
  path: {model_dir}
  dtype: fp32
  device: cpu
  resolution: {HEIGHT}
  width: {WIDTH}
  num_frames: {FRAMES}
  num_steps: 4
  cfg_scale: 4.5
  prompt_cache: {model_dir.parent / "wan_cache.safetensors"}
  lora: {{rank: 2}}
reward: {{name: jpeg_compressibility}}
sample: {{prompts_file: {tmp_path / "prompts.txt"}, prompts_per_iter: 2, group_size: 2, micro_batch: 4}}
estimator: {{mode: {mode}, window: 4, intermediate: interp, micro_batch: 4, clip_range: 0.2, kl_beta: 0.01,
            correction_p: 0.0}}
optim: {{lr: 0.01}}
grpo: {{iterations: 2, updates_per_epoch: 2, drop_zero_spread: false}}
log: {{output_dir: {tmp_path / "default_run"}, checkpoint_every: 1, keep_last: 2, tensorboard: false, progress: false,
      sample_images: 3}}
threads: 1
""")
    return cfg


@pytest.fixture
def captured(monkeypatch):
    """Every DiffusersTrainer that `jagg train` runs."""
    seen = []
    original = real_train.DiffusersTrainer.train

    def train(self):
        seen.append(self)
        return original(self)

    monkeypatch.setattr(real_train.DiffusersTrainer, "train", train)
    return seen


def trained(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.named_params.items()}


def test_jagg_train_two_iterations_gif_samples_and_bitwise_resume(tmp_path, wan_dir, captured):
    """Two JAGG iterations on 4 videos of 4 steps (one group of 4: 2 endpoint rows each), LoRA adapters that
    WanPipeline loads, an animated GIF of 3 rollouts per checkpoint; a run stopped after iteration 1 and resumed
    equals the uninterrupted one bit for bit (weights, rewards, losses)."""
    from PIL import Image

    cfg = write_config(tmp_path, wan_dir)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)]) == 0
    rec = records(out)
    assert [r["iteration"] for r in rec] == [1, 2]
    for r in rec:
        assert np.isfinite(r["reward_mean"]) and np.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["samples"] == 4 and r["backward_items"] == 4 * 2 and r["jagg_frac_routed"] == 1.0
    assert rec[1]["kl"] > 0
    gif = Image.open(out / "samples" / "iter_000002.gif")
    assert gif.n_frames == FRAMES and len((out / "samples" / "iter_000002.txt").read_text().splitlines()) == 3
    assert (out / "checkpoints" / "adapter_000002" / "pytorch_lora_weights.safetensors").is_file()
    end = trained(captured[0])
    assert all("lora_" in n for n in end)

    # a run stopped after iteration 1 and resumed to 2 equals the uninterrupted run bit for bit
    stopped = tmp_path / "stopped"
    assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--set", "grpo.iterations=1"]) == 0
    assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--resume"]) == 0
    resumed = trained(captured[2])
    assert all(torch.equal(resumed[n], end[n]) for n in end)
    assert [r["reward_mean"] for r in records(stopped)] == [r["reward_mean"] for r in rec]
    assert [r["loss"] for r in records(stopped)] == [r["loss"] for r in rec]


def test_exact_train_two_iterations_with_a_video_reward(tmp_path, wan_dir, captured, monkeypatch):
    """Exact mode trains every step of every video (4 x 4 rows per update set); a module:function reward gets the
    decoded videos [N, 5, 64, 96, 3]; with log.wandb the GIF grids go to wandb as videos."""
    import fake_wandb

    calls = fake_wandb.install(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)          # online mode (the default) needs a key: a logged-in user
    cfg = write_config(tmp_path, wan_dir, mode="exact")
    out = tmp_path / "exact"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out),
                 "--set", "reward.name=reward_plugins:video_brightness", "--set", "log.wandb=true"]) == 0
    rec = records(out)
    assert [r["iteration"] for r in rec] == [1, 2]
    for r in rec:
        assert 0 < r["reward_mean"] < 1 and np.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["backward_items"] == 4 * 4 and r["jagg_frac_routed"] == 0.0
    media = [c[1]["images/rollouts"] for c in calls if c[0] == "log" and "images/rollouts" in c[1]]
    assert [(type(m).__name__, Path(m.path).name) for m in media] == [("Video", "iter_000001.gif"),
                                                                       ("Video", "iter_000002.gif")]


def test_shipped_wan_config_resolves(tmp_path, capsys):
    """configs/wan_t2v.yaml resolves with --print-config once the required prompts file is set: family wan, 33 frames
    at 240 x 416, Flow-GRPO's LoRA, the frame-averaged PickScore reward."""
    import yaml

    (tmp_path / "p.txt").write_text("a cat playing piano\n")
    path = Path(__file__).resolve().parents[1] / "configs" / "wan_t2v.yaml"
    assert main(["train", "--config", str(path), "--print-config", "--set", f"sample.prompts_file={tmp_path / 'p.txt'}",
                 "--set", "pipeline.path=/models/Wan2.1-T2V-1.3B-Diffusers"]) == 0
    text = capsys.readouterr().out
    resolved = yaml.safe_load(text)
    p = resolved["pipeline"]
    assert (p["family"], p["resolution"], p["width"], p["num_frames"], p["num_steps"]) == ("wan", 240, 416, 33, 20)
    assert p["lora"]["rank"] == 32 and p["cfg_scale"] == 4.5 and resolved["reward"]["name"].startswith("pickscore:")
    assert main(["train", "--config", str(path), "--print-config"]) == 0      # printed, the unset inputs marked
    assert "REQUIRED" in capsys.readouterr().out
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2   # training refuses
    assert "sample.prompts_file must be set" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_cost_preset():
    """--cost flow_grpo_wan: Flow-GRPO's Wan 2.1 as configs/wan_t2v.yaml trains it (LoRA + gradient checkpointing: B/F
    2; both CFG branches with grad; 19 of 20 steps trained); JAGG's 2 of 4 rows per group project to this ratio."""
    from jagg.cost import PRESETS

    cost = PRESETS["flow_grpo_wan"]
    assert (cost.B_F, cost.cfg_rollout, cost.cfg_train, cost.rollout_steps, cost.train_steps) == (2.0, 2, 2, 20, 19)
    assert (cost.model, cost.resolution) == ("wan_1_3b", 240)
    # exact: 20 x 2 rollout + 19 x 2 x 3 training = 154; half the rows: 40 + 57 = 97
    assert cost.iteration_ratio(0.5) == pytest.approx(154 / 97)
    assert "flow_grpo_wan: B/F 2" in cost.describe()
