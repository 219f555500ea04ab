"""Group-relative advantages (GRPO / Flow-GRPO)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .checks import as_vector, check_positive


def prompt_group_index(prompt_ids: Sequence | Tensor) -> Tensor:
    """``[B]`` the dense prompt group index of each sample, in the order the prompt ids first appear; the ids may be
    any hashables (strings, ints; a tensor's values)."""
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.tolist()
    table: dict = {}
    return torch.tensor([table.setdefault(p, len(table)) for p in prompt_ids], dtype=torch.long)


def _as_rewards(rewards) -> Tensor:
    return as_vector(rewards, "rewards").float()


def group_advantages(
    rewards: Tensor,
    prompt_ids: Sequence | Tensor,
    global_std: bool = False,
    adv_clip_max: float = 5.0,
    eps: float = 1e-4,
) -> Tensor:
    """``(r - mean_prompt) / (std + eps)`` per prompt, clipped to ``[-adv_clip_max, adv_clip_max]``.

    Args:
        rewards: ``[B]`` rewards (a tensor, list or numpy array), all finite.
        prompt_ids: ``B`` ids; samples with equal ids form one prompt group.
        global_std: divide by the std of the whole batch instead of each prompt's (Flow-GRPO's option).
        adv_clip_max: clip bound (Flow-GRPO uses 5).
        eps: floor added to the std.

    Returns ``[B]`` fp32 advantages. Stds are population stds (``unbiased=False``, as numpy's ``np.std``).
    """
    rewards = _as_rewards(rewards)
    if len(prompt_ids) != rewards.numel():
        raise ValueError(f"got {rewards.numel()} rewards but {len(prompt_ids)} prompt ids")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or infinity; check the reward function")
    check_positive(adv_clip_max, "adv_clip_max")
    g = prompt_group_index(prompt_ids).to(rewards.device)
    n = int(g.max()) + 1
    zeros = lambda: torch.zeros(n, device=rewards.device, dtype=rewards.dtype)   # whatever the default dtype
    count = zeros().index_add_(0, g, torch.ones_like(rewards))
    mean = zeros().index_add_(0, g, rewards) / count
    dev = rewards - mean[g]
    if global_std:
        std = rewards.std(unbiased=False).expand_as(rewards)
    else:
        var = zeros().index_add_(0, g, dev**2) / count
        std = var.sqrt()[g]
    return (dev / (std + eps)).clamp(-adv_clip_max, adv_clip_max)


def nonzero_spread_mask(rewards: Tensor, prompt_ids: Sequence | Tensor, tol: float = 1e-8) -> Tensor:
    """``[B]`` bool: True where the sample's prompt group has rewards that are not all equal.

    Prompt groups with zero spread carry no learning signal (all advantages are 0); drop them to save compute.
    """
    rewards = _as_rewards(rewards)
    if len(prompt_ids) != rewards.numel():
        raise ValueError(f"got {rewards.numel()} rewards but {len(prompt_ids)} prompt ids")
    g = prompt_group_index(prompt_ids).to(rewards.device)
    n = int(g.max()) + 1
    full = lambda v: torch.full((n,), v, device=rewards.device, dtype=rewards.dtype)
    hi = full(-torch.inf).scatter_reduce(0, g, rewards, "amax")
    lo = full(torch.inf).scatter_reduce(0, g, rewards, "amin")
    return (hi - lo)[g] > tol
