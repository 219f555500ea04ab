"""A run directory belongs to one run: the three ways a user's results could be lost or mixed without a word, each
refused with a message and exit 2, the filesystem errors on the output directory as one line, and a resume that
would continue a run under another reward refused by name.

1. a new `jagg train` into a directory that holds a run (it would overwrite metrics.jsonl, pruning would delete the
   new run's final checkpoint, and a later --resume would continue the old run): refused; --overwrite moves the old
   run aside;
2. `--resume` where no checkpoint is readable (it would start from scratch over the old run): refused, naming every
   file;
3. `jagg pretrain` without --out (it would write over the shipped model in src/jagg/shapes/assets/): --out is
   required and never inside the installed package.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from command_line import one_line_error
from tiny_runs import real_model_config, tiny_train_args
from jagg.cli import main
from jagg.infra.checkpoint import list_checkpoints, load_latest, prune_checkpoints, save_checkpoint
from jagg.infra.rundir import RUN_FILE, read_run_file

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "src" / "jagg" / "shapes" / "assets" / "tiny_dit.safetensors"


def _snapshot(run: Path) -> dict:
    """Every file under ``run`` (but TensorBoard's) and its bytes' hash."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and "tensorboard" not in p.parts}


def _train(ckpt, run, iterations, *extra_sets, flags=()):
    return main(tiny_train_args(ckpt, run, iterations, "eval.every=0", *extra_sets) + list(flags))


def _train_records(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in l]


# ---------------------------------------------------------------------------------------------- 1. a new run


def test_a_new_run_into_a_run_directory_is_refused_and_changes_nothing(tmp_path, tiny_ckpt, capsys):
    run = tmp_path / "run"
    assert _train(tiny_ckpt, run, 3) == 0
    before = _snapshot(run)
    run_id = read_run_file(run)["run_id"]
    capsys.readouterr()
    assert _train(tiny_ckpt, run, 2) == 2                                  # no --resume, no --overwrite
    err = one_line_error(capsys, "train")
    assert str(run) in err and "metrics.jsonl with 3 records" in err and "ckpt_000003.pt" in err
    assert "--resume" in err and "--output-dir" in err and "--overwrite" in err
    assert _snapshot(run) == before                                       # metrics, checkpoints, run.json untouched
    # --resume continues *this* run, and says which allowed keys changed
    assert _train(tiny_ckpt, run, 4, flags=["--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "grpo.iterations: 3 in the checkpoint, 4 now" in out
    assert [r["iteration"] for r in _train_records(run)] == [1, 2, 3, 4]
    state, path = load_latest(run / "checkpoints")
    assert path.name == "ckpt_000004.pt" and state["run_id"] == run_id == read_run_file(run)["run_id"]


def test_overwrite_moves_the_old_run_aside_and_prunes_only_the_new_runs_checkpoints(tmp_path, tiny_ckpt, capsys):
    run = tmp_path / "run"
    assert _train(tiny_ckpt, run, 3) == 0
    before, old_id = _snapshot(run), read_run_file(run)["run_id"]
    capsys.readouterr()
    assert _train(tiny_ckpt, run, 2, flags=["--overwrite"]) == 0
    assert "nothing deleted" in capsys.readouterr().out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert re.fullmatch(r"run\.old-\d{8}-\d{6}(-\d+)?", aside.name)
    assert _snapshot(aside) == before                                     # the old run, byte for byte
    new_id = read_run_file(run)["run_id"]
    assert new_id != old_id
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt_000001.pt", "ckpt_000002.pt"]
    assert load_latest(run / "checkpoints")[0]["run_id"] == new_id
    assert [r["iteration"] for r in _train_records(run)] == [1, 2]


def test_overwrite_and_resume_are_mutually_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", "--overwrite"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_pruning_keeps_the_newest_checkpoint_of_this_run_and_never_another_runs(tmp_path):
    """A mixed directory: another run's ckpt_000025 and ckpt_000030 beside this run's ckpt 1..3, keep_last 2. Pruning
    by iteration alone would delete this run's final ckpt_000003 and keep the other run's two."""
    d = tmp_path / "checkpoints"
    for it in (25, 30):
        save_checkpoint({"model": {}, "run_id": "old-run"}, d, it, keep_last=2)
    save_checkpoint({"model": {}}, d, 20, keep_last=1)                      # before run ids: never pruned
    (d / "ckpt_000010.pt").write_bytes(b"unreadable")                     # unreadable: never pruned
    for it in (1, 2, 3):
        save_checkpoint({"model": {}, "run_id": "new-run"}, d, it, keep_last=2)
    names = [p.name for p in list_checkpoints(d)]
    assert names == ["ckpt_000002.pt", "ckpt_000003.pt", "ckpt_000010.pt", "ckpt_000020.pt", "ckpt_000025.pt",
                     "ckpt_000030.pt"]
    save_checkpoint({"model": {}, "run_id": "new-run"}, d, 7, keep_last=2)   # this run's: 3 and 7 now
    assert prune_checkpoints(d, 1, None) == []                              # no run id: nothing is deleted
    assert prune_checkpoints(d, 1, "new-run", keep=d / "ckpt_000003.pt") == []     # keep (the one just written)
    assert prune_checkpoints(d, 1, "new-run") == [d / "ckpt_000003.pt"]
    assert [p.name for p in list_checkpoints(d)] == ["ckpt_000007.pt", "ckpt_000010.pt", "ckpt_000020.pt",
                                                     "ckpt_000025.pt", "ckpt_000030.pt"]


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, tiny_ckpt, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(tiny_ckpt, a, 1) == 0 and _train(tiny_ckpt, b, 2) == 0
    shutil.copy(b / "checkpoints" / "ckpt_000002.pt", a / "checkpoints" / "ckpt_000002.pt")   # b's, newest in a
    before = _snapshot(a)
    capsys.readouterr()
    assert _train(tiny_ckpt, a, 3, flags=["--resume"]) == 2
    err = one_line_error(capsys, "train")
    assert "ckpt_000002.pt belongs to run " + read_run_file(b)["run_id"] in err
    assert read_run_file(a)["run_id"] in err and "mixes two runs" in err
    assert _snapshot(a) == before


# ---------------------------------------------------------------------------------------------- 2. --resume


def test_resume_without_a_readable_checkpoint_names_every_file_and_changes_nothing(tmp_path, tiny_ckpt, capsys):
    run = tmp_path / "run"
    assert _train(tiny_ckpt, run, 2) == 0
    for p in list_checkpoints(run / "checkpoints"):
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])                             # both truncated
    before = _snapshot(run)
    capsys.readouterr()
    for flag in ("--resume", "--resume-or-start"):
        assert _train(tiny_ckpt, run, 4, flags=[flag]) == 2
        err = one_line_error(capsys, "train")
        assert "no readable checkpoint" in err and "nothing was changed" in err
        for name in ("ckpt_000001.pt", "ckpt_000002.pt"):
            assert re.search(rf"{name} is not a loadable checkpoint, it may be truncated or corrupt \(\w+", err)
        assert "--overwrite" in err
        assert _snapshot(run) == before                                   # no "starting from scratch"


def test_resume_needs_a_run_and_starting_fresh_needs_an_explicit_flag(tmp_path, tiny_ckpt, capsys):
    absent, empty = tmp_path / "absent", tmp_path / "empty"
    empty.mkdir()
    for run, why in ((absent, "does not exist"), (empty, "holds no checkpoint")):
        assert _train(tiny_ckpt, run, 1, flags=["--resume"]) == 2
        err = one_line_error(capsys, "train")
        assert f"no run in {run} (it {why})" in err and "--resume-or-start" in err
    assert not absent.exists() and not any(empty.iterdir())
    assert _train(tiny_ckpt, absent, 1, flags=["--resume-or-start"]) == 0
    assert "starting a new one" in capsys.readouterr().out
    assert [r["iteration"] for r in _train_records(absent)] == [1]
    assert _train(tiny_ckpt, absent, 2, flags=["--resume-or-start"]) == 0      # then it resumes
    assert [r["iteration"] for r in _train_records(absent)] == [1, 2]
    # finished: `make train` (jagg train --resume-or-start) run twice trains nothing the second time, exit 0
    capsys.readouterr()
    before = _snapshot(absent)
    assert _train(tiny_ckpt, absent, 2, flags=["--resume-or-start"]) == 0
    assert "is at iteration 2 of grpo.iterations=2: nothing to train" in capsys.readouterr().out
    assert _snapshot(absent) == before
    recipe = (REPO / "Makefile").read_text().split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    assert "jagg train --resume-or-start" in recipe
    # records but no checkpoint (stopped before the first one): --resume refuses; --resume-or-start moves them aside
    # (the run cannot be continued) and starts a new run
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1}\n')
    assert _train(tiny_ckpt, stopped, 1, flags=["--resume"]) == 2
    err = one_line_error(capsys, "train")
    assert "metrics.jsonl with 1 record but no checkpoint" in err and "--overwrite" in err
    assert (stopped / "metrics.jsonl").read_text() == '{"kind": "train", "iteration": 1}\n'
    assert _train(tiny_ckpt, stopped, 1, flags=["--resume-or-start"]) == 0
    assert "but no checkpoint to resume: moved it to" in capsys.readouterr().out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("stopped.old-")]
    assert (aside / "metrics.jsonl").read_text() == '{"kind": "train", "iteration": 1}\n'
    assert [r["iteration"] for r in _train_records(stopped)] == [1]


