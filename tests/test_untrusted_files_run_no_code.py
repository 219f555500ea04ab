"""A checkpoint from somebody else never runs code when jagg reads it: every ``.pt`` jagg reads (``jagg eval`` and
``jagg sample --checkpoint``, a run directory's newest checkpoint, ``model.checkpoint``, the ``--resume`` scan, the
keep-last pruning that reads each checkpoint's run id) is unpickled with ``weights_only=True``; a file that would
build any other object is refused naming the file and the object, and the object is never built. What jagg train
writes (RNG states included) is tensors and plain data, which is all these loads accept."""

from __future__ import annotations

import shutil

import pytest
import torch

from command_line import files_under, refused, run as run_cli
from jagg.cli import main
from jagg.infra.checkpoint import list_checkpoints, load_file
from tiny_runs import no_eval_train_args


class Payload:
    """Unpickled, it creates the file ``marker``: what a hostile checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def hostile(path, marker):
    """A ``.pt`` shaped like a jagg checkpoint whose ``manifest`` runs :class:`Payload` when unpickled."""
    torch.save({"model": {}, "manifest": Payload(marker), "iteration": 9}, path)
    return path


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory, tiny_ckpt):
    """A run of 2 iterations (checkpoints at 1 and 2), to be copied."""
    run = tmp_path_factory.mktemp("untrusted") / "run"
    assert main(no_eval_train_args(tiny_ckpt, run, 2)) == 0
    return run


def test_the_payload_runs_code_when_unpickled_without_the_guard(tmp_path):
    """The hostile file of these tests does run code under ``weights_only=False`` (so the tests below test
    something), and :func:`load_file` refuses it naming the object, without running it."""
    marker = tmp_path / "ran"
    path = hostile(tmp_path / "evil.pt", marker)
    with pytest.raises(ValueError, match=r"evil\.pt is refused: it holds exec,") as e:
        load_file(path)
    assert not marker.exists() and "\n" not in str(e.value)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_every_checkpoint_jagg_train_writes_is_plain_data(two_iterations):
    """Every entry of a shapes checkpoint (RNG states, optimizer, config, manifest) loads with ``weights_only=True``."""
    for path in list_checkpoints(two_iterations / "checkpoints"):
        state = load_file(path)
        assert {"model", "optimizer", "rng", "manifest", "config"} <= state.keys()


@pytest.mark.parametrize("how", ["eval file", "eval run dir", "sample file", "train model.checkpoint"])
def test_a_hostile_checkpoint_is_refused_by_every_command_that_reads_one(how, two_iterations, tmp_path, tiny_ckpt,
                                                                         capsys):
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    shutil.copytree(two_iterations, run)
    evil = hostile(run / "checkpoints" / "ckpt_000003.pt", marker)      # the newest of the run
    argv = {"eval file": ["eval", "--checkpoint", str(evil)],
            "eval run dir": ["eval", "--checkpoint", str(run)],
            "sample file": ["sample", "--checkpoint", str(evil), "--prompt", "a red circle", "--out",
                            str(tmp_path / "grid.png")],
            "train model.checkpoint": no_eval_train_args(str(evil), tmp_path / "new", 1)}[how]
    refused(main, argv, capsys, f"{evil} is refused", "it holds exec,", "could run code")
    assert not marker.exists()
    assert not (tmp_path / "grid.png").exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["newest", "older"])
def test_resume_never_unpickles_a_planted_checkpoint(where, two_iterations, tmp_path, tiny_ckpt, capsys):
    """A hostile ``ckpt_*.pt`` planted in ``checkpoints/``: the newest is refused by ``--resume`` by name with nothing
    changed; an older one is never unpickled by the resume (which starts from the newest) nor by the pruning that
    reads each checkpoint's run id, and is never deleted (it is not this run's)."""
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    shutil.copytree(two_iterations, run)
    name = "ckpt_000003.pt" if where == "newest" else "ckpt_000000.pt"
    evil = hostile(run / "checkpoints" / name, marker)
    before = files_under(run)
    argv = no_eval_train_args(tiny_ckpt, run, 3, "log.keep_last=1") + ["--resume"]
    if where == "newest":
        refused(main, argv, capsys, "cannot resume", f"{evil} is refused", "it holds exec,", "nothing was changed")
        assert files_under(run) == before
    else:
        code, line, _ = run_cli(main, argv, capsys)
        assert code == 0, line
        assert evil.read_bytes() == before[f"checkpoints/{name}"]
        assert [p.name for p in list_checkpoints(run / "checkpoints")] == [name, "ckpt_000003.pt"]
    assert not marker.exists()


def test_numpy_floats_of_earlier_checkpoints_still_load(tmp_path):
    """Earlier versions kept numpy float scalars in the meter's state: the one kind of object the loads allow
    besides tensors and plain data (it builds a number from bytes); a numpy array, which they never wrote, is
    refused."""
    import numpy as np

    torch.save({"meter": {"tensor_noise": [[np.float64(0.25), np.float64(1e-3)]]}}, tmp_path / "old.pt")
    got = load_file(tmp_path / "old.pt")["meter"]["tensor_noise"][0]
    assert got == [0.25, 1e-3]
    torch.save({"meter": np.zeros(3, dtype=object)}, tmp_path / "array.pt")
    with pytest.raises(ValueError, match=r"array\.pt is refused: it holds numpy"):
        load_file(tmp_path / "array.pt")


def test_a_hostile_prompt_cache_is_refused(tmp_path):
    """``pipeline.prompt_cache`` as ``.pt``: the same load, the same refusal; a file that is no torch file names it."""
    from jagg.integrations.velocity_adapters import PromptEmbeddings

    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match=r"cache\.pt is refused: it holds exec,"):
        PromptEmbeddings.load(hostile(tmp_path / "cache.pt", marker))
    assert not marker.exists()
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ValueError, match=r"torn\.pt is not a readable prompt-embedding cache"):
        PromptEmbeddings.load(tmp_path / "torn.pt")
