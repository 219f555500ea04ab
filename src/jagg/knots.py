"""The plan of one update: which rows go through the network with grad, and with which weights.

Every estimator is a choice of *knots* per sample: trained steps whose rows go through the network with grad. A
trained step ``k`` lies at a knot (its upstream signal ``g_k`` goes to its own row with weight 1) or strictly between
two neighbouring knots ``a < k < b`` (weights ``1 - alpha_k`` on ``a``, ``alpha_k`` on ``b``). Cost = knot rows;
error = the piecewise-linear interpolation error of the parameter-Jacobian between knots. The words (glossary:
docs/design.md §0):

- *interval*: the run of trained steps ``[a, ..., b]`` between two neighbouring knots, ends included; its *inner
  steps* lie strictly between. This module owns the interval layout: where the knots sit and each inner step's
  interpolation coefficient ``alpha_k`` (:func:`interval_alphas`).
- *window* ``W``: the trained steps of one interval, ends included (the last interval may be shorter).
- *step groups* (``knots="groups"``, the paper): disjoint intervals of ``W`` consecutive steps, two knot rows each.
  ``shared``: consecutive intervals share their end knot, a knot every ``W - 1`` steps, ``1 + ceil((K - 1) / (W - 1))``
  rows per sample instead of ``2 ceil(K / W)``. ``mode="exact"``: every step a knot.
- *unit*: what routing and the correction decide on: (prompt group, interval) when the prompt group of each sample
  is given (``prompt_groups``), else (sample, interval) (:func:`unit_rows`).
- *routing* (``jagg_frac``, :func:`route`): the most linear units (:mod:`jagg.routing` scores them) go through JAGG;
  a unit routed exact makes all its steps knots. *Unbiased JAGG* (``correction_p = p``, or ``correction_probs`` per
  interval): each routed unit is also *picked* with probability ``p`` (:func:`pick_corrections`): its inner steps then
  also run exactly and add ``(exact - interpolated) / p``, so the expected gradient is the exact one;
  :func:`budget_probs` spreads a row budget over the intervals.
- *interval subsampling* (``interval_frac``): each unit trains a random ``m`` of the ``n`` intervals (:func:`draw`;
  with ``prompt_groups`` a prompt group's samples draw alike, which keeps the cancellation of their zero-sum
  advantages: drawn per sample, JAGG's per-sample error, larger than the group's, did not cancel), every term of a drawn
  interval at weight ``n / m``; each term belongs to one interval (:func:`owners`).
- *bundle* (:class:`Bundle`): rows of one sample that go through the network together (never split across chunks),
  and the loss *terms* (:class:`Term`, one per (sample, trained step)) they cover.

:func:`plan_update` turns a trajectory and an :class:`~jagg.estimator_config.EstimatorConfig` into the bundles of one
update; :func:`jagg.estimator.policy_gradient` executes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .advantages import prompt_group_index
from .checks import as_increasing_steps, check_count, check_finite_tensor, check_number, check_tensor, is_finite_number
from .estimator_config import ALPHAS, KNOTS, EstimatorConfig
from .routing import linearity_scores
from .trajectory import Trajectory


@dataclass
class Term:
    """One loss term ``l_{i,k}`` (sample ``i``, trained step ``k``) inside a :class:`Bundle`.

    Attributes:
        step: the trained step ``k``.
        source: where its velocity comes from: ``(row, -1, 0.0)`` = that row's output; ``(row_a, row_b, alpha)`` =
            the inner step between two knot rows (``fresh`` forward or ``interp`` from the rows and the rollout).
        weights: ``(row, weight)`` pairs: ``g`` of this term goes to those rows' backward signal.
        counted: counted in the statistics (loss, clip fraction, ...). False for the interpolated copy of a corrected
            inner step, whose true term (on its own row) is the one counted.
    """

    step: int
    source: tuple[int, int, float]
    weights: list[tuple[int, float]]
    counted: bool = True


@dataclass
class Bundle:
    """Rows of one sample that go through the network together (never split across chunks), and the terms they
    cover."""

    sample: int
    rows: list[int]                          # the knot steps, in order
    terms: list[Term] = field(default_factory=list)

    @property
    def jagg(self) -> bool:
        """Whether a term of the bundle is interpolated (an interval routed to JAGG)."""
        return any(t.source[1] >= 0 for t in self.terms)


@dataclass
class Plan:
    """The bundles of one update and what routing, the correction and the draws did. Counts are per sample: one
    sample's interval counts once (``B`` samples x intervals at most), and only the drawn ones count
    (``interval_frac``).

    Attributes:
        bundles: in execution order.
        eligible: drawn samples' intervals JAGG could take (intervals with inner steps, outside the exact first/last).
        routed: of those, routed to JAGG.
        corrected: of those routed, picked by unbiased JAGG (also run exactly).
        knots: the interval ends per sample before routing: positions into the trained steps (``[M]``).
        drawn: samples' intervals whose terms are trained: ``B`` x ``round(interval_frac n)`` of the ``n`` intervals
            (single steps where no layout applies: window <= 2, mode exact without interval_frac, mode subsample).
    """

    bundles: list[Bundle]
    eligible: int
    routed: int
    corrected: int
    knots: list[int]
    drawn: int = 0

    @property
    def rows(self) -> int:
        """Rows through the network with grad (the knots, and the exact steps): what the cost model counts."""
        return sum(len(b.rows) for b in self.bundles)


# ----------------------------------------------------------------------------- the interval layout


def step_groups(train_steps: list[int], window: int) -> list[list[int]]:
    """The paper's step groups: the trained steps (increasing, >= 0) split into consecutive runs of ``window`` (the
    last may be shorter). Each is one interval of ``knots="groups"``."""
    train_steps, window = as_increasing_steps(train_steps, "train_steps"), check_count(window, "window")
    return [train_steps[i : i + window] for i in range(0, len(train_steps), window)]


def interval_alphas(sigmas: Tensor, interval: list[int], alpha: str = "sigma") -> Tensor:
    """``alpha_k`` ``[m]`` (fp64) for the steps of ``interval``: 0 at ``a``, 1 at ``b``. ``[0.]`` for one step.

    ``alpha="sigma"``: ``(sigma_k - sigma_a) / (sigma_b - sigma_a)`` (the paper's t-weighting; schedules are not
    uniform). ``alpha="index"``: ``(k - a) / (b - a)`` (the authors' reference code). ``interval``: increasing steps;
    with ``"sigma"`` its sigmas must be finite and strictly monotone (equal ones would divide by zero).
    """
    if alpha not in ALPHAS:
        raise ValueError(f"alpha must be one of {ALPHAS}; got {alpha!r}")
    check_tensor(sigmas, "sigmas", "[T + 1]")
    interval = as_increasing_steps(interval, "interval")
    if interval[-1] >= sigmas.numel():
        raise ValueError(f"interval must be a non-empty list of steps in [0, {sigmas.numel() - 1}] (indices into "
                         f"sigmas); got {list(interval)!r}")
    if len(interval) == 1:
        return torch.zeros(1, dtype=torch.float64, device=sigmas.device)
    if alpha == "index":
        s = torch.tensor(interval, dtype=torch.float64, device=sigmas.device)
        return (s - s[0]) / (s[-1] - s[0])
    s = check_finite_tensor(sigmas[interval].double(), f"sigmas at the interval's steps {interval}")
    d = s.diff()
    if not bool(((d < 0).all() | (d > 0).all())):
        raise ValueError(f"sigmas must be strictly monotone over the interval {interval} (alpha='sigma' divides by "
                         f"sigma_b - sigma_a); got {[round(float(x), 6) for x in s[:8]]}: give a strictly decreasing "
                         "sigma grid, or alpha='index'")
    return (s - s[0]) / (s[-1] - s[0])


def shared_knots(num_steps: int, window: int) -> list[int]:
    """Positions ``0, W-1, 2(W-1), ..., K-1`` into ``K = num_steps`` trained steps (knots every ``W - 1`` steps)."""
    num_steps, window = check_count(num_steps, "num_steps"), check_count(window, "window")
    if window <= 2:
        return list(range(num_steps))
    pos = list(range(0, num_steps - 1, window - 1)) + [num_steps - 1]
    return sorted(set(pos))


def intervals_of(steps: list[int], knots: str, window: int) -> list[list[int]]:
    """The intervals (runs of trained steps between neighbouring knots, ends included) of one layout.

    ``groups``: the step groups of ``window`` (not sharing ends); ``shared``: between consecutive
    :func:`shared_knots`.
    """
    if knots not in KNOTS:
        raise ValueError(f"knots must be one of {KNOTS}; got {knots!r}")
    steps = as_increasing_steps(steps, "steps")
    if knots == "groups":
        return step_groups(steps, window)
    positions = shared_knots(len(steps), window)
    if len(positions) == 1:
        return [[steps[0]]]
    return [steps[a : b + 1] for a, b in zip(positions[:-1], positions[1:])]


def check_layout(config: EstimatorConfig, K: int, steps: str = "the trajectory's train_steps",
                 prefix: str = "") -> None:
    """Raise, naming the setting (``prefix`` + its name: ``window``, or the config key ``estimator.window``), when a
    count of the estimator is larger than what it counts on trajectories of ``K`` trained steps (``steps`` says where
    ``K`` comes from): ``window`` more than ``K`` (one interval would hold every step: the layout is clamped, never what
    was asked for), ``exact_first_intervals`` / ``exact_last_intervals`` more than the intervals JAGG may take,
    ``correction_probs`` not one rate per interval of the layout. Only where a layout applies: mode ``jagg`` (or
    ``exact`` with ``interval_frac < 1``, which draws the layout's intervals) and 3 or more trained steps (with 1 or 2
    every step runs exact, whatever the window)."""
    if not isinstance(config, EstimatorConfig):
        raise TypeError(f"config must be a jagg.EstimatorConfig; got {type(config).__name__}")
    K = check_count(K, "K (the trained steps)")
    if K <= 2 or not (config.mode == "jagg" or (config.mode == "exact" and config.interval_frac < 1)):
        return
    if config.window > K:
        raise ValueError(f"{prefix}window={config.window} is more than the {K} trained steps of an iteration "
                         f"({steps}): one interval would hold every step; lower {prefix}window to at most {K}")
    if config.window <= 2 or config.mode != "jagg":      # no layout (one exact interval per step), or nothing routed
        return
    intervals = intervals_of(list(range(K)), config.knots, config.window)
    inner = sum(len(iv) >= 3 for iv in intervals)
    layout = f"{prefix}window={config.window}, knots={config.knots} on the {K} trained steps of {steps}"
    for name in ("exact_first_intervals", "exact_last_intervals"):
        if getattr(config, name) > inner:
            raise ValueError(f"{prefix}{name}={getattr(config, name)} is more than the {inner} interval"
                             f"{'s' * (inner != 1)} with inner steps ({layout}); lower it to at most {inner}")
    rates = config.correction_probs
    if rates is not None and len(rates) != len(intervals):
        raise ValueError(f"{prefix}correction_probs has {len(rates)} rate{'s' * (len(rates) != 1)}, but the layout "
                         f"has {len(intervals)} intervals ({layout}); give one rate per interval, in order")


def layout_intervals(traj, config: EstimatorConfig) -> tuple[list[list[int]], list[int], bool]:
    """``(intervals, knot positions, jagg)`` of one update: the layout ``config.knots`` asks for (``window > 2`` and more
    than two trained steps) when JAGG applies (``jagg``: mode ``jagg``) or when ``interval_frac < 1`` draws its
    intervals (in mode ``exact`` too), else one interval per trained step."""
    steps = traj.train_steps.tolist()
    K = len(steps)
    laid = config.window > 2 and K > 2 and (config.mode == "jagg" or config.interval_frac < 1)
    scheme = config.knots if laid else "groups"
    window = config.window if laid else 1
    intervals = intervals_of(steps, scheme, window)
    positions = sorted({steps.index(s) for iv in intervals for s in (iv[0], iv[-1])})
    return intervals, positions, laid and config.mode == "jagg"


def owners(intervals: list[list[int]], shared: bool) -> dict[int, int]:
    """``{step: interval}``: the interval that owns each trained step's own loss term, so that every term belongs to
    exactly one interval (what interval subsampling draws). Disjoint intervals (step groups) own their steps. Intervals
    sharing knots (``shared``) own ``(a, b]``: their inner steps and their end knot; the first one also
    owns its start knot. A drawn interval still needs both knot rows when its start knot belongs to an undrawn
    neighbour."""
    out: dict[int, int] = {}
    for j, iv in enumerate(intervals):
        for k in (iv if not shared or j == 0 else iv[1:]):
            out.setdefault(k, j)
    return out


def eligible_intervals(intervals: list[list[int]], jagg: bool, config: EstimatorConfig) -> Tensor:
    """``[G]`` bool: the intervals JAGG may take: those with inner steps, less the first ``exact_first_intervals``
    and the last ``exact_last_intervals`` of them."""
    eligible = torch.tensor([len(iv) >= 3 for iv in intervals], dtype=torch.bool) & jagg
    idx = torch.nonzero(eligible).flatten().tolist()
    for j in idx[: config.exact_first_intervals]:
        eligible[j] = False
    for j in (idx[len(idx) - config.exact_last_intervals :] if config.exact_last_intervals else []):
        eligible[j] = False
    return eligible


# ----------------------------------------------------------------------------- units: routing and the correction


def unit_rows(prompt_groups: Tensor | Sequence | None, B: int) -> Tensor:
    """``[B]`` the unit row of each sample: its prompt group's dense index (prompt group ids in sorted order; ids may
    be ints or any hashables, e.g. the prompts), or the sample itself without ``prompt_groups``. A unit is (unit
    row, interval): routing and the correction move a prompt group's samples together."""
    if prompt_groups is None:
        return torch.arange(B)
    if not isinstance(prompt_groups, Tensor):             # e.g. the prompts themselves, or prompt ids
        prompt_groups = prompt_group_index(prompt_groups)
    ids = prompt_groups.cpu().flatten()
    if ids.numel() != B:
        raise ValueError(f"prompt_groups must have shape [B] = [{B}]; got {tuple(ids.shape)}")
    return torch.unique(ids, return_inverse=True)[1]


