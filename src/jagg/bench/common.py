"""Shared pieces of the benchmarks: the cost model, timing, memory, gradient comparison, tables and JSON.

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
from torch import Tensor

from ..routing import make_groups

# ----------------------------------------------------------------------------- the cost model (DESIGN §3)


def cost_limit(window: int, intermediate: str, f_grad: float = 1.0, f_nograd: float = 1.0,
               backward: float = 2.0, steps: int | None = None, jagg_frac: float = 1.0,
               exact_first: int = 0, exact_last: int = 0) -> float:
    """Ideal speed-up of JAGG over exact: exact cost / JAGG cost of the trained steps.

    Per group of ``m`` trained steps:  exact ``m (F_grad + B)``;  JAGG fresh ``2 F_grad + (m - 2) F_nograd + 2 B``;
    interp ``2 (F_grad + B)`` (a group of 1 or 2 steps costs the same as exact). With ``steps=None`` the
    limit is for one full group of ``window`` steps: the defaults (``B = 2F``, ``F_grad = F_nograd``) give
    DESIGN's ``3W / (W + 4)`` (fresh) and ``W / 2`` (interp). With ``steps=K`` the ``K`` trained steps are
    split into groups as the estimator splits them (the last group may be shorter). Pass measured times to
    get the limit of a given model. Routing: the fraction ``jagg_frac`` of each eligible group (>= 3 steps,
    not among the first ``exact_first`` / last ``exact_last`` groups) goes through JAGG, the rest exact.
    """
    if intermediate not in ("fresh", "interp"):
        raise ValueError(f"intermediate must be 'fresh' or 'interp'; got {intermediate!r}")
    sizes = [window] if steps is None else [len(g) for g in make_groups(list(range(steps)), window)]
    exact = sum(sizes) * (f_grad + backward)
    jagg = 0.0
    for gi, m in enumerate(sizes):
        group_exact = m * (f_grad + backward)
        if m <= 2 or gi < exact_first or gi >= len(sizes) - exact_last:
            jagg += group_exact
            continue
        routed = 2 * (f_grad + backward) + ((m - 2) * f_nograd if intermediate == "fresh" else 0.0)
        jagg += jagg_frac * routed + (1.0 - jagg_frac) * group_exact
    return exact / jagg


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
    if threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's default); got {threads}")
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


# ----------------------------------------------------------------------------- gradients


def flat_grad(params: Sequence[torch.nn.Parameter]) -> Tensor:
    """All ``.grad`` concatenated into one fp64 vector ``[P]`` (zeros where a grad is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two vectors (NaN when either is zero)."""
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else math.nan


def rel_err(approx: Tensor, ref: Tensor) -> float:
    """``||approx - ref|| / ||ref||`` (NaN when ``ref`` is zero)."""
    n = float(ref.norm())
    return float((approx - ref).norm()) / n if n > 0 else math.nan


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
    """The main job's YAML shipped inside the package (:func:`jagg.shapes.config.main_job_path`), the file that
    ``jagg train`` without ``--config`` and ``make train`` read, from any working directory."""
    from ..shapes.config import main_job_path

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
    """Write ``records`` as indented JSON (NaN and infinity become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(records), indent=1) + "\n")
