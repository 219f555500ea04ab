"""The report of ``python -m lab quality``: its tables (the columns of each, printed by :func:`print_report`) and its
plot (:func:`plot`). The figures are computed in :mod:`lab.quality_compare`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jagg.infra.atomic import atomic_write
from jagg.bench.common import table
from lab.machine_load import load_warning
from lab.quality_compare import TEST_CURVE, curves
from lab.statistics import smooth

def plot(runs: list[dict], path: Path, title: str = "GRPO on the shapes world", clock: str = "wall") -> None:
    """Two panels against the time of training iterations (``clock``: wall-clock or CPU seconds, mean over seeds):
    the training reward (smoothed trailing mean, 10% of the iterations) and the held-out test reward (band = min-max
    over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    for v, rs in by.items():
        n = min(len(r["train_curve"]) for r in rs)
        if n == 0:
            continue
        m = min(len(r["test_curve"]) for r in rs)
        cur = curves(rs, n, m)
        wall = cur.clock[clock].mean(0)
        per_iter = wall[-1] / n                          # test points: at their iteration's time
        line, = axes[0].plot(wall, smooth(cur.reward.mean(0), max(1, n // 10)), label=f"{v} ({len(rs)} seeds)")
        if m:
            at = TEST_CURVE.index("iterations")
            tw = np.array([p[at] for p in rs[0]["test_curve"][:m]], dtype=float) * per_iter
            axes[1].plot(tw, cur.test.mean(0), "o-", ms=3, color=line.get_color(), label=v)
            if len(rs) > 1:
                axes[1].fill_between(tw, cur.test.min(0), cur.test.max(0), color=line.get_color(), alpha=0.15)
    axes[0].set_ylabel("training reward (smoothed)")
    axes[1].set_ylabel("test reward (held-out prompts)")
    for ax in axes:
        ax.set_xlabel({"wall": "wall-clock seconds of training iterations (mean over seeds)",
                       "cpu": "CPU seconds of training iterations (mean over seeds)",
                       "iterations": "iterations (= optimizer updates)"}[clock])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:           # a diffusers config's runs: no held-out curve
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: reward against {dict(wall='wall-clock time', cpu='CPU time').get(clock, 'updates')}, "
                 "exact vs JAGG")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)


VARIANT_COLUMNS = [
    ("variant", "variant", ""), ("seeds", "seeds", ""), ("time_to_target_ratio", "time-to-target", ".2f"),
    ("ratio_lo", "lo", ".2f"), ("ratio_hi", "hi", ".2f"), ("not_reached_share", "unreached", ".2f"),
    ("time_ratio_estimate", "updates x cpu", ".2f"), ("time_ratio_estimate_lo", "lo", ".2f"),
    ("time_ratio_estimate_hi", "hi", ".2f"), ("test_gain", "test gain", "+.3f"),
    ("final_test_mean", "final test", ".3f"), ("final_test_lo", "lo", ".3f"), ("final_test_hi", "hi", ".3f"),
    ("diff_vs_exact", "- exact", "+.3f"), ("diff_lo", "lo", "+.3f"), ("diff_hi", "hi", "+.3f"),
    ("eval_se", "eval SE", ".3f"), ("train_start", "train start", ".3f"), ("train_end", "end", ".3f"),
    ("rows_per_update", "rows/upd", ".0f"), ("iter_ratio", "iter ratio", ".2f"), ("iter_ratio_ideal", "ideal", ".2f")]
# the rate and the plateau (cells "value [lo, hi]", built by rate_rows)
RATE_COLUMNS = [
    ("variant", "variant", ""), ("rate_gain", "smaller gain", "+.3f"), ("rate_25_ci", "rate 25%", ""),
    ("rate_50_ci", "rate 50%", ""), ("rate_75_ci", "rate 75%", ""), ("rate_ci", "rate (geo. mean)", ""),
    ("plateau_gap_ci", "plateau gap", ""), ("lag_gap_ci", "of it: lag", ""), ("plateau_excess_ci", "own plateau", ""),
    ("late_rise_ci", "late rise", ""), ("plateau_status", "plateau", ""),
    ("budget", "CPU budget s", ".1f"), ("budget_exact", "exact", ".3f"),
    ("budget_reward", "variant", ".3f"), ("budget_diff_ci", "- exact", ""),
    ("projected_budget_diff_ci", "projected: - exact", "")]
METER_COLUMNS = [
    ("variant", "variant", ""), ("rate", "rate", ".2f"), ("efficiency_to_lower_final", "to lower final", ".2f"),
    ("efficiency_to_lower_final_lo", "lo", ".2f"), ("efficiency_to_lower_final_hi", "hi", ".2f"),
    ("meter_adam_efficiency", "meter: Adam", ".2f"), ("meter_adam_tensor_efficiency", "per tensor", ".2f"),
    ("meter_efficiency", "SGD", ".2f"), ("meter_bias_z", "bias z", ".1f"),
    ("time_efficiency_to_lower_final", "per CPU s", ".2f"), ("meter_adam_time_efficiency", "meter: Adam", ".2f"),
    ("projected_iter_ratio", "projected: iter ratio", ".2f"), ("projected_rate", "rate", ".2f"),
    ("projected_time_efficiency", "to lower final", ".2f"), ("projected_time_efficiency_lo", "lo", ".2f"),
    ("projected_time_efficiency_hi", "hi", ".2f")]
RUN_COLUMNS = [("variant", "variant", ""), ("seed", "seed", ""), ("updates", "updates", ""),
               ("final_test_reward", "final test", ".3f"), ("iter_s", "iter s", ".2f"), ("wall_s", "wall s", ".0f"),
               ("rows_per_update", "rows/upd", ".0f"), ("trained_with", "auto chose", ""),
               ("preflight_cpu_s", "measured: CPU s", ".0f"), ("load_mean", "load", ".1f")]


def run_rows(runs: list[dict]) -> list[dict]:
    """The runs as :data:`RUN_COLUMNS` shows them: with an ``estimator.mode: auto`` run's decision and its measurement's
    CPU seconds, and the machine's mean load while it trained (:mod:`lab.machine_load`)."""
    return [{**r, "trained_with": (r.get("preflight") or {}).get("train_with", ""),
             "preflight_cpu_s": (r.get("preflight") or {}).get("preflight_cpu_s"),
             "load_mean": (r.get("load") or {}).get("mean")} for r in runs]


def with_interval(r: dict, key: str, spec: str = ".2f", unreached: str = "unreached") -> str:
    """``"value [lo, hi]"`` of ``key`` in ``r`` (its ``_lo``, ``_hi``); ``unreached`` where the value is undefined
    (NaN or absent), ``-`` where the record has no such figure."""
    if key not in r:
        return "-"
    value = r[key]
    if value is None or not np.isfinite(value):
        return unreached
    lo, hi = r.get(f"{key}_lo"), r.get(f"{key}_hi")
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return format(value, spec)
    return f"{value:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def rate_rows(summary: list[dict]) -> list[dict]:
    """The rows of :data:`RATE_COLUMNS`: each figure with its interval in one cell; a rate without a gain to read
    (``rate_status`` not ``ok``) reads "unreached (<why>)"."""
    rows = []
    for r in summary:
        why = "unreached" if r.get("rate_status") in (None, "ok") else f"unreached ({r['rate_status']})"
        row = dict(r)
        for key in ("rate_25", "rate_50", "rate_75", "rate"):
            row[f"{key}_ci"] = with_interval(r, key, ".2f", why)
        for key in ("plateau_gap", "lag_gap", "plateau_excess", "late_rise", "budget_diff", "projected_budget_diff"):
            row[f"{key}_ci"] = with_interval(r, key, "+.3f", "n/a")
        rows.append(row)
    return rows


def print_report(runs: list[dict], summary: list[dict], seeds: list[int], cost_line: str) -> None:
    """The tables of ``python -m lab quality``: the runs, the variants' time to target and final rewards, the rate and
    the plateau, and the meter and the projection beside the measured efficiencies."""
    print("\nruns (auto chose: estimator.mode auto's decision; its measurement's CPU seconds are in the run's)")
    print(table(run_rows(runs), RUN_COLUMNS))
    if (warning := load_warning(runs)) is not None:
        print(warning)
    spread = ("95% bootstrap intervals" if len(seeds) > 1 else "one seed: no intervals, which are over seeds (give "
              "--seeds 2 or more)")
    print(f"\nper variant, paired over seeds {seeds[0]}..{seeds[-1]} ({spread}; time-to-target and "
          "iteration ratios are exact / variant)")
    print(table(summary, VARIANT_COLUMNS))
    k = summary[0].get("plateau_evals", 0) if summary else 0
    shown = "value [95% interval]" if len(seeds) > 1 else "value; one seed: no interval"
    print(f"\nrate and plateau (held-out reward; {shown}): rate at 25/50/75% = exact's updates to that "
          "share of the smaller of the two gains / the variant's, and their geometric mean; plateau gap = the "
          f"variant's mean over its last {k} evaluations - exact's, of it the lag = the gap the rate alone explains "
          f"(exact's curve read at the rate x its updates) and own plateau = the rest; late rise = a curve's last {k} "
          f"evaluations - the {k} "
          "before them, plateau 'rising' where its interval is above 0 (not levelled off: a gap read against a rising "
          "exact is part rate, not plateau); at an equal budget = both held-out rewards when "
          "the smaller of the two CPU-second budgets runs out (projected: in the projected time of the cost "
          "structure below)")
    print(table(rate_rows(summary), RATE_COLUMNS))
    print("\nthe measured per-update efficiencies (rate; to lower final = exact's updates to the lower of the two "
          "final held-out rewards / the variant's, which mixes the rate with the plateau) beside the meter's final "
          "prediction (the runs' last audit, with estimator.meter_every; median over seeds) and, projected, not "
          f"measured: the measured figures times the iteration ratio of {cost_line}")
    print(table(summary, METER_COLUMNS))
