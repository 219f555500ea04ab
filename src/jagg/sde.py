"""The Flow-GRPO SDE step, its Gaussian log-probability, and the deterministic Euler step.

Everything here runs in fp32 (or fp64 if the inputs are fp64), whatever dtype the network produced.
For step k with ``s = sigma_k > s' = sigma_{k+1}``, ``dt = s' - s < 0`` and noise level ``eta``::

    std    = eta * sqrt(s / (1 - s))        (s = 1 uses sigma_1 in the denominator, as Flow-GRPO)
    mean   = x * (1 + std^2 / (2 s) * dt) + v * (1 + std^2 (1 - s) / (2 s)) * dt
    x'     = mean + std * sqrt(-dt) * eps
    log pi = -||x' - mean||^2 / (2 std^2 (-dt)) - log(std sqrt(-dt)) - log sqrt(2 pi)

``log pi`` is reduced over the latent dimensions with a mean by default (Flow-GRPO), or a sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

REDUCTIONS = ("mean", "sum")


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or fp64 when any input is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _expand(s: Tensor, like: Tensor) -> Tensor:
    """Per-item values ``[N]`` -> ``[N, 1, ..., 1]`` to broadcast against ``like`` ``[N, *S]``."""
    return s.reshape(-1, *([1] * (like.ndim - 1)))


def sde_std(sigma: Tensor, sigma_one: float, eta: float) -> Tensor:
    """Per-item ``std_k`` (without the ``sqrt(-dt)`` factor). ``sigma``: ``[N]``; ``sigma_one`` = the schedule's sigma_1."""
    denom = 1 - torch.where(sigma >= 1.0, torch.full_like(sigma, sigma_one), sigma)
    return eta * torch.sqrt(sigma / denom)


def sde_mean(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, std: Tensor) -> Tensor:
    """Mean of ``x_{k+1}`` given ``x_k`` ``[N, *S]``, velocity ``v`` ``[N, *S]``, per-item sigmas and std ``[N]``.

    Affine in ``v``. Returned in the compute dtype (fp32/fp64).
    """
    dtype = compute_dtype(x, v, sigma)
    x, v = x.to(dtype), v.to(dtype)
    s, dt, std = (_expand(t.to(dtype), x) for t in (sigma, sigma_next - sigma, std))
    return x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt


def gaussian_log_prob(x_next: Tensor, mean: Tensor, step_std: Tensor, reduction: str = "mean") -> Tensor:
    """Per-item log-density of ``x_next`` under ``N(mean, step_std^2 I)``, reduced over latent dims -> ``[N]``.

    ``step_std`` ``[N]`` is ``std_k * sqrt(-dt)``. ``reduction``: ``"mean"`` (Flow-GRPO) or ``"sum"``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"logprob reduction must be one of {REDUCTIONS}; got {reduction!r}")
    x_next = x_next.to(mean.dtype)
    sd = _expand(step_std.to(mean.dtype), mean)
    lp = -((x_next - mean) ** 2) / (2 * sd**2) - torch.log(sd) - 0.5 * math.log(2 * math.pi)
    lp = lp.flatten(1)
    return lp.mean(1) if reduction == "mean" else lp.sum(1)


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    sigma_one: float,
    eta: float,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One stochastic Flow-GRPO step.

    Args:
        x: latents ``[N, *S]`` at ``sigma``.
        v: velocity ``[N, *S]``.
        sigma, sigma_next: ``[N]`` with ``sigma > sigma_next``.
        sigma_one: the schedule's ``sigma_1``, used in place of ``sigma`` in ``1 - sigma`` when ``sigma = 1``.
        eta: noise level (Flow-GRPO's ``noise_level``; 0.7 for SD3).
        noise: optional standard normal ``[N, *S]``; drawn from ``generator`` otherwise.
        reduction: ``"mean"`` or ``"sum"`` over latent dims for the log-prob.

    Returns:
        ``(x_next [N, *S], log_prob [N], mean [N, *S], std [N])`` in the compute dtype.
    """
    std = sde_std(sigma.to(compute_dtype(x, v)), sigma_one, eta)
    mean = sde_mean(x, v, sigma, sigma_next, std)
    step_std = std * torch.sqrt(sigma - sigma_next).to(std.dtype)
    if noise is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    x_next = mean + _expand(step_std, mean) * noise.to(mean.dtype)
    return x_next, gaussian_log_prob(x_next, mean, step_std, reduction), mean, std


def euler_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Deterministic (ODE) step ``x + v * dt`` in the compute dtype. ``x, v``: ``[N, *S]``; sigmas ``[N]``."""
    dtype = compute_dtype(x, v)
    return x.to(dtype) + v.to(dtype) * _expand((sigma_next - sigma).to(dtype), x)
