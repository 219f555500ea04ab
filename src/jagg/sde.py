"""The SDE steps of GRPO for flow matching (three noise conventions), their Gaussian log-probability, the
deterministic Euler step, and the per-step loss head built on them (ratio, PPO clip, KL).

Everything here runs in fp32 (or fp64 if the inputs are fp64), whatever dtype the network produced.
For step k with ``s = sigma_k > s' = sigma_{k+1}``, ``dt = s' - s < 0``, noise level ``eta`` and velocity ``v``,
every SDE type samples ``x' = mean + step_std * eps`` with a ``mean`` affine in ``x`` and ``v``
(docs/design.md §2 says what each ``eta`` means):

- ``flow_grpo`` (Flow-GRPO, the default): ``std = eta * sqrt(s / (1 - s))`` (``s = 1`` uses sigma_1 in the
  denominator), ``mean = x (1 + std^2 dt / (2 s)) + v (1 + std^2 (1 - s) / (2 s)) dt``, ``step_std = std sqrt(-dt)``.
- ``dance`` (DanceGRPO, and the JAGG authors' code): the same mean with a constant ``std = eta``, so
  ``step_std = eta sqrt(-dt)`` (DanceGRPO writes it with the score ``-(x - (1 - s) x0_hat) / s^2``).
- ``cps`` (coefficients-preserving sampling, Flow-CPS / Flow-GRPO-Fast): ``x0_hat = x - s v``,
  ``x1_hat = x + (1 - s) v``, ``step_std = s' sin(eta pi / 2)``,
  ``mean = (1 - s') x0_hat + sqrt(s'^2 - step_std^2) x1_hat``. Needs ``0 < eta <= 1`` and ``s' > 0``.

``log pi = -||x' - mean||^2 / (2 step_std^2) - log(step_std) - log sqrt(2 pi)``, reduced over the latent dimensions
with a mean by default (Flow-GRPO), or a sum. For every type this is the true Gaussian log-density (Flow-GRPO's CPS
code drops the ``1 / (2 step_std^2)`` and the constants; a ratio is then ``exp`` of a differently scaled number).

The per-step Flow-GRPO loss head (:func:`step_loss`) is built from these densities, so it lives here too (and
:func:`group_clip`, one clip decision for a group of items): for one (sample, step) item with velocity ``v`` at
step k::

    r  = exp(log pi(x_{k+1} | x_k; v) - log pi_old)
    l  = max(-A r, -A clip(r, 1 - eps, 1 + eps)) + beta * KL
    KL = mean_dims (mean(v) - mean(v_ref))^2 / (2 std_k^2)

with the log-probability and the mean of the trajectory's SDE type (:func:`step_log_prob`). KL follows Flow-GRPO's
convention for every type: it divides by ``std_k^2 = step_std^2 / |dt|``, i.e. it is the Gaussian KL between the two
step distributions times ``|dt|``. The total loss averages ``l`` over the batch and the trained steps, so it has the
same scale whatever the estimator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import (Keys, check_eta, check_reduction, check_sde_type, check_tensor, cps_last_step_error,
                     first_non_finite, is_finite_number)

REDUCTION_ARGUMENT = Keys(logprob_reduction="reduction")       # the argument's name here


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or fp64 when any input is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_step(x, v, sigma, sigma_next, x_name: str = "x", v_name: str = "v") -> None:
    """The tensors of one step checked before any arithmetic (no device sync): ``x`` and ``v`` tensors of one shape
    ``[N, *S]``, ``sigma`` and ``sigma_next`` tensors of ``N`` values (or one, broadcast); the errors name them."""
    check_tensor(x, x_name, "[N, *S]")
    check_tensor(v, v_name, f"[N, *S] = {list(x.shape)} (the shape of {x_name})")
    if v.shape != x.shape:
        raise ValueError(f"{v_name} must have the shape of {x_name}, {tuple(x.shape)}; got {tuple(v.shape)}")
    for name, t in (("sigma", sigma), ("sigma_next", sigma_next)):
        check_tensor(t, name, f"[N] (N = {x.shape[0] if x.ndim else 1})")
        if t.numel() not in (1, x.shape[0] if x.ndim else 1):
            raise ValueError(f"{name} must have one value per item, [N] = [{x.shape[0]}]; got {tuple(t.shape)}")


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


def step_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, sigma_one: float, eta: float,
                 sde_type: str = "flow_grpo") -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [N, *S], step_std [N], std [N])`` of ``x_{k+1}`` under ``sde_type`` (module docstring) in the compute
    dtype. ``step_std`` is the whole step's standard deviation; ``std = step_std / sqrt(-dt)`` is the one before
    the step's ``sqrt(-dt)``, which the KL of :func:`step_loss` divides by (Flow-GRPO's convention, kept for every type)."""
    check_sde_type(sde_type)
    if sde_type in ("flow_grpo", "dance"):
        sig = sigma.to(compute_dtype(x, v))
        std = sde_std(sig, sigma_one, eta) if sde_type == "flow_grpo" else torch.full_like(sig, eta)
        return sde_mean(x, v, sigma, sigma_next, std), std * torch.sqrt(sigma - sigma_next).to(std.dtype), std
    dtype = compute_dtype(x, v, sigma)                                       # cps
    sigma, s_next = sigma.to(dtype), sigma_next.to(dtype)
    step_std = s_next * math.sin(eta * math.pi / 2)
    x, v = x.to(dtype), v.to(dtype)
    s, sn = _expand(sigma, x), _expand(s_next, x)
    root = torch.sqrt((sn**2 - _expand(step_std, x) ** 2).clamp_min(0))
    mean = (1 - sn) * (x - s * v) + root * (x + (1 - s) * v)
    return mean, step_std, step_std / torch.sqrt(sigma - s_next)