def route(scores: Tensor, jagg_frac: float, eligible: Tensor,
          prompt_groups: Tensor | Sequence | None = None) -> Tensor:
    """Route the top ``jagg_frac`` of the eligible units through JAGG, by linearity score.

    Args:
        scores: ``[B, G]`` linearity scores of every (sample, interval) (higher = more linear; :mod:`jagg.routing`).
        jagg_frac: the fraction of eligible units routed.
        eligible: ``[G]`` bool, intervals allowed to go through JAGG.
        prompt_groups: optional ``[B]``, the prompt group of each sample. When given, a unit is (prompt group,
            interval), its score the members' mean, so a prompt group's samples are routed together. Group-relative
            advantages sum to zero within a prompt group, so an error that its samples' JAGG gradients share cancels
            when they are all routed alike (and survives when only some are).

    Returns ``[B, G]`` bool: True = JAGG. The count is ``jagg_frac * n_eligible`` units rounded half up; ties break
    towards the lower index (deterministic).
    """
    check_number(jagg_frac, "jagg_frac", 0.0, 1.0, why="the share of eligible units routed")
    if check_tensor(scores, "scores", "[B, G]").ndim != 2 or tuple(check_tensor(eligible, "eligible", "[G]").shape) != (
            scores.shape[1],) or bool(torch.isnan(scores).any()):
        raise ValueError(f"scores must be [B, G] linearity scores without NaN (+inf: an exact interval) and eligible "
                         f"[G] bools; got scores {tuple(scores.shape)}, eligible {tuple(eligible.shape)}")
    B, G = scores.shape
    if prompt_groups is not None:
        member = unit_rows(prompt_groups, B).to(scores.device)                 # [B] in 0..U-1
        U = int(member.max()) + 1 if B else 0
        total = torch.zeros(U, G, dtype=torch.float64, device=scores.device).index_add_(0, member, scores.double())
        count = torch.bincount(member, minlength=U).double()[:, None]
        return route(total / count, jagg_frac, eligible)[member]               # [U, G] -> [B, G]
    mask = eligible[None, :].expand(B, G).reshape(-1)
    n_elig = int(mask.sum())
    n = int(math.floor(float(jagg_frac) * n_elig + 0.5))    # round half up: 1 of 1 unit at 0.5, not 0
    routed = torch.zeros(B * G, dtype=torch.bool, device=scores.device)
    if n > 0:
        s = scores.reshape(-1).double().masked_fill(~mask, -torch.inf)
        # stable descending sort: equal scores keep index order
        order = torch.sort(-s, stable=True).indices
        routed[order[:n]] = True
    return routed.view(B, G)


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


