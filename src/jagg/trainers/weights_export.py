"""The trained weights of a real-model checkpoint, exported beside it in the formats their users load.

With LoRA, ``checkpoints/adapter_<n>/`` holds the adapter in diffusers' and in peft's format
(:func:`jagg.integrations.lora_files.save_adapter`): ``pipe.load_lora_weights(dir)`` and
``PeftModel.from_pretrained(transformer, dir)`` read it, and so does ``pipeline.lora.path``. With full fine-tuning,
``checkpoints/transformer_<n>/`` holds the transformer written by its own ``save_pretrained``
(``<Transformer>.from_pretrained(dir)``). With an EMA (``optim.ema_decay > 0``) the EMA's weights are exported the
same way into the ``ema/`` subdirectory. Under FSDP the trainer gathers the weights first and passes them. Each export
is written to a temporary name and renamed, and goes when its checkpoint is pruned (:func:`prune_exports`); the run's
final weights (``final/``) are written the same way (:func:`write_weights`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..infra.atomic import replace_dir
from ..integrations.policy import save_transformer

EXPORT_PREFIXES = ("adapter_", "transformer_")          # checkpoints/<prefix><n>/, one per checkpoint
EMA_DIR = "ema"


def export_name(lora: bool, iteration: int) -> str:
    """The export directory's name of the checkpoint of ``iteration``."""
    return f"{'adapter_' if lora else 'transformer_'}{iteration:06d}"


def _write(policy, directory: Path, lora: bool, state=None) -> None:
    if lora:
        policy.save_adapter(directory, state)
    else:
        save_transformer(policy.bare, directory, state)


def write_weights(policy, directory: Path, weights: dict | None = None, ema: dict | None = None) -> Path:
    """Write ``policy``'s trained weights into ``directory`` as a whole (a temporary directory renamed into place):
    the adapter (LoRA) or the transformer (full fine-tuning), and ``ema``'s into ``directory/ema/``. ``weights``: the
    weights by parameter name to write (gathered from FSDP's shards: the trainable ones with LoRA, all of them with
    full fine-tuning; None: the model's own); ``ema``: the EMA's by parameter name (None: no EMA). Returns it."""
    lora = policy.config.lora.enabled

    def write(tmp: Path) -> None:
        _write(policy, tmp, lora, weights)
        if ema is not None:
            whole = weights if weights is not None else policy.bare.state_dict()
            _write(policy, tmp / EMA_DIR, lora, ema if lora else {**whole, **ema})

    return replace_dir(directory, write)


def export_weights(policy, ckpt_dir: Path, iteration: int, weights: dict | None = None,
                   ema: dict | None = None) -> Path:
    """The export directory of the checkpoint of ``iteration`` (module docstring), written by :func:`write_weights`;
    returns it."""
    return write_weights(policy, Path(ckpt_dir) / export_name(policy.config.lora.enabled, iteration), weights, ema)


def prune_exports(ckpt_dir: Path, removed: list[Path]) -> None:
    """Delete what belongs to the pruned checkpoints ``removed`` (``ckpt_<n>.pt`` -> its export, ``adapter_<n>/`` or
    ``transformer_<n>/``, and FSDP's shard directory ``ckpt_<n>.dcp/``); other directories stay."""
    for ckpt in removed:
        n = ckpt.name.removeprefix("ckpt_").removesuffix(".pt")
        for name in (*(f"{prefix}{n}" for prefix in EXPORT_PREFIXES), f"ckpt_{n}.dcp"):
            shutil.rmtree(Path(ckpt_dir) / name, ignore_errors=True)
