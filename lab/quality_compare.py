"""The paired comparison of ``python -m lab quality``: per variant, its runs beside exact's, every figure with its
bootstrap interval over seeds (:mod:`lab.statistics`; the figures are defined in :mod:`lab.quality`'s
docstring and docs/benchmarks.md).

:func:`compare` is the whole comparison; a run is the dict :func:`lab.quality_runs.summarize` wrote
(``train_curve`` rows of :data:`TRAIN_CURVE`, ``test_curve`` rows of :data:`TEST_CURVE`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from lab import statistics as stats
from jagg.cost import CostStructure
from lab.statistics import LEVELS, PLATEAU_EVALS, interval, resamples, time_to_target, time_to_test_target

CLOCKS = ("wall", "cpu", "iterations")
TARGETS = ("train", "test")
TRAIN_CURVE = ("iterations", "wall", "reward", "cpu")    # the columns of a run's train_curve (its result.json)
TEST_CURVE = ("iterations", "wall", "reward")            # ... and of its test_curve, one row per evaluation
LEVEL_KEYS = tuple(f"rate_{round(100 * f)}" for f in LEVELS)    # rate_25, rate_50, rate_75


@dataclass
class Curves:
    """One variant's runs over the seeds (``S`` of them), cut to the iterations (``n``) and evaluations (``m``) that
    every run of the comparison has.

    Attributes:
        reward: ``[S, n]`` training reward per iteration.
        clock: per clock of :data:`CLOCKS`, ``[S, n]`` its reading at each iteration.
        test: ``[S, m]`` held-out reward per evaluation.
        test_clock: per clock, ``[S, m]`` its reading at each evaluation (0 at the evaluation before training).
        final: ``[S]`` the final held-out reward (NaN for a run without one).
    """

    reward: np.ndarray
    clock: dict[str, np.ndarray]
    test: np.ndarray
    test_clock: dict[str, np.ndarray]
    final: np.ndarray


def _at_evaluations(run: dict, clock: str) -> list[float]:
    """The ``clock`` reading of a run at each of its evaluations (its train curve at the evaluation's iteration; 0 at
    the evaluation before training: ``estimator.mode: auto`` measures while it trains, in its iterations' clocks)."""
    col, it = TRAIN_CURVE.index(clock), TRAIN_CURVE.index("iterations")
    at = {p[it]: p[col] for p in run["train_curve"]}
    return [0.0 if p[it] == 0 else float(at.get(p[it], np.nan)) for p in run["test_curve"]]


def curves(runs: list[dict], n: int, m: int) -> Curves:
    """:class:`Curves` of one variant's ``runs`` (seed after seed), cut to ``n`` iterations and ``m`` evaluations."""
    column = lambda name: [[p[TRAIN_CURVE.index(name)] for p in r["train_curve"][:n]] for r in runs]
    return Curves(
        reward=np.array(column("reward")),
        clock={c: np.array(column(c), dtype=float) for c in CLOCKS},
        test=np.array([[p[TEST_CURVE.index("reward")] for p in r["test_curve"][:m]] for r in runs]),
        test_clock={c: np.array([_at_evaluations(r, c)[:m] for r in runs]) for c in CLOCKS},
        final=np.array([np.nan if r["final_test_reward"] is None else r["final_test_reward"] for r in runs]))


@dataclass
class Pair:
    """A variant's :class:`Curves` beside exact's, and how to compare them: the ``clock`` of time-to-target, its
    ``target`` (``train`` or ``test``), the trailing mean's ``w`` iterations and the plateau's ``k`` evaluations."""

    exact: Curves
    variant: Curves
    clock: str
    target: str
    w: int
    k: int = PLATEAU_EVALS

    def time_to_target_ratio(self, idx: np.ndarray, clock: str | None = None) -> tuple[float, bool]:
        """Exact's time to its own final reward over the variant's, on the seeds ``idx`` (a bootstrap resample), and
        whether the variant reached it (where it did not, the ratio is an upper bound)."""
        c = clock or self.clock
        ex, v = self.exact, self.variant
        if self.target == "test":
            goal = float(ex.test[idx][:, -1].mean())
            t_ex, _ = time_to_test_target(ex.test[idx], ex.test_clock[c][idx], goal)
            t_v, reached = time_to_test_target(v.test[idx], v.test_clock[c][idx], goal)
            return (t_ex / t_v if t_v > 0 else float("nan")), reached
        goal = float(ex.reward[idx][:, -self.w:].mean())
        t_ex, _ = time_to_target(ex.reward[idx], ex.clock[c][idx], goal, self.w)
        t_v, reached = time_to_target(v.reward[idx], v.clock[c][idx], goal, self.w)
        return t_ex / t_v, reached

    def lower_final_ratio(self, idx: np.ndarray) -> float:
        """Updates exact needs to reach the lower of the two seed-mean final held-out rewards / the variant's (the
        former ``measured_efficiency``: it mixes the rate with the plateau gap, see :meth:`rate`)."""
        ex, v = self.exact, self.variant
        if ex.test.shape[1] < 2:
            return float("nan")
        level = min(float(ex.test[idx][:, -1].mean()), float(v.test[idx][:, -1].mean()))
        u_ex, _ = time_to_test_target(ex.test[idx], ex.test_clock["iterations"][idx], level)
        u_v, _ = time_to_test_target(v.test[idx], v.test_clock["iterations"][idx], level)
        return u_ex / u_v if u_v > 0 and u_ex > 0 else float("nan")

    def rate(self, idx: np.ndarray) -> stats.Rate:
        """The rising-phase efficiency on the seeds ``idx`` (:func:`lab.statistics.rate`, updates)."""
        ex, v = self.exact, self.variant
        return stats.rate(ex.test[idx], ex.test_clock["iterations"][idx], v.test[idx], v.test_clock["iterations"][idx],
                          self.k)

    def gap(self, idx: np.ndarray) -> float:
        """The plateau gap on the seeds ``idx`` (:func:`lab.statistics.plateau_gap`)."""
        return stats.plateau_gap(self.exact.test[idx], self.variant.test[idx], self.k)

    def at_budget(self, idx: np.ndarray, scale: float | None = None) -> tuple[float, float, float]:
        """The held-out rewards of exact and the variant when the smaller of their two budgets runs out, and that
        budget: CPU seconds (``scale`` None) or, with ``scale`` = the variant's projected iteration ratio, the
        projected time in exact's iterations (the variant's iteration costs ``1 / scale`` of exact's)."""
        ex, v = self.exact, self.variant
        if scale is None:
            c_ex, c_v = ex.test_clock["cpu"][idx], v.test_clock["cpu"][idx]
        else:
            c_ex, c_v = ex.test_clock["iterations"][idx], v.test_clock["iterations"][idx] / scale
        budget = min(float(c_ex.mean(0)[-1]), float(c_v.mean(0)[-1]))
        return stats.at_budget(ex.test[idx], c_ex, budget), stats.at_budget(v.test[idx], c_v, budget), budget


def _median(runs: list[dict], key: str) -> float:
    """The median of ``key`` over runs (a run without it counts as NaN)."""
    return statistics.median(r.get(key) or np.nan for r in runs)


def _costs(exact_runs: list[dict], runs: list[dict]) -> dict:
    """Rows and seconds per update and iteration (medians over seeds), their ratios to exact's, and the ideal
    iteration ratio of the module docstring."""
    ex = {k: statistics.median(r[k] for r in exact_runs)
          for k in ("sample_s", "reward_s", "train_s", "iter_s", "rows_per_update")}
    rows = statistics.median(r["rows_per_update"] for r in runs)
    nograd = statistics.median(r["nograd_per_update"] for r in runs)
    iter_s = statistics.median(r["iter_s"] for r in runs)
    limit = 3 * ex["rows_per_update"] / (3 * rows + nograd) if rows else float("nan")
    sr = ex["sample_s"] + ex["reward_s"]
    return {"rows_per_update": rows, "nograd_per_update": nograd, "iter_s": iter_s,
            "train_s": statistics.median(r["train_s"] for r in runs), "iter_ratio": ex["iter_s"] / iter_s,
            "limit": limit, "iter_cpu_ratio": _median(exact_runs, "iter_cpu_s") / _median(runs, "iter_cpu_s"),
            "iter_ratio_ideal": (sr + ex["train_s"]) / (sr + ex["train_s"] / limit),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs)}


