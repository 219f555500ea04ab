"""Knots: which rows of one Flow-GRPO update go through the network with grad, and with which weights.

Every estimator is a choice of *knots* per sample: trained steps whose rows go through the network with grad. A
trained step ``k`` lies at a knot (its upstream signal ``g_k`` goes to its own row with weight 1) or strictly between
two neighbouring knots ``a < k < b`` (weights ``1 - alpha_k`` on ``a``, ``alpha_k`` on ``b``). Cost = knot rows;
error = the piecewise-linear interpolation error of the parameter-Jacobian between knots.

- ``exact`` (``mode="exact"``): every trained step is a knot.
- ``groups`` (the paper): groups of ``window`` consecutive steps, each contributing its two endpoints.
- ``shared``: consecutive intervals share a knot: knots every ``window - 1`` steps,
  ``1 + ceil((K - 1) / (window - 1))`` rows per sample instead of ``2 ceil(K / window)``.
- ``adaptive``: as many knots as ``shared``, placed per batch where interpolation costs least, by dynamic programming
  over the proxy ``sum_i sum_{a<k<b} ||v_ik - chord_ik|| * ||g_ik||`` (stored velocities and the loss head's signals
  on them; no network call).

An *interval* is the run of trained steps ``[a, ..., b]`` between two neighbouring knots (for ``groups``: one group).
Routing (``jagg_frac``) sends the most linear intervals through JAGG; an interval routed exact makes all its steps
knots. *Unbiased JAGG* (``correction_p = p``): each JAGG interval is also run exactly with probability ``p`` (a random
subset of that expected size per update) and contributes ``(exact - interpolated) / p``, so the expected gradient is
the exact one; only the picked intervals' inner rows are extra.

:func:`plan_update` turns a trajectory and an :class:`~jagg.estimator_config.EstimatorConfig` into *units*: runs of
rows that go through the network together (a unit is never split across micro-batches) and the loss evaluations
they cover. :func:`jagg.estimator.policy_gradient` executes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .estimator_config import EstimatorConfig
from .routing import group_alphas, group_scores, make_groups, route


@dataclass
class Eval:
    """One (sample, step) loss evaluation inside a :class:`Unit`.

    Attributes:
        step: the trained step.
        source: where its velocity comes from: ``(row, -1, 0.0)`` = that row's output; ``(row_a, row_b, alpha)`` =
            the inner step between two knot rows (``fresh`` forward or ``interp`` from the rows and the rollout).
        weights: ``(row, weight)`` pairs: ``g`` of this evaluation goes to those rows' backward signal.
        stat: counted in the statistics (loss, clip fraction, ...). False for the interpolated copy of a corrected
            inner step, whose true evaluation (on its own row) is the one counted.
    """

    step: int
    source: tuple[int, int, float]
    weights: list[tuple[int, float]]
    stat: bool = True


@dataclass
class Unit:
    """Rows of one sample that go through the network together, and the evaluations they cover."""

    sample: int
    rows: list[int]                          # the knot steps, in order
    evals: list[Eval] = field(default_factory=list)

    @property
    def jagg(self) -> bool:
        return any(e.source[1] >= 0 for e in self.evals)


@dataclass
class Plan:
    """The units of one update and what routing and correction did.

    Attributes:
        units: in execution order.
        eligible: (sample, interval) pairs JAGG could take (intervals with inner steps, outside the exact first/last).
        routed: of those, routed to JAGG.
        corrected: of those routed, also run exactly (unbiased JAGG).
        knots: the interval boundaries per sample before routing: positions into the trained steps (``[M]``).
    """

    units: list[Unit]
    eligible: int
    routed: int
    corrected: int
    knots: list[int]


# ----------------------------------------------------------------------------- knot placement


def shared_knots(num_steps: int, window: int) -> list[int]:
    """Positions ``0, W-1, 2(W-1), ..., K-1`` into ``K = num_steps`` trained steps (knots every ``W - 1`` steps)."""
    if num_steps < 1 or window < 1:
        raise ValueError(f"need num_steps >= 1 and window >= 1; got {num_steps}, {window}")
    if window <= 2:
        return list(range(num_steps))
    pos = list(range(0, num_steps - 1, window - 1)) + [num_steps - 1]
    return sorted(set(pos))


def num_shared_knots(num_steps: int, window: int) -> int:
    """``1 + ceil((K - 1) / (W - 1))`` (``K`` for ``W <= 2``): the knots of ``shared`` and ``adaptive``."""
    return len(shared_knots(num_steps, window))


def interval_cost(velocities: Tensor, signal_norms: Tensor, sigmas: Tensor, alpha: str = "sigma") -> Tensor:
    """``[K, K]`` cost of an interval between trained-step positions ``a < b``: the proxy of its interpolation error.

    ``cost[a, b] = sum_i sum_{a<k<b} ||v_ik - ((1 - alpha_k) v_ia + alpha_k v_ib)|| * ||g_ik||``.

    Args:
        velocities: ``[B, K, D]`` rollout velocities at the trained steps.
        signal_norms: ``[B, K]`` norms of the upstream signals ``g_ik`` (any non-negative weights).
        sigmas: ``[K]`` sigmas of the trained steps.
        alpha: ``"sigma"`` or ``"index"`` (see :func:`jagg.routing.group_alphas`).
    """
    B, K, _ = velocities.shape
    v, w = velocities.double(), signal_norms.double().to(velocities.device)
    G = v @ v.transpose(1, 2)                                    # [B, K, K] Gram matrix: one pass over D
    d = G.diagonal(dim1=1, dim2=2)                               # [B, K] squared norms
    cost = torch.zeros(K, K, dtype=torch.float64)
    for a in range(K):
        for b in range(a + 2, K):
            al = group_alphas(sigmas, list(range(a, b + 1)), alpha).to(v.device)[1:-1]    # [m]
            ks = slice(a + 1, b)
            # ||v_k - (1 - al) v_a - al v_b||^2 from inner products, [B, m]
            r2 = (d[:, ks] + (1 - al) ** 2 * d[:, a, None] + al**2 * d[:, b, None] - 2 * (1 - al) * G[:, ks, a]
                  - 2 * al * G[:, ks, b] + 2 * al * (1 - al) * G[:, a, b, None])
            cost[a, b] = float((r2.clamp_min(0).sqrt() * w[:, ks]).sum())
    return cost


def adaptive_knots(cost: Tensor, num_knots: int) -> list[int]:
    """The ``num_knots`` positions (first and last included) minimising the summed ``cost[a, b]`` of the intervals.

    Dynamic programming over ``cost`` ``[K, K]`` (upper triangle; ``cost[a, a+1] = 0``). Ties break towards the
    earliest positions. ``num_knots >= K`` returns every position.
    """
    K = cost.shape[0]
    if num_knots >= K:
        return list(range(K))
    if num_knots < 2:
        raise ValueError(f"num_knots must be >= 2 when there are {K} > 1 trained steps; got {num_knots}")
    inf = math.inf
    c = cost.tolist()
    # best[m][j]: least cost of m + 1 knots from position 0 to j (j a knot)
    best = [[inf] * K for _ in range(num_knots)]
    back = [[-1] * K for _ in range(num_knots)]
    best[0][0] = 0.0
    for m in range(1, num_knots):
        for j in range(1, K):
            for i in range(j):
                if best[m - 1][i] < inf and best[m - 1][i] + c[i][j] < best[m][j]:
                    best[m][j], back[m][j] = best[m - 1][i] + c[i][j], i
    pos, j = [K - 1], K - 1
    for m in range(num_knots - 1, 0, -1):
        j = back[m][j]
        pos.append(j)
    return pos[::-1]


def intervals_of(steps: list[int], knots: str, window: int, positions: list[int] | None = None) -> list[list[int]]:
    """The intervals (runs of trained steps between neighbouring knots, ends included) of one layout.

    ``groups``: the groups of ``window`` (not sharing ends); ``shared``/``adaptive``: consecutive ``positions``.
    """
    if knots == "groups":
        return make_groups(steps, window)
    positions = shared_knots(len(steps), window) if positions is None else positions
    if len(positions) == 1:
        return [[steps[0]]]
    return [steps[a : b + 1] for a, b in zip(positions[:-1], positions[1:])]


# ----------------------------------------------------------------------------- the plan


def _pick(candidates: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """A uniformly random subset of the True entries of ``candidates``, each included with probability exactly ``p``:
    ``floor(p n)`` entries plus one more with probability ``frac(p n)``, without replacement."""
    idx = torch.nonzero(candidates.flatten()).flatten()
    n = idx.numel()
    out = torch.zeros(candidates.numel(), dtype=torch.bool)
    if n == 0 or p <= 0:
        return out.view_as(candidates)
    m = math.floor(p * n)
    if torch.rand((), generator=generator, dtype=torch.float32).item() < p * n - m:   # fp32 whatever the default dtype
        m += 1
    order = torch.randperm(n, generator=generator)
    out[idx[order[:m]]] = True
    return out.view_as(candidates)


def _units_of_chain(sample: int, chain: list[list[int]], alphas: list[list[float]], micro_batch: int,
                    scale: dict[int, float]) -> list[Unit]:
    """Units for one run of JAGG intervals sharing knots (``chain``: intervals ``[a, ..., b]``, consecutive ones
    sharing an end; ``alphas``: their interpolation coefficients). Split into pieces of at most ``micro_batch`` knots that overlap by one knot; a knot's own loss is
    counted in the first piece holding it. ``scale[j]`` (``1 - 1/p`` for a corrected interval) multiplies the weights
    of interval ``j``'s inner steps; their evaluations then do not count in the statistics."""
    units: list[Unit] = []
    start = 0
    n = len(chain)                                          # intervals; knots = n + 1
    per = max(micro_batch - 1, 1)                           # intervals per piece
    while start < n:
        part = chain[start : start + per]
        rows = [iv[0] for iv in part] + [part[-1][-1]]
        u = Unit(sample, rows)
        for r, iv in enumerate(part):
            if r == 0 and start == 0:
                u.evals.append(Eval(iv[0], (0, -1, 0.0), [(0, 1.0)]))
            s = scale.get(start + r, 1.0)
            for k, al in zip(iv[1:-1], alphas[start + r][1:-1]):
                u.evals.append(Eval(k, (r, r + 1, al), [(r, (1.0 - al) * s), (r + 1, al * s)], stat=s == 1.0))
            u.evals.append(Eval(iv[-1], (r + 1, -1, 0.0), [(r + 1, 1.0)]))
        units.append(u)
        start += per
    return units


