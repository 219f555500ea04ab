"""Each diffusers family samples on its own pipeline's sigma grid (``pipeline.sigma_grid: pipeline``), and DanceGRPO's
grid stays available by name (``pipeline.sigma_grid: dance``).

The reference is the pipeline itself: each tiny pipeline is called with ``num_inference_steps`` N and stopped right
after it set its scheduler's timesteps, and the scheduler's sigmas at that moment are what its denoising loop would
walk. The policy's sigmas equal them at 10, 20 and 40 steps (1e-6) for SD3, FLUX.1, Qwen-Image, FLUX.2 [dev] and
[klein] and Wan 2.1 (with the ``UniPCMultistepScheduler`` Wan2.1-Diffusers ships); a static ``pipeline.shift``
replaces the model's own in both grids."""

from __future__ import annotations

import functools
import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler  # noqa: E402
from tiny_pipelines import (FLUX2_SCHEDULER, QWEN_SCHEDULER, embeds, tiny_flux, tiny_flux2,  # noqa: E402
                            tiny_flux2_vae, tiny_qwen, tiny_qwen_vae, tiny_sd3, tiny_vae, tiny_wan, tiny_wan_vae)

import jagg  # noqa: E402
from jagg.integrations import LoraSettings, PipelineConfig, Policy  # noqa: E402
from jagg.integrations.schedules import pipeline_sigmas  # noqa: E402

STEPS = (10, 20, 40)


class _Stop(Exception):
    """Raised by the scheduler right after the pipeline set its timesteps: carries the sigmas it set."""


def sigmas_the_pipeline_sets(pipe, call: dict, steps: int) -> torch.Tensor:
    """Call ``pipe`` with ``num_inference_steps=steps`` and stop it once it has set its scheduler's timesteps; the
    scheduler's sigmas then (what its denoising loop walks)."""
    scheduler = pipe.scheduler
    original = scheduler.set_timesteps

    @functools.wraps(original)                  # its signature: the pipelines inspect it for `sigmas`
    def set_timesteps(*args, **kwargs):
        original(*args, **kwargs)
        raise _Stop(scheduler.sigmas.clone())

    scheduler.set_timesteps = set_timesteps
    try:
        with pytest.raises(_Stop) as stop, torch.no_grad():
            pipe(**call, num_inference_steps=steps, output_type="latent")
    finally:
        scheduler.set_timesteps = original
    return stop.value.args[0].float()


def _config(family, height, width=None, **kw) -> PipelineConfig:
    return PipelineConfig(family=family, path="unused", dtype="fp32", device="cpu", resolution=height, width=width,
                          lora=LoraSettings(enabled=False), cfg_scale=1.0, **kw)


def _sd3():
    cond, _ = embeds()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = diffusers.StableDiffusion3Pipeline(transformer=tiny_sd3(), vae=tiny_vae(), scheduler=scheduler,
                                              text_encoder=None, tokenizer=None, text_encoder_2=None,
                                              tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    call = dict(prompt_embeds=cond.prompt_embeds, pooled_prompt_embeds=cond.pooled, guidance_scale=1.0,
                height=128, width=96)
    return pipe, call, _config("sd3", 128, 96)


def _flux():
    cond, _ = embeds(family="flux")
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = diffusers.FluxPipeline(transformer=tiny_flux(), vae=tiny_vae(), scheduler=scheduler, text_encoder=None,
                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    call = dict(prompt_embeds=cond.prompt_embeds, pooled_prompt_embeds=cond.pooled, height=128, width=128,
                guidance_scale=3.5)
    return pipe, call, _config("flux", 128, guidance_embed=3.5)


def _qwen():
    cond, _ = embeds(family="qwen_image")
    pipe = diffusers.QwenImagePipeline(transformer=tiny_qwen(), vae=tiny_qwen_vae(),
                                       scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), text_encoder=None,
                                       tokenizer=None)
    call = dict(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.mask.long(), height=128, width=128)
    return pipe, call, _config("qwen_image", 128)


def _flux2(family):
    def build():
        torch.manual_seed(0)
        text = torch.randn(2, 5, 16)
        parts = dict(transformer=tiny_flux2(guidance=family == "flux2"), vae=tiny_flux2_vae(),
                     scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), text_encoder=None, tokenizer=None)
        pipe = diffusers.Flux2Pipeline(**parts) if family == "flux2" else diffusers.Flux2KleinPipeline(**parts)
        call = dict(prompt_embeds=text, height=128, width=96)
        extra = dict(guidance_embed=4.0) if family == "flux2" else {}
        if family == "flux2_klein":
            call["guidance_scale"] = 1.0
        return pipe, call, _config(family, 128, 96, **extra)
    return build


