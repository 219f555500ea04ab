"""FLUX.2 (``family: flux2`` for ``Flux2Pipeline``, [dev]; ``flux2_klein`` for ``Flux2KleinPipeline``) on tiny random
models: no downloads, CPU, seconds.

Against diffusers' own pipelines: [dev] with its embedded guidance and FLUX.2's step-dependent dynamic shift, [klein]
with plain CFG and a negative prompt; jagg's Euler steps through the adapter equal the pipelines' denoising loops on
the patchified, batch-normalised latents ``[N, 4C, H/16, W/16]``, and the decoded images equal the pipelines'. The
exactness test of the other families (JAGG's 2-step groups equal exact); ``jagg train`` two iterations with JAGG and
exact, LoRA adapters that ``Flux2Pipeline.load_lora_weights`` reads, and a bit-identical ``--resume``.
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
from tiny_pipelines import FLUX2_SCHEDULER, tiny_flux2, tiny_flux2_vae  # noqa: E402
from tiny_runs import records  # noqa: E402

import jagg  # noqa: E402
from jagg.cli import main  # noqa: E402
from jagg.integrations import (LoraSettings, PipelineConfig, Policy, PromptEmbeddings, VelocityConfig,  # noqa: E402
                               velocity_adapter)
from jagg.integrations.schedules import flux2_mu  # noqa: E402
from jagg.trainers import diffusers_trainer as real_train  # noqa: E402

Z, L, D = 4, 5, 16                    # VAE channels (patchified: 4 Z = 16), text tokens, text width (tiny_pipelines')
HEIGHT, WIDTH = 128, 96               # latents [16, 8, 6]
LATENT = (4 * Z, HEIGHT // 16, WIDTH // 16)
PROMPTS = ["a red cube", "a blue ball"]


def embeds(seed=0) -> tuple[PromptEmbeddings, PromptEmbeddings]:
    g = torch.Generator().manual_seed(seed)
    cond = PromptEmbeddings(torch.randn(len(PROMPTS), L, D, generator=g), None, list(PROMPTS))
    return cond, PromptEmbeddings(torch.randn(1, L, D, generator=g), None, [""])


def flux2_config(family="flux2", path="unused", **kw) -> PipelineConfig:
    guidance = dict(guidance_embed=4.0, cfg_scale=1.0) if family == "flux2" else dict(cfg_scale=4.0)
    return PipelineConfig(**{**dict(family=family, path=str(path), dtype="fp32", device="cpu", resolution=HEIGHT,
                                    width=WIDTH, num_steps=3, lora=LoraSettings(enabled=False), **guidance), **kw})


@pytest.mark.parametrize("family", ["flux2", "flux2_klein"])
def test_euler_steps_and_images_equal_the_pipeline(family):
    """[dev]: embedded guidance 4, shift exp(mu(48 tokens, 3 steps)); [klein]: CFG 4 with the negative prompt. From
    the same noise, jagg's Euler steps with the policy's sigmas and velocity equal the pipeline's loop and its
    decoded images the pipeline's."""
    cond, neg = embeds()
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    parts = dict(transformer=tiny_flux2(guidance=family == "flux2"), vae=tiny_flux2_vae(), scheduler=scheduler,
                 text_encoder=None, tokenizer=None)
    pipe = diffusers.Flux2Pipeline(**parts) if family == "flux2" else diffusers.Flux2KleinPipeline(**parts)
    policy = Policy(flux2_config(family), pipe.transformer, pipe.vae, pipe, dict(scheduler.config),
                    PromptEmbeddings.cat([cond, neg]))
    assert policy.latent_shape == LATENT and policy.shift == pytest.approx(np.exp(flux2_mu(48, 3)))
    noise = policy.noise(2, torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=cond.prompt_embeds, height=HEIGHT, width=WIDTH, num_inference_steps=3,
                latents=noise, guidance_scale=4.0)
    if family == "flux2_klein":
        call["negative_prompt_embeds"] = neg.prompt_embeds.expand(2, -1, -1)
    last = {}                          # the packed latents [2, 48, 16] after the last step (row-major tokens)
    call.update(callback_on_step_end=lambda p, i, t, kw: last.update(kw) or {},
                callback_on_step_end_tensor_inputs=["latents"])
    with torch.no_grad():
        want_images = pipe(**call, output_type="np").images
        packed = last["latents"]
        sigmas = policy.sigmas()
        torch.testing.assert_close(sigmas, scheduler.sigmas, rtol=0, atol=1e-6)
        v = policy.velocity(PROMPTS)
        x = noise
        for k in range(3):
            x = x + (sigmas[k + 1] - sigmas[k]) * v(x, sigmas[k].expand(2), torch.arange(2))
    torch.testing.assert_close(x, packed.transpose(1, 2).reshape(2, *LATENT), rtol=1e-5, atol=1e-5)
    images = policy.decode(x)
    assert images.shape == (2, HEIGHT, WIDTH, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - np.round(want_images * 255).astype(int)).max() <= 1