def interval_probs(eligible: Tensor, config: EstimatorConfig) -> list[float]:
    """``[G]`` the correction probability of each interval: ``correction_p`` (or ``correction_probs[j]``) for the
    eligible intervals, 0 elsewhere."""
    G = eligible.numel()
    if not bool(eligible.any()):
        return [0.0] * G
    if config.correction_probs is not None and len(config.correction_probs) != G:
        raise ValueError(f"correction_probs has {len(config.correction_probs)} rates, one per interval of the layout, "
                         f"but this update's layout has {G} intervals")
    rates = config.correction_probs if config.correction_probs is not None else [float(config.correction_p)] * G
    return [float(rates[j]) if eligible[j] else 0.0 for j in range(G)]


def pick_corrections(routed: Tensor, rates: list[float], units: Tensor, config: EstimatorConfig,
                     generator: torch.Generator | None) -> Tensor:
    """Unbiased JAGG's picks ``[B, G]``: each routed unit (``units``: :func:`unit_rows`) is picked with the probability
    of its interval (``rates``: :func:`interval_probs`): one :func:`_pick` over every interval at ``correction_p``, or
    one per interval, in order, at ``correction_probs[j]``."""
    B, G = routed.shape
    if not any(r > 0 for r in rates) or not bool(routed.any()):
        return torch.zeros(B, G, dtype=torch.bool)
    scope = torch.tensor([r > 0 for r in rates], dtype=torch.bool)
    U = int(units.max()) + 1
    unit_routed = torch.zeros(U, G, dtype=torch.int64).index_add_(0, units, routed.long()) > 0      # [U, G]
    candidates = unit_routed & scope[None]
    if config.correction_probs is None:
        picked = _pick(candidates, float(config.correction_p), generator)
    else:
        picked = torch.stack([_pick(candidates[:, j], rates[j], generator) for j in range(G)], 1)
    return picked[units] & routed


