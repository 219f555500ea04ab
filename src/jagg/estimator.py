"""The policy-gradient estimators: ``exact`` (one backward per trained step) and ``jagg`` (knots, see
:mod:`jagg.knots`).

:func:`policy_gradient` is the drop-in replacement for the per-step forward/backward loop of a Flow-GRPO
update. It accumulates into ``.grad`` exactly what ``L.backward()`` would for

    L = loss_scale / (B |K|) * sum_{i, k in K} l_{i,k}        (l from :func:`jagg.loss.step_loss`)

in ``exact`` mode (and JAGG's estimate of it otherwise), and returns statistics. Every mode shares one machinery:

1. :func:`jagg.knots.plan_update` lays out *units*: rows ``(i, k)`` that go through the network together (an exact
   step: one row; a JAGG interval or chain of shared knots: its knot rows) and the loss evaluations they cover;
2. units are packed into chunks of at most ``micro_batch`` rows (a unit is never split);
3. per chunk: one forward with grad of all rows; the upstream signal ``g_{i,k} = dl_{i,k}/dv_{i,k}`` of every
   evaluation is computed by autograd through the loss head alone, on detached velocities; the row signals are
   ``G_row = sum_k w_{row,k} g_k`` (a knot's own step: ``w = 1``; an inner step: ``1 - alpha_k`` on ``a``,
   ``alpha_k`` on ``b``); one backward of the scalar ``sum(v * G)``, whose gradient is ``sum_row J_row^T G_row``.

Inner-step velocities are ``fresh`` (one no-grad forward of the chunk's inner rows) or ``interp``
(``v_k_old + (1 - alpha_k)(v_a - v_a_old) + alpha_k (v_b - v_b_old)``, no forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager, Sequence

import numpy as np
import torch
from torch import Tensor

from .advantages import as_vector
from .estimator_config import EstimatorConfig
from .knots import Unit, plan_update
from .loss import step_loss
from .schedule import is_finite_number
from .sde import compute_dtype
from .trajectory import Trajectory, VelocityFn, checked_velocity


@dataclass
class GradientStats:
    """What one :func:`policy_gradient` call did. Counts are rows (batch items) through the network.

    Attributes:
        loss: ``L / loss_scale``: the mean per-item loss over the batch and the trained steps.
        clip_frac: fraction of (sample, step) items whose ratio left ``[1 - eps, 1 + eps]``.
        approx_kl: mean of ``0.5 * (log pi - log pi_old)^2`` (PPO's approximate KL to the sampling policy).
        ratio_mean: mean ratio ``pi / pi_old``.
        kl: mean KL to the reference policy (0 without one).
        forward_grad_items: rows forwarded with grad (the knots): the cost model's ``F_grad`` count.
        forward_nograd_items: rows forwarded without grad (``fresh`` inner steps): ``F_nograd``.
        backward_items: rows back-propagated: the cost model's ``B`` count. Every row forwarded with grad is
            back-propagated, so it equals ``forward_grad_items``; both are reported so that each term of the cost
            model (docs/design.md: ``F_grad``, ``F_nograd``, ``B``) has its own counter.
        forward_calls: network calls, with and without grad.
        backward_calls: backward passes (one per chunk).
        groups: (sample, interval) pairs JAGG could take (intervals with inner steps, outside the exact first/last).
        groups_jagg: of those, routed to JAGG.
        jagg_frac_routed: ``groups_jagg / groups`` (0 when no interval is eligible).
        groups_corrected: of the routed pairs, those also run exactly by unbiased JAGG (``correction_p``).
    """

    loss: float
    clip_frac: float
    approx_kl: float
    ratio_mean: float
    kl: float
    forward_grad_items: int
    forward_nograd_items: int
    backward_items: int
    forward_calls: int
    backward_calls: int
    groups: int
    groups_jagg: int
    jagg_frac_routed: float
    groups_corrected: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _pack(units: list[Unit], micro_batch: int) -> list[list[Unit]]:
    """Greedy packing into chunks of at most ``micro_batch`` rows (a unit is never split)."""
    chunks, cur, rows = [], [], 0
    for u in units:
        n = len(u.rows)
        if cur and rows + n > micro_batch:
            chunks.append(cur)
            cur, rows = [], 0
        cur.append(u)
        rows += n
    return chunks + ([cur] if cur else [])


def _as_advantages(advantages, B: int, device) -> Tensor:
    """``[B]`` finite advantages from a tensor or any array-like (list, numpy array)."""
    advantages = as_vector(advantages, f"advantages (one per sample, {B})", np.float64).to(device)
    if advantages.numel() != B:
        raise ValueError(f"advantages must have shape [B] = [{B}]; got {tuple(advantages.shape)}")
    bad = torch.nonzero(~torch.isfinite(advantages)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"advantages must be finite; sample {i} has {float(advantages[i])} ({bad.numel()} non-finite "
                         "in all): check the rewards and the advantage normalisation")
    return advantages


def _signal_norms(traj: Trajectory, advantages: Tensor, config: EstimatorConfig, ref_velocities: Tensor | None,
                  chunk: int = 256) -> Tensor:
    """``[B, K]`` norms of the upstream signals ``g_{i,k}`` at the rollout velocities (no network call)."""
    B, steps = traj.batch_size, traj.train_steps
    K = steps.numel()
    bb, kk = torch.arange(B).repeat_interleave(K), steps.cpu().repeat(B)
    out = torch.empty(B * K, dtype=torch.float64)
    sig, lat = traj.sigmas, traj.latents
    for s in range(0, B * K, chunk):
        b, k = bb[s : s + chunk].to(lat.device), kk[s : s + chunk].to(lat.device)
        v = traj.velocities[b, k].detach().clone().requires_grad_(True)
        ref = None if ref_velocities is None else ref_velocities[b, k]
        with torch.enable_grad():
            l = step_loss(v, lat[b, k], lat[b, k + 1], sig[k], sig[k + 1], float(sig[1]), traj.eta, traj.log_probs[b, k],
                          advantages[b], config.clip_range, config.kl_beta, ref, traj.logprob_reduction, traj.sde_type).loss
            (g,) = torch.autograd.grad(l.sum(), v)
        out[s : s + chunk] = g.flatten(1).norm(dim=1).double().cpu()
    return out.view(B, K)


def check_call(velocity_fn, traj, config, loss_scale: float = 1.0, generator=None) -> None:
    """The argument types every estimator entry point needs, checked before any work, with what was expected."""
    if not callable(velocity_fn):
        raise TypeError(f"velocity_fn must be callable (latents [N,*S], sigma [N], sample_index [N]) -> [N,*S]; "
                        f"got {type(velocity_fn).__name__}")
    if not isinstance(traj, Trajectory):
        raise TypeError(f"traj must be a jagg.Trajectory (from jagg.sample_trajectories); got {type(traj).__name__}")
    if not isinstance(config, EstimatorConfig):
        raise TypeError(f"config must be a jagg.EstimatorConfig (EstimatorConfig.from_dict(d) for a dict); "
                        f"got {type(config).__name__}")
    if not is_finite_number(loss_scale):
        raise ValueError(f"loss_scale must be a finite number; got {loss_scale!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")


def policy_gradient(
    velocity_fn: VelocityFn,
    traj: Trajectory,
    advantages: Tensor | Sequence[float],
    config: EstimatorConfig,
    ref_velocities: Tensor | None = None,
    loss_scale: float = 1.0,
    backward_context: Callable[[bool], ContextManager] | None = None,
    backward_fn: Callable[[Tensor], None] | None = None,
    sample_groups: Tensor | Sequence | None = None,
    generator: torch.Generator | None = None,
    only_steps: Sequence[int] | None = None,
) -> GradientStats:
    """Accumulate the Flow-GRPO policy gradient of one update into the parameters' ``.grad``.

    Args:
        velocity_fn: ``(latents [N, *S], sigma [N], sample_index [N] long) -> v [N, *S]`` at the current
            parameters, with grad enabled (guidance included; detach the unconditional branch if desired). Its output
            must have exactly the shape of its latents (no broadcasting).
        traj: the stored :class:`~jagg.trajectory.Trajectory` (``B`` samples, ``T`` steps).
        advantages: ``[B]`` per-sample advantages (a tensor, list or numpy array), all finite.
        config: :class:`~jagg.estimator_config.EstimatorConfig`.
        ref_velocities: ``[B, T, *S]`` reference-policy velocities (from
            :func:`reference_velocities`, computed once per rollout); required when ``config.kl_beta > 0``.
        loss_scale: multiplies the loss (e.g. ``1 / grad_accum_steps``).
        backward_context: ``f(is_last) -> context manager`` entered around each chunk's forward with grad and
            its backward (DDP decides at forward time whether the backward all-reduces), e.g.
            ``lambda last: contextlib.nullcontext() if last else ddp_model.no_sync()``.
        backward_fn: called with each chunk's scalar surrogate instead of ``surrogate.backward()``, for
            engines that own the backward (DeepSpeed: ``engine.backward``).
        sample_groups: optional ``[B]`` GRPO group of each sample (ints, or e.g. the prompts). With routing
            (``0 < jagg_frac < 1``) a GRPO group's members are then routed together (see
            :func:`jagg.routing.route`), which keeps the JAGG error they share cancelling in their zero-sum
            advantages; unbiased JAGG (``correction_p``) then also picks whole GRPO groups. The trainers pass it;
            without it, single (sample, interval) pairs are routed and picked.
        generator: RNG of unbiased JAGG's random picks (default: torch's global RNG).
        only_steps: accumulate only the loss terms of these trained steps (diagnostics: the gradient of a step
            range). Knots, routing and picks are those of the whole trajectory, so the gradients of disjoint ranges
            sum to the full one. Statistics then cover those steps only.

    Returns:
        :class:`GradientStats`.
    """
    check_call(velocity_fn, traj, config, loss_scale, generator)
    traj.validate()
    B, T = traj.batch_size, traj.num_steps
    S = tuple(traj.latents.shape[2:])
    advantages = _as_advantages(advantages, B, traj.latents.device)
    if config.kl_beta > 0:
        if ref_velocities is None:
            raise ValueError("config.kl_beta > 0 needs ref_velocities [B, T, *S]; compute them once per rollout "
                             "with jagg.reference_velocities(ref_fn, traj)")
        if tuple(ref_velocities.shape) != (B, T, *S):
            raise ValueError(f"ref_velocities must have shape {(B, T, *S)}; got {tuple(ref_velocities.shape)}")
    backward_context = backward_context or (lambda last: contextlib.nullcontext())
    backward_fn = backward_fn or (lambda loss: loss.backward())

    norms = None
    if config.mode == "jagg" and config.knots == "adaptive":
        norms = _signal_norms(traj, advantages, config, ref_velocities)
    plan = plan_update(traj, config, sample_groups, norms, generator)
    units = plan.units
    if only_steps is not None:
        keep = {int(k) for k in only_steps}
        if not keep <= set(traj.train_steps.tolist()):
            raise ValueError(f"only_steps must be trained steps {traj.train_steps.tolist()}; got {sorted(keep)}")
        units = [Unit(u.sample, u.rows, [e for e in u.evals if e.step in keep]) for u in units]
        units = [u for u in units if u.evals]
    chunks = _pack(units, config.micro_batch)
    K = traj.train_steps.numel()
    c = loss_scale / (B * K)
    sig, lat, v_old = traj.sigmas, traj.latents, traj.velocities
    sigma_one = float(sig[1])
    dev = lat.device
    acc = torch.zeros(6, dtype=torch.float64, device=dev)   # loss, clipped, approx_kl, ratio, kl sums; count
    fwd_grad = fwd_nograd = n_calls = 0
    velocity = checked_velocity(velocity_fn, S)

    for ci, chunk in enumerate(chunks):
        # rows through the network with grad, and the evaluations (sample, step) whose loss the chunk covers
        row_b, row_k, ev_b, ev_k, ev_src, stat = [], [], [], [], [], []
        weights: list[tuple[int, int, float]] = []           # (row, eval, weight)
        inner: list[int] = []                                # evals needing a fresh/interp velocity
        for u in chunk:
            r0 = len(row_b)
            row_b += [u.sample] * len(u.rows)
            row_k += u.rows
            for e in u.evals:
                ei = len(ev_b)
                ev_b.append(u.sample)
                ev_k.append(e.step)
                weights += [(r0 + r, ei, w) for r, w in e.weights]
                ra, rb, al = e.source
                ev_src.append((r0 + ra, -1, 0.0) if rb < 0 else (r0 + ra, r0 + rb, al))
                stat.append(e.stat)
                if rb >= 0:
                    inner.append(ei)

        rb_t = torch.tensor(row_b, device=dev)
        rk_t = torch.tensor(row_k, device=dev)
        eb_t = torch.tensor(ev_b, device=dev)
        ek_t = torch.tensor(ev_k, device=dev)
        R, E = len(row_b), len(ev_b)

        src = torch.tensor(ev_src, dtype=torch.float64, device=dev)      # [E, 3]: row_a, row_b or -1, alpha
        inn = torch.tensor(inner, dtype=torch.long, device=dev)
        fresh = []
        if inner and config.intermediate == "fresh":                      # before the grad graph exists
            with torch.no_grad():                                        # micro_batch rows per call
                for part in inn.split(config.micro_batch):
                    fresh.append((part, velocity(lat[eb_t[part], ek_t[part]], sig[ek_t[part]], eb_t[part])))
                    n_calls += 1
            fwd_nograd += len(inner)

        with backward_context(ci == len(chunks) - 1):  # DDP: no_sync must cover the forward too
            v = velocity(lat[rb_t, rk_t], sig[rk_t], rb_t)                   # [R, *S], with grad
            fwd_grad += R
            n_calls += 1
            dtype = compute_dtype(v, lat)
            vd = v.detach().to(dtype)

            # velocities of every evaluation at the current parameters
            direct = src[:, 1] < 0
            v_eval = torch.empty((E, *S), dtype=dtype, device=dev)
            v_eval[direct] = vd[src[direct, 0].long()]
            if inner:
                if config.intermediate == "fresh":
                    for part, vp in fresh:
                        v_eval[part] = vp.to(dtype)
                else:
                    ra, rbb = src[inn, 0].long(), src[inn, 1].long()
                    al = src[inn, 2].to(dtype).view(-1, *([1] * len(S)))
                    ib = eb_t[inn]
                    va_old = v_old[ib, rk_t[ra]].to(dtype)
                    vb_old = v_old[ib, rk_t[rbb]].to(dtype)
                    v_eval[inn] = (v_old[ib, ek_t[inn]].to(dtype)
                                   + (1 - al) * (vd[ra] - va_old) + al * (vd[rbb] - vb_old))

            # upstream signals g = dl/dv through the loss head alone
            v_eval.requires_grad_(True)
            out = step_loss(
                v_eval, lat[eb_t, ek_t], lat[eb_t, ek_t + 1], sig[ek_t], sig[ek_t + 1], sigma_one, traj.eta,
                traj.log_probs[eb_t, ek_t], advantages[eb_t], config.clip_range, config.kl_beta,
                None if ref_velocities is None else ref_velocities[eb_t, ek_t], traj.logprob_reduction, traj.sde_type,
            )
            (g,) = torch.autograd.grad(out.loss.sum() * c, v_eval)             # [E, *S]
            w = torch.zeros(R, E, dtype=dtype, device=dev)
            wi = torch.tensor(weights, dtype=torch.float64, device=dev)
            w[wi[:, 0].long(), wi[:, 1].long()] = wi[:, 2].to(dtype)
            signal = (w @ g.flatten(1)).view(R, *S)                           # [R, *S]

            backward_fn((v.to(dtype) * signal).sum())

        old = traj.log_probs[eb_t, ek_t].to(out.log_prob.dtype)
        items = torch.stack([
            out.loss.detach(), out.clipped.to(out.ratio.dtype), 0.5 * (out.log_prob.detach() - old) ** 2,
            out.ratio, out.kl, torch.ones_like(out.ratio),
        ]).double()                                                             # [6, E]
        acc += items.sum(1) if all(stat) else items[:, torch.tensor(stat, device=dev)].sum(1)

    sums = (acc[:5] / acc[5].clamp_min(1)).tolist()                      # the one host sync
    return GradientStats(
        loss=sums[0], clip_frac=sums[1], approx_kl=sums[2], ratio_mean=sums[3], kl=sums[4],
        forward_grad_items=fwd_grad, forward_nograd_items=fwd_nograd, backward_items=fwd_grad,
        forward_calls=n_calls, backward_calls=len(chunks), groups=plan.eligible, groups_jagg=plan.routed,
        jagg_frac_routed=plan.routed / max(plan.eligible, 1), groups_corrected=plan.corrected,
    )


@torch.no_grad()
def reference_velocities(ref_fn: VelocityFn, traj: Trajectory, micro_batch: int = 8) -> Tensor:
    """Reference-policy velocities ``[B, T, *S]`` at every trained step (zeros elsewhere).

    The reference never changes during training: compute this once per rollout and pass it to every
    :func:`policy_gradient` call of that rollout.
    """
    B = traj.batch_size
    out = torch.zeros_like(traj.velocities)
    pairs = [(i, k) for k in traj.train_steps.tolist() for i in range(B)]
    for s in range(0, len(pairs), micro_batch):
        b, k = (torch.tensor(x, device=traj.latents.device) for x in zip(*pairs[s : s + micro_batch]))
        out[b, k] = checked_velocity(ref_fn, tuple(traj.latents.shape[2:]), "ref_fn")(
            traj.latents[b, k], traj.sigmas[k], b).to(out.dtype)
    return out
