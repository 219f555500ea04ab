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
from importlib import resources
from pathlib import Path

import torch

from . import __version__
from .models import TinyDiT, load_pretrained

BUILTIN = {"builtin:tiny_dit": "tiny_dit.safetensors"}
_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def builtin_path(name: str) -> Path:
    """Path of a checkpoint shipped inside the package (``builtin:tiny_dit``)."""
    if name not in BUILTIN:
        raise ValueError(f"unknown builtin checkpoint {name!r}; available: {', '.join(BUILTIN)}")
    path = Path(str(resources.files("jagg") / "assets" / BUILTIN[name]))
    if not path.is_file():
        raise FileNotFoundError(f"the shipped checkpoint {path} is missing; rebuild it with `jagg pretrain` "
                                "(see docs/pretrain.md)")
    return path


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


def load_latest(directory: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads completely, or None. Unreadable files are skipped with a warning."""
    for path in reversed(list_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            if "manifest" in state and "model" in state:
                return state, path
        except Exception as e:  # a truncated or corrupt file: fall back to the previous one
            print(f"warning: skipping unreadable checkpoint {path}: {e}")
    return None


def load_model(spec: str, use_ema: bool = True) -> TinyDiT:
    """A TinyDiT from ``builtin:tiny_dit``, a ``.safetensors`` file, or a training checkpoint ``.pt``
    (its EMA weights when present and ``use_ema``) or run directory (its newest checkpoint)."""
    if spec.startswith("builtin:"):
        return load_pretrained(builtin_path(spec))
    path = Path(spec)
    if path.is_dir():
        found = load_latest(path / "checkpoints") or load_latest(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint found in {path} (looked for checkpoints/ckpt_*.pt)")
        state = found[0]
    elif not path.is_file():
        raise FileNotFoundError(f"checkpoint {spec!r} not found; pass a .safetensors file, a training "
                                "checkpoint .pt, a run directory, or builtin:tiny_dit")
    elif path.suffix == ".safetensors":
        return load_pretrained(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)
    from .models import DiTConfig

    model = TinyDiT(DiTConfig.from_dict(state["model_config"]))
    weights = state["ema"] if use_ema and state.get("ema") is not None else state["model"]
    model.load_state_dict(weights)
    return model
