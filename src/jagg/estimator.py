"""The policy-gradient estimators: ``exact`` (one backward per trained step) and ``jagg``.

:func:`policy_gradient` is the drop-in replacement for the per-step forward/backward loop of a Flow-GRPO
update. It accumulates into ``.grad`` exactly what ``L.backward()`` would for

    L = loss_scale / (B |K|) * sum_{i, k in K} l_{i,k}        (l from :func:`jagg.loss.step_loss`)

and returns statistics. Both modes share one machinery:

1. the trained (sample, step) items are split into *units*: an exact unit is one row ``(i, k)`` through the
   network; a JAGG unit is the two endpoint rows ``(i, a), (i, b)`` of one group of ``window`` steps;
2. units are packed into chunks of at most ``micro_batch`` rows (a unit is never split);
3. per chunk: one forward with grad of all rows; the upstream signal ``g_{i,k} = dl_{i,k}/dv_{i,k}`` of every
   step the chunk covers is computed by autograd through the loss head alone, on detached velocities;
   the row signals are ``G_row = sum_k w_{row,k} g_k`` (exact: ``w = 1``; JAGG: ``1 - alpha_k`` for ``a``,
   ``alpha_k`` for ``b``); one backward of the scalar ``sum(v * G)``, whose gradient is ``sum_row J_row^T G_row``.

Inner-step velocities of a JAGG group are ``fresh`` (one no-grad forward of the chunk's inner rows) or
``interp`` (``v_k_old + (1 - alpha_k)(v_a - v_a_old) + alpha_k (v_b - v_b_old)``, no forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager, Sequence

import torch
from torch import Tensor

from .estimator_config import EstimatorConfig
from .loss import step_loss
from .routing import group_alphas, group_scores, make_groups, route
from .sde import compute_dtype
from .trajectory import Trajectory, VelocityFn


@dataclass
class GradientStats:
    """What one call did. Counts are rows (batch items) through the network."""

    loss: float                 # L / loss_scale: mean per-item loss over the batch and trained steps
    clip_frac: float            # fraction of items whose ratio left [1 - eps, 1 + eps]
    approx_kl: float            # mean of 0.5 * (log pi - log pi_old)^2
    ratio_mean: float
    kl: float                   # mean KL to the reference (0 without one)
    forward_grad_items: int
    forward_nograd_items: int
    backward_items: int
    forward_calls: int          # network calls (with and without grad)
    backward_calls: int
    groups: int                 # (sample, group) pairs JAGG could take (groups of >= 3 steps)
    groups_jagg: int            # of those, routed to JAGG
    jagg_frac_routed: float     # groups_jagg / groups (0 when no group is eligible)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Unit:
    sample: int
    steps: list[int]            # the steps whose loss this unit covers
    jagg: bool                  # True: rows are the endpoints steps[0], steps[-1]


def _plan(traj: Trajectory, config: EstimatorConfig,
          sample_groups: Tensor | None = None) -> tuple[list[_Unit], int, int]:
    """Route (sample, group) pairs and return the units in execution order, #eligible pairs and #JAGG pairs."""
    steps = traj.train_steps.tolist()
    window = config.window if config.mode == "jagg" else 1
    groups = make_groups(steps, window)
    B, G = traj.batch_size, len(groups)
    # groups of 1 or 2 steps cost 1 or 2 rows either way and JAGG is exact on them: they run exact and
    # jagg_frac counts only groups where JAGG saves work
    eligible = torch.tensor([len(g) >= 3 for g in groups], dtype=torch.bool)
    if config.mode != "jagg":
        eligible[:] = False
    eligible[: config.exact_first_groups] = False
    if config.exact_last_groups:
        eligible[max(G - config.exact_last_groups, 0) :] = False
    if 0.0 < config.jagg_frac < 1.0:
        scores = group_scores(traj.velocities, traj.sigmas, groups, config.score).cpu()
    else:
        scores = torch.zeros(B, G)
    routed = route(scores, config.jagg_frac, eligible, sample_groups)     # [B, G]
    units = []
    for gi, group in enumerate(groups):                    # group-major, like Flow-GRPO's step loop
        units += [_Unit(i, group, True) for i in range(B) if routed[i, gi]]
        units += [_Unit(i, [k], False) for k in group for i in range(B) if not routed[i, gi]]
    return units, B * int(eligible.sum()), int(routed.sum())


def _pack(units: list[_Unit], micro_batch: int) -> list[list[_Unit]]:
    """Greedy packing into chunks of at most ``micro_batch`` rows (a JAGG unit has 2 rows)."""
    chunks, cur, rows = [], [], 0
    for u in units:
        n = 2 if u.jagg else 1
        if cur and rows + n > micro_batch:
            chunks.append(cur)
            cur, rows = [], 0
        cur.append(u)
        rows += n
    return chunks + ([cur] if cur else [])


