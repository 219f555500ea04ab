"""The statistics the benchmarks share: one bootstrap, percentile intervals, and what a reward curve is read for.

- :func:`resamples` and :func:`interval`: the bootstrap of every interval the benchmarks print (``python -m lab quality``
  resamples seeds, paired across variants; ``python -m lab paired`` resamples prompts), 95% percentile intervals of the
  defined resamples.
- :func:`smooth`, :func:`time_to_target`, :func:`crossing`: when a curve first reaches a level.
- :func:`rate`: the **rising-phase efficiency** of a curve against a reference's, the updates the reference needs to
  gain 25/50/75% of the *smaller* of the two gains over the updates the curve needs (a level both reach, read where
  both still rise).
- :func:`plateau`: where a curve levels off, the mean of its last evaluations, and the **plateau gap** to the
  reference's.
- :func:`late_rise`: whether a curve has levelled off where its plateau is read: the plateau minus the mean of the
  evaluations just before it (a curve still rising there has no plateau yet, and a gap read then is part rate).
- :func:`lag_gap`: the plateau gap a rate alone explains (a slower curve still behind a reference that has not
  levelled off); the rest of the gap is a plateau of its own.
- :func:`at_budget`: a curve's value when a budget (seconds) runs out, interpolated between its evaluations.

Curves are ``[S, M]`` arrays: one row per seed, one column per evaluation; a clock ``[S, M]`` gives each evaluation's
time (updates, CPU seconds, ...). Every function reads the seed-mean curve of the seeds it is given (a resample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP = 2000                      # resamples of every interval, unless a command says otherwise
LEVELS = (0.25, 0.5, 0.75)            # the rate's levels: fractions of the smaller of the two gains
PLATEAU_EVALS = 3                     # evaluations the plateau averages over, by default
NO_GAIN = "no gain"                   # a rate's status where the smaller gain is not > 0 (a curve that never rises)
OK = "ok"


def resamples(n: int, count: int = BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """``[count, n]`` indices of a bootstrap over ``n`` items (numpy's generator seeded ``seed``); with one item, the
    item itself once (``[1, 1]``): nothing to resample."""
    if n < 1:
        raise ValueError(f"a bootstrap needs at least one item; got {n}")
    if n == 1:
        return np.zeros((1, 1), dtype=np.int64)
    return np.random.default_rng(seed).integers(0, n, (count, n))


def interval(xs) -> tuple[float, float]:
    """The 95% percentile interval of the defined (non-NaN) resamples; NaN when none is defined. A ratio is undefined
    in a resample where it is 0 / 0 (a level met at the start, a curve that does not rise)."""
    xs = np.asarray(xs, dtype=float)
    if xs.size == 0 or np.isnan(xs).all():
        return float("nan"), float("nan")
    return float(np.nanpercentile(xs, 2.5)), float(np.nanpercentile(xs, 97.5))


def undefined_share(xs) -> float:
    """The share of resamples whose statistic is undefined (NaN)."""
    xs = np.asarray(xs, dtype=float)
    return float(np.isnan(xs).mean()) if xs.size else float("nan")


def smooth(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over ``w`` entries along the last axis (shorter at the start)."""
    c = np.cumsum(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, 0)]), axis=-1)
    n = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(n - w, 0)
    return (c[..., n] - c[..., lo]) / (n - lo)


def time_to_target(reward: np.ndarray, wall: np.ndarray, target: float, w: int) -> tuple[float, bool]:
    """Seconds until the seed-mean of ``reward`` ``[S, N]``, smoothed over ``w`` iterations, first reaches ``target``
    (wall-clock ``[S, N]`` averaged over seeds), and whether it did (else: the last iteration's time)."""
    curve, t = smooth(reward.mean(0), w), wall.mean(0)
    hit = np.nonzero(curve >= target - 1e-12)[0]
    return (float(t[hit[0]]), True) if hit.size else (float(t[-1]), False)


def crossing(curve: np.ndarray, t: np.ndarray, target: float) -> tuple[float, bool]:
    """When ``curve`` ``[M]`` (at the times ``t`` ``[M]``) first reaches ``target``, linearly interpolated between the
    two points around the crossing; and whether it does (else: the last time)."""
    hit = np.nonzero(curve >= target - 1e-12)[0]
    if not hit.size:
        return float(t[-1]), False
    i = int(hit[0])
    if i == 0:
        return float(t[0]), True
    frac = (target - curve[i - 1]) / (curve[i] - curve[i - 1])
    return float(t[i - 1] + frac * (t[i] - t[i - 1])), True


def time_to_test_target(test: np.ndarray, clock: np.ndarray, target: float) -> tuple[float, bool]:
    """:func:`crossing` of the seed-mean held-out reward ``test`` ``[S, M]`` (evaluations at the times ``clock``
    ``[S, M]``, averaged over seeds)."""
    return crossing(test.mean(0), clock.mean(0), target)


def plateau_count(m: int, k: int = PLATEAU_EVALS) -> int:
    """How many of ``m`` evaluations the plateau averages: the last ``k``, never the first (the start)."""
    return max(0, min(k, m - 1))


