"""Training checkpoints: atomic writes, keep-last-N, newest-complete lookup, and model loading.

A checkpoint is one ``torch.save`` file ``checkpoints/ckpt_<iteration>.pt`` holding the model, optimizer
and EMA states, every RNG state, the iteration, the config, the run id (:mod:`jagg.infra.rundir`) and a
manifest (code version, time). It is
written to a temporary file in the same directory, flushed to disk, then renamed, so a crash mid-write
leaves the previous checkpoint intact. When the weights are sharded across processes (FSDP), every process writes its
shards with ``torch.distributed.checkpoint`` to the directory ``ckpt_<iteration>.dcp/`` (:func:`write_shards`: a
temporary directory renamed once complete), and the ``.pt`` file, written after it, names that directory in place of
the model and optimizer states.

Checkpoints hold tensors and plain data only (dicts, lists, tuples, numbers, strings: the RNG states too), and every
checkpoint is read with ``torch.load(weights_only=True)`` (:func:`load_file`), which unpickles nothing else (but
numpy's float scalars, which earlier versions wrote): a file
from somebody else that holds any other object (whose unpickling could run code) is refused by name
(:class:`UnsafeCheckpoint`), never loaded.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import __version__
from ..checks import check_fields
from ..meter import Meter
from .atomic import atomic_write
from .shards import check_shards, mark_run

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_GLOBAL = re.compile(rf"GLOBAL ({_DOTTED}) was not|got <class '({_DOTTED})'>|GLOBAL ({_DOTTED}) whose module")

# what a training checkpoint holds, by kind (:func:`jagg.checks.check_fields`): ``model`` and ``manifest`` in every one,
# the loop's state (:data:`RESUME_FIELDS`) in those a run resumes from, the others where the trainer writes them; under
# FSDP ``model`` and ``optimizer`` name the shard directory ``ckpt_<n>.dcp`` instead (:func:`write_shards`)
FIELDS = {"model": "object|string", "manifest": "object", "config": "object", "iteration": "integer", "wall": "number",
          "cpu": "number", "skipped_updates": "integer", "rng": "object|list", "optimizer": "object|string",
          "run_id": "string|null", "meter": "object|null", "ema": "object|null", "model_config": "object",
          "trainer": "string", "world_size": "integer"}
RESUME_FIELDS = ("config", "iteration", "wall", "skipped_updates", "rng", "optimizer")


class UnsafeCheckpoint(ValueError):
    """A ``.pt`` file that holds more than tensors and plain data: refused unread (unpickling it could run code)."""


def _allowed_globals() -> list:
    """What :func:`load_file` builds besides tensors and plain data: numpy's float scalars (their constructor and
    dtype), which the meter's state held in checkpoints of earlier versions; building them runs no code."""
    try:
        from numpy._core.multiarray import scalar           # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import scalar
    return [scalar, np.dtype, type(np.dtype(np.float64))]


