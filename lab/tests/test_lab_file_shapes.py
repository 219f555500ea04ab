"""Every file the lab's tools read is checked for its shape: a torn or foreign run result (``result.json``), a garbage
or torn regime map (``--json``) is one error line naming the file (and the line or key) with what was expected,
exit 2, never a decoder traceback; nothing is written."""

from __future__ import annotations

import json

import pytest

from command_line import files_under, refused
from lab.__main__ import main
from lab.quality_runs import read_result
from constructed_runs import constructed_run, exact_curve

PROG = "python -m lab"


@pytest.fixture
def out(tmp_path):
    for variant in ("exact", "slow"):
        for seed in range(2):
            d = tmp_path / "out" / variant / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps(constructed_run(variant, seed, exact_curve)))
    return tmp_path / "out"


@pytest.mark.parametrize("text,culprit", [
    ('{"iterations": 60, "train_cu', "is not valid JSON (line 1, column"),               # torn by a crash
    ("[]", "must hold an object (key: value); it holds a list"),
    ("{}", "has no 'iterations' (an integer)"),
    (json.dumps({**constructed_run("slow", 1, exact_curve), "train_curve": [[1, 2.0]]}),
     "'train_curve' must be a list of rows of 4"),
    (json.dumps({**constructed_run("slow", 1, exact_curve), "wall_s": "long"}),
     "'wall_s' must be a finite number; it holds a string"),
])
def test_a_torn_or_foreign_result_is_named_by_the_plateau_tool(text, culprit, out, capsys):
    path = out / "slow" / "seed1" / "result.json"
    path.write_text(text)
    before = files_under(out)
    line = refused(main, ["plateau", "--out", str(out), "--seeds", "2", "--pair", "slow:exact"], capsys, str(path),
                   culprit, prog=PROG)
    assert "delete it" in line and files_under(out) == before


def test_quality_reads_its_results_through_the_same_check(out):
    """``python -m lab quality`` reuses a finished run's result.json only through :func:`read_result` (its reuse of a
    run of another config: lab/tests/test_lab_refusals.py)."""
    path = out / "exact" / "seed0" / "result.json"
    assert read_result(path)["iterations"] == 60
    path.write_text('{"iterations": 60, "config": [')
    with pytest.raises(ValueError, match=f"{path} is not valid JSON.*delete it"):
        read_result(path)


@pytest.mark.parametrize("text,culprit", [
    ("this is not a map\n", "line 1 is not valid JSON"),
    ('{"num_steps": 10}\n[1, 2]\n', "line 2 must hold a JSON object (a record); it holds a list"),
    ('{"num_steps": 10}\n', "record 1 has no 'sde_type' (a string)"),
    ('{"num_steps": "ten"}\n', "record 1: 'num_steps' must be an integer; it holds a string 'ten'"),
])
def test_a_garbage_regime_map_is_named(text, culprit, tmp_path, capsys):
    path = tmp_path / "map.jsonl"
    path.write_text(text)
    for extra in ([], ["--summary"]):
        refused(main, ["regime-map", "--json", str(path), "--batches", "3", *extra], capsys, str(path), culprit,
                prog=PROG)
    assert path.read_text() == text
