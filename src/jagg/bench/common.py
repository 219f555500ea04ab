"""Shared pieces of the benchmarks: the cost model, timing, memory, rank statistics, tables and JSON (gradients are
compared with :func:`jagg.audit.flat_grad`, :func:`~jagg.audit.cosine` and :func:`~jagg.audit.rel_err`).

Nothing here computes a gradient: every benchmark calls :func:`jagg.policy_gradient` itself.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..checks import check_threads
from ..knots import drawn_count, intervals_of
from ..training.atomic import atomic_write_text

# ----------------------------------------------------------------------------- the cost model (docs/design.md §3)


def cost_limit(window: int, intermediate: str, f_grad: float = 1.0, f_nograd: float = 1.0,
               backward: float = 2.0, steps: int | None = None, jagg_frac: float = 1.0,
               exact_first: int = 0, exact_last: int = 0, knots: str = "groups", correction_p: float = 0.0,
               correction_rates=None, interval_frac: float = 1.0) -> float:
    """Ideal speed-up of JAGG over exact: exact cost / JAGG cost of the trained steps, per sample (expected rows where
    the estimator draws).

    Exact: ``K (F_grad + B)``. JAGG: ``rows (F_grad + B) + nograd F_nograd``, where the rows are the knots plus the
    inner steps of the intervals that run exact, and ``nograd`` the inner steps of the routed intervals under
    ``fresh``. With ``steps=None`` the limit is for one full interval of ``window`` steps: the defaults
    (``B = 2F``, ``F_grad = F_nograd``) give docs/design.md's ``3W / (W + 4)`` (fresh) and ``W / 2`` (interp). With
    ``steps=K`` the ``K`` trained steps are laid out as the estimator lays them out: step groups of ``window`` (the last
    may be shorter), or shared knots every ``window - 1`` steps. Routing: the fraction ``jagg_frac`` of each
    eligible interval (>= 3 steps, not among the first ``exact_first`` / last ``exact_last`` eligible ones) goes
    through JAGG; unbiased JAGG adds, per routed interval, ``p_j`` (``correction_p``, or ``correction_rates[j]``) x its
    inner rows. Interval subsampling (``interval_frac``, ``m`` of the ``n`` intervals per sample) keeps each interval with
    probability ``m / n``; a knot shared by two intervals is a row when the interval that owns its term is drawn or
    the other one is drawn and routed. ``jagg_frac = 0`` with ``interval_frac`` is exact's interval subsampling,
    limit ``n / m``. Pass measured times to get the limit of a given model.
    """
    if intermediate not in ("fresh", "interp"):
        raise ValueError(f"intermediate must be 'fresh' or 'interp'; got {intermediate!r}")
    K = window if steps is None else steps
    layout = "groups" if knots == "groups" else "shared"
    intervals = intervals_of(list(range(K)), layout, window) if window > 2 else [[k] for k in range(K)]
    n = len(intervals)
    m = drawn_count(n, interval_frac)
    keep = m / n                                                                 # P(an interval is drawn)
    out_in = keep - (m * (m - 1) / (n * (n - 1)) if n > 1 else 0.0)              # P(one undrawn, a given other drawn)
    eligible = [j for j, iv in enumerate(intervals) if len(iv) >= 3]
    eligible = eligible[exact_first: len(eligible) - exact_last]
    rates = list(correction_rates) if correction_rates is not None else [correction_p] * n
    routed = [jagg_frac if j in eligible else 0.0 for j in range(n)]
    rows, nograd = 0.0, 0.0
    for j, iv in enumerate(intervals):
        inner = max(len(iv) - 2, 0)
        p = rates[j] if j in eligible else 0.0
        rows += keep * ((1.0 - routed[j]) * inner + routed[j] * p * inner)
        if intermediate == "fresh":
            nograd += keep * routed[j] * inner
        if layout == "groups":
            rows += keep * min(len(iv), 2)                                      # its own knots
            continue
        # knots shared: its end knot (and the first interval's start) is its own, a row when it is drawn; the end
        # knot is also a row when only the next interval is drawn and that one is routed
        rows += keep * (2 if j == 0 else 1) + (out_in * routed[j + 1] if j + 1 < n else 0.0)
    return K * (f_grad + backward) / (rows * (f_grad + backward) + nograd * f_nograd)


def estimator_limit(est, steps: int, f_grad: float = 1.0, f_nograd: float = 1.0, backward: float = 2.0) -> float:
    """:func:`cost_limit` of an :class:`~jagg.EstimatorConfig` on ``steps`` trained steps: mode ``subsample`` ``K / m``;
    mode ``exact`` 1, or ``n / m`` with ``interval_frac``; mode ``jagg`` its layout, routing, correction and draws."""
    if est.mode == "subsample":
        return steps / drawn_count(steps, est.subsample_frac)
    if est.mode == "exact" and est.interval_frac >= 1:
        return 1.0
    return cost_limit(est.window, est.intermediate, f_grad, f_nograd, backward, steps=steps,
                      jagg_frac=est.jagg_frac if est.mode == "jagg" else 0.0, exact_first=est.exact_first_intervals,
                      exact_last=est.exact_last_intervals, knots=est.knots, correction_p=est.correction_p,
                      correction_rates=est.correction_rates, interval_frac=est.interval_frac)


# ----------------------------------------------------------------------------- devices, timing, memory


def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda`` (``cuda:N``); a clear error when CUDA is asked for but not available."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available in this torch build/machine; use --device cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N]; got {name!r}")
    return torch.device(name)


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)`` when ``threads > 0`` (0 keeps torch's default)."""
    check_threads(threads, "--threads")
    if threads:
        torch.set_num_threads(threads)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds of one call of ``fn`` (device work included) and its result."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """Peak extra memory of a block, in MiB (``self.mb``), and how it was measured (``self.kind``).

    - CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at entry (``kind="cuda_max_allocated"``).
    - CPU: the process RSS, sampled every ~0.5 ms by a thread, peak above the RSS at entry
      (``kind="cpu_rss_sampled"``). Approximate: the allocator may keep freed memory, short peaks may be
      missed, and other threads of the process count too. ``None`` where ``/proc/self/statm`` is missing.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_sampled"
        self.mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._base = _rss_bytes()
        self._peak = self._base
        self._stop = threading.Event()
        if self._base is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            rss = _rss_bytes()
            if rss is not None and rss > self._peak:
                self._peak = rss
            time.sleep(0.0005)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mb = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
            return
        if self._base is None:
            return
        self._stop.set()
        self._thread.join()
        rss = _rss_bytes()
        self._peak = max(self._peak, rss or 0)
        self.mb = (self._peak - self._base) / 2**20