def load_file(path: Path, mmap: bool = False):
    """What the ``torch.save`` file ``path`` holds, unpickled with ``weights_only=True``: tensors and plain data only,
    no code runs. Raises :class:`UnsafeCheckpoint` naming the file and the object it would have built when it holds
    anything else; other failures (truncated, corrupt, missing) raise as ``torch.load`` raises them."""
    allowed = getattr(torch.serialization, "safe_globals", None)        # torch >= 2.5; before it: plain data only
    try:
        with allowed(_allowed_globals()) if allowed else contextlib.nullcontext():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        what = _GLOBAL.search(str(e))       # else damaged (an unknown opcode, a garbled name such as 'u.')
        if what is None:
            raise
        raise UnsafeCheckpoint(
            f"{path} is refused: it holds {next(g for g in what.groups() if g)}, more than the "
            "tensors and plain data jagg train writes, and loading it could run code, so it was not loaded; it was "
            "not written by jagg train (or was changed since): move it away and use a checkpoint jagg wrote") from None


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` through :func:`jagg.infra.atomic.atomic_write` (a temp file next to ``path``, fsync, rename)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def write_checkpoint(state: dict, directory: Path, iteration: int) -> Path:
    """Write ``state`` atomically as ``ckpt_<iteration>.pt`` with a manifest; returns its path."""
    state = dict(state, manifest={"jagg_version": __version__, "iteration": iteration, "time": time.time()})
    path = Path(directory) / f"ckpt_{iteration:06d}.pt"
    atomic_torch_save(state, path)
    return path


def checkpoint_run_id(path: Path) -> str | None:
    """The ``run_id`` a checkpoint file carries (memory-mapped: its tensors are not read), or None when it has none
    (written before run ids) or cannot be read."""
    try:
        state = load_file(path, mmap=True)
    except Exception:
        return None
    return state.get("run_id") if isinstance(state, dict) else None


def prune_checkpoints(directory: Path, keep_last: int, run_id: str | None, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints of run ``run_id``; returns the deleted paths.

    Only files carrying ``run_id`` are candidates: another run's checkpoints, checkpoints without a run id and
    unreadable files are never deleted, nor is ``keep`` (the one just written). Without a run id nothing is deleted."""
    if run_id is None:
        return []
    keep = Path(keep) if keep is not None else None
    ours = [p for p in list_checkpoints(directory) if p == keep or checkpoint_run_id(p) == run_id]
    removed = [p for p in ours[:-keep_last] if p != keep]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def save_checkpoint(state: dict, directory: Path, iteration: int, keep_last: int) -> Path:
    """Write ``state`` as ``ckpt_<iteration>.pt`` with a manifest, then delete this run's (``state["run_id"]``)
    checkpoints but the newest ``keep_last`` (:func:`prune_checkpoints`)."""
    path = write_checkpoint(state, directory, iteration)
    prune_checkpoints(directory, keep_last, state.get("run_id"), keep=path)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temp files of interrupted writes are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def read_checkpoint(path: str | Path, resume: bool = False) -> dict:
    """The state dict of one checkpoint file written by :func:`save_checkpoint`.

    Raises ``ValueError`` naming the file when it is not a loadable checkpoint: truncated or corrupt (torch.load
    fails), not a jagg training checkpoint (no ``model`` or ``manifest`` entry), or an entry of the wrong kind
    (:data:`FIELDS`, named); with ``resume``, the loop's state (:data:`RESUME_FIELDS`) must be there too.
    """
    try:
        state = load_file(path)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError, ...: the message says which
        raise ValueError(f"{path} is not a loadable checkpoint, it may be truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"model", "manifest"} <= state.keys():
        raise ValueError(f"{path} is not a loadable checkpoint: it holds no jagg training state (model and "
                         "manifest entries, written by jagg train)")
    required = ("model", "manifest") + (RESUME_FIELDS if resume else ())
    check_fields(state, FIELDS, f"{path} is not a loadable checkpoint", tuple(k for k in FIELDS if k not in required),
                 "it was not written by jagg train, or was changed since")
    for key in ("model", "optimizer"):
        if isinstance(state.get(key), str):      # FSDP's shards: there, complete and of this run (jagg.infra.shards)
            try:
                check_shards(Path(path).parent / state[key], state.get("run_id"))
            except ValueError as e:
                raise ValueError(f"{path} is not a loadable checkpoint: its {key!r} {e}; restore it, or resume "
                                 "from another checkpoint") from None
    if state.get("meter") is not None:
        check_fields(state["meter"], Meter.STATE_FIELDS, f"{path} is not a loadable checkpoint: its 'meter'",
                     fix="it was not written by jagg train, or was changed since")
    if state.get("iteration", 0) < 0:
        raise ValueError(f"{path} is not a loadable checkpoint: its 'iteration' is {state['iteration']}, below 0")
    return state


def load_latest(directory: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads completely, or None. Unreadable files are skipped with a warning; a file that
    holds more than jagg writes is refused (:class:`UnsafeCheckpoint`)."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return read_checkpoint(path), path
        except UnsafeCheckpoint:
            raise
        except ValueError as e:  # a truncated or corrupt file: fall back to the previous one
            print(f"warning: skipping unreadable checkpoint: {e}")
    return None


def write_shards(save: Callable[[Path], None], directory: Path, iteration: int, main: bool,
                 barrier: Callable[[], None], run_id: str | None = None) -> str:
    """The shard directory of iteration ``iteration``, ``ckpt_<iteration>.dcp`` in ``directory``: every process calls
    this with ``save(tmp)`` (a collective, e.g. ``torch.distributed.checkpoint.save``) filling a temporary directory,
    which the main process marks with ``run_id`` (:func:`jagg.infra.shards.mark_run`) and renames once every process
    is done (``barrier``). Returns the directory's name, for the ``.pt`` file written after it."""
    name = f"ckpt_{iteration:06d}.dcp"
    tmp = Path(directory) / f".{name}.tmp"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)               # left by a crash mid-write
        tmp.mkdir(parents=True)
    barrier()
    save(tmp)
    barrier()
    if main:
        mark_run(tmp, run_id)
        shutil.rmtree(Path(directory) / name, ignore_errors=True)   # an orphan: its .pt was never written
        os.replace(tmp, Path(directory) / name)
    barrier()
    return name


def shard_names(path: Path, entry: str = "model") -> set[str]:
    """The keys of ``entry`` (e.g. the trainable parameters' names) in a shard directory of :func:`write_shards`."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:       # missing or torn: the message says which
        raise ValueError(f"the checkpoint's shard directory {path} cannot be read ({type(e).__name__}: {e})") from None
    prefix = entry + "."
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}