def draw(B: int, n: int, m: int, generator: torch.Generator | None) -> Tensor:
    """``[B, n]`` bool: a fresh uniformly random ``m`` of ``n`` per row, without replacement (all ``n``, and no draw,
    when ``m >= n``)."""
    B, n, m = check_count(B, "B", 0), check_count(n, "n"), check_count(m, "m")
    if m >= n:
        return torch.ones(B, n, dtype=torch.bool)
    order = torch.rand(B, n, generator=generator, dtype=torch.float32).argsort(dim=1)      # [B, n]
    return torch.zeros(B, n, dtype=torch.bool).scatter_(1, order[:, :m], True)


def drawn_count(n: int, frac: float) -> int:
    """``m = round(frac n)``, at least 1 and at most ``n``: how many of ``n`` units a draw at ``frac`` keeps."""
    n, frac = check_count(n, "n"), check_number(frac, "frac", 0.0, 1.0, strict=True, why="the share of units kept")
    return max(1, min(n, round(frac * n)))


def budget_probs(errors: Sequence[float], rows: Sequence[float], budget: float) -> list[float]:
    """Per-interval correction probabilities ``p_j`` that minimise the correction's variance ``sum_j (1/p_j - 1) D_j`` at the
    row budget ``sum_j p_j r_j = budget``: ``p_j = min(1, c sqrt(D_j / r_j))`` with ``c`` set by the budget (capped
    rates at 1, the rest of the budget shared again). An interval without error or without rows gets 0; a budget of at
    least the rows of every interval with an error gives them 1.

    Args:
        errors: ``[G]`` ``D_j >= 0``, the error energy the correction of interval ``j`` removes, e.g. plain JAGG's
            ``error_to_noise`` of that interval (``jagg bench meter --by-interval``); negative estimates count as 0.
        rows: ``[G]`` ``r_j >= 0``, the rows one correction of interval ``j`` runs per sample (its inner steps for
            correction).
        budget: the correction rows per sample to spend, ``>= 0`` (e.g. ``p sum_j r_j`` for a uniform rate ``p``).
    """
    for name, values in (("errors", errors), ("rows", rows)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"budget_probs: {name} must be a sequence of numbers, one per interval; got "
                            f"{type(values).__name__}")
    if len(errors) != len(rows):
        raise ValueError(f"budget_probs needs one error per interval and one row count per interval (errors, rows); "
                         f"got {len(errors)} errors and {len(rows)} rows")
    for name, values in (("errors", errors), ("rows", rows), ("budget", [budget])):
        if not all(is_finite_number(v) for v in values):
            raise ValueError(f"budget_probs: {name} must be finite numbers; got {list(values)}")
    if budget < 0 or any(r < 0 for r in rows):
        raise ValueError(f"budget_probs: rows and budget must be >= 0; got rows {list(rows)}, budget {budget}")
    D = [max(float(d), 0.0) for d in errors]
    live = [j for j in range(len(D)) if D[j] > 0 and rows[j] > 0]
    p = [0.0] * len(D)
    left, free = float(budget), list(live)
    while free:
        c = left / sum(math.sqrt(D[j] * rows[j]) for j in free)          # sum_j r_j c sqrt(D_j / r_j) = left
        capped = [j for j in free if c * math.sqrt(D[j] / rows[j]) >= 1.0]
        if not capped:
            for j in free:
                p[j] = c * math.sqrt(D[j] / rows[j])
            break
        for j in capped:
            p[j] = 1.0
            left -= rows[j]
        free = [j for j in free if j not in capped]
    return p