def gaussian_log_prob(x_next: Tensor, mean: Tensor, step_std: Tensor, reduction: str = "mean") -> Tensor:
    """Per-item log-density of ``x_next`` under ``N(mean, step_std^2 I)``, reduced over latent dims -> ``[N]``.

    ``step_std`` ``[N]`` is ``std_k * sqrt(-dt)``. ``reduction``: ``"mean"`` (Flow-GRPO) or ``"sum"``.
    """
    check_reduction(reduction, REDUCTION_ARGUMENT)
    check_tensor(mean, "mean", "[N, *S]")
    check_tensor(x_next, "x_next", f"[N, *S] = {list(mean.shape)} (the shape of mean)")
    check_tensor(step_std, "step_std", "[N]")
    if x_next.shape != mean.shape:
        raise ValueError(f"x_next must have the shape of mean, {tuple(mean.shape)}; got {tuple(x_next.shape)}")
    if step_std.numel() not in (1, mean.shape[0] if mean.ndim else 1):
        raise ValueError(f"step_std must have one value per item, [N] = [{mean.shape[0]}]; got {tuple(step_std.shape)}")
    x_next = x_next.to(mean.dtype)
    sd = _expand(step_std.to(mean.dtype), mean)
    lp = -((x_next - mean) ** 2) / (2 * sd**2) - torch.log(sd) - 0.5 * math.log(2 * math.pi)
    lp = lp.flatten(1)
    return lp.mean(1) if reduction == "mean" else lp.sum(1)