def _time_to_target(pair: Pair, boots: np.ndarray) -> dict:
    """Time to exact's final reward, exact / variant, on all seeds, with its interval over the resamples ``boots``."""
    ratio, reached = pair.time_to_target_ratio(np.arange(pair.exact.reward.shape[0]))
    bt = [pair.time_to_target_ratio(idx) for idx in boots]
    lo, hi = interval([b[0] for b in bt])
    return {"time_to_target_ratio": ratio, "reached": reached, "ratio_lo": lo, "ratio_hi": hi,
            "not_reached_share": float(np.mean([not b[1] for b in bt])),
            "undefined_share": float(np.mean([math.isnan(b[0]) for b in bt]))}


def _with_interval(key: str, value: float, resampled: list[float]) -> dict:
    """``{key: value, key_lo: .., key_hi: ..}``: a figure and its 95% interval over the resampled values."""
    lo, hi = interval(resampled)
    return {key: value, f"{key}_lo": lo, f"{key}_hi": hi}


def _nanmean(x: np.ndarray) -> float:
    """The mean of the entries that are not NaN; NaN, without numpy's warning, when none is (runs without a
    held-out evaluation: a diffusers config's)."""
    return float(np.nanmean(x)) if bool(np.any(~np.isnan(x))) else math.nan


