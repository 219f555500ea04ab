"""The trained weights of a real-model checkpoint, exported beside it in the formats their users load.

With LoRA, ``checkpoints/adapter_<n>/`` holds the adapter in diffusers' and in peft's format
(:func:`jagg.integrations.adapters.save_adapter`): ``pipe.load_lora_weights(dir)`` and
``PeftModel.from_pretrained(transformer, dir)`` read it, and so does ``pipeline.lora.path``. With full fine-tuning,
``checkpoints/transformer_<n>/`` holds the transformer written by its own ``save_pretrained``
(``<Transformer>.from_pretrained(dir)``). With an EMA (``optim.ema_decay > 0``) the EMA's weights are exported the
same way into the ``ema/`` subdirectory. Each export is written to a temporary name and renamed, and goes when its
checkpoint is pruned (:func:`prune_exports`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

EXPORT_PREFIXES = ("adapter_", "transformer_")          # checkpoints/<prefix><n>/, one per checkpoint
EMA_DIR = "ema"


def export_name(lora: bool, iteration: int) -> str:
    """The export directory's name of the checkpoint of ``iteration``."""
    return f"{'adapter_' if lora else 'transformer_'}{iteration:06d}"


def _write(policy, directory: Path, lora: bool, state=None) -> None:
    if lora:
        policy.save_adapter(directory, state)
    else:
        policy.bare.save_pretrained(str(directory))


def export_weights(policy, ckpt_dir: Path, iteration: int, ema=None) -> Path:
    """Export ``policy``'s trained weights (and ``ema``'s, an :class:`jagg.trainers.ema.EMA`, into ``ema/``) as the
    checkpoint of ``iteration``'s export directory (module docstring); returns it."""
    lora = policy.config.lora.enabled
    final = Path(ckpt_dir) / export_name(lora, iteration)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _write(policy, tmp, lora)
    if ema is not None:
        if lora:
            _write(policy, tmp / EMA_DIR, lora, ema.state_dict())
        else:
            with ema.applied():
                _write(policy, tmp / EMA_DIR, lora)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def prune_exports(ckpt_dir: Path, removed: list[Path]) -> None:
    """Delete the export directories of the pruned checkpoints ``removed`` (``ckpt_<n>.pt`` -> ``adapter_<n>/``,
    ``transformer_<n>/``); other directories stay."""
    for ckpt in removed:
        n = ckpt.name.removeprefix("ckpt_").removesuffix(".pt")
        for prefix in EXPORT_PREFIXES:
            shutil.rmtree(Path(ckpt_dir) / f"{prefix}{n}", ignore_errors=True)
