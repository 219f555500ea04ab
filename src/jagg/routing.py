"""Linearity scores: how well each (sample, interval) suits JAGG, from the rollout's stored velocities alone.

Routing (``jagg_frac < 1``) sends the highest-scoring units through JAGG; the decision itself, like the interval
layout it scores, belongs to the plan (:func:`jagg.knots.route`). A score needs no forward pass; higher = more linear.
Of the scores ``python -m lab fidelity`` compares, this one ranks the true per-interval gradient cosine best.
"""

from __future__ import annotations

import torch
from torch import Tensor


def linearity_scores(velocities: Tensor, intervals: list[list[int]]) -> Tensor:
    """Linearity score ``[B, G]`` of every (sample, interval) from rollout velocities ``[B, T, *S]``: the mean cosine
    between the consecutive increments ``v_{k+1} - v_k`` and the chord ``v_b - v_a``.

    Intervals of one or two steps are exact under JAGG and score ``+inf``.
    """
    B = velocities.shape[0]
    out = torch.full((B, len(intervals)), torch.inf, dtype=torch.float32, device=velocities.device)
    for j, interval in enumerate(intervals):
        if len(interval) <= 2:
            continue
        v = velocities[:, interval].flatten(2).float()       # [B, m, D]
        inc = v[:, 1:] - v[:, :-1]                        # [B, m-1, D]
        chord = (v[:, -1] - v[:, 0])[:, None]             # [B, 1, D]
        cos = torch.nn.functional.cosine_similarity(inc, chord.expand_as(inc), dim=2, eps=1e-12)
        out[:, j] = cos.mean(1)
    return out
