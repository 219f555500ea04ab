"""Held-out evaluation on the shapes world: deterministic ODE sampling with fixed seeds."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .velocity import GuidedVelocity
from ..schedule import flow_sigmas
from ..trajectory import sample_ode
from . import from_tensor, test_prompts, tokenizer, uses_held_out


@torch.no_grad()
def generate(model: nn.Module, prompts: list[str], num_steps: int, guidance_scale: float, seed: int,
             shift: float = 1.0, micro_batch: int = 64) -> np.ndarray:
    """One image per prompt by Euler sampling from noise seeded by ``seed`` -> uint8 ``[N, H, W, 3]``."""
    cfg = model.config
    tokens = tokenizer.encode(prompts, max_len=cfg.max_text_len)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(prompts), cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    x = sample_ode(GuidedVelocity(model, tokens, guidance_scale), noise, flow_sigmas(num_steps, shift), micro_batch)
    return from_tensor(x)


def _component_info(info: dict) -> dict:
    """A weighted sum of rewards files a component's info under ``<name>/<key>``: lift the GenEval-like keys
    (``correct``, ``constraints``, ``accuracy/...``) of the first component that has them to the top."""
    for key in info:
        if key.endswith("/correct"):
            prefix = key[: -len("correct")]
            return {k[len(prefix):]: v for k, v in info.items() if k.startswith(prefix)}
    return {}


@torch.no_grad()
def evaluate(model: nn.Module, reward_fn, num_prompts: int = 0, images_per_prompt: int = 2, num_steps: int = 10,
             guidance_scale: float = 3.0, seed: int = 1234, shift: float = 1.0, with_scores: bool = False) -> tuple:
    """Reward of the test split (the first ``num_prompts``, 0 = all), ``images_per_prompt`` each.

    Returns ``(metrics, images uint8 [N, H, W, 3], prompts)``, and the per-image rewards ``[N]`` as a fourth item
    when ``with_scores`` (the trainer captions its sample grids with them); metrics hold ``reward_mean``, ``accuracy``,
    ``held_out_reward`` (prompts using a held-out colour+shape pair), per-category accuracies and, for rewards
    that report ``constraints`` (geneval), the pass rate of each constraint kind (``pass/shape``, ``pass/color``,
    ``pass/relation``, ``pass/no_extra``), and for a weighted sum of rewards each component's unweighted mean
    (``reward/<name>``).
    """
    prompts = test_prompts()
    prompts = prompts[:num_prompts] if num_prompts else prompts
    batch = [p for p in prompts for _ in range(images_per_prompt)]
    images = generate(model, batch, num_steps, guidance_scale, seed, shift)
    scores, info = reward_fn(images, batch, None)
    info = {**info, **_component_info(info)}
    held = np.array([uses_held_out(p) for p in batch])
    metrics = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std())}
    if "correct" in info:
        metrics["accuracy"] = float(np.mean(info["correct"]))
    if held.any():
        metrics["held_out_reward"] = float(scores[held].mean())
    if (~held).any():
        metrics["seen_reward"] = float(scores[~held].mean())
    metrics.update({k: v for k, v in info.items() if k.startswith("accuracy/")})
    for k, v in info.items():      # a weighted sum of rewards: each component's mean, reported separately
        if k.startswith("scores/"):
            metrics["reward/" + k[len("scores/"):]] = float(np.mean(v))
    if "constraints" in info:      # GenEval-like rewards: pass rate per constraint kind ("shape:circle" -> shape)
        passed: dict[str, list[bool]] = {}
        for c in info["constraints"]:
            for k, v in c.items():
                passed.setdefault("pass/" + k.split(":")[0], []).append(bool(v))
        metrics.update({k: float(np.mean(v)) for k, v in passed.items()})
    return (metrics, images, batch, np.asarray(scores)) if with_scores else (metrics, images, batch)
