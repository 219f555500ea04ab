"""The meter's answer and the decision it supports: which estimator to train with.

:func:`prediction` turns one measurement of an estimator's error against the update's noise (a record of ``jagg bench
meter``, :func:`jagg.meter.error_noise_stats`' terms with the iteration ratio measured beside them) into a per-update
rate of exact's as a range, or ``unknown`` where no model holds; :func:`job_prediction` averages the ranges over the
update positions of a rollout. :func:`verdict` decides: a candidate is recommended only when, at every update position
of the job, its range is known and its low end times the iteration ratio clears exact's progress per second by a
margin; otherwise exact. "Never below exact" is the promise, so every doubt (an unresolved error, a repeating one, a
position not measured) falls to exact. ``jagg bench meter`` prints the verdict; ``estimator.mode: auto`` trains with
it (:mod:`jagg.trainers.auto`).
"""

from __future__ import annotations

import math
import statistics

from .checks import check_count, check_fields, check_number, is_finite_number
from .estimator_config import EstimatorConfig
from .meter import adam_efficiency, predicted_efficiency

# the widest range of a per-update rate the meter still answers with (docs/design.md §3.8): a wider one cannot tell
# an estimator that keeps most of exact's learning from one that loses most of it
MAX_RANGE = 0.5
# the margin by which a candidate's low end must clear exact's progress per second (estimator.preflight_margin)
MARGIN = 0.1
# the largest bias^2 / signal^2 a repeating error may have: a bias b at right angles to the signal s turns the direction
# Adam integrates by an angle whose cosine is 1 / sqrt(1 + |b|^2 / |s|^2), which keeps 1 / (1 + MARGIN) of the progress
# along the signal at this ratio
MAX_BIAS_TO_SIGNAL = (1 + MARGIN) ** 2 - 1


def rate_range(error_to_noise: float, se: float) -> tuple[float, float]:
    """The per-update rate (of exact's) an unbiased error ``E|e|^2/V_b = error_to_noise`` (jackknife SE ``se``) leaves:
    from SGD's variance model at the error's upper end ``+ 2 SE`` to Adam's first-order model at its lower end
    ``- 2 SE`` (clamped at 0). Paired seeds fell between the two models and on both of their sides
    (docs/results.md), so neither alone is the prediction. Both are finite numbers >= 0."""
    check_number(error_to_noise, "error_to_noise", 0.0, why="E|e|^2 / V_b")
    check_number(se, "se", 0.0, why="its standard error")
    return predicted_efficiency(1.0, error_to_noise + 2 * se), adam_efficiency(1.0, max(error_to_noise - 2 * se, 0.0))


RECORD = {"estimator": "string", "error_to_noise": "number|nan", "error_to_noise_se": "number|nan",
          "iter_ratio": "number", "bias_z": "number|nan|null", "projected_iter_ratio": "number|nan|null"}


def _checked(rec: dict) -> dict:
    """A meter record's terms checked by name before any decision: ``iter_ratio`` a finite number > 0,
    ``error_to_noise`` and its ``_se`` finite numbers >= 0 or NaN (not measured: the answer is ``unknown``),
    ``bias_z`` None, NaN or finite, ``projected_iter_ratio`` (when given) None, NaN or a finite number > 0. An
    infinite ratio or a negative SE would otherwise project ``inf-inf`` and pass any bar."""
    where = f"the meter record of {rec.get('estimator')!r}" if isinstance(rec, dict) else "a meter record"
    check_fields(rec, RECORD, where, optional=("estimator", "projected_iter_ratio"))
    for key, strict in (("iter_ratio", True), ("error_to_noise", False), ("error_to_noise_se", False),
                        ("projected_iter_ratio", True)):
        if is_finite_number(rec.get(key)):
            check_number(rec[key], f"{where}: {key}", 0.0, strict=strict)
    return rec