def _single(sample: int, step: int, weight: float = 1.0) -> Unit:
    return Unit(sample, [step], [Eval(step, (0, -1, 0.0), [(0, weight)])])


def plan_update(traj, config: EstimatorConfig, sample_groups: Tensor | Sequence | None = None,
                signal_norms: Tensor | None = None, generator: torch.Generator | None = None) -> Plan:
    """Route, correct and lay out the rows of one update (see the module docstring).

    Args:
        traj: the :class:`~jagg.trajectory.Trajectory` (``B`` samples, trained steps ``[K]``).
        config: the estimator's configuration.
        sample_groups: optional ``[B]`` GRPO group of each sample: routing and correction then move a GRPO group's
            members together (see :func:`jagg.routing.route`).
        signal_norms: ``[B, K]`` norms of the upstream signals at the rollout velocities; needed by
            ``knots="adaptive"``.
        generator: RNG of the correction's random picks (``torch.rand`` / ``randperm`` on the CPU).
    """
    steps = traj.train_steps.tolist()
    B, K = traj.batch_size, len(steps)
    if config.mode == "subsample":
        return _subsample_plan(steps, B, config.subsample_frac, generator)
    sig = traj.sigmas
    jagg = config.mode == "jagg" and config.window > 2 and K > 2
    scheme = config.knots if jagg else "groups"
    window = config.window if jagg else 1
    positions = None
    if scheme == "adaptive":
        if signal_norms is None:
            raise ValueError("knots='adaptive' needs signal_norms [B, K]")
        D = traj.velocities[0, 0].numel()
        cost = interval_cost(traj.velocities[:, steps].reshape(B, K, D), signal_norms, sig[steps], config.alpha)
        positions = adaptive_knots(cost, num_shared_knots(K, window))
    intervals = intervals_of(steps, scheme, window, positions)
    if scheme == "groups":
        positions = sorted({steps.index(s) for iv in intervals for s in (iv[0], iv[-1])})
    G = len(intervals)

    # eligibility: intervals with inner steps; the exact first/last ones counted among those
    eligible = torch.tensor([len(iv) >= 3 for iv in intervals], dtype=torch.bool) & jagg
    idx = torch.nonzero(eligible).flatten().tolist()
    for j in idx[: config.exact_first_groups]:
        eligible[j] = False
    for j in (idx[len(idx) - config.exact_last_groups :] if config.exact_last_groups else []):
        eligible[j] = False
    if 0.0 < config.jagg_frac < 1.0:
        scores = group_scores(traj.velocities, sig, intervals, config.score, config.alpha).cpu()
    else:
        scores = torch.zeros(B, G, dtype=torch.float32)
    routed = route(scores, config.jagg_frac, eligible, sample_groups)          # [B, G]

    # unbiased JAGG: pick (GRPO group or sample, interval) units among the routed ones
    corrected = torch.zeros(B, G, dtype=torch.bool)
    p = config.correction_p
    if p > 0 and bool(routed.any()):
        scope = torch.zeros(G, dtype=torch.bool)
        routed_cols = torch.nonzero(eligible).flatten().tolist()
        scope[routed_cols[: config.correction_intervals] if config.correction_intervals else routed_cols] = True
        member = _members(sample_groups, B)
        U = int(member.max()) + 1
        unit_routed = torch.zeros(U, G, dtype=torch.int64).index_add_(0, member, routed.long()) > 0              # [U, G]
        picked = _pick(unit_routed & scope[None], p, generator)                   # [U, G]
        corrected = picked[member] & routed
    weight = 1.0 / p if p > 0 else 1.0
    alphas = [group_alphas(sig, iv, config.alpha).tolist() for iv in intervals]    # once per interval

    units: list[Unit] = []
    singles: list[Unit] = []
    if scheme == "groups":                  # group-major, as Flow-GRPO's step loop (and the estimator before knots)
        for gi, iv in enumerate(intervals):
            for i in range(B):
                if routed[i, gi]:
                    units += _units_of_chain(i, [iv], [alphas[gi]], 2, {0: 1.0 - weight} if corrected[i, gi] else {})
            units += [_single(i, k) for k in iv for i in range(B) if not routed[i, gi]]
            singles += [_single(i, k, weight) for k in iv[1:-1] for i in range(B) if corrected[i, gi]]
    else:
        for i in range(B):                  # each maximal run of routed intervals is one chain of shared knots
            run: list[int] = []
            for j in range(G + 1):
                if j < G and routed[i, j]:
                    run.append(j)
                    continue
                if run:
                    scale = {r: 1.0 - weight for r, jj in enumerate(run) if corrected[i, jj]}
                    units += _units_of_chain(i, [intervals[jj] for jj in run], [alphas[jj] for jj in run],
                                             config.micro_batch, scale)
                    run = []
        covered = [set() for _ in range(B)]
        for u in units:
            covered[u.sample].update(e.step for e in u.evals)
        for k in steps:                     # the rest run exact, step-major
            singles += [_single(i, k) for i in range(B) if k not in covered[i]]
        for j, iv in enumerate(intervals):
            singles += [_single(i, k, weight) for k in iv[1:-1] for i in range(B) if corrected[i, j]]
    return Plan(units + singles, B * int(eligible.sum()), int(routed.sum()), int(corrected.sum()), positions)