def plateau(test: np.ndarray, k: int = PLATEAU_EVALS) -> float:
    """Where the seed-mean held-out curve ``test`` ``[S, M]`` levels off: the mean of its last
    :func:`plateau_count` evaluations (NaN with fewer than two evaluations)."""
    n = plateau_count(test.shape[1], k)
    return float(test[:, -n:].mean()) if n else float("nan")


def late_rise(test: np.ndarray, k: int = PLATEAU_EVALS) -> float:
    """How much the seed-mean held-out curve ``test`` ``[S, M]`` still rises where its plateau is read: the mean of
    its last :func:`plateau_count` evaluations minus the mean of as many evaluations before them (never the start;
    NaN without enough evaluations). About 0 on a levelled curve; > 0 on one still rising."""
    n = plateau_count(test.shape[1], k)
    if n == 0 or test.shape[1] - 1 < 2 * n:
        return float("nan")
    return float(test[:, -n:].mean() - test[:, -2 * n:-n].mean())


@dataclass(frozen=True)
class Rate:
    """The rising-phase efficiency of a curve against a reference (:func:`rate`).

    Attributes:
        levels: per level of :data:`LEVELS`, the reference's updates to it over the curve's (NaN: undefined).
        combined: the geometric mean of the defined levels' ratios (NaN when none is).
        gain: the smaller of the two gains (plateau - start) the levels are fractions of.
        status: :data:`OK`, or :data:`NO_GAIN` where the smaller gain is not > 0 (a curve that never rises, or a gain
            of 0): the levels are NaN, read "unreached".
    """

    levels: tuple[float, ...]
    combined: float
    gain: float
    status: str


def rate(ref: np.ndarray, ref_clock: np.ndarray, cur: np.ndarray, cur_clock: np.ndarray,
         k: int = PLATEAU_EVALS, levels: tuple[float, ...] = LEVELS) -> Rate:
    """The updates the reference needs to gain each fraction of ``levels`` of the smaller of the two held-out gains,
    over the updates the curve needs. ``ref``, ``cur``: ``[S, M]`` held-out rewards of the same seeds (the first
    evaluation at the start); ``ref_clock``, ``cur_clock``: ``[S, M]`` the updates at each evaluation. A gain is the
    plateau (:func:`plateau`, the last ``k`` evaluations) minus the start; each curve's level is its own start plus
    the fraction of the smaller gain, reached where its seed-mean curve first crosses it (:func:`crossing`)."""
    starts = float(ref[:, 0].mean()), float(cur[:, 0].mean())
    gain = min(plateau(ref, k) - starts[0], plateau(cur, k) - starts[1])
    if not math.isfinite(gain) or gain <= 1e-12:
        nan = tuple(float("nan") for _ in levels)
        return Rate(nan, float("nan"), gain, NO_GAIN)
    ratios = []
    for f in levels:
        u_ref, hit_ref = crossing(ref.mean(0), ref_clock.mean(0), starts[0] + f * gain)
        u_cur, hit_cur = crossing(cur.mean(0), cur_clock.mean(0), starts[1] + f * gain)
        ok = hit_ref and hit_cur and u_ref > 0 and u_cur > 0
        ratios.append(u_ref / u_cur if ok else float("nan"))
    defined = [r for r in ratios if math.isfinite(r)]
    combined = math.exp(sum(math.log(r) for r in defined) / len(defined)) if defined else float("nan")
    return Rate(tuple(ratios), combined, gain, OK)


def plateau_gap(ref: np.ndarray, cur: np.ndarray, k: int = PLATEAU_EVALS) -> float:
    """The curve's plateau minus the reference's (:func:`plateau`, the last ``k`` evaluations of each)."""
    return plateau(cur, k) - plateau(ref, k)


def lag_gap(ref: np.ndarray, ref_clock: np.ndarray, rate_: float, k: int = PLATEAU_EVALS) -> float:
    """The plateau gap a rate alone explains: the reference's seed-mean curve read at ``rate_`` times the updates of
    its last :func:`plateau_count` evaluations, minus its plateau (the variant as the reference slowed by ``rate_``;
    0 for a rate of 1 or a reference that levelled off before ``rate_`` x its plateau's updates; NaN for an undefined
    rate). ``ref``, ``ref_clock``: ``[S, M]`` held-out rewards and the updates at each evaluation."""
    n = plateau_count(ref.shape[1], k)
    if n == 0 or not math.isfinite(rate_) or rate_ <= 0:
        return float("nan")
    t, curve = ref_clock.mean(0), ref.mean(0)
    lagged = np.interp(min(rate_, 1.0) * t[-n:], t, curve)
    return float(lagged.mean() - curve[-n:].mean())


def at_budget(test: np.ndarray, clock: np.ndarray, budget: float) -> float:
    """The seed-mean held-out reward ``test`` ``[S, M]`` when ``budget`` (on the seed-mean ``clock`` ``[S, M]``) runs
    out, linearly interpolated between evaluations (NaN past the last evaluation)."""
    t, curve = clock.mean(0), test.mean(0)
    if not math.isfinite(budget) or budget > t[-1] + 1e-9 * max(1.0, abs(t[-1])):
        return float("nan")
    return float(np.interp(budget, t, curve))
