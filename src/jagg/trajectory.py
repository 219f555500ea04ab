"""Rollouts: sample a batch of SDE trajectories and keep what training needs.

A *velocity callable* ``velocity_fn(latents [N, *S], sigma [N], sample_index [N] long) -> velocity [N, *S]``
owns conditioning and classifier-free guidance: ``sample_index`` says which trajectory of the batch each
row belongs to, so the callable can pick that sample's prompt embedding. Items of one call may carry
different sigmas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .checks import (Keys, check_callable, check_count, check_flag, check_noise, check_sampler, check_sde_steps, check_sigmas,
                     check_sliding_window, check_tensor, check_train_steps, cps_last_step_error)
from .sde import compute_dtype, euler_step, sde_step

VelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]
VELOCITY_SIGNATURE = "(latents [N, *S], sigma [N], sample_index [N] long) -> velocity [N, *S]"
# how the checks name sliding_sde_window's arguments
SLIDING_ARGS = Keys(sde_window="span", sde_window_size="size", sde_window_stride="stride", sde_window_every="every")


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def velocity_shape_error(velocity_fn: VelocityFn, v, latents: Tensor, what: str = "velocity_fn") -> ValueError:
    """The error for a velocity callable whose output ``v`` is not exactly the shape of its ``latents`` ``[N, *S]``
    (no broadcasting, e.g. ``[N, 1, 1, 1]``): it names the function and both shapes."""
    got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
    return ValueError(f"{what} {_name(velocity_fn)} returned {got} for latents {tuple(latents.shape)}; it must "
                      f"return a velocity of exactly the latents' shape {tuple(latents.shape)} (no broadcasting)")


def checked_velocity(velocity_fn: VelocityFn, latent_shape: tuple[int, ...], what: str = "velocity_fn") -> VelocityFn:
    """``velocity_fn`` wrapped so that an output whose shape is not exactly ``[N, *S]`` (the latents' shape) raises
    :func:`velocity_shape_error`."""
    S = tuple(latent_shape)

    def call(latents: Tensor, sigma: Tensor, sample_index: Tensor) -> Tensor:
        v = velocity_fn(latents, sigma, sample_index)
        if not isinstance(v, Tensor) or tuple(v.shape) != (latents.shape[0], *S):
            raise velocity_shape_error(velocity_fn, v, latents, what)
        return v

    return call


@dataclass
class Trajectory:
    """A batch of ``B`` stored trajectories of ``T`` steps over latents of shape ``S``.

    Attributes:
        latents: ``[B, T + 1, *S]`` — ``x_0`` (noise) ... ``x_T`` (the sample), fp32 (fp64 allowed).
        sigmas: ``[T + 1]`` strictly decreasing from 1 to 0.
        log_probs: ``[B, T]`` log-probabilities at sampling time (``log pi_old``); 0 at ODE steps.
        velocities: ``[B, T, *S]`` velocities used at sampling time (``v_old``, with guidance), fp32.
        train_steps: ``[K]`` sorted, unique step indices that are trained (all SDE steps).
        eta: noise level the SDE steps used; the training log-probs must use the same.
        logprob_reduction: ``"mean"`` (Flow-GRPO) or ``"sum"`` over latent dims.
        sde_type: the SDE of the sampled steps, one of :data:`jagg.checks.SDE_TYPES` (``"flow_grpo"``, ``"dance"``,
            ``"cps"``); the training log-probs use the same.
    """

    latents: Tensor
    sigmas: Tensor
    log_probs: Tensor
    velocities: Tensor
    train_steps: Tensor
    eta: float
    logprob_reduction: str = "mean"
    sde_type: str = "flow_grpo"

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    def validate(self) -> None:
        """Raise a ValueError (a TypeError for a field that is not a tensor) naming the first inconsistency between
        the stored tensors: each of the shape the class docstring gives, at least one sample."""
        for name in ("latents", "sigmas", "log_probs", "velocities", "train_steps"):
            check_tensor(getattr(self, name), f"Trajectory.{name}", "(see jagg.Trajectory)")
        check_sigmas(self.sigmas)
        B, T = self.latents.shape[0], self.num_steps
        if B == 0:
            raise ValueError("the trajectory holds no sample (latents [0, ...]): give a batch of B >= 1 trajectories")
        if self.latents.ndim < 3 or self.latents.shape[1] != T + 1:
            raise ValueError(
                f"latents must have shape [B, T + 1, *S] = [B, {T + 1}, ...] for {T + 1} sigmas; "
                f"got {tuple(self.latents.shape)}"
            )
        S = tuple(self.latents.shape[2:])
        if tuple(self.velocities.shape) != (B, T, *S):
            raise ValueError(
                f"velocities must have shape [B, T, *S] = {(B, T, *S)}; got {tuple(self.velocities.shape)}"
            )
        if tuple(self.log_probs.shape) != (B, T):
            raise ValueError(f"log_probs must have shape [B, T] = {(B, T)}; got {tuple(self.log_probs.shape)}")
        ts = self.train_steps
        check_train_steps(ts, T)
        check_sampler(self.eta, self.sde_type, self.logprob_reduction)
        if self.sde_type == "cps" and float(self.sigmas[int(ts.max()) + 1]) <= 0:
            raise cps_last_step_error()

    def to(self, device: torch.device | str) -> "Trajectory":
        return Trajectory(
            self.latents.to(device), self.sigmas.to(device), self.log_probs.to(device),
            self.velocities.to(device), self.train_steps.to(device), self.eta, self.logprob_reduction, self.sde_type,
        )

    def select(self, index: Tensor) -> "Trajectory":
        """The sub-batch of trajectories ``index`` (``[b]`` long)."""
        return Trajectory(
            self.latents[index], self.sigmas, self.log_probs[index], self.velocities[index],
            self.train_steps, self.eta, self.logprob_reduction, self.sde_type,
        )


def select_train_steps(
    num_steps: int, timestep_fraction: float = 1.0, sde_window: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor]:
    """Which steps are SDE steps and which are trained.

    - ``sde_window=None``: every step is an SDE step; the first ``int(num_steps * timestep_fraction)`` are
      trained (Flow-GRPO's timestep fraction).
    - ``sde_window=(start, end)``: steps ``start <= k < end`` are SDE steps and trained; the others are
      deterministic Euler steps (Flow-GRPO-Fast, MixGRPO). ``timestep_fraction`` must then be 1.

    Returns ``(train_steps [K] long, sde_mask [T] bool)``.
    """
    num_steps = check_count(num_steps, "num_steps")
    if sde_window is not None and (isinstance(sde_window, (str, bytes)) or not hasattr(sde_window, "__len__")):
        raise TypeError(f"sde_window must be None or (start, end); got {type(sde_window).__name__} {sde_window!r}")
    check_sde_steps(num_steps, timestep_fraction, sde_window)
    if sde_window is None:
        return torch.arange(int(num_steps * timestep_fraction)), torch.ones(num_steps, dtype=torch.bool)
    start, end = (check_count(v, "sde_window's start and end", 0) for v in sde_window)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:end] = True
    return torch.arange(start, end), mask


def sliding_sde_window(iteration: int, span: tuple[int, int], size: int, stride: int = 1,
                       every: int = 1) -> tuple[int, int]:
    """MixGRPO's sliding SDE window: the ``[start, end)`` of iteration ``iteration`` (counted from 0), for
    :func:`select_train_steps`'s ``sde_window``.

    The window of ``size`` steps starts at ``span[0]`` and moves ``stride`` steps later every ``every`` iterations
    (MixGRPO's ``window_size``, shift and ``iters_per_group``). It never runs past ``span[1]``: when the next move would,
    it returns to ``span[0]`` and slides again (MixGRPO's ``roll_back``). So there are
    ``(span[1] - span[0] - size) // stride + 1`` positions, visited in turn; the last one ends before ``span[1]`` when
    ``stride`` does not divide ``span[1] - span[0] - size``. A function of the iteration alone: a resumed run has the
    same window.
    """
    check_sliding_window(span, size, stride, every, SLIDING_ARGS)
    iteration = check_count(iteration, "iteration", 0)
    positions = (span[1] - span[0] - size) // stride + 1
    start = int(span[0] + stride * ((iteration // every) % positions))
    return start, start + int(size)


def checked_sde_mask(sde_mask: Tensor | None, T: int) -> Tensor:
    """``sde_mask`` ``[T]`` bool on the CPU (None: every step an SDE step), refused unless it is one per step."""
    if sde_mask is None:
        return torch.ones(T, dtype=torch.bool)
    if not isinstance(sde_mask, Tensor) or tuple(sde_mask.shape) != (T,) or sde_mask.dtype != torch.bool:
        raise ValueError(f"sde_mask must be a bool tensor [T] = [{T}] (one per step of the {T + 1} sigmas); got "
                         f"{tuple(sde_mask.shape) if isinstance(sde_mask, Tensor) else type(sde_mask).__name__}")
    return sde_mask.cpu()


def check_sampling_call(velocity_fn, sigmas, micro_batch, generator) -> None:
    """The arguments :func:`sample_trajectories` and :func:`sample_ode` share, checked before any network call: a
    callable velocity, a sigma tensor, ``micro_batch`` None or an integer >= 1, ``generator`` None or a
    ``torch.Generator``."""
    check_callable(velocity_fn, "velocity_fn", VELOCITY_SIGNATURE)
    check_tensor(sigmas, "sigmas", "[T + 1] (e.g. jagg.flow_sigmas(num_steps))")
    if micro_batch is not None:
        check_count(micro_batch, "micro_batch")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")


def _chunks(n: int, size: int | None) -> Sequence[slice]:
    size = n if not size else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def check_finite_rollout(latents: list[Tensor]) -> None:
    """One check after sampling (a single device sync): name the first step whose latents are not finite, which
    means the velocity function returned NaN or infinity there."""
    finite = torch.stack([torch.isfinite(x).flatten(1).all(1) for x in latents], 1)    # [B, T + 1]
    if not bool(finite.all()):
        step = int((~finite).any(0).nonzero()[0]) - 1
        samples = (~finite[:, step + 1]).nonzero().flatten().tolist()
        raise ValueError(f"the rollout became non-finite at step {step}: the velocity function returned NaN or "
                         f"infinity there (samples {samples[:8]}{'...' if len(samples) > 8 else ''})")


def _sample_steps(velocity_fn: VelocityFn, x: Tensor, sigmas: Tensor, sde_mask: Tensor, eta: float,
                  generator: torch.Generator | None, micro_batch: int | None, reduction: str,
                  sde_type: str) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The rollout from ``x = x_0``: per step, the velocity (``micro_batch`` rows per call) and an SDE step (``sde_mask``
    True) or an Euler step; returns the latents ``x_0 .. x_T``, the velocities and the log-probabilities (0 at ODE
    steps), all in ``x``'s dtype."""
    B, dtype = x.shape[0], x.dtype
    latents, velocities, log_probs = [x], [], []
    sigma_one = float(sigmas[1])
    for k in range(sigmas.numel() - 1):
        v = torch.empty_like(x)
        for sl in _chunks(B, micro_batch):
            idx = torch.arange(B, device=x.device)[sl]
            v[sl] = velocity_fn(x[sl], sigmas[k].expand(idx.numel()), idx).to(dtype)
        s, s_next = sigmas[k].expand(B), sigmas[k + 1].expand(B)
        if sde_mask[k]:
            x, lp, _, _ = sde_step(x, v, s, s_next, sigma_one, eta, generator=generator, reduction=reduction,
                                   sde_type=sde_type)
        else:
            x, lp = euler_step(x, v, s, s_next), torch.zeros(B, device=x.device, dtype=dtype)
        latents.append(x)
        velocities.append(v)
        log_probs.append(lp.to(dtype))
    return latents, velocities, log_probs


@torch.no_grad()
def sample_trajectories(
    velocity_fn: VelocityFn,
    noise: Tensor,
    sigmas: Tensor,
    eta: float,
    train_steps: Tensor | None = None,
    sde_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    micro_batch: int | None = None,
    logprob_reduction: str = "mean",
    check_finite: bool = True,
    sde_type: str = "flow_grpo",
) -> Trajectory:
    """Sample ``B`` trajectories from initial noise ``[B, *S]`` and record everything training needs.

    Steps with ``sde_mask`` True use the Flow-GRPO SDE step (noise from ``generator``), the others the Euler
    step. ``train_steps`` defaults to all SDE steps. ``micro_batch`` bounds the rows per network call.
    ``sde_type`` picks the SDE (:data:`jagg.checks.SDE_TYPES`: ``"flow_grpo"`` = Flow-GRPO's, the default; ``"dance"`` =
    DanceGRPO's constant ``eta sqrt(-dt)`` noise; ``"cps"`` = coefficients-preserving sampling, whose last step must
    be an ODE step); what ``eta`` means depends on it (docs/design.md §2).

    Raises ValueError, before any network call, on non-finite or misshaped noise, an ``eta`` that is not a finite
    number > 0, an unknown SDE type or log-prob reduction, a bad schedule, trained steps that are not sorted, unique
    SDE steps; then on a velocity of the wrong shape (naming the function), and, with ``check_finite`` (one device
    sync after sampling), a rollout that turned NaN/inf (naming the step). The trainers turn it off: a non-finite rollout gives
    a non-finite loss there, which they skip and, after ``grpo.max_consecutive_skips``, stop on with a checkpoint.
    """
    check_sampling_call(velocity_fn, sigmas, micro_batch, generator)
    check_noise(noise)
    check_sampler(eta, sde_type, logprob_reduction)
    check_finite = check_flag(check_finite, "check_finite")
    dtype = compute_dtype(noise)                        # fp32 storage (fp64 if the noise is fp64)
    sigmas = sigmas.to(device=noise.device, dtype=dtype)
    check_sigmas(sigmas)
    T = sigmas.numel() - 1
    sde_mask = checked_sde_mask(sde_mask, T)
    if train_steps is None:
        train_steps = torch.nonzero(sde_mask).flatten()
    # before sampling (the trajectory is valid by construction)
    check_train_steps(train_steps.cpu().long() if isinstance(train_steps, Tensor) else train_steps, T)
    if not bool(sde_mask[train_steps.cpu()].all()):
        raise ValueError("every trained step must be an SDE step (sde_mask True)")
    if sde_type == "cps" and bool(sde_mask[-1]):
        raise cps_last_step_error()
    velocity_fn = checked_velocity(velocity_fn, tuple(noise.shape[1:]))
    latents, velocities, log_probs = _sample_steps(velocity_fn, noise.to(dtype), sigmas, sde_mask, eta, generator,
                                                   micro_batch, logprob_reduction, sde_type)
    if check_finite:
        check_finite_rollout(latents)
    traj = Trajectory(
        latents=torch.stack(latents, 1),          # [B, T + 1, *S]
        sigmas=sigmas,
        log_probs=torch.stack(log_probs, 1),      # [B, T]
        velocities=torch.stack(velocities, 1),    # [B, T, *S]
        train_steps=train_steps.to(noise.device).long(),
        eta=eta,
        logprob_reduction=logprob_reduction,
        sde_type=sde_type,
    )
    return traj


@torch.no_grad()
def sample_ode(velocity_fn: VelocityFn, noise: Tensor, sigmas: Tensor, micro_batch: int | None = None) -> Tensor:
    """Deterministic Euler (ODE) sampling from noise ``[B, *S]``; returns the final latents ``[B, *S]``."""
    check_sampling_call(velocity_fn, sigmas, micro_batch, None)
    check_noise(noise)
    sigmas = sigmas.to(device=noise.device, dtype=compute_dtype(noise))
    check_sigmas(sigmas)
    x = noise.to(sigmas.dtype)
    B = x.shape[0]
    velocity_fn = checked_velocity(velocity_fn, tuple(noise.shape[1:]))
    for k in range(sigmas.numel() - 1):
        for sl in _chunks(B, micro_batch):
            idx = torch.arange(B, device=x.device)[sl]
            v = velocity_fn(x[sl], sigmas[k].expand(idx.numel()), idx)
            x[sl] = euler_step(x[sl], v, sigmas[k].expand(idx.numel()), sigmas[k + 1].expand(idx.numel()))
    return x
