"""Qwen-Image (``family: qwen_image``) against diffusers' own ``QwenImagePipeline``, on tiny random models.

The sampler's sigmas (dynamic shift, ``shift_terminal``), the packed latents, the timestep, the text mask of prompts
of different lengths and the norm-rescaled true CFG: jagg's Euler steps through the adapter equal the pipeline's
denoising loop, and its decoded images equal the pipeline's. With a tiny random Qwen2.5-VL text encoder and
tokenizer built offline (the ``qwen_dir`` fixture): prompt embeddings equal the pipeline's ``encode_prompt``, the
prompt-cache builder writes them and a policy without text encoders reads them back.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from gradient_checks import assert_rel  # noqa: E402
from tiny_pipelines import C, L, QWEN_SCHEDULER, embeds, tiny_qwen, tiny_qwen_vae  # noqa: E402

from jagg.integrations import (LoraSettings, PipelineConfig, Policy, PromptEmbeddings, VelocityConfig,  # noqa: E402
                               load_model, pack_latents, unpack_latents, velocity_adapter)
from jagg.integrations import pipeline  # noqa: E402

RES = 128                                           # 16x16 latents (the tiny VAE downsamples 8x, as Qwen-Image's)


def qwen_config(path="unused", **kw) -> PipelineConfig:
    return PipelineConfig(**{**dict(family="qwen_image", path=str(path), dtype="fp32", device="cpu", resolution=RES,
                                    num_steps=3, cfg_scale=4.0, negative_prompt=" ",
                                    lora=LoraSettings(enabled=False)), **kw})


def test_euler_steps_and_images_equal_the_pipeline():
    """QwenImagePipeline's denoising loop (3 steps, true CFG 4 with a negative prompt, prompts of 5 and 3 tokens)
    from the same packed noise equals jagg's Euler steps with the policy's sigmas and velocity, and its decoded images
    equal the policy's."""
    cond, neg = embeds(family="qwen_image")
    cond = cond.select([0, 2])                                           # 5 and 3 tokens: a mask
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    pipe = diffusers.QwenImagePipeline(transformer=tiny_qwen(), vae=tiny_qwen_vae(), scheduler=scheduler,
                                       text_encoder=None, tokenizer=None)
    policy = Policy(qwen_config(), pipe.transformer, pipe.vae, pipe, dict(scheduler.config),
                    PromptEmbeddings.cat([cond, neg]))
    assert policy.latent_shape == (C, 16, 16)
    noise = torch.randn(2, C, 16, 16, generator=torch.Generator().manual_seed(0))
    call = dict(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.mask.long(),
                negative_prompt_embeds=neg.prompt_embeds, true_cfg_scale=4.0, height=RES, width=RES,
                num_inference_steps=3, latents=pack_latents(noise))
    with torch.no_grad():
        want = unpack_latents(pipe(**call, output_type="latent").images, 16, 16)
        want_images = pipe(**call, output_type="np").images
        sigmas = policy.sigmas()
        torch.testing.assert_close(sigmas, scheduler.sigmas, rtol=0, atol=1e-6)     # shift and shift_terminal
        assert abs(float(sigmas[-2]) - 0.02) < 1e-6
        v = policy.velocity(["a red cube", "a blue ball"])
        assert v.cond.mask is not None and v.cond.prompt_embeds.shape[1] == L
        x = noise
        for k in range(3):
            x = x + (sigmas[k + 1] - sigmas[k]) * v(x, sigmas[k].expand(2), torch.arange(2))
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    got_images = policy.decode(x)
    assert got_images.shape == (2, RES, RES, 3) and got_images.dtype == np.uint8
    assert np.abs(got_images.astype(int) - np.round(want_images * 255).astype(int)).max() <= 1


