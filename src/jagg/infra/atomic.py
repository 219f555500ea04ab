"""Atomic file writes: every file jagg writes (checkpoints, weights, ``run.json``, image grids, plots, JSON results)
goes through :func:`atomic_write` (a directory of files, e.g. exported weights: :func:`replace_dir`), so that a
crash, a full disk or Ctrl-C mid-write leaves the previous file (or none), never a torn one. Whether a command may
replace a user's file is decided before the work, by :func:`jagg.checks.check_output_file` (``--overwrite``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` atomically: ``write(f)`` fills a temporary file (binary) in the same directory, which is flushed
    to disk and renamed over ``path``; on any failure (or interrupt) the temporary file is removed and ``path`` is as
    it was. The parent directory is created. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def replace_dir(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Write the directory ``path`` as a whole: ``write(tmp)`` fills a temporary directory next to it, which then
    takes its place (an earlier ``path`` is renamed aside first and deleted after), so ``path`` is either the old
    directory or the complete new one; a failure leaves the old one and removes the temporary. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        write(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return path


def json_safe(v):
    """``v`` with every non-finite float (NaN, infinity: a figure that could not be computed) as None, JSON's null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def write_json(path: str | Path, records) -> None:
    """Write ``records`` as indented JSON (NaN and infinity become null), atomically (:func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(json_safe(records), indent=1) + "\n")