def step_log_prob(x: Tensor, v: Tensor, x_next: Tensor, sigma: Tensor, sigma_next: Tensor, sigma_one: float,
                  eta: float, sde_type: str = "flow_grpo", reduction: str = "mean") -> tuple[Tensor, Tensor, Tensor]:
    """``(log_prob [N], mean [N, *S], std [N])`` of a stored step ``x -> x_next`` under velocity ``v``: what the loss
    head needs (:func:`step_moments`, then :func:`gaussian_log_prob` of ``x_next``)."""
    mean, step_std, std = step_moments(x, v, sigma, sigma_next, sigma_one, eta, sde_type)
    return gaussian_log_prob(x_next, mean, step_std, reduction), mean, std


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
    sde_type: str = "flow_grpo",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One stochastic step of GRPO sampling.

    Args:
        x: latents ``[N, *S]`` at ``sigma``.
        v: velocity ``[N, *S]``.
        sigma, sigma_next: ``[N]`` with ``sigma > sigma_next``.
        sigma_one: the schedule's ``sigma_1``, used in place of ``sigma`` in ``1 - sigma`` when ``sigma = 1``
            (``flow_grpo`` only).
        eta: noise level (Flow-GRPO's ``noise_level``; 0.7 for SD3). Its meaning depends on ``sde_type``.
        noise: optional standard normal ``[N, *S]``; drawn from ``generator`` otherwise.
        reduction: ``"mean"`` or ``"sum"`` over latent dims for the log-prob.
        sde_type: ``"flow_grpo"``, ``"dance"`` or ``"cps"`` (module docstring).

    Returns:
        ``(x_next [N, *S], log_prob [N], mean [N, *S], std [N])`` in the compute dtype; ``std`` is before the
        step's ``sqrt(-dt)`` (the step's standard deviation is ``std * sqrt(sigma - sigma_next)``).
    """
    check_step(x, v, sigma, sigma_next)
    check_eta(eta)
    check_sde_type(sde_type, eta)
    if not is_finite_number(sigma_one) or not 0 <= sigma_one < 1:
        raise ValueError(f"sigma_one must be the schedule's sigma_1, a number in [0, 1); got {sigma_one!r}")
    if noise is not None and (not isinstance(noise, Tensor) or noise.shape != x.shape):
        raise ValueError(f"noise must be None or a standard normal tensor of the shape of x, {tuple(x.shape)}; got "
                         f"{tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    if sde_type == "cps" and not bool((sigma_next > 0).all()):
        raise cps_last_step_error()
    mean, step_std, std = step_moments(x, v, sigma, sigma_next, sigma_one, eta, sde_type)
    if noise is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    x_next = mean + _expand(step_std, mean) * noise.to(mean.dtype)
    return x_next, gaussian_log_prob(x_next, mean, step_std, reduction), mean, std


def euler_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Deterministic (ODE) step ``x + v * dt`` in the compute dtype. ``x, v``: ``[N, *S]``; sigmas ``[N]``."""
    check_step(x, v, sigma, sigma_next)
    dtype = compute_dtype(x, v)
    return x.to(dtype) + v.to(dtype) * _expand((sigma_next - sigma).to(dtype), x)


# ----------------------------------------------------------------------------- the loss head


@dataclass
class StepLoss:
    """Per-item outputs of :func:`step_loss`, each ``[n]``."""

    loss: Tensor
    log_prob: Tensor
    ratio: Tensor
    clipped: Tensor
    kl: Tensor
    dropped: Tensor                    # the items whose policy gradient the clip zeroed


# ``step_loss``'s per-item clip decisions (``clip_decision``): PPO's own (the ratio decides), kept unclipped, dropped
CLIP_OWN, CLIP_KEEP, CLIP_DROP = -1, 0, 1