def test_batched_cfg_pads_prompts_like_separate_forwards():
    """The default batched [uncond; cond] forward pads the negative prompt (2 tokens) and the prompts (5, 3 tokens) to
    one length with a mask: its velocity equals two separate forwards (detach_uncond, uncond_forward: separate), and
    its gradient flows through both branches and the norm rescaling."""
    model = tiny_qwen()
    cond, neg = embeds(family="qwen_image")
    x, s, i = torch.randn(3, C, 16, 16), torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0, 2, 3])
    weight = torch.linspace(-1, 1, x.numel()).view_as(x)
    out = {}
    for name, cfg in (("both", VelocityConfig(cfg_scale=4.0)),
                      ("separate", VelocityConfig(cfg_scale=4.0, detach_uncond=True, uncond_forward="separate")),
                      ("batched", VelocityConfig(cfg_scale=4.0, detach_uncond=True, uncond_forward="batched"))):
        model.zero_grad(set_to_none=True)
        vel = velocity_adapter(model, cond, neg, cfg)(x, s, i)
        (vel * weight).sum().backward()
        out[name] = vel.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(out["separate"][0], out["both"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["batched"][0], out["both"][0], rtol=1e-5, atol=1e-6)
    assert_rel(out["batched"][1], out["separate"][1])
    assert float((out["separate"][1] - out["both"][1]).norm() / out["both"][1].norm()) > 0.05


def test_older_diffusers_is_refused(monkeypatch):
    """Before 0.37 QwenImageTransformer2DModel ignored the text mask (shorter prompts would attend to padding)."""
    monkeypatch.setattr(diffusers, "__version__", "0.36.0")
    with pytest.raises(RuntimeError, match="Qwen-Image needs diffusers >= 0.37.*found 0.36.0"):
        velocity_adapter(tiny_qwen(), embeds(family="qwen_image")[0])


def test_text_encoder_prompt_cache_and_a_policy_without_it(qwen_dir, tmp_path, capsys):
    """Loaded with its text encoder, the policy embeds each prompt alone as QwenImagePipeline.encode_prompt does (its
    own length); the cache builder writes the prompts and the negative prompt; loaded from that cache the text
    encoder is not loaded and the embeddings are the same."""
    prompts = ["a red cube", "a blue ball on a table"]
    cfg = qwen_config(qwen_dir, max_sequence_length=512)
    policy = load_model(cfg)
    assert policy.can_encode and policy.shift_terminal == 0.02
    emb = policy.embeddings(prompts)
    assert emb.pooled is None and emb.mask is not None and emb.mask.sum(1).tolist() == [
        policy.pipe.encode_prompt(p, device="cpu")[0].shape[1] for p in prompts]
    for k, p in enumerate(prompts):
        alone, _ = policy.pipe.encode_prompt(p, device="cpu", max_sequence_length=512)
        torch.testing.assert_close(emb.row(k).prompt_embeds, alone)
    yaml_path = tmp_path / "qwen.yaml"
    yaml_path.write_text(f"pipeline:\n  family: qwen_image\n  path: {qwen_dir}\n  dtype: fp32\n  device: cpu\n"
                         f"  resolution: {RES}\n  cfg_scale: 4.0\n  negative_prompt: ' '\n  max_sequence_length: 512\n")
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    assert pipeline.main(["cache", "--config", str(yaml_path), "--prompts", str(tmp_path / "prompts.txt"),
                          "--out", str(tmp_path / "cache.safetensors"), "--batch-size", "2"]) == 0
    assert "wrote 2 prompt embeddings" in capsys.readouterr().out
    cached = load_model(dataclasses.replace(cfg, prompt_cache=str(tmp_path / "cache.safetensors")))
    assert cached.pipe.text_encoder is None and not cached.can_encode
    back = cached.embeddings(prompts)
    torch.testing.assert_close(back.prompt_embeds, emb.prompt_embeds)
    assert torch.equal(back.mask, emb.mask)
    torch.testing.assert_close(cached.negative().prompt_embeds, policy.negative().prompt_embeds)
    with pytest.raises(ValueError, match="max_sequence_length must be <= 1024"):
        qwen_config(max_sequence_length=2048)
