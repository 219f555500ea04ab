"""Group-relative advantages (GRPO / Flow-GRPO)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .checks import as_vector, check_flag, check_float32, check_positive, is_finite_number


def prompt_group_index(prompt_ids: Sequence | Tensor) -> Tensor:
    """``[B]`` the dense prompt group index of each sample, in the order the prompt ids first appear; the ids may be
    any hashables (strings, ints; a tensor's values)."""
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.tolist()
    table: dict = {}
    return torch.tensor([table.setdefault(p, len(table)) for p in prompt_ids], dtype=torch.long)


def _rewards_and_ids(rewards, prompt_ids) -> tuple[Tensor, Tensor]:
    """``([B] fp32 rewards, [B] prompt group index)``, checked: at least one reward, all finite, and one prompt id
    (a sequence or a tensor of hashables) per reward; the errors name the argument."""
    rewards = as_vector(rewards, "rewards").float()
    if rewards.numel() == 0:
        raise ValueError("rewards is empty: give one reward per sample ([B], B >= 1)")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or infinity; check the reward function")
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise TypeError(f"prompt_ids must be a sequence or tensor of B = {rewards.numel()} ids (samples with equal ids "
                        f"form one prompt group); got {type(prompt_ids).__name__} (an argument in the wrong position?)")
    if len(prompt_ids) != rewards.numel():
        raise ValueError(f"prompt_ids has {len(prompt_ids)} prompt ids but rewards has {rewards.numel()}; give one "
                         "prompt id per reward")
    try:
        return rewards, prompt_group_index(prompt_ids).to(rewards.device)
    except TypeError as e:                                  # an unhashable id (a list, a dict)
        raise TypeError(f"prompt_ids must hold hashable ids (ints, strings); {e}") from None


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
        eps: floor added to the std, a finite number > 0 (Flow-GRPO: 1e-4; the JAGG authors: 1e-8).

    Returns ``[B]`` fp32 advantages. Stds are population stds (``unbiased=False``, as numpy's ``np.std``).
    Raises (naming the argument) on an empty batch, non-finite rewards, a prompt id count that is not ``B``, a
    ``global_std`` that is not a bool, and an ``adv_clip_max`` or ``eps`` that is not a finite number > 0 (``eps``
    <= 0 would flip the advantages' signs or divide by 0).
    """
    rewards, g = _rewards_and_ids(rewards, prompt_ids)
    global_std = check_flag(global_std, "global_std")
    for name, value, why in (("adv_clip_max", adv_clip_max, "the clip bound; 5 in Flow-GRPO"),
                             ("eps", eps, "the floor added to the std; 1e-4 in Flow-GRPO")):
        check_positive(value, name, why)
        check_float32(value, name)
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
    ``tol``: the spread at or below which a group counts as flat, a finite number >= 0.
    """
    rewards, g = _rewards_and_ids(rewards, prompt_ids)
    if not is_finite_number(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0 (the spread at or below which a prompt group is flat); "
                         f"got {tol!r}")
    n = int(g.max()) + 1
    full = lambda v: torch.full((n,), v, device=rewards.device, dtype=rewards.dtype)
    hi = full(-torch.inf).scatter_reduce(0, g, rewards, "amax")
    lo = full(torch.inf).scatter_reduce(0, g, rewards, "amin")
    return (hi - lo)[g] > tol