def _final_rewards(pair: Pair, boots: np.ndarray, runs: list[dict]) -> dict:
    """The final held-out reward at equal updates, its paired difference to exact's and the evaluation's noise; the
    training reward at the start and at the end."""
    v, w = pair.variant, pair.w
    fin, diff = v.final, v.final - pair.exact.final
    fin_lo, fin_hi = interval([_nanmean(fin[idx]) for idx in boots])
    diff_lo, diff_hi = interval([_nanmean(diff[idx]) for idx in boots])
    sd = [r["final_test_reward_std"] for r in runs if r["final_test_reward_std"] is not None]
    return {"final_test_mean": _nanmean(fin), "final_test_lo": fin_lo, "final_test_hi": fin_hi,
            "diff_vs_exact": _nanmean(diff), "diff_lo": diff_lo, "diff_hi": diff_hi,
            "eval_se": statistics.fmean(sd) / np.sqrt(runs[0]["eval_images"]) if sd else None,
            "train_start": float(v.reward[:, :w].mean()), "train_end": float(v.reward[:, -w:].mean())}


def _per_update(pair: Pair, boots: np.ndarray, cpu_ratio: float) -> dict:
    """Updates to target with its interval, the time ratio they and the CPU-seconds iteration ratio estimate, the
    efficiency to the lower of the two final rewards, and the held-out gain over the start."""
    S, v = pair.exact.reward.shape[0], pair.variant
    updates = pair.time_to_target_ratio(np.arange(S), "iterations")[0]
    ups_lo, ups_hi = interval([pair.time_to_target_ratio(idx, "iterations")[0] for idx in boots])
    rec = {"target": pair.target, "updates_to_target_ratio": updates, "updates_ratio_lo": ups_lo,
           "updates_ratio_hi": ups_hi,
           # updates-to-target times the CPU-seconds iteration ratio measured in the same runs
           "time_ratio_estimate": updates * cpu_ratio, "time_ratio_estimate_lo": ups_lo * cpu_ratio,
           "time_ratio_estimate_hi": ups_hi * cpu_ratio,
           **_with_interval("efficiency_to_lower_final", pair.lower_final_ratio(np.arange(S)),
                            [pair.lower_final_ratio(idx) for idx in boots])}
    if v.test.shape[1]:
        gain = v.final - v.test[:, 0]
        rec.update({"test_start": float(np.nanmean(v.test[:, 0])), "test_gain": float(np.nanmean(gain))})
        rec["test_gain_lo"], rec["test_gain_hi"] = interval([float(np.nanmean(gain[idx])) for idx in boots])
    else:
        rec.update(dict.fromkeys(("test_start", "test_gain", "test_gain_lo", "test_gain_hi")))
    for k in ("", "_lo", "_hi"):
        rec[f"time_efficiency_to_lower_final{k}"] = rec[f"efficiency_to_lower_final{k}"] * cpu_ratio
    return rec