def test_library_resume_true_starts_or_continues_as_bench_quality_needs(tmp_path, tiny_ckpt):
    """`ShapesTrainer(cfg, resume=True)` (what `python -m lab quality` calls) starts a run in an empty directory and
    continues it later; it never starts over unreadable checkpoints."""
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.trainers.shapes_trainer import ShapesTrainer
    from jagg.infra import config_loader as configuration

    run = tmp_path / "q"
    sets = tiny_train_args(tiny_ckpt, run, 1, "eval.every=0")[4::2] + [f"log.output_dir={run}"]
    ShapesTrainer(configuration.load(ShapesTrainConfig, None, sets), resume=True).train()
    ShapesTrainer(configuration.load(ShapesTrainConfig, None, sets + ["grpo.iterations=2"]), resume=True).train()
    assert [r["iteration"] for r in _train_records(run)] == [1, 2]
    for p in list_checkpoints(run / "checkpoints"):
        p.write_bytes(b"x")
    with pytest.raises(ValueError, match="no readable checkpoint"):
        ShapesTrainer(configuration.load(ShapesTrainConfig, None, sets + ["grpo.iterations=3"]), resume=True)


# ---------------------------------------------------------------------------------------------- 3. pretrain


def test_pretrain_requires_out_and_never_writes_into_the_package(tmp_path, monkeypatch, capsys):
    digest, mtime = hashlib.sha256(ASSET.read_bytes()).hexdigest(), ASSET.stat().st_mtime_ns
    with pytest.raises(SystemExit) as exc:
        main(["pretrain", "--set", "train.steps=1"])
    assert exc.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err
    monkeypatch.chdir(REPO)
    for out in ("src/jagg/shapes/assets/tiny_dit.safetensors", str(ASSET), "src/jagg/shapes/assets/new.safetensors",
                "src/jagg/../jagg/shapes/assets/tiny_dit.safetensors"):
        assert main(["pretrain", "--out", out, "--set", "train.steps=1"]) == 2
        err = one_line_error(capsys, "pretrain")
        assert out in err and "inside the installed jagg package" in err and "--out runs/pretrain/" in err
    assert hashlib.sha256(ASSET.read_bytes()).hexdigest() == digest and ASSET.stat().st_mtime_ns == mtime
    assert not (ASSET.parent / "new.safetensors").exists()
    assert main(["pretrain", "--out", str(tmp_path), "--set", "train.steps=1"]) == 2
    assert "is a directory" in one_line_error(capsys, "pretrain")
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = capsys.readouterr().out
    assert "set in YAML" not in text and "set with --set key=value" in text and "--out OUT" in text