# ----------------------------------------------------------------------------- the plan


def plan_update(traj: Trajectory, config: EstimatorConfig, prompt_groups: Tensor | Sequence | None = None,
                generator: torch.Generator | None = None) -> Plan:
    """Lay out, route, pick, draw and bundle the rows of one update (see the module docstring).

    Args:
        traj: the :class:`~jagg.trajectory.Trajectory` (``B`` samples, trained steps ``[K]``).
        config: the estimator's configuration.
        prompt_groups: optional ``[B]`` prompt group of each sample: routing and the correction then decide per
            (prompt group, interval) unit (:func:`route`).
        generator: RNG of the random choices, in this order: the correction's picks, the intervals each sample
            trains (``interval_frac < 1``) (``torch.rand`` / ``randperm`` on the CPU).
    """
    if not isinstance(traj, Trajectory):
        raise TypeError(f"traj must be a jagg.Trajectory; got {type(traj).__name__}")
    if not isinstance(config, EstimatorConfig):
        raise TypeError(f"config must be a jagg.EstimatorConfig; got {type(config).__name__}")
    B = traj.latents.shape[0]
    check_layout(config, traj.train_steps.numel())
    if config.mode == "subsample":
        return _subsample_plan(traj.train_steps.tolist(), B, config.subsample_frac, generator)
    intervals, positions, jagg = layout_intervals(traj, config)
    G = len(intervals)
    alphas = [interval_alphas(traj.sigmas, iv, config.alpha) for iv in intervals]      # once per interval
    eligible = eligible_intervals(intervals, jagg, config)
    if 0.0 < config.jagg_frac < 1.0:
        scores = linearity_scores(traj.velocities, intervals).cpu()
    else:
        scores = torch.zeros(B, G, dtype=torch.float32)
    routed = route(scores, config.jagg_frac, eligible, prompt_groups)                  # [B, G]
    units = unit_rows(prompt_groups, B)
    rates = interval_probs(eligible, config)
    picked = pick_corrections(routed, rates, units, config, generator)
    fixes = _corrected_steps(picked, intervals, rates)
    m = drawn_count(G, config.interval_frac)
    drawn = draw(int(units.max()) + 1 if B else 0, G, m, generator)[units]       # [B, G]: a unit's samples alike
    weight = 1.0 if m == G else G / m
    shared = config.knots != "groups" and len(intervals) > 1 and intervals[0][-1] == intervals[1][0]
    layout = _Layout(intervals, [a.tolist() for a in alphas], routed & drawn,
                     {u: f for u, f in fixes.items() if drawn[u]}, drawn, weight)
    bundles = (_shared_knot_bundles(B, traj.train_steps.tolist(), layout, config.micro_batch) if shared
               else _step_group_bundles(B, layout))
    return Plan(bundles, int((eligible[None] & drawn).sum()), int(layout.routed.sum()), len(layout.fixes), positions,
                int(drawn.sum()))


