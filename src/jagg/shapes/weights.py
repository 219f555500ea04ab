"""Where a TinyDiT's weights come from: the checkpoint shipped with jagg, a ``.safetensors`` file, or a training
checkpoint (``.pt`` or a run directory, its EMA weights by default)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..infra.checkpoint import load_latest, read_checkpoint
from .dit import DiTConfig, TinyDiT, load_pretrained

BUILTIN = {"builtin:tiny_dit": "tiny_dit.safetensors"}

def builtin_path(name: str) -> Path:
    """Path of a checkpoint shipped inside the package (``builtin:tiny_dit``)."""
    if name not in BUILTIN:
        raise ValueError(f"unknown builtin checkpoint {name!r}; available: {', '.join(BUILTIN)}")
    path = Path(str(resources.files("jagg.shapes") / "assets" / BUILTIN[name]))
    if not path.is_file():
        raise FileNotFoundError(f"the shipped checkpoint {path} is missing; rebuild it with `jagg pretrain` "
                                "(see docs/pretrain.md)")
    return path


def load_model(spec: str, use_ema: bool = True) -> TinyDiT:
    """A TinyDiT from ``builtin:tiny_dit``, a ``.safetensors`` file, or a training checkpoint ``.pt``
    (its EMA weights when present and ``use_ema``) or run directory (its newest checkpoint)."""
    if spec.startswith("builtin:"):
        return _load_safetensors(builtin_path(spec))
    path = Path(spec)
    if path.is_dir():
        found = load_latest(path / "checkpoints") or load_latest(path)
        if found is None:
            raise FileNotFoundError(f"no loadable checkpoint in {path} (looked for checkpoints/ckpt_*.pt; "
                                    "unreadable ones are reported above)")
        state, path = found
    elif not path.is_file():
        raise FileNotFoundError(f"checkpoint {spec!r} not found; pass a .safetensors file, a training "
                                "checkpoint .pt, a run directory, or builtin:tiny_dit")
    elif path.suffix == ".safetensors":
        return _load_safetensors(path)
    else:
        state = read_checkpoint(path)
    if "model_config" not in state:
        raise ValueError(f"{path} is not a loadable TinyDiT checkpoint: it has no model_config (a real-model "
                         "checkpoint? load those with jagg.integrations)")
    try:
        model = TinyDiT(DiTConfig.from_dict(state["model_config"]))
        model.load_state_dict(state["ema"] if use_ema and state.get("ema") is not None else state["model"])
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a loadable TinyDiT checkpoint: {e}") from None
    return model


def _load_safetensors(path: Path) -> TinyDiT:
    try:
        return load_pretrained(path)
    except Exception as e:  # SafetensorError (truncated, corrupt), missing metadata, mismatched weights
        raise ValueError(f"{path} is not a loadable checkpoint, it may be truncated or corrupt "
                         f"({type(e).__name__}: {e}); pass a .safetensors written by jagg pretrain") from None