def policy_gradient(
    velocity_fn: VelocityFn,
    traj: Trajectory,
    advantages: Tensor,
    config: EstimatorConfig,
    ref_velocities: Tensor | None = None,
    loss_scale: float = 1.0,
    backward_context: Callable[[bool], ContextManager] | None = None,
    backward_fn: Callable[[Tensor], None] | None = None,
    sample_groups: Tensor | Sequence | None = None,
) -> GradientStats:
    """Accumulate the Flow-GRPO policy gradient of one update into the parameters' ``.grad``.

    Args:
        velocity_fn: ``(latents [N, *S], sigma [N], sample_index [N] long) -> v [N, *S]`` at the current
            parameters, with grad enabled (guidance included; detach the unconditional branch if desired).
        traj: the stored :class:`~jagg.trajectory.Trajectory` (``B`` samples, ``T`` steps).
        advantages: ``[B]`` per-sample advantages.
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
            advantages. The trainers pass it; without it, routing picks single (sample, group) pairs.

    Returns:
        :class:`GradientStats`.
    """
    traj.validate()
    B, T = traj.batch_size, traj.num_steps
    S = tuple(traj.latents.shape[2:])
    advantages = advantages.detach().flatten().to(traj.latents.device)
    if advantages.numel() != B:
        raise ValueError(f"advantages must have shape [B] = [{B}]; got {tuple(advantages.shape)}")
    if config.kl_beta > 0:
        if ref_velocities is None:
            raise ValueError("config.kl_beta > 0 needs ref_velocities [B, T, *S]; compute them once per rollout "
                             "with jagg.reference_velocities(ref_fn, traj)")
        if tuple(ref_velocities.shape) != (B, T, *S):
            raise ValueError(f"ref_velocities must have shape {(B, T, *S)}; got {tuple(ref_velocities.shape)}")
    backward_context = backward_context or (lambda last: contextlib.nullcontext())
    backward_fn = backward_fn or (lambda loss: loss.backward())

    units, n_pairs, n_jagg = _plan(traj, config, sample_groups)
    chunks = _pack(units, config.micro_batch)
    K = traj.train_steps.numel()
    c = loss_scale / (B * K)
    sig, lat, v_old = traj.sigmas, traj.latents, traj.velocities
    sigma_one = float(sig[1])
    dev = lat.device
    acc = torch.zeros(5, dtype=torch.float64, device=dev)   # loss, clipped, approx_kl, ratio, kl sums
    fwd_grad = fwd_nograd = n_calls = 0

    for ci, chunk in enumerate(chunks):
        # rows through the network with grad, and the evaluations (sample, step) whose loss the chunk covers
        row_b, row_k, ev_b, ev_k, ev_src = [], [], [], [], []
        weights: list[tuple[int, int, float]] = []           # (row, eval, weight)
        inner: list[int] = []                                # evals needing a fresh/interp velocity
        for u in chunk:
            if not u.jagg:
                weights.append((len(row_b), len(ev_b), 1.0))
                ev_src.append((len(row_b), -1, 0.0))
                row_b.append(u.sample); row_k.append(u.steps[0])
                ev_b.append(u.sample); ev_k.append(u.steps[0])
                continue
            ra, rb = len(row_b), len(row_b) + 1
            row_b += [u.sample, u.sample]; row_k += [u.steps[0], u.steps[-1]]
            alphas = group_alphas(sig, u.steps).tolist()
            for j, (k, al) in enumerate(zip(u.steps, alphas)):
                e = len(ev_b)
                ev_b.append(u.sample); ev_k.append(k)
                weights += [(ra, e, 1.0 - al), (rb, e, al)]
                if j == 0:
                    ev_src.append((ra, -1, 0.0))
                elif j == len(u.steps) - 1:
                    ev_src.append((rb, -1, 0.0))
                else:
                    ev_src.append((ra, rb, al))
                    inner.append(e)

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
                    fresh.append((part, velocity_fn(lat[eb_t[part], ek_t[part]], sig[ek_t[part]], eb_t[part])))
                    n_calls += 1
            fwd_nograd += len(inner)

        with backward_context(ci == len(chunks) - 1):  # DDP: no_sync must cover the forward too
            v = velocity_fn(lat[rb_t, rk_t], sig[rk_t], rb_t)                # [R, *S], with grad
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
                None if ref_velocities is None else ref_velocities[eb_t, ek_t], traj.logprob_reduction,
            )
            (g,) = torch.autograd.grad(out.loss.sum() * c, v_eval)             # [E, *S]
            w = torch.zeros(R, E, dtype=dtype, device=dev)
            wi = torch.tensor(weights, dtype=torch.float64, device=dev)
            w[wi[:, 0].long(), wi[:, 1].long()] = wi[:, 2].to(dtype)
            signal = (w @ g.flatten(1)).view(R, *S)                           # [R, *S]

            backward_fn((v.to(dtype) * signal).sum())

        old = traj.log_probs[eb_t, ek_t].to(out.log_prob.dtype)
        acc += torch.stack([
            out.loss.detach().sum(), out.clipped.sum(), (0.5 * (out.log_prob.detach() - old) ** 2).sum(),
            out.ratio.sum(), out.kl.sum(),
        ]).double()

    n = B * K
    sums = (acc / n).tolist()                                            # the one host sync
    return GradientStats(
        loss=sums[0], clip_frac=sums[1], approx_kl=sums[2], ratio_mean=sums[3], kl=sums[4],
        forward_grad_items=fwd_grad, forward_nograd_items=fwd_nograd, backward_items=fwd_grad,
        forward_calls=n_calls, backward_calls=len(chunks), groups=n_pairs, groups_jagg=n_jagg,
        jagg_frac_routed=n_jagg / max(n_pairs, 1),
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
        out[b, k] = ref_fn(traj.latents[b, k], traj.sigmas[k], b).to(out.dtype)
    return out