def prediction(rec: dict) -> dict:
    """The meter's answer for one estimator's record: the per-update rate between SGD's model at the error's upper end
    and Adam's at its lower end (:func:`rate_range`: ``rate_lo``, ``rate_hi``; times the iteration ratio
    ``time_rate_lo``, ``time_rate_hi``) and ``prediction``: ``range``, or ``unknown`` where the models do not hold, a
    significant repeating error (``bias_z >= 2``), a repeating error not shown small against the signal
    (:func:`bias_against_signal`), or where the range is wider than :data:`MAX_RANGE` (a heavy-tailed error that these
    batches do not resolve: more ``--batches`` narrow it). ``prediction_range`` prints it. For a job of ``U`` updates
    per iteration the per-update rate is the mean of the ranges at ``--update 0 .. U-1``."""
    e, se = _checked(rec)["error_to_noise"], rec["error_to_noise_se"]
    lo, hi = (math.nan, math.nan) if math.isnan(e) or math.isnan(se) else rate_range(e, se)
    ratio, z = rec["iter_ratio"], rec["bias_z"]
    if z is not None and math.isfinite(z) and z >= 2:
        why = "unknown: a significant repeating error (bias z >= 2)"
    elif (against := bias_against_signal(rec)) is not None:
        why = f"unknown: {against}"
    elif not hi - lo <= MAX_RANGE:
        why = f"unknown: the error is not resolved (the range is wider than {MAX_RANGE}: measure more --batches)"
    else:
        why = "range"
    return {"rate_lo": lo, "rate_hi": hi, "time_rate_lo": ratio * lo, "time_rate_hi": ratio * hi, "prediction": why,
            "prediction_range": f"{lo:.2f}-{hi:.2f}" if why == "range" else "unknown"}


def bias_against_signal(rec: dict) -> str | None:
    """Why a record's repeating error cannot be trusted against the gradient's signal, or None. Adam integrates a
    repeating error (a bias) as it integrates the signal, so what it costs is its size against the signal, not against
    the noise; a small bias against the noise can still turn the step where the signal is smaller still. For an
    estimator that is not unbiased by construction (the record's ``estimator_config``,
    :attr:`jagg.EstimatorConfig.unbiased`), the bias's upper end (``bias_to_noise`` + 2 SE) must be at most
    :data:`MAX_BIAS_TO_SIGNAL` times the signal's lower end (``signal_to_noise`` - 2 SE, both against ``V_b``); a
    signal that reaches 0 within 2 SE bounds nothing. A record without these terms is not judged here."""
    config = rec.get("estimator_config")
    terms = [rec.get(k) for k in ("bias_to_noise", "bias_to_noise_se", "signal_to_noise", "signal_to_noise_se")]
    if not isinstance(config, dict) or not all(is_finite_number(t) for t in terms):
        return None
    if EstimatorConfig.from_dict(config).unbiased:
        return None
    bias_hi, signal_lo = max(terms[0] + 2 * terms[1], 0.0), terms[2] - 2 * terms[3]
    if bias_hi <= MAX_BIAS_TO_SIGNAL * max(signal_lo, 0.0):
        return None
    if signal_lo <= 0:
        return (f"a repeating error against a signal not resolved (bias^2 / V_b up to {bias_hi:.3f}, |E g|^2 / V_b "
                f"{terms[2]:.3f} +- {terms[3]:.3f})")
    return (f"a repeating error not shown small against the signal (bias^2 / signal^2 up to {bias_hi / signal_lo:.2f}, "
            f"above {MAX_BIAS_TO_SIGNAL:.2f})")