# ---------------------------------------------------------------------------------------------- filesystem errors


def test_a_file_where_the_run_directory_should_be_is_one_line(tmp_path, tiny_ckpt, capsys):
    file = tmp_path / "file"
    file.write_text("not a directory")
    assert _train(tiny_ckpt, file, 1) == 2
    err = one_line_error(capsys, "train")
    assert f"the run directory {file} is a file, not a directory; use another --output-dir" in err
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file")
    assert _train(tiny_ckpt, run, 1) == 2
    assert "checkpoints is a file, not a directory" in one_line_error(capsys, "train")
    assert _train(tiny_ckpt, file / "sub", 1) == 2                          # a file where a parent should be
    assert "sub" in one_line_error(capsys, "train") and file.read_text() == "not a directory"


def _refuse_under(root: Path, code: int, only: str = ""):
    """A ``tempfile.mkstemp`` that fails with ``code`` for directories under ``root`` (containing ``only``)."""
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        if dir is not None and str(Path(dir)).startswith(str(root)) and only in str(dir):
            raise OSError(code, os.strerror(code), str(Path(dir) / "file.tmp"))
        return real(*a, dir=dir, **k)
    return mkstemp


def test_a_read_only_run_directory_is_one_line_and_exit_2(tmp_path, tiny_ckpt, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    if os.geteuid() != 0:                                  # a real read-only directory (root writes anyway)
        run.chmod(0o555)
        try:
            assert _train(tiny_ckpt, run, 1) == 2
            err = one_line_error(capsys, "train")
            assert str(run) in err and "--output-dir" in err
        finally:
            run.chmod(0o755)
    with monkeypatch.context() as m:                      # EROFS as a read-only mount gives it
        m.setattr(tempfile, "mkstemp", _refuse_under(run, errno.EROFS))
        assert _train(tiny_ckpt, run, 1) == 2
    err = one_line_error(capsys, "train")
    assert "cannot write the run directory" in err and "read-only file system" in err and str(run) in err
    assert "use another --output-dir, a writable one" in err
    with monkeypatch.context() as m:                      # permission denied
        m.setattr(tempfile, "mkstemp", _refuse_under(run, errno.EACCES))
        assert _train(tiny_ckpt, run, 1) == 2
    assert "Permission denied" in one_line_error(capsys, "train")


def test_a_checkpoint_write_failing_mid_run_is_one_line_and_keeps_the_metrics(tmp_path, tiny_ckpt, capsys,
                                                                             monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(tempfile, "mkstemp", _refuse_under(run, errno.ENOSPC, only="checkpoints"))
    assert _train(tiny_ckpt, run, 2) == 2
    err = one_line_error(capsys, "train")
    assert "No space left on device" in err and "checkpoints" in err
    assert [r["iteration"] for r in _train_records(run)] == [1]


# ---------------------------------------------------------------------------------------------- the end-of-run line


def test_the_end_of_run_line_lists_only_what_was_written(tmp_path, tiny_ckpt, capsys):
    assert main(tiny_train_args(tiny_ckpt, tmp_path / "quiet", 1, "eval.every=0", "log.tensorboard=false")) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("outputs in")][-1]
    assert line == f"outputs in {tmp_path / 'quiet'}: metrics.jsonl, checkpoints/"
    assert not (tmp_path / "quiet" / "reward_curve.png").exists() and not (tmp_path / "quiet" / "samples").exists()
    assert main(tiny_train_args(tiny_ckpt, tmp_path / "full", 1, "eval.every=1")) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("outputs in")][-1]
    assert line.endswith("metrics.jsonl, tensorboard/, reward_curve.png, samples/, checkpoints/")


