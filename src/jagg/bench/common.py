"""Shared pieces of the benchmarks: timing, memory, rank statistics, tables and JSON (gradients are
compared with :func:`jagg.audit.flat_grad`, :func:`~jagg.audit.cosine` and :func:`~jagg.audit.rel_err`).

Nothing here computes a gradient: every benchmark calls :func:`jagg.policy_gradient` itself.
"""

from __future__ import annotations

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
from ..infra.atomic import write_json

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


def json_if_asked(path: str | Path | None, records) -> None:
    """``--json PATH``: write the records there and say so; nothing without a path."""
    if path:
        write_json(path, records)
        print(f"wrote {path}")
