"""``threads: 0``: torch's CPU threads from the cores the machine's other processes leave free, re-read before each
iteration.

Two threads that wait on each other at every parallel region lose badly when another process holds one of the two
cores: OpenMP's workers spin while their partner is descheduled (the main job went from about 1.6 to 5 seconds per
iteration with one core taken, against 2.4 with one thread: docs/usage.md). :class:`CpuShare` reads the machine's
busy time from ``/proc/stat`` over the last iteration, subtracts this process's own CPU time, and sets
``torch.set_num_threads`` to the cores left (at least 1, at most the cores this process may run on). On a system
without ``/proc/stat`` it keeps torch's default. The thread count can change the rounding of parallel reductions, so a
run with ``threads: 0`` is reproducible bit for bit only on an equally loaded machine; set a number for that.
"""

from __future__ import annotations

import os
import time

import torch

STAT = "/proc/stat"


def _busy_seconds() -> float | None:
    """The machine's busy CPU seconds since boot (every core: user, nice, system, irq, softirq, steal), or None."""
    try:
        with open(STAT) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)            # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                            # not Linux
        return os.cpu_count() or 1


class CpuShare:
    """Sets torch's CPU threads before each iteration (:meth:`adjust`) to the cores the other processes left free
    over the previous one (module docstring)."""

    def __init__(self) -> None:
        self.cores = usable_cores()
        self._last = self._sample()
        self.threads = torch.get_num_threads()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        busy = _busy_seconds()
        return None if busy is None else (time.perf_counter(), busy, time.process_time())

    def others(self) -> float | None:
        """The cores the other processes used since the last call (None without ``/proc/stat``)."""
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))

    def adjust(self) -> int:
        """Set and return the threads for the coming iteration."""
        others = self.others()
        if others is None:
            return self.threads
        threads = max(1, min(self.cores, round(self.cores - others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