def _corrected_steps(picked: Tensor, intervals, rates: list[float]) -> dict[tuple[int, int], dict[int, float]]:
    """``{(sample, interval): {inner step: f}}`` of the picked intervals (``rates``: :func:`interval_probs`): every
    inner step at ``f = 1 / p_j``; a corrected step's interpolated term is scaled by ``1 - f`` and its own row enters
    at ``f``."""
    pairs = [(int(i), int(j)) for i, j in torch.nonzero(picked).tolist()]
    return {(i, j): {k: 1.0 / rates[j] for k in intervals[j][1:-1]} for i, j in pairs}


@dataclass
class _Layout:
    """What the bundle builders read: the intervals and their alphas; ``routed`` ``[B, G]`` (routed to JAGG and
    drawn); the corrections ``{(sample, interval): {inner step: f}}`` (:func:`_corrected_steps`, drawn only); ``drawn``
    ``[B, G]`` and the weight ``n / m`` of a drawn interval's terms."""

    intervals: list[list[int]]
    alphas: list[list[float]]
    routed: Tensor
    fixes: dict[tuple[int, int], dict[int, float]]
    drawn: Tensor
    weight: float


def _step_group_bundles(B: int, lay: _Layout) -> list[Bundle]:
    """Bundles of disjoint intervals, interval-major as Flow-GRPO's step loop (and the estimator before knots): per
    interval, its routed samples' knot pairs and the other drawn samples' exact steps; the picked inner steps last."""
    bundles: list[Bundle] = []
    singles: list[Bundle] = []
    w = lay.weight
    for j, iv in enumerate(lay.intervals):
        for i in range(B):
            if lay.routed[i, j]:
                bundles += _chain_bundles(i, [iv], [lay.alphas[j]], 2, {0: lay.fixes.get((i, j), {})}, w, True)
        bundles += [_single(i, k, w) for k in iv for i in range(B) if lay.drawn[i, j] and not lay.routed[i, j]]
        singles += _correction_singles(B, j, iv, lay)
    return bundles + singles


