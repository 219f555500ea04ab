"""A run whose files were damaged (a crash mid-append, an editor, a disk) resumes without losing or mixing anything,
or is refused saying how to recover: a torn last line of metrics.jsonl is set aside with a warning and the run
resumes; a damaged line before the last, or a run.json that is missing, unreadable or holds no run id, is refused
naming the file with nothing changed (and the recovery the message gives works); an unreadable newest checkpoint is
skipped with a warning for the one before it."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from command_line import files_under, one_line_error, refused, run as run_cli
from jagg.cli import main
from jagg.infra.checkpoint import load_latest, save_checkpoint
from tiny_runs import no_eval_train_args, tiny_train_args


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory, tiny_ckpt):
    """A run of 2 iterations (checkpoints at 1 and 2), to be copied and damaged."""
    run = tmp_path_factory.mktemp("torn") / "run"
    assert main(no_eval_train_args(tiny_ckpt, run, 2)) == 0
    return run


@pytest.mark.parametrize("bad", [b'{"kind": "train", "iteration": 3, "rew', b"\xff\xfe\x00\x01", b"[1, 2", b'{"no": 1}',
                                 b'"a string"'])
def test_a_torn_metrics_line_never_blocks_a_resume(bad, two_iterations, tmp_path, tiny_ckpt, capsys):
    """A torn last line of metrics.jsonl never blocks --resume with the raw decoder's text: the last line that is
    not a record is dropped with a warning naming the file and the line and kept aside next to it; the same line
    before the last is an error (exit 2, nothing changed) naming the file, the line and what to do."""
    torn = tmp_path / "torn"
    shutil.copytree(two_iterations, torn)
    metrics = torn / "metrics.jsonl"
    good = metrics.read_bytes()
    metrics.write_bytes(good + bad)                              # an append cut short
    code, line, out = run_cli(main, no_eval_train_args(tiny_ckpt, torn, 3) + ["--resume"], capsys)
    assert code == 0, line
    assert f"{metrics} line 3 is not a complete record" in out
    kept = list(torn.glob("metrics.jsonl.torn-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == bad + b"\n"
    assert [json.loads(l)["iteration"] for l in metrics.read_text().splitlines()] == [1, 2, 3]

    corrupt = tmp_path / "corrupt"
    shutil.copytree(two_iterations, corrupt)
    first, rest = (corrupt / "metrics.jsonl").read_bytes().split(b"\n", 1)
    (corrupt / "metrics.jsonl").write_bytes(first + b"\n" + bad + b"\n" + rest)
    before = files_under(corrupt)
    line = refused(main, no_eval_train_args(tiny_ckpt, corrupt, 3) + ["--resume"], capsys,
                    f"{corrupt / 'metrics.jsonl'} line 2 is not a JSON record", "repair or delete that line", "--resume")
    assert files_under(corrupt) == before and "run.json" in before


@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory, tiny_ckpt):
    run = tmp_path_factory.mktemp("one_iteration") / "run"
    assert main(no_eval_train_args(tiny_ckpt, run, 1)) == 0
    return run


@pytest.mark.parametrize("damage,what", [
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_text('{"run_id": "2026'), "cannot be read"),
    (lambda f: f.write_bytes(b"\xff\xfe"), "cannot be read"),
    (lambda f: f.write_text('{"started": "x"}'), "holds no run id"),
    (lambda f: f.write_text("[1, 2]"), "holds no run id"),
])
def test_an_unreadable_or_deleted_run_json_is_refused_on_resume(damage, what, one_iteration, tmp_path, tiny_ckpt,
                                                                capsys):
    run = tmp_path / "run"
    shutil.copytree(one_iteration, run)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    damage(run / "run.json")
    before = files_under(run)
    line = refused(main, no_eval_train_args(tiny_ckpt, run, 2) + ["--resume"], capsys, f"{run / 'run.json'} {what}",
                   "nothing was changed")
    assert run_id in line and "echo" in line
    assert files_under(run) == before
    (run / "run.json").write_text(json.dumps({"run_id": run_id}))           # the recovery the message gives
    code, line, _ = run_cli(main, no_eval_train_args(tiny_ckpt, run, 2) + ["--resume"], capsys)
    assert code == 0, line
    (run / "run.json").write_text(json.dumps({"run_id": "another-run"}))    # the run-id check stays
    refused(main, no_eval_train_args(tiny_ckpt, run, 3) + ["--resume"], capsys, "mixes two runs")


def test_load_latest_still_skips_unreadable_checkpoints(tmp_path, tiny_ckpt, capsys):
    run = tmp_path / "run"
    assert main(tiny_train_args(tiny_ckpt, run, 1, "eval.every=0")) == 0
    good = run / "checkpoints" / "ckpt_000001.pt"
    newer = run / "checkpoints" / "ckpt_000002.pt"
    newer.write_bytes(good.read_bytes()[: good.stat().st_size // 2])          # a write cut short
    capsys.readouterr()
    state, path = load_latest(run / "checkpoints")
    assert path == good and state["iteration"] == 1
    assert re.search(rf"warning: skipping unreadable checkpoint.*{re.escape(str(newer))}", capsys.readouterr().out)
    assert main(["sample", "--checkpoint", str(run), "--prompt", "a red circle", "--num-per-prompt", "1",
                 "--steps", "2", "--out", str(tmp_path / "s.png")]) == 0
    save_checkpoint({"model": {}}, run / "checkpoints", 3, keep_last=5)          # newest, but no TinyDiT
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "ckpt_000003.pt")]) == 2
    assert "not a loadable TinyDiT checkpoint" in one_line_error(capsys, "eval")
