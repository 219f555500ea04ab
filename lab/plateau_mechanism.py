"""Which mechanism sets JAGG's plateau gap: the lag of its rate, a noise floor or a biased fixed point?

Reads the runs of one ``python -m lab quality`` output directory (``OUT/<variant>/seed<k>/result.json``) and compares
variants in pairs, each against its own reference (the same seeds, paired), with the bench's own statistics
(:func:`lab.quality_compare.compare`): the rising-phase rate, the plateau gap, the final held-out difference
and the difference at an equal CPU budget, each with its 95% bootstrap interval over seeds. Then each pair's plateau
gap minus the first pair's, bootstrapped with the same seed resamples (a paired contrast).

The two mechanisms predict different contrasts against plain JAGG's gap at a constant learning rate:

- **noise floor** (the stationary gap grows with the update's variance): the gap closes with a decaying learning
  rate (decayed pair: contrast > 0) and with a batch enlarged to exact's total variance (enlarged pair: contrast > 0),
  and the unbiased correction, which adds variance, does not close it (contrast <= 0);
- **biased fixed point** (a repeating error ``b`` that does not vanish where exact's gradient does): the decay and the
  larger batch leave the gap (contrasts ~ 0); the unbiased correction closes it (contrast > 0).

With ``--predict VARIANT:REFERENCE=LO:HI`` (or ``=RATE``, ``=RATE:LO:HI``, ``=unknown``) it also sets a predicted
per-update rate of that pair (the meter's range, ``jagg bench meter``'s ``rate/update``) against the measured
one, and the plateau gap that rate predicts where the gap is a lag (the variant's own plateau 0, the gap the
reference's curve read at the rate times its updates, :func:`lag_gap`), each marked inside or outside the measured
95% interval (a point inside it, a range overlapping it; ``unknown``: no judgement).

Usage (the runs are trained by ``python -m lab quality``: lab/README.md)::

    python -m lab plateau --out runs/q_main --seeds 5 \
        --pair plain:exact --pair plain_cos:exact_cos --pair plain_big:exact --pair unb:exact
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from jagg.arguments import overwrite_argument
from jagg.bench.common import fmt, table
from jagg.infra.atomic import write_json
from jagg.checks import check_output_file
from jagg.infra.config_loader import differences
from lab.quality_compare import Curves, compare, curves
from lab.quality_runs import read_result
from lab.statistics import PLATEAU_EVALS, interval, lag_gap, plateau_gap, resamples

BOOTSTRAP = 2000
FIGURES = ("rate", "plateau_gap", "lag_gap", "plateau_excess", "final_diff", "budget_diff")


def load_runs(out: Path, variants: set[str], seeds: list[int]) -> dict[tuple[str, int], dict]:
    """``{(variant, seed): result}`` of every finished run asked for, each checked for its shape
    (:func:`lab.quality_runs.read_result`); a missing one is an error naming it."""
    runs, missing = {}, []
    for v in sorted(variants):
        for s in seeds:
            path = out / v / f"seed{s}" / "result.json"
            if path.is_file():
                runs[(v, s)] = {**read_result(path), "variant": v, "seed": s, "path": str(path)}
            else:
                missing.append(str(path))
    if missing:
        raise ValueError(f"unfinished runs (train them with python -m lab quality --train-only first): {missing}")
    return runs


def checked_seeds(args: argparse.Namespace) -> list[int]:
    """The seeds ``0 .. --seeds - 1`` of a script that reads stored runs, after checking what can be checked before
    any run is read: at least 2 seeds (the intervals are over seeds) and ``--json`` a file it may write."""
    if args.seeds < 2:
        raise ValueError("--seeds must be >= 2: the intervals are over seeds")
    if args.json is not None:
        check_output_file(args.json, "--json", args.overwrite, (".json",))
    return list(range(args.seeds))


def check_settings(runs: dict, pairs: list[tuple[str, str]], seeds: list[int]) -> None:
    """Results made under other settings are never compared as if they were one experiment: a variant's seeds must
    have been trained with one config but for the seed (and ``log.*``), and the two runs of a pair evaluated alike
    (the same ``eval.*``); a ValueError names the two results and the first key that differs."""
    for v in sorted({v for pair in pairs for v in pair}):
        first = runs[(v, seeds[0])]
        for s in seeds[1:]:
            diff = differences(first["config"], runs[(v, s)]["config"], ("seed", "log."))
            if diff:
                key, a, b = diff[0]
                raise ValueError(f"{runs[(v, s)]['path']} was trained with other settings than {first['path']} "
                                 f"({key}: {b!r} and {a!r}): a variant's seeds may differ in their seed alone; train "
                                 "them again into one --out with one python -m lab quality command")
    for variant, reference in pairs:
        a, b = (runs[(x, seeds[0])]["config"] for x in (variant, reference))
        diff = [d for d in differences(a, b) if d[0].startswith("eval.")]
        if diff:
            key, x, y = diff[0]
            raise ValueError(f"--pair {variant}:{reference}: the two were evaluated differently ({key}: {x!r} and "
                             f"{y!r}), so their held-out curves are not comparable; compare runs evaluated alike")


def parse_pair(spec: str) -> tuple[str, str]:
    variant, colon, reference = spec.partition(":")
    if not colon or not variant or not reference or variant == reference:
        raise ValueError(f"--pair {spec!r}: give VARIANT:REFERENCE, two different variant names")
    return variant, reference


def parse_prediction(spec: str) -> tuple[tuple[str, str], tuple[float | None, float, float] | None]:
    """``VARIANT:REFERENCE=RATE``, ``=LO:HI`` (a range, the meter's answer), ``=RATE:LO:HI`` or ``=unknown`` ->
    ``((variant, reference), (rate, lo, hi))`` (rate None for a range; None for unknown), each a rate in (0, 10]
    with lo <= rate <= hi."""
    pair, eq, values = spec.partition("=")
    if eq and values == "unknown":
        return parse_pair(pair), None
    try:
        nums = [float(x) for x in values.split(":")]
    except ValueError:
        nums = []
    if not eq or len(nums) not in (1, 2, 3):
        raise ValueError(f"--predict {spec!r}: give VARIANT:REFERENCE= RATE, LO:HI, RATE:LO:HI (numbers) or unknown")
    rate, lo, hi = {1: (nums[0],) * 3, 2: (None, *nums), 3: tuple(nums)}[len(nums)]
    if not all(0 < x <= 10 for x in nums) or not lo <= (lo if rate is None else rate) <= hi:
        raise ValueError(f"--predict {spec!r}: the rates must lie in (0, 10] with LO <= RATE <= HI")
    return parse_pair(pair), (rate, lo, hi)


def predicted(ref: Curves, rec: dict, rates: tuple[float | None, float, float] | None) -> dict:
    """A predicted rate and the plateau gap it predicts (the reference's curve ``ref`` read at that rate times its
    updates) beside the measured ones: each ``*_inside`` is whether a predicted point lies in the measured 95%
    interval, or a predicted range (no point) overlaps it; None (no judgement) for a prediction of ``unknown`` and
    where the measured interval is undefined (NaN: a rate these curves cannot give), never OUTSIDE of nothing."""
    if rates is None:
        return {"predicted_rate": "unknown", "rate_inside": None, "predicted_gap": "unknown", "gap_inside": None}
    gap = [None if r is None else lag_gap(ref.test, ref.test_clock["iterations"], r, PLATEAU_EVALS) for r in rates]

    def inside(point, lo, hi, key):
        m_lo, m_hi = rec.get(key + "_lo"), rec.get(key + "_hi")
        if not (defined(m_lo) and defined(m_hi)) or not all(defined(x) for x in (lo, hi)):
            return None                                  # the measured interval (or the prediction's) is undefined
        return bool(m_lo <= point <= m_hi) if point is not None else bool(lo <= m_hi and m_lo <= hi)

    g_lo, g_hi = min(gap[1:]), max(gap[1:])
    return {"predicted_rate": rates[0], "predicted_rate_lo": rates[1], "predicted_rate_hi": rates[2],
            "rate_inside": inside(rates[0], rates[1], rates[2], "rate"), "predicted_gap": gap[0],
            "predicted_gap_lo": g_lo, "predicted_gap_hi": g_hi,
            "gap_inside": inside(gap[0], g_lo, g_hi, "plateau_gap")}


def defined(x) -> bool:
    """Whether ``x`` is a number that was computed (not None, not NaN)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def pair_figures(runs: dict, variant: str, reference: str, seeds: list[int]) -> dict:
    """The bench's comparison of ``variant`` against ``reference`` (relabelled as the bench's ``exact``)."""
    rs = [{**runs[(reference, s)], "variant": "exact"} for s in seeds] + [runs[(variant, s)] for s in seeds]
    rec = compare(rs, ["exact", variant], seeds, clock="cpu", target="test", bootstrap=BOOTSTRAP)[1]
    final = {"final_diff": rec["diff_vs_exact"], "final_diff_lo": rec["diff_lo"], "final_diff_hi": rec["diff_hi"]}
    return {"pair": f"{variant} - {reference}", **final,
            **{k: rec.get(k) for k in rec if any(k.startswith(f) for f in FIGURES)}}


def pair_curves(runs: dict, variant: str, reference: str, seeds: list[int]) -> tuple[Curves, Curves]:
    """The reference's and the variant's :class:`Curves`, cut to the iterations and evaluations both have."""
    n = min(len(runs[(v, s)]["train_curve"]) for v in (variant, reference) for s in seeds)
    m = min(len(runs[(v, s)]["test_curve"]) for v in (variant, reference) for s in seeds)
    return tuple(curves([runs[(v, s)] for s in seeds], n, m) for v in (reference, variant))


def gaps(ref: Curves, cur: Curves, boots: np.ndarray) -> tuple[float, np.ndarray]:
    """The plateau gap on every seed and on each bootstrap resample of the seeds (the same resamples for each pair)."""
    ref, cur = ref.test, cur.test
    return plateau_gap(ref, cur), np.array([plateau_gap(ref[idx], cur[idx]) for idx in boots])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab plateau", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the python -m lab quality output directory (--out) of the runs")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 [default: 5]")
    p.add_argument("--pair", action="append", metavar="VARIANT:REFERENCE",
                   help="a variant and its reference (repeatable); the first pair is the contrasts' baseline "
                        "[default: plain:exact plain_cos:exact_cos plain_big:exact unb:exact]")
    p.add_argument("--predict", action="append", default=[], metavar="VARIANT:REFERENCE=LO:HI",
                   help="a predicted per-update rate of a pair's variant against its reference: the meter's range "
                        "LO:HI, a point RATE, RATE:LO:HI, or unknown; set against the measured rate and, through the "
                        "lag, the measured plateau gap (repeatable)")
    p.add_argument("--json", help="also write the records to this JSON file")
    overwrite_argument(p, "--json")
    args = p.parse_args(argv)
    seeds = checked_seeds(args)
    pairs = [parse_pair(s) for s in (args.pair or ["plain:exact", "plain_cos:exact_cos", "plain_big:exact",
                                                    "unb:exact"])]
    predictions = dict(parse_prediction(s) for s in args.predict)
    unknown = set(predictions) - set(pairs)
    if unknown:
        raise ValueError(f"--predict names pairs that no --pair compares: {sorted(':'.join(u) for u in unknown)}")
    runs = load_runs(Path(args.out), {v for pair in pairs for v in pair}, seeds)
    check_settings(runs, pairs, seeds)
    boots = resamples(len(seeds), BOOTSTRAP)
    base, base_boot = gaps(*pair_curves(runs, *pairs[0], seeds), boots)
    records = []
    for variant, reference in pairs:
        rec = pair_figures(runs, variant, reference, seeds)
        ref, cur = pair_curves(runs, variant, reference, seeds)
        gap, gap_boot = gaps(ref, cur, boots)
        lo, hi = interval(gap_boot - base_boot)
        rec = {**rec, "gap_minus_baseline": gap - base, "gap_minus_baseline_lo": lo, "gap_minus_baseline_hi": hi}
        if (variant, reference) in predictions:
            rec.update(predicted(ref, rec, predictions[(variant, reference)]))
        records.append(rec)
    num = lambda v: fmt(v) if defined(v) else "undefined"
    show = lambda r, k: (f"{num(r.get(k))} [{num(r.get(k + '_lo'))}, {num(r.get(k + '_hi'))}]" if defined(r.get(k))
                         else "undefined")
    rows = [{"pair": r["pair"], **{k: show(r, k) for k in FIGURES + ("gap_minus_baseline",)}} for r in records]
    print(table(rows, [("pair", "pair", "s")] + [(k, k, "s") for k in FIGURES + ("gap_minus_baseline",)]))
    said = [r for r in records if "predicted_rate" in r]
    if said:
        mark = lambda ok: "no judgement" if ok is None else "inside" if ok else "OUTSIDE"   # None: unknown or undefined
        said_as = lambda r, k: ("unknown" if r[k] == "unknown" else show(r, k) if r[k] is not None
                                else f"[{num(r[k + '_lo'])}, {num(r[k + '_hi'])}]")
        print("\nthe predictions against the measured 95% intervals (the gap predicted as the lag of the rate; a "
              "range without a point is inside where it overlaps the interval):")
        print(table([{"pair": r["pair"], "rate": f"{said_as(r, 'predicted_rate')}: {mark(r['rate_inside'])}",
                      "gap": f"{said_as(r, 'predicted_gap')}: {mark(r['gap_inside'])}"} for r in said],
                    [("pair", "pair", "s"), ("rate", "predicted rate", "s"), ("gap", "predicted plateau gap", "s")]))
    if args.json:
        write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