# ---------------------------------------------------------------------------------------------- the real-model trainer


def _real_config(tmp_path: Path) -> Path:
    return real_model_config(tmp_path, "no_model")


def test_the_real_model_trainer_applies_the_same_rules_before_loading_a_model(tmp_path, capsys):
    """The rules live in jagg.infra.rundir, which DiffusersTrainer calls before it loads the model (its directory
    here holds config files of the right shape and no weights: each refusal comes first); the model directory is
    checked before the run directory is touched, so --overwrite with a missing model moves nothing aside."""
    cfg, run = _real_config(tmp_path), tmp_path / "run"
    model = tmp_path / "no_model"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline", '
                                            '"transformer": ["diffusers", "SD3Transformer2DModel"]}')
    (model / "transformer" / "config.json").write_text('{"patch_size": 2, "pos_embed_max_size": 192}')
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1}\n')
    torch.save({"model": {}, "manifest": {}, "run_id": "x"}, run / "checkpoints" / "ckpt_000001.pt")
    assert main(["train", "--config", str(cfg), "--output-dir", str(run)]) == 2
    assert "already holds a run" in one_line_error(capsys, "train")
    assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "no run in" in one_line_error(capsys, "train")
    (run / "checkpoints" / "ckpt_000001.pt").write_bytes(b"cut")
    assert main(["train", "--config", str(cfg), "--output-dir", str(run), "--resume"]) == 2
    assert "ckpt_000001.pt is not a loadable checkpoint" in one_line_error(capsys, "train")
    assert main(["train", "--config", str(cfg), "--output-dir", str(run), "--overwrite",
                 "--set", f"pipeline.path={tmp_path / 'missing'}"]) == 2
    assert "jagg never downloads weights" in one_line_error(capsys, "train")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]    # the model first: nothing moved
    assert main(["train", "--config", str(cfg), "--output-dir", str(run), "--overwrite"]) == 2   # moved, no weights
    assert "no_model" in one_line_error(capsys, "train")
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert (aside / "metrics.jsonl").is_file() and (aside / "checkpoints" / "ckpt_000001.pt").read_bytes() == b"cut"
    assert not (run / RUN_FILE).exists()                                   # nothing written before the model loads


