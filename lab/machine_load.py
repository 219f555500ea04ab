"""The machine's load beside a timed run: a CPU-clock comparison is only as good as the machine's quiet.

A process's CPU seconds leave out the time it waited for a core, but not a core slowed by its neighbours (a shared
cache, memory bandwidth, a clock lowered under load): on a 2-core machine the same exact iteration read 2.8-4.5 CPU s
with 3-5 processes running. :class:`MachineLoad` samples the 1-minute load average while a run trains; a bench keeps its
summary beside the run's clocks, and :func:`load_warning` says when the runs compared saw different loads, or more
load than the machine has cores.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable, Sequence

UNEVEN = 1.25          # the variants' mean loads differ by more than this factor: their CPU clocks are not alike


class MachineLoad:
    """Samples ``loadavg()`` (default :func:`os.getloadavg`'s 1-minute average) every ``every`` seconds while the
    ``with`` block runs, once on entry and once on exit; :meth:`summary` is ``{"mean", "max", "samples", "cpus"}``."""

    def __init__(self, every: float = 15.0, loadavg: Callable[[], float] | None = None):
        if not every > 0:
            raise ValueError(f"every must be > 0 seconds; got {every!r}")
        self.every, self.loadavg = every, loadavg or (lambda: os.getloadavg()[0])
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self.samples.append(float(self.loadavg()))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> MachineLoad:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="machine-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self) -> dict:
        return {"mean": statistics.fmean(self.samples), "max": max(self.samples), "samples": len(self.samples),
                "cpus": os.cpu_count() or 1}


def load_warning(runs: Sequence[dict]) -> str | None:
    """A line for a comparison of ``runs`` (results holding ``load``, :meth:`MachineLoad.summary`; runs without it are
    left out) whose CPU clocks carry unlike loads: the variants' mean loads differing by more than :data:`UNEVEN` x, or
    a run that saw more load than the machine's cores; None when they are alike or nothing was recorded."""
    loaded = [r for r in runs if isinstance(r.get("load"), dict)]
    if not loaded:
        return None
    by_variant: dict[str, list[float]] = {}
    for r in loaded:
        by_variant.setdefault(r["variant"], []).append(r["load"]["mean"])
    means = {v: statistics.fmean(x) for v, x in by_variant.items()}
    cpus = max(r["load"]["cpus"] for r in loaded)
    over = [f"{r['variant']} seed {r['seed']} ({r['load']['mean']:.1f})" for r in loaded if r["load"]["mean"] > cpus]
    low, high = min(means.values()), max(means.values())
    uneven = high > UNEVEN * max(low, 1.0)          # below one core's worth, a load is quiet whatever its ratio
    if not over and not uneven:
        return None
    shown = ", ".join(f"{v} {m:.1f}" for v, m in means.items())
    parts = [f"the machine's mean load per variant: {shown} on {cpus} cores"]
    if uneven:
        parts.append(f"unlike (over {UNEVEN:g} x)")
    if over:
        parts.append(f"more than the cores in {', '.join(over)}")
    return ("load: " + "; ".join(parts) + ": their CPU clocks carry it; read the updates to target times an "
            "iteration ratio measured on a quiet machine (python -m lab e2e), or rerun them on one")