def job_prediction(per_update: list[list[dict]]) -> list[dict]:
    """The meter's answer for a job of ``U`` optimizer updates per iteration, from its records at ``--update 0 .. U-1``
    (``per_update[u]``: the records at position ``u``, the same estimators in the same order). Per estimator:
    ``rate_lo``, ``rate_hi`` (and ``time_rate_lo``, ``time_rate_hi``), the means of the positions' :func:`prediction`
    ranges, for the job's per-update rate is the mean of its updates'; ``prediction`` is ``range`` only where every
    position's is, else the first position's reason, with ``unknown_at`` listing the positions; ``positions`` prints
    each position's range."""
    if not per_update:
        raise ValueError("job_prediction: no update positions given")
    names = [r["estimator"] for r in per_update[0]]
    for u, recs in enumerate(per_update):
        if [r["estimator"] for r in recs] != names:
            raise ValueError(f"job_prediction: update {u} measured the estimators {[r['estimator'] for r in recs]}, "
                             f"update 0 measured {names}")
    out = []
    for i, name in enumerate(names):
        preds = [prediction(recs[i]) for recs in per_update]
        unknown = [u for u, p in enumerate(preds) if p["prediction"] != "range"]
        mean = {k: statistics.fmean(p[k] for p in preds) for k in ("rate_lo", "rate_hi", "time_rate_lo", "time_rate_hi")}
        out.append({"kind": "job", "estimator": name, "updates": len(per_update), **mean,
                    "prediction": preds[unknown[0]]["prediction"] if unknown else "range", "unknown_at": unknown,
                    "prediction_range": "unknown" if unknown else f"{mean['rate_lo']:.2f}-{mean['rate_hi']:.2f}",
                    "positions": " ".join(p["prediction_range"] for p in preds)})
    return out


def position_failure(rec: dict, margin: float = MARGIN) -> str | None:
    """Why one measured update position does not clear the verdict's bar, or None when it does: its range is known
    (:func:`prediction`) and its low end times the measured iteration ratio is at least ``1 + margin``."""
    check_number(margin, "margin", 0.0, why="the share by which a candidate must clear exact")
    p = prediction(rec)
    if p["prediction"] != "range":
        cause = p["prediction"].removeprefix("unknown: ").split(" (")[0]         # e.g. "the error is not resolved"
        return f"unknown ({cause})"
    if not p["time_rate_lo"] >= 1 + margin:
        return f"low end {p['time_rate_lo']:.3f} x exact's progress per second, below {1 + margin:.3f}"
    return None


def _candidate(name: str, recs: dict[int, dict], updates: int, margin: float, missing: str) -> dict:
    """One candidate's verdict over the job's ``updates`` positions (``recs``: its record at each measured one)."""
    out = {"estimator": name, "passes": False, "why": None}
    for u in range(updates):
        rec = recs.get(u)
        why = f"not measured ({missing})" if rec is None else position_failure(rec, margin)
        if why is not None:
            out["why"] = f"update {u}: {why}" if updates > 1 or rec is None else why
            break
    measured = [recs[u] for u in sorted(recs)]
    if measured:
        preds = [prediction(r) for r in measured]
        for k in ("rate_lo", "rate_hi", "time_rate_lo", "time_rate_hi"):
            out[k] = statistics.fmean(p[k] for p in preds)
        out["iter_ratio"] = statistics.fmean(r["iter_ratio"] for r in measured)
        projected = [r.get("projected_iter_ratio") for r in measured]
        if all(x is not None and math.isfinite(x) for x in projected):
            out["projected_lo"] = statistics.fmean(p["rate_lo"] * x for p, x in zip(preds, projected))
            out["projected_hi"] = statistics.fmean(p["rate_hi"] * x for p, x in zip(preds, projected))
        out["positions"] = " ".join(p["prediction_range"] for p in preds)
    out["passes"] = out["why"] is None
    return out