def test_a_run_directory_in_use_by_another_process_is_refused_and_changes_nothing(tmp_path, tiny_ckpt, capsys):
    """While a process trains in a directory (it holds run.lock), a second jagg train --resume or
    --resume-or-start there, or a new run with --overwrite, is refused with exit 2 and nothing moves; once the lock
    is released the same --resume works. (Two bench quality processes once moved a run aside under each other.)"""
    import subprocess
    import sys
    import time

    from jagg.infra.rundir import lock_holder, lock_run

    out = tmp_path / "run"
    assert main(tiny_train_args(tiny_ckpt, out, 1)) == 0
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from jagg.infra.rundir import lock_run; "
                               f"f = lock_run({str(out)!r}); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_holder(out) == str(holder.pid)
        before = _snapshot(out)
        capsys.readouterr()
        for extra in (["--resume"], ["--resume-or-start"], ["--overwrite"]):
            args = tiny_train_args(tiny_ckpt, out, 2)
            assert main(args[:3] + extra + args[3:]) == 2, extra
            err = capsys.readouterr().err
            assert f"in use by another jagg process (pid {holder.pid})" in err and "Traceback" not in err
            assert _snapshot(out) == before and not list(tmp_path.glob("run.old-*"))
        with pytest.raises(ValueError, match="in use"):
            lock_run(out)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert lock_holder(out) is None                    # released by the operating system when the process ended
    args = tiny_train_args(tiny_ckpt, out, 2)
    assert main(args[:3] + ["--resume"] + args[3:]) == 0


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_ckpt):
    """A run of 1 iteration (records, a checkpoint, run.json), to be copied."""
    out = tmp_path_factory.mktemp("locked") / "run"
    assert main(tiny_train_args(tiny_ckpt, out, 1, "eval.every=0")) == 0
    return out


@pytest.mark.parametrize("first", ["training", "starting"])
@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"], ["--resume-or-start"]])
def test_a_second_start_into_a_held_directory_is_refused_before_it_reads_or_loads_anything(first, flag, finished_run,
                                                                                         tmp_path, capsys):
    """Two `jagg train` into one directory a second apart: while the first holds the run lock (training: its records
    and checkpoints are there; starting: nothing but run.lock yet, its model loading), a second start of any kind
    (new, --resume, --overwrite, --resume-or-start) is refused "in use" naming the process, before it reads, moves or
    writes anything in the directory and before its model loads (here a model file that does not exist: that
    refusal would come after), and the first run's files are byte-identical afterwards."""
    from jagg.infra.rundir import LOCK_FILE, lock_run

    out = tmp_path / "run"
    if first == "training":
        shutil.copytree(finished_run, out)
    else:
        out.mkdir()
    held = lock_run(out)                       # the first run (another open file: flock refuses this process too)
    try:
        before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        assert LOCK_FILE in before and (first == "starting") == (len(before) == 1)
        args = tiny_train_args(str(tmp_path / "no_model.safetensors"), out, 2)
        assert main(args[:3] + flag + args[3:]) == 2
        err = one_line_error(capsys, "train")
        assert f"{out} is in use by another jagg process (pid {os.getpid()})" in err and "nothing was changed" in err
        after = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        assert after == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    finally:
        held.close()