# ----------------------------------------------------------------------------- rank statistics


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x`` with ties given their average rank (as scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inv, ranks)
    return (sums / counts)[inv]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation of two equally long sequences (NaN when fewer than 3 or constant)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"spearman needs equal lengths; got {a.shape} and {b.shape}")
    if len(a) < 3:
        return math.nan
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / den) if den > 0 else math.nan


# ----------------------------------------------------------------------------- configs, tables, JSON


def default_config_path() -> str:
    """The main job's YAML shipped inside the package (:func:`jagg.trainers.shapes_config.main_job_path`), the file that
    ``jagg train`` without ``--config`` and ``make train`` read, from any working directory."""
    from ..trainers.shapes_config import main_job_path

    return str(main_job_path())


def fmt(v, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec)
    return str(v)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table: ``columns`` are ``(key, header, format spec)``."""
    cells = [[h for _, h, _ in columns]] + [[fmt(r.get(k), s) for k, _, s in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def write_json(path: str | Path, records) -> None:
    """Write ``records`` as indented JSON (NaN and infinity become null), atomically
    (:func:`jagg.training.atomic.atomic_write_text`)."""
    atomic_write_text(path, json.dumps(_json_safe(records), indent=1) + "\n")


def json_if_asked(path: str | Path | None, records) -> None:
    """``--json PATH``: write the records there and say so; nothing without a path."""
    if path:
        write_json(path, records)
        print(f"wrote {path}")
