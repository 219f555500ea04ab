"""`python -m lab weight-changes` (which of a run's weight changes carry its gain) and `python -m lab trace-file-changes`
(the real-model trainer's path through the source files)."""

import json

import pytest


def test_weight_changes_applies_only_the_changes_it_is_asked_for(tmp_path, tiny_ckpt):
    """The trained weights, and the start with only the changes of the
    matching parameters; a pattern that matches nothing is the start itself, one that matches everything the run."""
    from tiny_runs import tiny_train_args
    from jagg.cli import main
    from lab import weight_changes as wc

    run = tmp_path / "run"
    assert main(tiny_train_args(tiny_ckpt, run, 2)) == 0
    out = tmp_path / "rows.json"
    ckpt = run / "checkpoints" / "ckpt_000002.pt"
    assert wc.main([str(ckpt), "--start", tiny_ckpt, "--keep", "^nothing$", "--keep", ".", "--images-per-prompt", "1",
                    "--json", str(out)]) == 0
    rows = {r["weights"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"start", "trained", "keep ^nothing$", "keep ."}
    assert rows["keep ^nothing$"] == {**rows["start"], "weights": "keep ^nothing$"}
    assert rows["keep ."] == {**rows["trained"], "weights": "keep ."}
    assert all(0 <= r["test_reward"] <= 1 and r["background_rms"] >= 0 for r in rows.values())
    with pytest.raises(SystemExit):                                   # the file exists: never replaced
        wc.main([str(ckpt), "--start", tiny_ckpt, "--json", str(out)])
    with pytest.raises(SystemExit):
        wc.main([str(ckpt), "--keep", "("])


def test_trace_file_changes_counts_the_real_model_trainer_s_path(tmp_path):
    """`python -m lab trace-file-changes` on a tiny SD3 pipeline: the path from `jagg train` to the first optimizer
    step changes file at least once per module it crosses, and leaving jagg.checks out never adds a change."""
    pytest.importorskip("diffusers")
    from lab import trace_file_changes as tfc

    counts = {}
    for skip in (False, True):
        out = tmp_path / f"trace_{skip}.json"
        assert tfc.main(["--json", str(out)] + (["--skip-checks"] if skip else [])) == 0
        result = json.loads(out.read_text())
        assert result["file_changes"] > 0 and result["files_visited"] > 3
        assert any(f.endswith("estimator.py") for f in result["entered"])
        counts[skip] = result["file_changes"]
    assert counts[True] <= counts[False]
