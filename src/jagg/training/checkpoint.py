"""Training checkpoints: atomic writes, keep-last-N, newest-complete lookup, and model loading.

A checkpoint is one ``torch.save`` file ``checkpoints/ckpt_<iteration>.pt`` holding the model, optimizer
and EMA states, every RNG state, the iteration, the config and a manifest (code version, time). It is
written to a temporary file in the same directory, flushed to disk, then renamed, so a crash mid-write
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import torch

from .. import __version__

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temp file next to ``path``, fsync, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(state: dict, directory: Path, iteration: int, keep_last: int) -> Path:
    """Write ``state`` as ``ckpt_<iteration>.pt`` with a manifest, then delete all but the newest ``keep_last``."""
    state = dict(state, manifest={"jagg_version": __version__, "iteration": iteration, "time": time.time()})
    path = Path(directory) / f"ckpt_{iteration:06d}.pt"
    atomic_torch_save(state, path)
    for old in list_checkpoints(directory)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temp files of interrupted writes are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def read_checkpoint(path: str | Path) -> dict:
    """The state dict of one checkpoint file written by :func:`save_checkpoint`.

    Raises ``ValueError`` naming the file when it is not a loadable checkpoint: truncated or corrupt (torch.load
    fails), or not a jagg training checkpoint (no ``model`` or ``manifest`` entry).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError, ...: the message says which
        raise ValueError(f"{path} is not a loadable checkpoint, it may be truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"model", "manifest"} <= state.keys():
        raise ValueError(f"{path} is not a loadable checkpoint: it holds no jagg training state (model and "
                         "manifest entries, written by jagg train)")
    return state


def load_latest(directory: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads completely, or None. Unreadable files are skipped with a warning."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return read_checkpoint(path), path
        except ValueError as e:  # a truncated or corrupt file: fall back to the previous one
            print(f"warning: skipping unreadable checkpoint: {e}")
    return None
