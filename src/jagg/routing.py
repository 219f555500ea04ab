"""Groups of trained steps, the t-weighted interpolation coefficients, and linearity-based routing.

A group is a run of consecutive trained steps ``k_0 < ... < k_{m-1}`` with endpoints ``a = k_0``,
``b = k_{m-1}`` and ``alpha_k = (sigma_k - sigma_a) / (sigma_b - sigma_a)`` (by sigma, not by index).
Scores are computed from the rollout's stored velocities only (no forward passes); higher = more linear.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .estimator_config import ALPHAS, SCORES


def make_groups(train_steps: list[int], window: int) -> list[list[int]]:
    """Split the sorted trained steps into consecutive groups of ``window`` (the last may be shorter)."""
    return [train_steps[i : i + window] for i in range(0, len(train_steps), window)]


def group_alphas(sigmas: Tensor, group: list[int], alpha: str = "sigma") -> Tensor:
    """``alpha_k`` ``[m]`` (fp64) for the steps of ``group``: 0 at ``a``, 1 at ``b``. ``[0.]`` for one step.

    ``alpha="sigma"``: ``(sigma_k - sigma_a) / (sigma_b - sigma_a)`` (the paper's t-weighting; schedules are not
    uniform). ``alpha="index"``: ``(k - a) / (b - a)`` (the authors' reference code).
    """
    if alpha not in ALPHAS:
        raise ValueError(f"alpha must be one of {ALPHAS}; got {alpha!r}")
    if len(group) == 1:
        return torch.zeros(1, dtype=torch.float64, device=sigmas.device)
    s = sigmas[group].double() if alpha == "sigma" else torch.tensor(group, dtype=torch.float64, device=sigmas.device)
    return (s - s[0]) / (s[-1] - s[0])


def group_scores(velocities: Tensor, sigmas: Tensor, groups: list[list[int]], score: str,
                 alpha: str = "sigma") -> Tensor:
    """Linearity score ``[B, G]`` of every (sample, group) from rollout velocities ``[B, T, *S]``.

    - ``chord``: ``-max_k ||v_k - ((1-alpha_k) v_a + alpha_k v_b)|| / mean_k ||v_k||`` (chord residual).
    - ``cosine``: mean cosine between consecutive increments ``v_{k+1} - v_k`` and the chord ``v_b - v_a``.
    - ``cosine_min``: the minimum of those cosines.
    - ``velocity_cosine``: minimum cosine between consecutive velocities ``v_k, v_{k+1}``.

    Groups of one or two steps are exact under JAGG and score ``+inf``. ``alpha`` is the chord's interpolation
    coefficient (:func:`group_alphas`).
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}; got {score!r}")
    B = velocities.shape[0]
    out = torch.full((B, len(groups)), torch.inf, dtype=torch.float32, device=velocities.device)
    for gi, group in enumerate(groups):
        if len(group) <= 2:
            continue
        v = velocities[:, group].flatten(2).float()          # [B, m, D]
        if score == "chord":
            al = group_alphas(sigmas, group, alpha).float().to(v.device)[None, :, None]
            chord_pts = (1 - al) * v[:, :1] + al * v[:, -1:]
            resid = (v - chord_pts).norm(dim=2).amax(1)
            out[:, gi] = -resid / v.norm(dim=2).mean(1).clamp_min(1e-12)
        elif score in ("cosine", "cosine_min"):
            inc = v[:, 1:] - v[:, :-1]                        # [B, m-1, D]
            chord = (v[:, -1] - v[:, 0])[:, None]             # [B, 1, D]
            cos = torch.nn.functional.cosine_similarity(inc, chord.expand_as(inc), dim=2, eps=1e-12)
            out[:, gi] = cos.mean(1) if score == "cosine" else cos.amin(1)
        else:
            cos = torch.nn.functional.cosine_similarity(v[:, 1:], v[:, :-1], dim=2, eps=1e-12)
            out[:, gi] = cos.amin(1)
    return out


def route(scores: Tensor, jagg_frac: float, eligible: Tensor,
          sample_groups: Tensor | Sequence | None = None) -> Tensor:
    """Pick the top ``jagg_frac`` of the eligible (sample, group) pairs by score.

    Args:
        scores: ``[B, G]`` linearity scores (higher = more linear).
        eligible: ``[G]`` bool, groups allowed to go through JAGG.
        sample_groups: optional ``[B]``, the GRPO group of each sample (an int tensor, or any sequence of
            hashables such as the prompts). When given, a GRPO group's members are routed together: the unit
            is (GRPO group, step group), its score the members' mean, and the top ``jagg_frac`` of the
            eligible units go through JAGG. Group-relative advantages sum to zero within a GRPO group, so an
            error that its members' JAGG gradients share cancels when they are all routed alike (and survives
            when only some are).

    Returns ``[B, G]`` bool: True = JAGG. The count is ``jagg_frac * n_eligible`` rounded half up (pairs, or
    units with ``sample_groups``); ties break towards the lower index (deterministic).
    """
    B, G = scores.shape
    if sample_groups is not None:
        if not isinstance(sample_groups, Tensor):            # e.g. the prompts themselves, or prompt ids
            first = {}
            sample_groups = torch.tensor([first.setdefault(k, len(first)) for k in sample_groups])
        sample_groups = sample_groups.to(scores.device).flatten()
        if sample_groups.numel() != B:
            raise ValueError(f"sample_groups must have shape [B] = [{B}]; got {tuple(sample_groups.shape)}")
        ids, member = torch.unique(sample_groups, return_inverse=True)          # member: [B] in 0..U-1
        U = ids.numel()
        total = torch.zeros(U, G, dtype=torch.float64, device=scores.device).index_add_(0, member, scores.double())
        count = torch.bincount(member, minlength=U).double()[:, None]
        unit_routed = route(total / count, jagg_frac, eligible)                 # [U, G]
        return unit_routed[member]
    mask = eligible[None, :].expand(B, G).reshape(-1)
    n_elig = int(mask.sum())
    n = int(math.floor(float(jagg_frac) * n_elig + 0.5))    # round half up: 1 of 1 unit at 0.5, not 0
    routed = torch.zeros(B * G, dtype=torch.bool, device=scores.device)
    if n > 0:
        s = scores.reshape(-1).double().masked_fill(~mask, -torch.inf)
        # stable descending sort: equal scores keep index order
        order = torch.sort(-s, stable=True).indices
        routed[order[:n]] = True
    return routed.view(B, G)