def _shared_knot_bundles(B: int, steps: list[int], lay: _Layout, micro_batch: int) -> list[Bundle]:
    """Bundles of intervals sharing knots: per sample, each maximal run of routed (and drawn) intervals is one chain;
    the steps no chain covers run exact, step-major, when their owner (:func:`owners`) is drawn; the picked inner steps
    last."""
    bundles: list[Bundle] = []
    G = len(lay.intervals)
    for i in range(B):
        run: list[int] = []
        for j in range(G + 1):
            if j < G and lay.routed[i, j]:
                run.append(j)
                continue
            if run:
                first = run[0]
                own_start = bool(lay.drawn[i, first - 1]) if first > 0 else True      # its start knot's owner
                bundles += _chain_bundles(i, [lay.intervals[jj] for jj in run], [lay.alphas[jj] for jj in run],
                                          micro_batch, {r: lay.fixes.get((i, jj), {}) for r, jj in enumerate(run)},
                                          lay.weight, own_start)
                run = []
    covered = [set() for _ in range(B)]
    for b in bundles:
        covered[b.sample].update(t.step for t in b.terms)
    owner = owners(lay.intervals, shared=True)
    singles = [_single(i, k, lay.weight) for k in steps for i in range(B)
               if k not in covered[i] and lay.drawn[i, owner[k]]]
    for j, iv in enumerate(lay.intervals):
        singles += _correction_singles(B, j, iv, lay)
    return bundles + singles