@pytest.mark.parametrize("first", [[], ["--resume"]])
def test_a_run_holds_its_directory_from_before_its_model_loads(first, finished_run, tmp_path, tiny_ckpt, capsys,
                                                               monkeypatch):
    """While the first `jagg train` (new, or --resume) is loading its model, second starts of every kind into its
    directory are refused "in use" with every file as it was (a new run: nothing but run.lock); then the first run
    trains as if alone (its records continue, nothing moved aside)."""
    from jagg.trainers.shapes_trainer import ShapesTrainer

    out = tmp_path / "run"
    if first:
        shutil.copytree(finished_run, out)
    files = lambda: {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    before, refusals, real_setup = files(), [], ShapesTrainer.setup

    def setup(self):                            # the first run's model loading: the others try to start meanwhile
        if not refusals:
            now = files()
            assert set(now) == set(before) | {"run.lock"}
            for flag in ([], ["--resume"], ["--overwrite"], ["--resume-or-start"]):
                args = tiny_train_args(tiny_ckpt, out, 3)
                refusals.append(main(args[:3] + flag + args[3:]))
                assert "is in use by another jagg process" in capsys.readouterr().err
                assert files() == now and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
        real_setup(self)

    monkeypatch.setattr(ShapesTrainer, "setup", setup)
    args = tiny_train_args(tiny_ckpt, out, 2, "eval.every=0")
    assert main(args[:3] + first + args[3:]) == 0
    assert refusals == [2, 2, 2, 2]
    assert [r["iteration"] for r in _train_records(out)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_start_that_fails_before_training_leaves_no_lock_nor_directory(tmp_path, capsys):
    """The lock is taken before the model loads: a new run whose model does not load removes the directory it made
    for the lock (and the lock file in a directory that was there), and a refused --resume creates nothing."""
    from jagg.infra.rundir import LOCK_FILE, lock_holder

    missing = str(tmp_path / "no_model.safetensors")
    new = tmp_path / "a" / "b" / "run"
    assert main(tiny_train_args(missing, new, 1)) == 2
    assert "no_model.safetensors" in one_line_error(capsys, "train") and not (tmp_path / "a").exists()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("x")
    for flag in ([], ["--resume"]):
        args = tiny_train_args(missing, notes, 1)
        assert main(args[:3] + flag + args[3:]) == 2
        one_line_error(capsys, "train")
        assert sorted(p.name for p in notes.iterdir()) == ["mine.txt"] and lock_holder(notes) is None
    assert main(["train", "--output-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "no run in" in one_line_error(capsys, "train") and not (tmp_path / "none").exists()
    assert not (tmp_path / "none" / LOCK_FILE).exists()


def test_the_processes_of_one_run_all_refuse_or_all_go_on(tmp_path):
    """Under torchrun only the main process takes the lock; the others learn its answer from the gather every process
    makes (``agree``, here two processes' values): a held directory is refused on both, a free one opens on both,
    the other process holding no lock and reading only after the main one holds it."""
    from jagg.infra.rundir import RunDirError, lock_holder, lock_run, open_run

    out = tmp_path / "run"
    out.mkdir()
    held, told = lock_run(out), []
    try:
        with pytest.raises(RunDirError, match="in use"):
            open_run(out, main=True, agree=lambda error: told.append(error) or [error, None])
        assert len(told) == 1 and "in use by another jagg process" in told[0]
        with pytest.raises(RunDirError, match="in use"):
            open_run(out, main=False, agree=lambda error: [told[0], error])
    finally:
        held.close()
    main_start = open_run(out, main=True, agree=lambda error: [error, None])
    try:
        assert lock_holder(out) == str(os.getpid())
        other = open_run(out, main=False, agree=lambda error: [None, error])
        assert other.lock.file is None and other.resumed is None
    finally:
        main_start.lock.release(out)
    assert lock_holder(out) is None


def test_the_processes_of_one_run_probing_the_lock_at_once_do_not_refuse_each_other(tmp_path):
    """Every process of a run on several processes asks whether the directory is in use at the same moment: one
    probe in progress (a shared lock, held here) does not make another answer "in use"; once it is over a training
    process takes the lock, and then a probe answers with that process's pid."""
    import fcntl

    from jagg.infra.rundir import LOCK_FILE, lock_holder, lock_run

    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("4242\n")                 # left by a run that ended
    with open(out / LOCK_FILE) as probe:
        fcntl.flock(probe.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)      # another process's probe, mid-way
        assert lock_holder(out) is None
        fcntl.flock(probe.fileno(), fcntl.LOCK_UN)
    held = lock_run(out)
    try:
        assert lock_holder(out) == str(os.getpid())
    finally:
        held.close()
    assert lock_holder(out) is None


def test_a_changed_reward_stops_a_resume_by_name():
    from jagg.trainers.resume import check_resumable

    weights = {"jpeg_compressibility": 1.0, "geneval": 0.0}
    saved = {"reward": {"name": None, "weights": weights}, "grpo": {"iterations": 10}}
    assert check_resumable(saved, {"reward": {"name": None, "weights": weights}, "grpo": {"iterations": 20}}) == [
        "grpo.iterations: 10 in the checkpoint, 20 now"]
    with pytest.raises(ValueError, match="reward.weights"):
        check_resumable(saved, {"reward": {"name": None, "weights": {"jpeg_compressibility": 1.0}},
                                "grpo": {"iterations": 10}})
    with pytest.raises(ValueError, match="reward.name"):
        check_resumable({"reward": {"name": "geneval", "weights": None}}, {"reward": {"name": "x:y", "weights": None}})