def _rate_and_plateau(pair: Pair, boots: np.ndarray) -> dict:
    """The rising-phase efficiency (each level of :data:`LEVELS` and their geometric mean ``rate``), its status and
    the smaller gain, and the plateau gap with the evaluations it averages; each figure with its interval. Fewer than
    two evaluations: every figure NaN, status ``no evaluations``."""
    m = pair.exact.test.shape[1]
    k = stats.plateau_count(m, pair.k)
    if m < 2:
        return {"rate": math.nan, "rate_status": "no evaluations", "plateau_evals": 0, "plateau_gap": math.nan,
                "late_rise": math.nan, "plateau_status": "unknown", "lag_gap": math.nan, "plateau_excess": math.nan,
                **{key: math.nan for key in LEVEL_KEYS}}
    every = np.arange(pair.exact.test.shape[0])
    full, resampled = pair.rate(every), [pair.rate(idx) for idx in boots]
    rec = {"rate_status": full.status, "rate_gain": full.gain, "plateau_evals": k,
           "plateau_from_iteration": float(pair.exact.test_clock["iterations"][:, -k].mean()),
           **_with_interval("rate", full.combined, [r.combined for r in resampled]),
           "rate_undefined_share": stats.undefined_share([r.combined for r in resampled]),
           **_with_interval("plateau_gap", pair.gap(every), [pair.gap(idx) for idx in boots]),
           **_with_interval("late_rise", stats.late_rise(pair.variant.test, pair.k),
                            [stats.late_rise(pair.variant.test[idx], pair.k) for idx in boots])}
    rec["plateau_status"] = _levelled(rec)
    rec.update(_lag(pair, boots, full.combined, [r.combined for r in resampled]))
    for j, key in enumerate(LEVEL_KEYS):
        rec.update(_with_interval(key, full.levels[j], [r.levels[j] for r in resampled]))
    return rec


def _lag(pair: Pair, boots: np.ndarray, rate: float, resampled: list[float]) -> dict:
    """The plateau gap the rate alone explains (``lag_gap``, :func:`lab.statistics.lag_gap`: exact's curve
    read at the rate times its updates) and the rest (``plateau_excess`` = ``plateau_gap - lag_gap``: a plateau of
    the variant's own), each with its interval (the same resamples)."""
    ex = pair.exact
    lag = lambda idx, r: stats.lag_gap(ex.test[idx], ex.test_clock["iterations"][idx], r, pair.k)
    every = np.arange(ex.test.shape[0])
    lags = [lag(idx, r) for idx, r in zip(boots, resampled)]
    excess = [pair.gap(idx) - g for idx, g in zip(boots, lags)]
    full = lag(every, rate)
    return {**_with_interval("lag_gap", full, lags),
            **_with_interval("plateau_excess", pair.gap(every) - full, excess)}


def _levelled(rec: dict) -> str:
    """``rising`` where the curve's late rise (:func:`lab.statistics.late_rise`) has an interval above 0: it
    had not levelled off where its plateau is read; ``levelled`` where the interval covers 0 or lies below;
    ``unknown`` without one."""
    lo = rec.get("late_rise_lo")
    if lo is None or not math.isfinite(lo):
        return "unknown"
    return "rising" if lo > 0 else "levelled"


def _budget(pair: Pair, boots: np.ndarray, scale: float | None = None, prefix: str = "budget") -> dict:
    """The held-out reward at an equal budget (:meth:`Pair.at_budget`: CPU seconds, or the projected time with
    ``scale``): the budget, exact's and the variant's reward then, and their difference with its interval."""
    if pair.exact.test.shape[1] < 2 or (scale is not None and not (math.isfinite(scale) and scale > 0)):
        return {f"{prefix}_diff": math.nan}
    ex, v, budget = pair.at_budget(np.arange(pair.exact.test.shape[0]), scale)
    diffs = []
    for idx in boots:
        b_ex, b_v, _ = pair.at_budget(idx, scale)
        diffs.append(b_v - b_ex)
    return {prefix: budget, f"{prefix}_exact": ex, f"{prefix}_reward": v, **_with_interval(f"{prefix}_diff", v - ex,
                                                                                           diffs)}


def _meter(runs: list[dict]) -> dict:
    """The meter's final prediction (each run's last audit) as medians over the seeds: per update
    (``meter_efficiency`` under SGD's model, ``meter_adam_efficiency``, ``meter_adam_tensor_efficiency``: the
    predicted efficiencies over the rows ratio, to set beside the measured ones), per CPU second
    (``meter_adam_time_efficiency``), ``meter_bias_z`` and ``meter_audits``. NaN without audits."""
    def med(values) -> float:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.median(values) if values else math.nan

    meters = [r["meter"] for r in runs if r.get("meter")]
    per_update = lambda key: med(m[key] / m["rows_ratio"] for m in meters
                                 if m.get(key) is not None and m.get("rows_ratio"))
    return {"meter_efficiency": per_update("predicted_efficiency"),
            "meter_adam_efficiency": per_update("predicted_adam_efficiency"),
            "meter_adam_tensor_efficiency": per_update("predicted_adam_tensor_efficiency"),
            "meter_adam_time_efficiency": med(m.get("predicted_adam_time_efficiency") for m in meters),
            "meter_bias_z": med(m.get("bias_z") for m in meters), "meter_audits": med(m.get("audits") for m in meters)}