def _subsample_plan(steps: list[int], B: int, frac: float, generator: torch.Generator | None) -> Plan:
    """``mode="subsample"``: each sample's ``m = max(1, round(frac K))`` trained steps drawn uniformly without
    replacement, fresh per sample and update, each weighted ``K / m`` (unbiased); step-major as ``exact``."""
    K = len(steps)
    m = max(1, min(K, round(frac * K)))
    if m == K:                                    # every step at weight 1: exact, bit for bit (no draw)
        chosen = torch.ones(B, K, dtype=torch.bool)
    else:
        order = torch.rand(B, K, generator=generator, dtype=torch.float32).argsort(dim=1)      # [B, K]
        chosen = torch.zeros(B, K, dtype=torch.bool).scatter_(1, order[:, :m], True)
    weight = 1.0 if m == K else K / m
    units = [_single(i, k, weight) for j, k in enumerate(steps) for i in range(B) if chosen[i, j]]
    return Plan(units, 0, 0, 0, list(range(K)))


def _members(sample_groups: Tensor | Sequence | None, B: int) -> Tensor:
    """``[B]`` dense unit index of each sample: its GRPO group, or itself."""
    if sample_groups is None:
        return torch.arange(B)
    if not isinstance(sample_groups, Tensor):
        first: dict = {}
        sample_groups = torch.tensor([first.setdefault(k, len(first)) for k in sample_groups])
    return torch.unique(sample_groups.cpu().flatten(), return_inverse=True)[1]