def test_on_policy_ratio_is_one_and_jagg_pairs_equal_exact():
    model = tiny_flux2()
    cond, _ = embeds()
    v = velocity_adapter(model, cond.select([0, 0, 1, 1]), None, VelocityConfig(guidance_embed=4.0))
    g = torch.Generator().manual_seed(0)
    traj = jagg.sample_trajectories(v, torch.randn(4, *LATENT, generator=g), jagg.flow_sigmas(6, shift=3.0), 0.7,
                                    generator=g)
    assert_window_two_is_exact(model, v, traj)
    with pytest.raises(ValueError, match="guidance_embed"):
        velocity_adapter(model, cond, None, VelocityConfig())


@pytest.fixture(scope="module")
def flux2_dir(tmp_path_factory) -> Path:
    """A tiny random FLUX.2 [dev] directory without text encoder, and a prompt cache beside it."""
    pipe = diffusers.Flux2Pipeline(transformer=tiny_flux2(), vae=tiny_flux2_vae(),
                                   scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), text_encoder=None,
                                   tokenizer=None)
    path = tmp_path_factory.mktemp("models") / "flux2"
    pipe.save_pretrained(path)
    PromptEmbeddings.cat(list(embeds())).save(path.parent / "cache.safetensors")
    return path


def write_config(tmp_path: Path, model_dir: Path, mode: str) -> Path:
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = tmp_path / "flux2.yaml"
    cfg.write_text(f"""\
pipeline: {{family: flux2, path: {model_dir}, dtype: fp32, device: cpu, resolution: {HEIGHT}, width: {WIDTH},
           num_steps: 4, cfg_scale: 1.0, guidance_embed: 4.0, prompt_cache: {model_dir.parent / "cache.safetensors"},
           lora: {{rank: 2}}}}
reward: {{name: jpeg_compressibility}}
sample: {{prompts_file: {tmp_path / "prompts.txt"}, prompts_per_iter: 2, group_size: 2, micro_batch: 4}}
estimator: {{mode: {mode}, window: 4, intermediate: interp, micro_batch: 4, clip_range: 0.2, kl_beta: 0.01,
            correction_p: 0.0}}
optim: {{lr: 0.01}}
grpo: {{iterations: 2, updates_per_epoch: 2, drop_zero_spread: false}}
log: {{checkpoint_every: 1, keep_last: 2, tensorboard: false, progress: false, sample_images: 2}}
threads: 1
""")
    return cfg


def test_train_jagg_and_exact_adapter_and_bitwise_resume(tmp_path, flux2_dir, monkeypatch):
    """`jagg train` on FLUX.2 [dev] with LoRA: two JAGG iterations (one 4-step group: 2 rows per sample) and two exact
    ones (4 rows), an adapter that Flux2Pipeline.load_lora_weights reads into the trained velocity, and a run stopped
    after iteration 1 and resumed that equals the uninterrupted one bit for bit."""
    seen = []
    original = real_train.DiffusersTrainer.train
    monkeypatch.setattr(real_train.DiffusersTrainer, "train", lambda self: seen.append(self) or original(self))
    cfg = write_config(tmp_path, flux2_dir, "jagg")
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)]) == 0
    rec = records(out)
    assert [(r["iteration"], r["backward_items"], r["jagg_frac_routed"]) for r in rec] == [(1, 8, 1.0), (2, 8, 1.0)]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rec) and rec[1]["kl"] > 0
    assert (out / "samples" / "iter_000002.png").is_file()
    end = {n: p.detach().clone() for n, p in seen[0].named_params.items()}
    assert end and all("lora_" in n for n in end)
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A" in n for n in end)

    pipe = diffusers.Flux2Pipeline.from_pretrained(flux2_dir, text_encoder=None, tokenizer=None, vae=None)
    pipe.load_lora_weights(str(out / "checkpoints" / "adapter_000002"))
    policy = seen[0].policy
    v = policy.velocity(PROMPTS)
    x, s, i = torch.randn(2, *LATENT), torch.tensor([0.7, 0.3]), torch.arange(2)
    with torch.no_grad():
        want = v(x, s, i)
        got = v.with_transformer(pipe.transformer)(x, s, i)
        base = policy.reference(v)(x, s, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want - base).abs().max() > 1e-5

    stopped = tmp_path / "stopped"
    assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--set", "grpo.iterations=1"]) == 0
    assert main(["train", "--config", str(cfg), "--output-dir", str(stopped), "--resume"]) == 0
    assert all(torch.equal(seen[2].named_params[n].detach(), end[n]) for n in end)
    assert [r["loss"] for r in records(stopped)] == [r["loss"] for r in rec]

    exact = tmp_path / "exact"
    assert main(["train", "--config", str(write_config(tmp_path, flux2_dir, "exact")), "--output-dir", str(exact),
                 "--set", "log.sample_images=0"]) == 0
    assert [(r["iteration"], r["backward_items"]) for r in records(exact)] == [(1, 16), (2, 16)]