def verdict(records: list[dict], updates: int, margin: float = MARGIN, cost: str | None = None,
            missing: str = "--update all measures every position") -> dict:
    """Which estimator to train with, from the meter's records (each with ``estimator``, ``update`` and the terms
    :func:`prediction` reads; ``exact`` is the reference and may be among them) for a job of ``updates`` optimizer
    updates per iteration. A candidate passes when every position ``0 .. updates-1`` was measured and clears the bar
    (:func:`position_failure`); the recommendation is the passing one with the highest low end (mean over the
    positions), else exact, with the reason. ``cost`` names the cost structure of the records'
    ``projected_iter_ratio``; ``missing`` says why a position has no record.

    Returns ``estimator`` (the name to train with), ``reason``, ``line`` (the recommendation, one line), ``lines``
    (one per candidate), ``candidates`` (per candidate: ``passes``, ``why`` and the means ``rate_lo``, ``rate_hi``,
    ``time_rate_lo``, ``time_rate_hi``, ``iter_ratio``, ``projected_lo``, ``projected_hi`` where measured), ``margin``
    and ``updates``."""
    check_count(updates, "updates")
    check_number(margin, "margin", 0.0, why="the share by which a candidate must clear exact")
    if isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
        raise TypeError(f"records must be a list of meter records; got {type(records).__name__}")
    for r in records:
        check_fields(r, {"estimator": "string", "update": "integer"}, "a meter record")
    names = list(dict.fromkeys(r["estimator"] for r in records if r["estimator"] != "exact"))
    cands = [_candidate(n, {r["update"]: r for r in records if r["estimator"] == n}, updates, margin, missing)
             for n in names]
    lines = [_line(c, cost) for c in cands]
    winners = sorted((c for c in cands if c["passes"]), key=lambda c: -c["time_rate_lo"])
    where = "at every update position" if updates > 1 else "per update"
    if winners:
        w = winners[0]
        reason = f"its low end clears {1 + margin:.2f} x exact's progress per second {where}"
        line = (f"train with {w['estimator']}: projected {w['time_rate_lo']:.2f}-{w['time_rate_hi']:.2f} x exact's "
                f"progress per second on this machine ({_projected(w, cost)}); {reason}")
        return {"estimator": w["estimator"], "reason": reason, "line": line, "lines": lines, "candidates": cands,
                "margin": margin, "updates": updates}
    if not cands:
        reason = "no candidate was measured"
    else:
        reason = (f"no candidate's projected progress per second clears {1 + margin:.2f} x exact's at its low end "
                  f"{where} (" + "; ".join(f"{c['estimator']}: {c['why']}" for c in cands) + ")")
    return {"estimator": "exact", "reason": reason, "line": f"train with exact: {reason}", "lines": lines,
            "candidates": cands, "margin": margin, "updates": updates}


def signal_note(records: list[dict]) -> str | None:
    """``signal not resolved`` and what it means for the choice, when exact's ``|E g|^2 / V_b`` (its records'
    ``signal_to_noise`` with ``signal_to_noise_se``) reaches 0 within 2 standard errors at some measured position; None
    when it is resolved everywhere (or not measured)."""
    low = [(r["update"], r["signal_to_noise"], r["signal_to_noise_se"]) for r in records
           if r.get("estimator") == "exact" and r.get("signal_to_noise") is not None
           and math.isfinite(r["signal_to_noise"]) and not r["signal_to_noise"] - 2 * r["signal_to_noise_se"] > 0]
    if not low:
        return None
    where = ", ".join(f"update {u}: {s:.2f} +- {se:.2f}" for u, s, se in low)
    return (f"signal not resolved: exact's |E g|^2 / V_b reaches 0 within 2 SE ({where}); these batches cannot tell "
            "the gradient's direction from its noise, so a repeating error cannot be weighed against the signal it "
            "would deflect: only an estimator unbiased by construction can be chosen (more batches resolve it)")


def _projected(c: dict, cost: str | None) -> str:
    if "projected_lo" not in c:
        return "no projection"
    return f"{cost or 'the cost structure'} projected: {c['projected_lo']:.2f}-{c['projected_hi']:.2f}"


def _line(c: dict, cost: str | None) -> str:
    """One candidate's line of the verdict: its ranges and why it passed or failed; where a position's answer is
    unknown, what the variance model alone would have said, marked as such."""
    name, why = c["estimator"], c["why"]
    if not (math.isfinite(c.get("time_rate_lo", math.nan)) and math.isfinite(c.get("time_rate_hi", math.nan))):
        return f"{name}: {why}"
    numbers = (f"{c['rate_lo']:.2f}-{c['rate_hi']:.2f} of exact's learning per update x iteration ratio "
               f"{c['iter_ratio']:.2f}")
    if why is not None and "unknown" in why:
        return f"{name}: {why} (the variance model alone would say {numbers}; at each update position: {c['positions']})"
    return (f"{name}: {numbers} = {c['time_rate_lo']:.2f}-{c['time_rate_hi']:.2f} x exact's progress per second "
            f"({_projected(c, cost)}; at each update position: {c['positions']}): " + ("clears the bar" if c["passes"]
                                                                                      else why))
