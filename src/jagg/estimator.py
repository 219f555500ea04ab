"""The policy-gradient estimators: ``exact`` (one backward per trained step), ``jagg`` (knots, see :mod:`jagg.knots`)
and ``subsample``.

:func:`policy_gradient` is the drop-in replacement for the per-step forward/backward loop of a Flow-GRPO
update. It accumulates into ``.grad`` exactly what ``L.backward()`` would for

    L = loss_scale / (B |K|) * sum_{i, k in K} l_{i,k}        (l from :func:`jagg.sde.step_loss`)

in ``exact`` mode (and an estimate of it otherwise), and returns statistics. Every mode runs the same five phases
(the words: docs/design.md §0):

1. *plan* (:func:`plan`): :func:`jagg.knots.plan_update` lays out *bundles*: rows ``(i, k)`` that go through the
   network together (an exact step: one row; a JAGG interval or chain of shared knots: its knot rows) and the loss
   *terms* they cover;
2. *pack* (:func:`pack`): bundles are packed into chunks of at most ``micro_batch`` rows (a bundle is never split),
   and each chunk into index tensors (:class:`Chunk`);
3. *signals* (:func:`term_velocities`, :func:`row_signals`): per chunk, the velocity of every term at the current
   parameters (a knot's own row; an inner step ``fresh`` or ``interp``), its upstream signal
   ``g_{i,k} = dl_{i,k}/dv_{i,k}`` by autograd through the loss head alone on detached velocities, and the row
   signals ``G_row = sum_k w_{row,k} g_k`` (a knot's own step: ``w = 1``; an inner step: ``1 - alpha_k`` on ``a``,
   ``alpha_k`` on ``b``);
4. *backward* (:func:`backward_chunk`): one forward with grad of the chunk's rows and one backward of the scalar
   ``sum(v * G)``, whose gradient is ``sum_row J_row^T G_row``;
5. *stats* (:func:`chunk_sums`, :func:`gradient_stats`): loss, clip fraction, KL and counters, summed on the device
   and read once.

Inner-step velocities are ``fresh`` (one no-grad forward of the chunk's inner rows), ``interp``
(``v_k_old + (1 - alpha_k)(v_a - v_a_old) + alpha_k (v_b - v_b_old)``, no forward) or ``stale`` (``v_k_old``, no
forward: ratio 1 at the inner steps). ``interp`` and ``stale`` are exact only on-policy, at the parameters the
trajectory was sampled with; ``intermediate="auto"`` (:func:`inner_velocities`) uses ``interp`` there and ``fresh``
in off-policy updates, where the extrapolation's error would enter the inner steps' ratios and clip decisions
(docs/design.md §3.3).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager, Sequence

import numpy as np
import torch
from torch import Tensor

from .checks import as_vector, check_callable, check_count, check_tensor, is_finite_number, shown
from .estimator_config import AUTO_INTERMEDIATE, EstimatorConfig
from .knots import Bundle, Plan, plan_update, unit_rows
from .sde import CLIP_DROP, CLIP_KEEP, CLIP_OWN, StepLoss, compute_dtype, group_clip, step_loss
from .trajectory import VELOCITY_SIGNATURE, Trajectory, VelocityFn, checked_velocity, velocity_shape_error


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
        intervals: the samples' intervals JAGG could take (intervals with inner steps, outside the exact first/last;
            one sample's interval counts once, so at most ``B`` x the eligible intervals).
        intervals_jagg: of those, routed to JAGG.
        jagg_frac_routed: ``intervals_jagg / intervals`` (0 when no interval is eligible).
        intervals_corrected: of the routed ones, those also run exactly by unbiased JAGG (``correction_p``).
        intervals_drawn: the samples' intervals whose terms were trained: ``B`` x ``round(interval_frac n)`` of the
            ``n`` intervals of the layout (single steps where none applies); ``intervals``, ``intervals_jagg`` and
            ``intervals_corrected`` count drawn intervals only.
        dropped_frac: fraction of (sample, step) items whose policy gradient the clip zeroed: by PPO's rule (the
            ratio beyond the range on the side its advantage favours, a part of ``clip_frac``'s items), or at a JAGG
            interval's inner steps by ``inner_clip``'s decision (:func:`clip_decisions`).
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
    intervals: int
    intervals_jagg: int
    jagg_frac_routed: float
    intervals_corrected: int = 0
    intervals_drawn: int = 0
    dropped_frac: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """One chunk's bundles as index tensors (on the trajectory's device): ``R`` rows through the network with grad
    and the ``E`` loss terms they cover.

    Attributes:
        row_sample, row_step: ``[R]`` sample and trained step of each row.
        term_sample, term_step: ``[E]`` sample and trained step of each term.
        term_source: ``[E, 3]`` float64: ``(row_a, row_b, alpha)``; ``row_b = -1`` for a term on its own row
            ``row_a``, else the term is an inner step between the rows ``row_a`` and ``row_b``.
        inner: ``[n]`` the terms that are inner steps (``fresh`` or ``interp`` velocities).
        weights: ``[W, 3]`` float64: ``(row, term, weight)``: the term's signal goes to the row's with that weight.
        counted: ``[E]`` bool, the terms counted in the statistics, or None when all are.
    """

    row_sample: Tensor
    row_step: Tensor
    term_sample: Tensor
    term_step: Tensor
    term_source: Tensor
    inner: Tensor
    weights: Tensor
    counted: Tensor | None

    @property
    def rows(self) -> int:
        return self.row_sample.numel()

    @property
    def terms(self) -> int:
        return self.term_sample.numel()


@dataclass
class _Counters:
    """Rows and network calls of one :func:`policy_gradient` call, and the device-side sums of its statistics
    (loss, clipped, approx_kl, ratio, kl, dropped; count of terms)."""

    sums: Tensor
    forward_grad: int = 0
    forward_nograd: int = 0
    calls: int = 0


# ----------------------------------------------------------------------------- checks


def check_call(velocity_fn, traj, config, loss_scale: float = 1.0, generator=None, backward_context=None,
               backward_fn=None) -> None:
    """The argument types every estimator entry point needs, checked before any work, with what was expected; the
    trajectory's tensors fit together and hold at least one sample (:meth:`Trajectory.validate`)."""
    for name, fn, signature in (("backward_context", backward_context, "(is_last) -> a context manager, or None"),
                                ("backward_fn", backward_fn, "(the chunk's scalar surrogate) -> None, or None")):
        if fn is not None:
            check_callable(fn, name, signature)
    check_callable(velocity_fn, "velocity_fn", VELOCITY_SIGNATURE)
    if not isinstance(traj, Trajectory):
        raise TypeError(f"traj must be a jagg.Trajectory (from jagg.sample_trajectories); got {type(traj).__name__}")
    if not isinstance(config, EstimatorConfig):
        raise TypeError(f"config must be a jagg.EstimatorConfig (EstimatorConfig.from_dict(d) for a dict); "
                        f"got {type(config).__name__}")
    if config.mode == "auto":
        raise ValueError("config.mode 'auto' is the trainers' choice at a run's start (jagg.trainers.auto); give "
                         "policy_gradient the estimator it chose: mode 'exact', 'jagg' or 'subsample'")
    if not is_finite_number(loss_scale):
        raise ValueError(f"loss_scale must be a finite number; got {loss_scale!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    traj.validate()


def check_batch_arguments(traj: Trajectory, config: EstimatorConfig, advantages, ref_velocities,
                          prompt_groups) -> Tensor:
    """The per-sample arguments of one update checked against the trajectory's ``B`` samples before any work:
    ``advantages`` ``[B]`` finite (returned as a tensor), ``ref_velocities`` (:func:`_check_reference`) and
    ``prompt_groups`` ``[B]``."""
    B = traj.batch_size
    advantages = _as_advantages(advantages, B, traj.latents.device)
    _check_reference(ref_velocities, traj, config)
    if prompt_groups is not None:
        if isinstance(prompt_groups, (str, bytes)) or not hasattr(prompt_groups, "__len__"):
            raise TypeError(f"prompt_groups must be None or [B] = [{B}] prompt group ids; got "
                            f"{type(prompt_groups).__name__}")
        n = prompt_groups.numel() if isinstance(prompt_groups, Tensor) else len(prompt_groups)
        if n != B:
            raise ValueError(f"prompt_groups must have one prompt group per sample, [B] = [{B}]; got {n}")
    return advantages


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


def _check_reference(ref_velocities: Tensor | None, traj: Trajectory, config: EstimatorConfig) -> None:
    """Reference velocities ``[B, T, *S]`` (the shape of the rollout's velocities) are needed when ``config.kl_beta
    > 0``, and whenever given (with ``kl_beta`` 0 too: a wrong one is an argument in the wrong place) must be a
    tensor of that shape, finite wherever the rollout's velocities are (one check a call)."""
    shape = tuple(traj.velocities.shape)
    if ref_velocities is None:
        if config.kl_beta > 0:
            raise ValueError("config.kl_beta > 0 needs ref_velocities [B, T, *S]; compute them once per rollout "
                             "with jagg.reference_velocities(ref_fn, traj)")
        return
    check_tensor(ref_velocities, "ref_velocities", f"[B, T, *S] = {list(shape)}")
    if tuple(ref_velocities.shape) != shape:
        raise ValueError(f"ref_velocities must have shape [B, T, *S] = {shape} (the rollout's velocities'); got "
                         f"{tuple(ref_velocities.shape)}")
    bad = ~torch.isfinite(ref_velocities) & torch.isfinite(traj.velocities)           # [B, T, *S]
    if bool(bad.any()):                     # one sync a call; where the rollout itself is not finite, neither is the
        raise ValueError(f"ref_velocities must be finite where the rollout's velocities are; {int(bad.sum())} of "
                         f"its {bad.numel()} entries are NaN or infinite there (the reference policy's velocities: "
                         "a NaN would flow into every gradient through the KL)")   # loss, and trainers skip it


# ----------------------------------------------------------------------------- phase 1: plan


@dataclass
class UpdateInputs:
    """What every phase of one :func:`policy_gradient` call reads: the velocity callable, the trajectory, the
    advantages ``[B]``, the configuration, the reference velocities and ``term_weight``, the weight of one term
    ``l_{i,k}`` in the loss ``L`` (``loss_scale / (B |K|)``); ``inner``, how this update computes inner-step
    velocities (``fresh``, ``interp`` or ``stale``: :func:`inner_velocities`); and ``dtype``, the update's compute dtype (the
    trajectory's, as sampling stores it: fp32, or fp64 when the trajectory is fp64), set once for every chunk;
    ``decisions``, the ``[B, T]`` clip decisions of ``config.inner_clip`` (:func:`clip_decisions`; None: PPO's own)."""

    velocity_fn: VelocityFn
    traj: Trajectory
    advantages: Tensor
    config: EstimatorConfig
    ref_velocities: Tensor | None
    term_weight: float
    inner: str = "interp"
    dtype: torch.dtype = field(init=False)
    decisions: Tensor | None = None

    def __post_init__(self):
        self.dtype = compute_dtype(self.traj.latents)

    def velocity(self, sample: Tensor, step: Tensor) -> Tensor:
        """One network call: the velocities ``[n, *S]`` of the rows ``(sample, step)``, checked to have exactly the
        latents' shape (:func:`jagg.trajectory.velocity_shape_error`)."""
        x = self.traj.latents[sample, step]
        v = self.velocity_fn(x, self.traj.sigmas[step], sample)
        if not isinstance(v, Tensor) or v.shape != x.shape:
            raise velocity_shape_error(self.velocity_fn, v, x)
        return v

    def losses(self, v: Tensor, sample: Tensor, step: Tensor) -> StepLoss:
        """The loss head (:func:`jagg.sde.step_loss`) of the terms ``(sample, step)`` at velocities ``v``."""
        t, c, ref, dec = self.traj, self.config, self.ref_velocities, self.decisions
        lat, sig = t.latents, t.sigmas
        return step_loss(v, lat[sample, step], lat[sample, step + 1], sig[step], sig[step + 1], float(sig[1]), t.eta,
                         t.log_probs[sample, step], self.advantages[sample], c.clip_range, c.kl_beta,
                         None if ref is None else ref[sample, step], t.logprob_reduction, t.sde_type,
                         None if dec is None else dec[sample, step])


def plan(inputs: UpdateInputs, prompt_groups, generator: torch.Generator | None,
         only_steps: Sequence[int] | None) -> tuple[Plan, list[Bundle]]:
    """Phase 1: the update's :class:`~jagg.knots.Plan` and its bundles, restricted to the terms of ``only_steps`` when
    given."""
    traj, config = inputs.traj, inputs.config
    update = plan_update(traj, config, prompt_groups, generator)
    if only_steps is None:
        return update, update.bundles
    if isinstance(only_steps, (str, bytes)) or not hasattr(only_steps, "__iter__"):
        raise TypeError(f"only_steps must be None or a sequence of trained steps; got {type(only_steps).__name__}")
    keep = {int(k) for k in only_steps}
    if not keep:
        raise ValueError("only_steps is empty: give some of the trained steps "
                         f"{shown(traj.train_steps, 200)} (None: all of them)")
    if not keep <= set(traj.train_steps.tolist()):
        raise ValueError(f"only_steps must be trained steps {shown(traj.train_steps, 200)}; got "
                         f"{shown(sorted(keep), 200)}")
    bundles = [Bundle(b.sample, b.rows, [t for t in b.terms if t.step in keep]) for b in update.bundles]
    return update, [b for b in bundles if b.terms]


# ----------------------------------------------------------------------------- phase 2: pack


def pack(bundles: list[Bundle], micro_batch: int) -> list[list[Bundle]]:
    """Phase 2: greedy packing into chunks of at most ``micro_batch`` rows (a bundle is never split)."""
    chunks, cur, rows = [], [], 0
    for b in bundles:
        n = len(b.rows)
        if cur and rows + n > micro_batch:
            chunks.append(cur)
            cur, rows = [], 0
        cur.append(b)
        rows += n
    return chunks + ([cur] if cur else [])


def chunk_tensors(chunk: list[Bundle], device) -> Chunk:
    """Phase 2: one chunk's bundles as index tensors: their rows one after another, each bundle's row numbers and
    term sources shifted by the rows before it."""
    row_sample, row_step, term_sample, term_step, source, counted, weights, inner = [], [], [], [], [], [], [], []
    for b in chunk:
        first = len(row_sample)                              # the bundle's first row in the chunk
        row_sample += [b.sample] * len(b.rows)
        row_step += b.rows
        for t in b.terms:
            term = len(term_sample)
            term_sample.append(b.sample)
            term_step.append(t.step)
            weights += [(first + r, term, w) for r, w in t.weights]
            row_a, row_b, alpha = t.source
            source.append((first + row_a, -1, 0.0) if row_b < 0 else (first + row_a, first + row_b, alpha))
            counted.append(t.counted)
            if row_b >= 0:
                inner.append(term)
    as_long = lambda values: torch.tensor(values, device=device)
    as_f64 = lambda values: torch.tensor(values, dtype=torch.float64, device=device)
    return Chunk(as_long(row_sample), as_long(row_step), as_long(term_sample), as_long(term_step), as_f64(source),
                 torch.tensor(inner, dtype=torch.long, device=device), as_f64(weights),
                 None if all(counted) else torch.tensor(counted, device=device))


# ----------------------------------------------------------------------------- phase 3: signals


@torch.no_grad()
def fresh_velocities(inputs: UpdateInputs, ch: Chunk) -> list[tuple[Tensor, Tensor]]:
    """``intermediate="fresh"``: ``(terms, velocities)`` of the chunk's inner steps, one no-grad forward per
    ``micro_batch`` of them (run before the chunk's graph exists)."""
    out = []
    for part in ch.inner.split(inputs.config.micro_batch):
        out.append((part, inputs.velocity(ch.term_sample[part], ch.term_step[part])))
    return out


def inner_forwards(inputs: UpdateInputs, ch: Chunk, counters: "_Counters") -> list[tuple[Tensor, Tensor]]:
    """The chunk's ``fresh`` inner velocities (:func:`fresh_velocities`), counted, when this update runs them; else
    ``[]``."""
    if not ch.inner.numel() or inputs.inner != "fresh":
        return []
    out = fresh_velocities(inputs, ch)
    counters.calls += len(out)
    counters.forward_nograd += ch.inner.numel()
    return out


@torch.no_grad()
def inner_ratios(inputs: UpdateInputs, chunks: list[Chunk], fresh: list[list[tuple[Tensor, Tensor]]]) -> Tensor:
    """The ratios ``[n]`` of the chunks' inner terms, in order, at the velocities the update gives them before any
    backward: ``fresh`` (the chunks' no-grad forwards, ``fresh``) or ``stale`` (the rollout's)."""
    ratios = []
    for ch, parts in zip(chunks, fresh):
        if inputs.inner == "stale":
            s, k = ch.term_sample[ch.inner], ch.term_step[ch.inner]
            ratios.append(inputs.losses(inputs.traj.velocities[s, k], s, k).ratio)
        ratios += [inputs.losses(v, ch.term_sample[part], ch.term_step[part]).ratio for part, v in parts]
    return torch.cat(ratios)


def clip_decisions(inputs: UpdateInputs, chunks: list[Chunk], fresh: list[list[tuple[Tensor, Tensor]]] | None,
                   prompt_groups: Tensor | Sequence | None) -> Tensor | None:
    """Phase 3: ``[B, T]`` int8, the clip decision (:data:`jagg.sde.CLIP_OWN`, ``CLIP_KEEP``, ``CLIP_DROP``) of each
    (sample, step) item under ``config.inner_clip``; None for ``step`` (PPO's own everywhere). The items at a JAGG
    interval's inner steps (a corrected inner step's own row included: the same item) are kept unclipped (``none``) or
    decided together per prompt group (``prompt_groups``' units, :func:`jagg.knots.unit_rows`) and step by
    :func:`jagg.sde.group_clip` (``group``) from :func:`inner_ratios` (``fresh``: every chunk's forwards, run first);
    with ``interp``, whose velocities exist only after the knots' forward with grad, they are kept (``auto`` runs it
    on-policy only, where every ratio is 1). Every other item keeps PPO's own clip."""
    mode = inputs.config.inner_clip
    if mode == "step" or not any(ch.inner.numel() for ch in chunks):
        return None
    sample = torch.cat([ch.term_sample[ch.inner] for ch in chunks])             # [n] the inner items
    step = torch.cat([ch.term_step[ch.inner] for ch in chunks])
    out = torch.full(tuple(inputs.traj.log_probs.shape), CLIP_OWN, dtype=torch.int8, device=sample.device)
    out[sample, step] = CLIP_KEEP
    if mode == "none" or inputs.inner == "interp":
        return out
    ratio = inner_ratios(inputs, chunks, fresh if fresh is not None else [[] for _ in chunks])
    units = unit_rows(prompt_groups, out.shape[0])                                # [B] on the CPU
    group = units.to(sample.device)[sample] * out.shape[1] + step                # one group per (unit, step)
    drop = group_clip(ratio, inputs.advantages[sample], group, inputs.config.clip_range,
                      (int(units.max()) + 1) * out.shape[1])
    out[sample, step] = torch.where(drop, CLIP_DROP, CLIP_KEEP).to(torch.int8)
    return out


def term_velocities(v_rows: Tensor, inputs: UpdateInputs, ch: Chunk, fresh: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Phase 3: the velocity ``[E, *S]`` (detached, in the compute dtype of ``v_rows``) of every term at the current
    parameters: a knot's own row output; an inner step's ``fresh`` forward, its ``interp`` first-order update of
    the rollout velocity ``v_k_old + (1 - alpha_k)(v_a - v_a_old) + alpha_k (v_b - v_b_old)``, or its ``stale`` rollout
    velocity ``v_k_old``."""
    dtype, S = v_rows.dtype, tuple(v_rows.shape[1:])
    own = ch.term_source[:, 1] < 0
    v = torch.empty((ch.terms, *S), dtype=dtype, device=v_rows.device)
    v[own] = v_rows[ch.term_source[own, 0].long()]
    if not ch.inner.numel():
        return v
    if inputs.inner == "fresh":
        for part, vp in fresh:
            v[part] = vp.to(dtype)
        return v
    if inputs.inner == "stale":                              # the rollout's own velocities: ratio 1 at every inner step
        v[ch.inner] = inputs.traj.velocities[ch.term_sample[ch.inner], ch.term_step[ch.inner]].to(dtype)
        return v
    row_a, row_b = ch.term_source[ch.inner, 0].long(), ch.term_source[ch.inner, 1].long()
    alpha = ch.term_source[ch.inner, 2].to(dtype).view(-1, *([1] * len(S)))
    sample, v_old = ch.term_sample[ch.inner], inputs.traj.velocities
    va_old = v_old[sample, ch.row_step[row_a]].to(dtype)
    vb_old = v_old[sample, ch.row_step[row_b]].to(dtype)
    v[ch.inner] = (v_old[sample, ch.term_step[ch.inner]].to(dtype)
                   + (1 - alpha) * (v_rows[row_a] - va_old) + alpha * (v_rows[row_b] - vb_old))
    return v


def row_signals(v_terms: Tensor, inputs: UpdateInputs, ch: Chunk) -> tuple[Tensor, StepLoss]:
    """Phase 3: the upstream signals ``g = term_weight * dl/dv`` of the terms, by autograd through the loss head
    alone, gathered into the rows' signals ``G = W g`` ``[R, *S]``; also the terms' losses (for the statistics)."""
    v_terms.requires_grad_(True)
    out = inputs.losses(v_terms, ch.term_sample, ch.term_step)
    (g,) = torch.autograd.grad(out.loss.sum() * inputs.term_weight, v_terms)     # [E, *S]
    w = torch.zeros(ch.rows, ch.terms, dtype=v_terms.dtype, device=v_terms.device)
    w[ch.weights[:, 0].long(), ch.weights[:, 1].long()] = ch.weights[:, 2].to(v_terms.dtype)
    return (w @ g.flatten(1)).view(ch.rows, *v_terms.shape[1:]), out


# ----------------------------------------------------------------------------- phase 4: backward


def backward_chunk(inputs: UpdateInputs, ch: Chunk, fresh: list[tuple[Tensor, Tensor]],
                   backward_fn: Callable[[Tensor], None], counters: _Counters) -> StepLoss:
    """Phase 4: one forward with grad of the chunk's rows, their signals (phase 3), and one backward of the scalar
    surrogate ``sum(v * G)``, whose gradient is ``sum_row J_row^T G_row``. Returns the terms' losses."""
    v = inputs.velocity(ch.row_sample, ch.row_step)                                     # with grad
    counters.forward_grad += ch.rows
    counters.calls += 1
    v_terms = term_velocities(v.detach().to(inputs.dtype), inputs, ch, fresh)
    signal, out = row_signals(v_terms, inputs, ch)
    backward_fn((v.to(inputs.dtype) * signal).sum())
    return out


# ----------------------------------------------------------------------------- phase 5: stats


def chunk_sums(out: StepLoss, traj: Trajectory, ch: Chunk) -> Tensor:
    """Phase 5: ``[7]`` float64 sums over the chunk's counted terms of loss, clipped, approx_kl, ratio, kl, dropped,
    and their count (on the device: no sync)."""
    old = traj.log_probs[ch.term_sample, ch.term_step].to(out.log_prob.dtype)
    items = torch.stack([
        out.loss.detach(), out.clipped.to(out.ratio.dtype), 0.5 * (out.log_prob.detach() - old) ** 2,
        out.ratio, out.kl, out.dropped.to(out.ratio.dtype), torch.ones_like(out.ratio),
    ]).double()                                                             # [7, E]
    return items.sum(1) if ch.counted is None else items[:, ch.counted].sum(1)


def gradient_stats(update: Plan, counters: _Counters, chunks: int) -> GradientStats:
    """Phase 5: the call's :class:`GradientStats` (the one host sync: the means of the summed statistics)."""
    sums = counters.sums
    means = (sums[:6] / sums[6].clamp_min(1)).tolist()
    return GradientStats(
        loss=means[0], clip_frac=means[1], approx_kl=means[2], ratio_mean=means[3], kl=means[4],
        forward_grad_items=counters.forward_grad, forward_nograd_items=counters.forward_nograd,
        backward_items=counters.forward_grad, forward_calls=counters.calls, backward_calls=chunks,
        intervals=update.eligible, intervals_jagg=update.routed,
        jagg_frac_routed=update.routed / max(update.eligible, 1), intervals_corrected=update.corrected,
        intervals_drawn=update.drawn, dropped_frac=means[5],
    )


# ----------------------------------------------------------------------------- the call


def inner_velocities(config: EstimatorConfig, on_policy: bool | None) -> str:
    """How one update computes its inner steps' velocities: ``"fresh"``, ``"interp"`` or ``"stale"``. ``"auto"``
    gives ``interp`` when ``on_policy`` is True (the parameters the trajectory was sampled with: ``interp`` is exact
    there and costs no forward) and ``fresh`` otherwise (False, or None: not known). ``interp`` asked for in an update
    known to be off-policy warns: its first-order extrapolation's error then enters the inner steps' ratios and clip
    decisions (with Flow-GRPO's clip range 1e-4 it clips many terms exact would not)."""
    if on_policy is not None and not isinstance(on_policy, bool):
        raise TypeError(f"on_policy must be True, False or None; got {type(on_policy).__name__}")
    if config.intermediate == AUTO_INTERMEDIATE:
        return "interp" if on_policy else "fresh"
    if config.intermediate == "interp" and on_policy is False and config.mode == "jagg":
        warnings.warn("intermediate='interp' in an off-policy update (after an optimizer step on this rollout): the "
                      "inner steps' velocities are extrapolated, and their error enters the ratios and clipping; use "
                      "intermediate='auto' (interp on-policy, fresh off-policy) or 'fresh'", stacklevel=3)
    return config.intermediate



def policy_gradient(
    velocity_fn: VelocityFn,
    traj: Trajectory,
    advantages: Tensor | Sequence[float],
    config: EstimatorConfig,
    ref_velocities: Tensor | None = None,
    loss_scale: float = 1.0,
    backward_context: Callable[[bool], ContextManager] | None = None,
    backward_fn: Callable[[Tensor], None] | None = None,
    prompt_groups: Tensor | Sequence | None = None,
    generator: torch.Generator | None = None,
    only_steps: Sequence[int] | None = None,
    on_policy: bool | None = None,
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
        prompt_groups: optional ``[B]`` prompt group of each sample (ints, or e.g. the prompts). Routing
            (``0 < jagg_frac < 1``) and unbiased JAGG's picks (``correction_p``) then decide per (prompt group,
            interval) unit (see :func:`jagg.knots.route`), which keeps the JAGG error a prompt group's samples share
            cancelling in their zero-sum advantages, and so does ``inner_clip="group"`` (one clip decision per prompt
            group and inner step). The trainers pass it; without it, a unit is (sample, interval).
        generator: RNG of the random choices: unbiased JAGG's picks and the intervals drawn (``interval_frac``)
            (default: torch's global RNG).
        only_steps: accumulate only the loss terms of these trained steps (diagnostics: the gradient of a step
            range). Knots, routing, picks and draws are those of the whole trajectory, so the gradients of disjoint
            ranges sum to the full one. Statistics then cover those steps only.
        on_policy: whether the parameters are those the trajectory was sampled with (True: the first update after
            sampling; False: after an optimizer step on it; None: not known): :func:`inner_velocities`.

    Returns: :class:`GradientStats`.
    """
    check_call(velocity_fn, traj, config, loss_scale, generator, backward_context, backward_fn)
    B = traj.latents.shape[0]
    advantages = check_batch_arguments(traj, config, advantages, ref_velocities, prompt_groups)
    inputs = UpdateInputs(velocity_fn, traj, advantages, config, ref_velocities,
                          loss_scale / (B * traj.train_steps.numel()), inner_velocities(config, on_policy))
    backward_context = backward_context or (lambda last: contextlib.nullcontext())
    backward_fn = backward_fn or (lambda loss: loss.backward())

    update, bundles = plan(inputs, prompt_groups, generator, only_steps)
    chunks = [chunk_tensors(b, traj.latents.device) for b in pack(bundles, config.micro_batch)]
    counters = run_chunks(inputs, chunks, prompt_groups, backward_context, backward_fn)
    return gradient_stats(update, counters, len(chunks))


def run_chunks(inputs: UpdateInputs, chunks: list[Chunk], prompt_groups: Tensor | Sequence | None,
               backward_context: Callable[[bool], ContextManager], backward_fn: Callable[[Tensor], None]) -> _Counters:
    """Phases 3 to 5: the clip decisions of ``inner_clip`` (:func:`clip_decisions`; for ``group`` every chunk's
    ``fresh`` inner velocities first), then for each chunk in turn its ``fresh`` inner velocities (before the chunk's
    graph exists, unless they ran first), the forward and backward inside ``backward_context(is_last)``, and its
    statistics' sums."""
    counters = _Counters(torch.zeros(7, dtype=torch.float64, device=inputs.traj.latents.device))
    early = inputs.config.inner_clip == "group" and inputs.inner == "fresh"     # the group decides before backward
    fresh = [inner_forwards(inputs, ch, counters) for ch in chunks] if early else None
    inputs.decisions = clip_decisions(inputs, chunks, fresh, prompt_groups)
    for n, ch in enumerate(chunks):
        velocities = fresh[n] if fresh is not None else inner_forwards(inputs, ch, counters)
        with backward_context(n == len(chunks) - 1):       # DDP: no_sync must cover the forward too
            out = backward_chunk(inputs, ch, velocities, backward_fn, counters)
        counters.sums += chunk_sums(out, inputs.traj, ch)
    return counters


@torch.no_grad()
def reference_velocities(ref_fn: VelocityFn, traj: Trajectory, micro_batch: int = 8) -> Tensor:
    """Reference-policy velocities ``[B, T, *S]`` at every trained step (zeros elsewhere).

    The reference never changes during training: compute this once per rollout and pass it to every
    :func:`policy_gradient` call of that rollout. ``ref_fn``: a velocity callable of the reference policy
    (:data:`jagg.trajectory.VELOCITY_SIGNATURE`); ``micro_batch``: rows per call, an integer >= 1.
    """
    check_callable(ref_fn, "ref_fn", VELOCITY_SIGNATURE)
    if not isinstance(traj, Trajectory):
        raise TypeError(f"traj must be a jagg.Trajectory (from jagg.sample_trajectories); got {type(traj).__name__}")
    traj.validate()
    micro_batch = check_count(micro_batch, "micro_batch")
    B = traj.batch_size
    out = torch.zeros_like(traj.velocities)
    pairs = [(i, k) for k in traj.train_steps.tolist() for i in range(B)]
    for s in range(0, len(pairs), micro_batch):
        b, k = (torch.tensor(x, device=traj.latents.device) for x in zip(*pairs[s : s + micro_batch]))
        out[b, k] = checked_velocity(ref_fn, tuple(traj.latents.shape[2:]), "ref_fn")(
            traj.latents[b, k], traj.sigmas[k], b).to(out.dtype)
    return out
