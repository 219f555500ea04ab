"""`python -m lab auto-twins` on constructed runs: an auto run is read off its fixed twin shifted by its pre-flight's
seconds (the machine's load on its own clock taken out), falls back to its own run where the twin is not the same
training or was not trained, and bad input is refused by name."""

import json

import pytest

from constructed_runs import constructed_run, exact_curve

from lab import auto_twins as at

EXACT = lambda i: exact_curve(i, stretch=10.0)          # 0.5 + 0.001 per iteration
FAST = lambda i: exact_curve(i, stretch=5.0)            # 0.5 + 0.002 per iteration: the fixed estimator that pays
PRE = 6.0                                               # the pre-flight's seconds


def write(out, variant, seed, run):
    d = out / variant / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(json.dumps(run))


def auto_run(seed, chose, curve, per_iter):
    """An auto run that trained as ``curve`` at ``per_iter`` CPU seconds an iteration after a pre-flight of PRE."""
    run = constructed_run("auto", seed, curve, per_iter=per_iter)
    for row in run["train_curve"]:
        row[at.TRAIN_CURVE.index("wall")] += PRE
        row[at.TRAIN_CURVE.index("cpu")] += PRE
    run["preflight"] = {"train_with": chose, "preflight_s": PRE, "preflight_cpu_s": PRE}
    return run


@pytest.fixture
def out(tmp_path):
    """Seeds 0-1 chose s5u (the fast fixed run ``s5p1``), seed 2 chose exact; auto's own runs measured 1.2 and 1.1 CPU
    seconds an iteration against their twins' 1.0 (what ran beside them)."""
    out = tmp_path / "out"
    for seed in range(3):
        write(out, "exact", seed, constructed_run("exact", seed, EXACT))
        write(out, "s5p1", seed, constructed_run("s5p1", seed, FAST))
    for seed, (chose, curve, per_iter) in enumerate([("s5u", FAST, 1.2), ("s5u", FAST, 1.2), ("exact", EXACT, 1.1)]):
        write(out, "auto", seed, auto_run(seed, chose, curve, per_iter))
    return out


def test_each_auto_run_is_read_off_its_twin_shifted_by_its_pre_flight(out, tmp_path, capsys):
    path = tmp_path / "twins.json"
    assert at.main(["--out", str(out), "--seeds", "3", "--twin", "s5u=s5p1", "--json", str(path)]) == 0
    *seeds, twin, own = json.loads(path.read_text())
    assert [s["read_as"] for s in seeds] == ["s5p1's run, shifted by the pre-flight"] * 2 + [
        "exact's run, shifted by the pre-flight"]
    # exact's budget, 60 s, runs out when the twins are at iteration 54: (0.608 + 0.608 + 0.554) / 3 - 0.560
    assert twin["budget_s"] == pytest.approx(60.0) and twin["budget_diff"] == pytest.approx(0.030, abs=1e-9)
    # read off their own clocks, the same trainings reach less by then: the load counted against them
    assert own["budget_diff"] < twin["budget_diff"] - 0.01
    assert "auto read off its twins' runs (the load taken out): +0.030" in capsys.readouterr().out


def test_a_twin_that_trained_otherwise_or_not_at_all_leaves_auto_s_own_run(out, capsys):
    write(out, "s5p1", 1, constructed_run("s5p1", 1, FAST, offset=0.01))          # not seed 1's training
    (out / "s5p1" / "seed0" / "result.json").unlink()
    assert at.main(["--out", str(out), "--seeds", "3", "--twin", "s5u=s5p1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "read as own run (s5p1 seed 0 not trained)" in lines[0]
    assert "read as own run (s5p1's held-out curve differs: not the same training)" in lines[1]
    assert "read as exact's run, shifted by the pre-flight" in lines[2]
    assert at.main(["--out", str(out), "--seeds", "3"]) == 0                       # no --twin for s5u: its own run
    assert "read as own run (no --twin for its decision)" in capsys.readouterr().out.splitlines()[0]


def test_bad_input_is_refused_by_name(out, tmp_path):
    with pytest.raises(ValueError, match=r"--twin 's5u' must be NAME=VARIANT"):
        at.main(["--out", str(out), "--seeds", "3", "--twin", "s5u"])
    with pytest.raises(ValueError, match=r"holds no pre-flight decision .* name auto's variant with --auto"):
        at.main(["--out", str(out), "--seeds", "3", "--auto", "s5p1"])
    with pytest.raises(ValueError, match="--seeds must be >= 2"):
        at.main(["--out", str(out), "--seeds", "1"])
    with pytest.raises(ValueError, match="unfinished runs"):
        at.main(["--out", str(tmp_path / "none"), "--seeds", "3"])
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    with pytest.raises(ValueError, match="--json"):
        at.main(["--out", str(out), "--seeds", "3", "--json", str(taken)])
