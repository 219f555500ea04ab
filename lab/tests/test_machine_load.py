"""The machine's load beside a bench's runs (:mod:`lab.machine_load`): sampled while a run trains, and a comparison
whose runs saw unlike loads, or more than the machine's cores, says so."""

from __future__ import annotations

import time

import pytest

from lab.machine_load import MachineLoad, load_warning


def test_the_load_is_sampled_on_entry_meanwhile_and_on_exit():
    values = iter([1.0, 3.0, 2.0, 5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0] + [4.0] * 1000)
    with MachineLoad(every=0.01, loadavg=lambda: next(values)) as load:
        time.sleep(0.1)
    s = load.summary()
    assert load.samples[:4] == [1.0, 3.0, 2.0, 5.0] and s["samples"] == len(load.samples) >= 3
    assert s["max"] == 5.0 and s["mean"] == pytest.approx(sum(load.samples) / len(load.samples))
    with pytest.raises(ValueError, match="every must be > 0"):
        MachineLoad(every=0)


def _run(variant, seed, mean, cpus=2):
    return {"variant": variant, "seed": seed, "load": {"mean": mean, "max": mean, "samples": 3, "cpus": cpus}}


@pytest.mark.parametrize("runs, says", [
    ([_run("exact", 0, 1.8), _run("g4", 0, 1.9)], None),                             # alike
    ([_run("exact", 0, 0.2), _run("g4", 0, 0.9)], None),                             # quiet: below one core
    ([{"variant": "exact", "seed": 0}, {"variant": "g4", "seed": 0}], None),         # nothing recorded
    ([_run("exact", 0, 1.2), _run("exact", 1, 1.4), _run("g4", 0, 2.0)], "exact 1.3, g4 2.0 on 2 cores; unlike"),
    ([_run("exact", 0, 3.1), _run("g4", 0, 3.0)], "more than the cores in exact seed 0 (3.1), g4 seed 0 (3.0)"),
])
def test_a_comparison_under_unlike_or_excess_load_says_so(runs, says):
    line = load_warning(runs)
    if says is None:
        assert line is None
    else:
        assert line.startswith("load: the machine's mean load per variant: ") and says in line, line
        assert "python -m lab e2e" in line
