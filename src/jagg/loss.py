"""The per-step Flow-GRPO loss head: ratio, PPO clip and KL to a reference, per (sample, step) item.

For one item with velocity ``v`` at step k (docs/design.md §2)::

    r  = exp(log pi(x_{k+1} | x_k; v) - log pi_old)
    l  = max(-A r, -A clip(r, 1 - eps, 1 + eps)) + beta * KL
    KL = mean_dims (mean(v) - mean(v_ref))^2 / (2 std_k^2)

The log-probability and the mean come from the trajectory's SDE type (:func:`jagg.sde.step_log_prob`). KL follows
Flow-GRPO's convention for every type: it divides by ``std_k^2 = step_std^2 / |dt|``, i.e. it is the Gaussian
KL between the two step distributions times ``|dt|``. The total loss averages ``l`` over the batch and
the trained steps, so it has the same scale whatever the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sde import step_log_prob, step_moments


@dataclass
class StepLoss:
    """Per-item outputs of :func:`step_loss`, each ``[n]``."""

    loss: Tensor
    log_prob: Tensor
    ratio: Tensor
    clipped: Tensor
    kl: Tensor


def step_loss(
    v: Tensor,
    x: Tensor,
    x_next: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    sigma_one: float,
    eta: float,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    kl_beta: float = 0.0,
    ref_v: Tensor | None = None,
    reduction: str = "mean",
    sde_type: str = "flow_grpo",
) -> StepLoss:
    """Per-item Flow-GRPO loss for ``n`` (sample, step) items.

    Args:
        v: current velocities ``[n, *S]`` (the only input gradients flow through).
        x, x_next: stored latents ``[n, *S]`` at steps k and k + 1.
        sigma, sigma_next: ``[n]``.
        old_log_prob, advantages: ``[n]``.
        clip_range: PPO clip ``eps``.
        kl_beta, ref_v: KL weight and reference velocities ``[n, *S]`` (needed when ``kl_beta > 0``).
        reduction: ``"mean"`` (Flow-GRPO) or ``"sum"`` of the log-prob over the latent dimensions.
        sde_type: the SDE the trajectory was sampled with (:data:`jagg.sde.SDE_TYPES`).
    """
    log_prob, mean, std = step_log_prob(x, v, x_next, sigma, sigma_next, sigma_one, eta, sde_type, reduction)
    ratio = torch.exp(log_prob - old_log_prob.to(log_prob.dtype))
    adv = advantages.to(log_prob.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    kl = torch.zeros_like(loss)
    if kl_beta > 0:
        if ref_v is None:
            raise ValueError("kl_beta > 0 needs reference velocities (ref_v)")
        ref_mean = step_moments(x, ref_v, sigma, sigma_next, sigma_one, eta, sde_type)[0]
        kl = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std**2)
        loss = loss + kl_beta * kl
    return StepLoss(loss, log_prob, ratio.detach(), (ratio - 1).abs().detach() > clip_range, kl.detach())