def _projected(rec: dict, exact: dict, cost: CostStructure) -> dict:
    """The iteration ratio ``cost`` projects for the variant's rows and no-grad rows against exact's
    (:meth:`~jagg.cost.CostStructure.iteration_ratio`), ``projected_time_efficiency`` (with its
    interval) = ``efficiency_to_lower_final`` x that ratio, and ``projected_rate`` = the rising-phase efficiency x
    that ratio."""
    rows = exact["rows_per_update"]
    ratio = cost.iteration_ratio(rec["rows_per_update"] / rows, (rec["nograd_per_update"] - exact["nograd_per_update"])
                                 / rows) if rows else math.nan
    return {"projected_iter_ratio": ratio,
            **{f"projected_time_efficiency{k}": rec[f"efficiency_to_lower_final{k}"] * ratio for k in ("", "_lo", "_hi")},
            **{f"projected_rate{k}": rec.get(f"rate{k}", math.nan) * ratio for k in ("", "_lo", "_hi")}}


def _check(clock: str, target: str) -> None:
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}; got {clock!r}")
    if target not in TARGETS:
        raise ValueError(f"--target must be one of {TARGETS}; got {target!r}")


def compare(runs: list[dict], variants: list[str], seeds: list[int], clock: str = "wall",
            target: str = "train", cost: CostStructure | None = None, plateau_evals: int = PLATEAU_EVALS,
            bootstrap: int = stats.BOOTSTRAP) -> list[dict]:
    """Per variant: the paired statistics of :mod:`lab.quality`'s docstring (bootstrap over seeds).
    ``clock``: ``wall`` (wall-clock seconds), ``cpu`` (CPU seconds of the training process) or ``iterations`` for the
    time axis; ``target``: ``train`` (exact's final training reward) or ``test`` (exact's final held-out reward);
    ``cost``: the cost structure of the projected columns (None: none); ``plateau_evals``: the evaluations the
    plateau averages; ``bootstrap``: resamples."""
    _check(clock, target)
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    by = {v: [by_key[(v, s)] for s in seeds] for v in variants}
    n = min(len(r["train_curve"]) for rs in by.values() for r in rs)
    m = min(len(r["test_curve"]) for rs in by.values() for r in rs)
    if target == "test" and m < 2:
        raise ValueError("--target test needs at least two evaluations per run (eval.every > 0)")
    w = max(1, n // 10)
    cur = {v: curves(rs, n, m) for v, rs in by.items()}
    S = len(seeds)
    boots = resamples(S, bootstrap)
    out = []
    for v in variants:
        pair = Pair(cur["exact"], cur[v], clock, target, w, plateau_evals)
        costs = _costs(by["exact"], by[v])
        out.append({"kind": "variant", "variant": v, "seeds": S, "iterations": n, "smooth_iterations": w,
                    "evaluations": m, "updates": by[v][0]["updates"], **_time_to_target(pair, boots),
                    **_final_rewards(pair, boots, by[v]), **costs, "clock": clock,
                    **_per_update(pair, boots, costs["iter_cpu_ratio"]), **_rate_and_plateau(pair, boots),
                    **_budget(pair, boots), **_meter(by[v])})
    e = out[variants.index("exact")]
    if cost is not None:
        for v, r in zip(variants, out):
            r.update(_projected(r, e, cost))
            pair = Pair(cur["exact"], cur[v], clock, target, w, plateau_evals)
            r.update(_budget(pair, boots, r["projected_iter_ratio"], "projected_budget"))
    for r in out:
        r["within_exact_interval"] = bool(e["final_test_lo"] <= r["final_test_mean"] <= e["final_test_hi"])
        r["drifted"] = r["train_end"] < r["train_start"]
    return out if S > 1 else [without_intervals(r) for r in out]


def without_intervals(rec: dict) -> dict:
    """A variant's record of one seed: its intervals are over seeds, so there are none (None: undefined), never a
    "95% interval" of zero width."""
    out = {k: (None if k.endswith(("_lo", "_hi")) else v) for k, v in rec.items()}
    out["within_exact_interval"] = None
    return out