def _correction_singles(B: int, j: int, iv: list[int], lay: _Layout) -> list[Bundle]:
    """The own rows of interval ``j``'s corrected inner steps, each at ``f n / m`` (inner-step-major)."""
    return [_single(i, k, lay.fixes[(i, j)][k] * lay.weight) for k in iv[1:-1] for i in range(B)
            if k in lay.fixes.get((i, j), {})]


def _chain_bundles(sample: int, chain: list[list[int]], alphas: list[list[float]], micro_batch: int,
                   fixes: dict[int, dict[int, float]], weight: float, own_start: bool) -> list[Bundle]:
    """Bundles of one run of JAGG intervals sharing knots (``chain``: intervals ``[a, ..., b]``, consecutive ones
    sharing an end; ``alphas``: their interpolation coefficients), every weight times ``weight`` (``n / m`` with
    interval subsampling). Split into pieces of at most ``micro_batch`` knots that overlap by one knot; a knot's own
    term is counted in the first piece holding it, the chain's start knot only when ``own_start`` (its owner is
    drawn, :func:`owners`). ``fixes[r]`` (``{inner step: f}``, :func:`_corrected_steps`) scales those inner steps'
    interpolated weights of interval ``r`` by ``1 - f``; their terms then do not count in the statistics."""
    bundles: list[Bundle] = []
    start = 0
    n = len(chain)                                          # intervals; knots = n + 1
    per = max(micro_batch - 1, 1)                           # intervals per piece
    while start < n:
        part = chain[start : start + per]
        b = Bundle(sample, [iv[0] for iv in part] + [part[-1][-1]])
        for r, iv in enumerate(part):
            if r == 0 and start == 0 and own_start:
                b.terms.append(Term(iv[0], (0, -1, 0.0), [(0, 1.0 * weight)]))
            fix = fixes.get(start + r, {})
            for k, al in zip(iv[1:-1], alphas[start + r][1:-1]):
                s = 1.0 if k not in fix else 1.0 - fix[k]
                b.terms.append(Term(k, (r, r + 1, al), [(r, (1.0 - al) * s * weight), (r + 1, al * s * weight)],
                                    counted=k not in fix))
            b.terms.append(Term(iv[-1], (r + 1, -1, 0.0), [(r + 1, 1.0 * weight)]))
        bundles.append(b)
        start += per
    return bundles


def _single(sample: int, step: int, weight: float = 1.0) -> Bundle:
    """The bundle of one exact step: its own row, its term at ``weight``."""
    return Bundle(sample, [step], [Term(step, (0, -1, 0.0), [(0, weight)])])


def _subsample_plan(steps: list[int], B: int, frac: float, generator: torch.Generator | None) -> Plan:
    """``mode="subsample"``: each sample's ``m = max(1, round(frac K))`` trained steps drawn uniformly without
    replacement, fresh per sample and update, each weighted ``K / m`` (unbiased); step-major as ``exact``."""
    K = len(steps)
    m = drawn_count(K, frac)
    chosen = draw(B, K, m, generator)                # every step at weight 1 when m = K: exact, bit for bit (no draw)
    weight = 1.0 if m == K else K / m
    bundles = [_single(i, k, weight) for j, k in enumerate(steps) for i in range(B) if chosen[i, j]]
    return Plan(bundles, 0, 0, 0, list(range(K)), B * m)