def _wan():
    torch.manual_seed(0)
    text = torch.randn(2, 5, 16)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = diffusers.WanPipeline(transformer=tiny_wan(), vae=tiny_wan_vae(), scheduler=scheduler, text_encoder=None,
                                 tokenizer=None)
    call = dict(prompt_embeds=text, guidance_scale=1.0, height=64, width=96, num_frames=5)
    return pipe, call, _config("wan", 64, 96, num_frames=5)


BUILDERS = {"sd3": _sd3, "flux": _flux, "qwen_image": _qwen, "flux2": _flux2("flux2"),
            "flux2_klein": _flux2("flux2_klein"), "wan": _wan}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_each_family_samples_on_its_pipelines_grid(family):
    pipe, call, config = BUILDERS[family]()
    scheduler = {**pipe.scheduler.config, "_class_name": type(pipe.scheduler).__name__}
    policy = Policy(config, pipe.transformer, pipe.vae, pipe, scheduler)
    for steps in STEPS:
        want = sigmas_the_pipeline_sets(pipe, call, steps)
        got = policy.sigmas(steps)
        assert got.shape == (steps + 1,) and float(got[-1]) == 0.0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if family == "sd3":       # StableDiffusion3Pipeline's own grid, not DanceGRPO's: last sigma 0.0089 at 10 steps
        assert float(policy.sigmas(10)[-2]) == pytest.approx(0.0089, abs=1e-4)
    if family == "qwen_image":                              # the scheduler's terminal stretch
        assert float(policy.sigmas(10)[-2]) == pytest.approx(0.02, abs=1e-6)


def test_sd3_pipeline_grid_is_not_dancegrpos():
    """At 10 steps with shift 3, the pipeline grid (SD3's set_timesteps) and DanceGRPO's differ from the first
    step on and end 0.0089 -> 0 against 0.25 -> 0."""
    pipe, _, config = _sd3()
    policy = Policy(config, pipe.transformer, pipe.vae, pipe, dict(pipe.scheduler.config))
    dance = Policy(_config("sd3", 128, 96, sigma_grid="dance"), tiny_sd3(), tiny_vae(), None,
                   dict(pipe.scheduler.config))
    assert float(policy.sigmas(10)[-2]) == pytest.approx(0.0089, abs=1e-4)
    assert float(dance.sigmas(10)[-2]) == pytest.approx(0.25, abs=1e-6)
    assert (policy.sigmas(10)[1:-1] - dance.sigmas(10)[1:-1]).abs().min() > 1e-3


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_the_named_dance_grid_is_shift_of_linspace(family):
    """``sigma_grid: dance`` with a static shift is shift(linspace(1, 0, N + 1)) at every step count, whatever the
    model's scheduler; a static shift on the pipeline grid is the scheduler's grid at that shift."""
    pipe, call, config = BUILDERS[family]()
    scheduler = {**pipe.scheduler.config, "_class_name": type(pipe.scheduler).__name__}
    extra = dict(guidance_embed=3.5) if family == "flux" else dict(num_frames=5) if family == "wan" else {}
    size = (config.resolution, config.width)
    dance = Policy(_config(family, *size, sigma_grid="dance", shift=2.5, **extra), pipe.transformer, pipe.vae, None,
                   scheduler)
    for steps in STEPS:
        t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        torch.testing.assert_close(dance.sigmas(steps), (2.5 * t / (1 + 1.5 * t)).float(), rtol=0, atol=1e-7)
        torch.testing.assert_close(dance.sigmas(steps), jagg.flow_sigmas(steps, 2.5), rtol=0, atol=0)
    static = Policy(_config(family, *size, shift=2.5, **extra), pipe.transformer, pipe.vae, None, scheduler)
    if family == "sd3":
        want = FlowMatchEulerDiscreteScheduler(shift=2.5)
        want.set_timesteps(10)
        torch.testing.assert_close(static.sigmas(10), want.sigmas.float(), rtol=0, atol=1e-6)
    elif family == "flux":                   # FluxPipeline's sigmas at a static shift: exactly DanceGRPO's grid
        torch.testing.assert_close(static.sigmas(10), jagg.flow_sigmas(10, 2.5), rtol=0, atol=1e-6)


def test_a_scheduler_that_is_not_a_flow_grid_is_named():
    with pytest.raises(ValueError, match="names 'NoSuchScheduler'.*sigma_grid: dance"):
        pipeline_sigmas("sd3", 10, {"_class_name": "NoSuchScheduler"}, 64)
    with pytest.raises(ValueError, match="pipeline.sigma_grid must be one of"):
        _config("sd3", 128, sigma_grid="linear")
    got = pipeline_sigmas("sd3", 10, None, 64)                      # no config: FlowMatchEulerDiscreteScheduler()
    assert float(got[0]) == 1.0 and float(got[-1]) == 0.0 and np.all(np.diff(got.numpy()) < 0)
