"""Linearity scores: how well each (sample, interval) suits JAGG, from the rollout's stored velocities alone.

Routing (``jagg_frac < 1``) sends the highest-scoring units through JAGG; the decision itself, like the interval
layout it scores, belongs to the plan (:func:`jagg.knots.route`). A score needs no forward pass; higher = more linear.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .estimator_config import SCORES


def linearity_scores(velocities: Tensor, intervals: list[list[int]], alphas: list[Tensor], score: str) -> Tensor:
    """Linearity score ``[B, G]`` of every (sample, interval) from rollout velocities ``[B, T, *S]``.

    - ``chord``: ``-max_k ||v_k - ((1-alpha_k) v_a + alpha_k v_b)|| / mean_k ||v_k||`` (chord residual).
    - ``cosine``: mean cosine between consecutive increments ``v_{k+1} - v_k`` and the chord ``v_b - v_a``.
    - ``cosine_min``: the minimum of those cosines.
    - ``velocity_cosine``: minimum cosine between consecutive velocities ``v_k, v_{k+1}``.

    Intervals of one or two steps are exact under JAGG and score ``+inf``. ``alphas``: each interval's interpolation
    coefficients (:func:`jagg.knots.interval_alphas`), which place the chord's points.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}; got {score!r}")
    B = velocities.shape[0]
    out = torch.full((B, len(intervals)), torch.inf, dtype=torch.float32, device=velocities.device)
    for j, interval in enumerate(intervals):
        if len(interval) <= 2:
            continue
        v = velocities[:, interval].flatten(2).float()       # [B, m, D]
        if score == "chord":
            al = alphas[j].float().to(v.device)[None, :, None]
            chord_pts = (1 - al) * v[:, :1] + al * v[:, -1:]
            resid = (v - chord_pts).norm(dim=2).amax(1)
            out[:, j] = -resid / v.norm(dim=2).mean(1).clamp_min(1e-12)
        elif score in ("cosine", "cosine_min"):
            inc = v[:, 1:] - v[:, :-1]                        # [B, m-1, D]
            chord = (v[:, -1] - v[:, 0])[:, None]             # [B, 1, D]
            cos = torch.nn.functional.cosine_similarity(inc, chord.expand_as(inc), dim=2, eps=1e-12)
            out[:, j] = cos.mean(1) if score == "cosine" else cos.amin(1)
        else:
            cos = torch.nn.functional.cosine_similarity(v[:, 1:], v[:, :-1], dim=2, eps=1e-12)
            out[:, j] = cos.amin(1)
    return out
