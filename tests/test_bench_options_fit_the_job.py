"""The benches measure what the job does and what was asked, or refuse before any work: ``bench meter --update N``
at or past the job's optimizer updates per iteration is refused with the job's count (it measured an off-policy
position of a job that never makes one, and a large N ran for minutes); ``--by-interval`` refuses a window longer
than the trained steps and an ``--update`` it does not measure; ``bench speed`` never ignores ``--set`` or
``--config``."""

from __future__ import annotations

import pytest

from command_line import refused
from jagg.bench import meter_command as bench_meter
from jagg.bench import speed_command as bench_speed
from jagg.cli import main


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(bench_meter, "measure", lambda *a, **k: pytest.fail("measured before the options' checks"))
    monkeypatch.setattr(bench_meter, "by_interval", lambda *a, **k: pytest.fail("measured before the checks"))
    monkeypatch.setattr(bench_speed, "run_speed", lambda *a, **k: pytest.fail("timed before the options' checks"))


@pytest.mark.parametrize("sets,update,count", [
    ([], "4", "4 optimizer updates per iteration (grpo.inner_epochs=1 x grpo.updates_per_epoch=4), at positions 0 to 3"),
    (["grpo.updates_per_epoch=1"], "1", "1 optimizer update per iteration"),
    ([], "1000000", "give --update below 4 or --update all"),
])
def test_an_update_position_the_job_does_not_have_is_refused(sets, update, count, no_work, capsys):
    argv = ["bench", "meter", "--quick", "--update", update] + [a for s in sets for a in ("--set", s)]
    refused(main, argv, capsys, f"--update {update}", count)


def test_the_positions_the_job_has_are_measured(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(bench_meter, "measure", lambda cfg, specs, b, d, t, cost, update: seen.append(update) or [])
    monkeypatch.setattr(bench_meter, "measure_job", lambda cfg, *a: seen.append(
        list(range(cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch))) or [])
    monkeypatch.setattr(bench_meter, "_report", lambda *a: None)
    monkeypatch.setattr(bench_meter, "job_prediction", lambda per_update: [])
    monkeypatch.setattr(bench_meter, "_print_verdict", lambda *a: {})
    assert main(["bench", "meter", "--quick", "--update", "3"]) == 0          # the main job: 4 per iteration
    assert main(["bench", "meter", "--quick", "--update", "all"]) == 0
    assert seen == [3, [0, 1, 2, 3]]


@pytest.mark.parametrize("extra,culprits", [
    (["--by-interval", "w9:window=9"], ["--by-interval 'w9:window=9'", "more than the 8 trained steps"]),
    (["--by-interval", "config", "--update", "1"], ["--by-interval measures the on-policy update (0) only",
                                                     "--update 1"]),
])
def test_by_interval_measures_what_it_says_or_refuses(extra, culprits, no_work, capsys):
    refused(main, ["bench", "meter", "--quick", *extra], capsys, *culprits)


@pytest.mark.parametrize("argv,culprits", [
    (["--set", "sample.eta=0.3"], ["--set sample.eta=0.3", "give --config"]),
    (["--config", "CFG", "--models", "tiny_dit"], ["--models tiny_dit leaves out config", "drop --config"]),
    (["--config", "CFG", "--set", "sample.eta=-1"], ["sample.eta must be a finite number > 0"]),
])
def test_bench_speed_never_ignores_set_or_config(argv, culprits, no_work, capsys):
    from jagg.trainers.shapes_config import main_job_path

    argv = [str(main_job_path()) if a == "CFG" else a for a in argv]
    refused(main, ["bench", "speed", "--quick", *argv], capsys, *culprits)


def test_an_auto_job_measures_the_default_candidates_that_fit_and_refuses_a_named_one(monkeypatch, capsys):
    """``bench meter`` on the main job (estimator.mode: auto) with 4 trained steps: the default candidate whose
    window is longer (s5u, window 5) is left out with a note, as auto's pre-flight leaves it out, and the others are
    measured; a candidate the user names that does not fit is refused, naming it."""
    seen = []
    monkeypatch.setattr(bench_meter, "measure", lambda cfg, specs, *a: seen.append(specs) or [])
    monkeypatch.setattr(bench_meter, "_report", lambda *a: None)
    monkeypatch.setattr(bench_meter, "_print_verdict", lambda *a: {})
    four = ["--set", "sample.sde_window=[0, 4]"]
    assert main(["bench", "meter", "--quick", "--update", "0", *four]) == 0
    out = capsys.readouterr().out
    assert [s.partition(":")[0] for s in seen[0]] == ["g4", "s4", "g4u"]
    assert "note: the default candidate 's5u' is left out" in out and "window=5 is more than the 4 trained" in out
    refused(main, ["bench", "meter", "--quick", *four, "--set", 'estimator.candidates=["w5:window=5"]'], capsys,
            "estimator.candidates: 'w5:window=5'", "more than the 4 trained steps")