def _check_loss_args(v, x, sigma, sigma_next, sigma_one, eta, old_log_prob, advantages, clip_range, kl_beta) -> None:
    """:func:`step_loss`'s arguments checked, each named: the step's tensors (:func:`check_step`), finite numbers, one
    stored log-prob and advantage per item."""
    check_step(x, v, sigma, sigma_next)
    bad = first_non_finite({"clip_range": clip_range, "kl_beta": kl_beta, "eta": eta, "sigma_one": sigma_one})
    if bad is not None or clip_range <= 0 or kl_beta < 0:
        raise ValueError(f"clip_range must be a finite number > 0, kl_beta one >= 0, eta and sigma_one finite "
                         f"numbers; got clip_range={clip_range!r}, kl_beta={kl_beta!r}, eta={eta!r}, "
                         f"sigma_one={sigma_one!r}")
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if not isinstance(t, Tensor) or t.numel() != (x.shape[0] if x.ndim else 1):
            raise ValueError(f"{name} must be a tensor [n] = [{x.shape[0]}] (one per item); got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")


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
    clip_decision: Tensor | None = None,
) -> StepLoss:
    """Per-item Flow-GRPO loss for ``n`` (sample, step) items (the module docstring's ``l``).

    Args:
        v: current velocities ``[n, *S]`` (the only input gradients flow through).
        x, x_next: stored latents ``[n, *S]`` at steps k and k + 1.
        sigma, sigma_next: ``[n]``.
        old_log_prob, advantages: ``[n]``.
        clip_range: PPO clip ``eps``.
        kl_beta, ref_v: KL weight and reference velocities ``[n, *S]`` (needed when ``kl_beta > 0``).
        reduction: ``"mean"`` (Flow-GRPO) or ``"sum"`` of the log-prob over the latent dimensions.
        sde_type: the SDE the trajectory was sampled with (:data:`jagg.checks.SDE_TYPES`).
        clip_decision: optional ``[n]`` per-item clip decisions taken by the caller: :data:`CLIP_OWN` (PPO's, from the
            item's own ratio: the default for every item), :data:`CLIP_KEEP` (the unclipped ``-A r``) or
            :data:`CLIP_DROP` (the same value, no policy gradient); e.g. :func:`group_clip` for a prompt group's
            items. The KL term is never clipped.
    """
    _check_loss_args(v, x, sigma, sigma_next, sigma_one, eta, old_log_prob, advantages, clip_range, kl_beta)
    log_prob, mean, std = step_log_prob(x, v, x_next, sigma, sigma_next, sigma_one, eta, sde_type, reduction)
    ratio = torch.exp(log_prob - old_log_prob.to(log_prob.dtype))
    adv = advantages.to(log_prob.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    dropped = (adv * (ratio - 1) > clip_range * adv.abs()).detach()      # PPO's max took the constant clipped side
    if clip_decision is not None:
        own, drop = clip_decision == CLIP_OWN, clip_decision == CLIP_DROP
        loss = torch.where(own, loss, torch.where(drop, unclipped.detach(), unclipped))
        dropped = torch.where(own, dropped, drop)
    kl = torch.zeros_like(loss)
    if kl_beta > 0:
        if ref_v is None:
            raise ValueError("kl_beta > 0 needs reference velocities (ref_v)")
        ref_mean = step_moments(x, ref_v, sigma, sigma_next, sigma_one, eta, sde_type)[0]
        kl = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std**2)
        loss = loss + kl_beta * kl
    return StepLoss(loss, log_prob, ratio.detach(), (ratio - 1).abs().detach() > clip_range, kl.detach(), dropped)


def group_clip(ratio: Tensor, advantages: Tensor, group: Tensor, clip_range: float, groups: int | None = None) -> Tensor:
    """One PPO clip decision per group of items: ``[n]`` bool, True where the item's group is dropped (no policy
    gradient for any of its items), False where all are kept unclipped.

    A group is dropped when its advantage-weighted ratio ``1 + sum A (r - 1) / sum |A|`` exceeds ``1 + clip_range``:
    its surrogate has already improved beyond the trust region. For a group of one item this is PPO's own rule (the
    gradient of ``max(-A r, -A clip(r))`` is zero exactly when ``A (r - 1) > clip_range |A|``). A group whose items
    share an error in proportion to their zero-sum advantages (JAGG's interpolation error, docs/results.md) keeps
    it cancelling: its items are dropped or kept together.

    Args:
        ratio, advantages: ``[n]`` each item's ratio ``pi / pi_old`` and advantage.
        group: ``[n]`` long, each item's group in ``0 .. G-1``.
        clip_range: PPO's ``eps``.
        groups: ``G`` when known (saves a device sync), else ``group.max() + 1``.
    """
    G = groups if groups is not None else int(group.max()) + 1 if group.numel() else 0
    adv = advantages.to(ratio.dtype)
    gain = torch.zeros(G, dtype=ratio.dtype, device=ratio.device).index_add_(0, group, adv * (ratio - 1))
    scale = torch.zeros(G, dtype=ratio.dtype, device=ratio.device).index_add_(0, group, adv.abs())
    return (gain > clip_range * scale)[group]
