"""LoRA adapter files in both formats a Flow-GRPO user reads, written side by side in one directory:

- **diffusers**: ``pytorch_lora_weights.safetensors`` (peft keys under ``transformer.``, the LoraConfig as metadata, so
  ``alpha != rank`` survives), written with ``<Pipeline>.save_lora_weights``: ``pipe.load_lora_weights(dir)`` reads it
  (StableDiffusion3Pipeline, FluxPipeline, QwenImagePipeline, WanPipeline, Flux2Pipeline);
- **peft**: ``adapter_config.json`` + ``adapter_model.safetensors``, written by peft's own
  ``PeftModel.save_pretrained`` (on a weightless copy of the transformer, given the trained state): what
  ``PeftModel.from_pretrained(transformer, dir)`` reads, and what Flow-GRPO's checkpoints (``checkpoint-N/lora/``) hold.

:func:`save_adapter` writes both (the trained adapter, or the EMA's weights given as ``state``); :func:`load_adapter`
reads either into a transformer (``pipeline.lora.path``: start a run from a jagg or a Flow-GRPO adapter);
:func:`adapter_format` checks a directory before any model loads, :func:`check_adapter` also its weights file's header
(readable, LoRA tensors in it, one rank, the rank of ``pipeline.lora.rank`` when that is set), and :func:`load_adapter`
refuses an adapter whose modules are not the model's, naming the file. Note: ``convert_state_dict_to_diffusers`` must
*not* be applied to transformer adapters in current diffusers: it renames keys to the old UNet ``lora.down/up``
format and ``load_lora_weights`` then silently drops the attention adapters.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch
from torch import Tensor, nn

from ..checks import read_json
from .config import LORA_WEIGHT_NAME
from .families import FAMILIES
from .velocity_adapters import model_family, unwrap_model

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."                  # PeftModel's names of the wrapped model's parameters


def _lora_model(transformer: nn.Module) -> nn.Module:
    model = unwrap_model(transformer)
    if not getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError("the transformer has no LoRA adapter to save (full fine-tuning: use "
                         "transformer.save_pretrained(dir) instead)")
    return model


def save_lora(transformer: nn.Module, directory: str | Path, family: str | None = None,
              is_main_process: bool = True, state: dict[str, Tensor] | None = None) -> Path:
    """Save the LoRA adapter in the format ``<Pipeline>.load_lora_weights(directory)`` reads.

    Writes ``directory/pytorch_lora_weights.safetensors`` (peft keys under ``transformer.``; the LoraConfig as
    metadata). ``state``: weights by the transformer's parameter names to save instead of its own (the EMA's).
    Returns the directory. Under DDP/FSDP call it on every rank with ``is_main_process``.
    """
    import diffusers
    from peft.utils import get_peft_model_state_dict

    model = _lora_model(transformer)
    family = family or model_family(model)
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, state_dict=state).items()}
    cls = getattr(diffusers, FAMILIES[family].pipeline_class)
    kwargs = {}
    if "transformer_lora_adapter_metadata" in inspect.signature(cls.save_lora_weights).parameters:
        kwargs["transformer_lora_adapter_metadata"] = model.peft_config["default"].to_dict()
    else:                                   # old diffusers: no metadata, so fold alpha / r into B (exact at alpha=r)
        cfg = model.peft_config["default"]
        scale = cfg.lora_alpha / cfg.r
        state = {k: v * scale if "lora_B" in k else v for k, v in state.items()}
    directory = Path(directory)
    cls.save_lora_weights(str(directory), transformer_lora_layers=state, is_main_process=is_main_process, **kwargs)
    return directory


def save_peft(transformer: nn.Module, directory: str | Path, state: dict[str, Tensor] | None = None) -> Path:
    """Save the LoRA adapter in peft's format with peft's own ``PeftModel.save_pretrained``: ``adapter_config.json`` +
    ``adapter_model.safetensors`` (+ peft's ``README.md``), what ``PeftModel.from_pretrained(transformer, directory)``
    reads. The PeftModel wraps a copy of the transformer on the meta device (no weights, no memory) and is given the
    adapter's trained weights (``state``: by the transformer's parameter names, default its own)."""
    from peft import get_peft_model

    model = _lora_model(transformer)
    if state is None:
        state = {n: p for n, p in model.named_parameters() if "lora_" in n}
    with torch.device("meta"):
        skeleton = type(model).from_config(model.config)
    wrapper = get_peft_model(skeleton, copy.deepcopy(model.peft_config["default"]))
    wrapper.save_pretrained(str(directory), state_dict={PEFT_PREFIX + k: v.detach().cpu().contiguous()
                                                        for k, v in state.items() if "lora_" in k})
    return Path(directory)


def save_adapter(transformer: nn.Module, directory: str | Path, family: str | None = None,
                 state: dict[str, Tensor] | None = None) -> Path:
    """Both formats in ``directory`` (:func:`save_lora`, :func:`save_peft`): ``pipe.load_lora_weights(directory)``
    and ``PeftModel.from_pretrained(transformer, directory)`` each read it. ``state``: weights to save instead of the
    transformer's own (the EMA's), by its parameter names."""
    save_lora(transformer, directory, family, state=state)
    save_peft(transformer, directory, state)
    return Path(directory)


def adapter_format(directory: str | Path, key: str = "pipeline.lora.path") -> str:
    """``"diffusers"`` or ``"peft"``: which adapter ``directory`` holds (a jagg adapter holds both: diffusers is
    read), checked without loading a model; a missing directory, one with neither format, or a peft config that is
    not a LoRA adapter's is an error naming ``key``."""
    d = Path(directory).expanduser()
    formats = (f"{LORA_WEIGHT_NAME} (diffusers, save_lora_weights) or {PEFT_CONFIG_NAME} + "
               f"{PEFT_WEIGHT_NAMES[0]} (peft, save_pretrained)")
    if not d.is_dir():
        raise FileNotFoundError(f"{key} {str(directory)!r} is not a directory; give a LoRA adapter directory with "
                                f"{formats}")
    if (d / LORA_WEIGHT_NAME).is_file():
        return "diffusers"
    if (d / PEFT_CONFIG_NAME).is_file():
        config = read_json(d / PEFT_CONFIG_NAME, key)
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            got = config.get("peft_type") if isinstance(config, dict) else f"a JSON {type(config).__name__}"
            raise ValueError(f"{key} {d}: {PEFT_CONFIG_NAME} is not a LoRA adapter's (peft_type {got!r}, expected "
                             "'LORA')")
        if not any((d / name).is_file() for name in PEFT_WEIGHT_NAMES):
            raise FileNotFoundError(f"{key} {d} has {PEFT_CONFIG_NAME} but no {' or '.join(PEFT_WEIGHT_NAMES)}")
        return "peft"
    raise FileNotFoundError(f"{key} {d} holds no LoRA adapter: expected {formats}")


def _lora_shapes(path: Path, key: str) -> dict[str, list[int]]:
    """The shapes of the LoRA tensors (``lora_A`` / ``lora_B``) in the ``.safetensors`` file ``path``, read from its
    header alone; an empty, truncated or garbage file, or one without a LoRA tensor, is a ValueError naming ``key``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        size = path.stat().st_size if path.is_file() else 0
        raise ValueError(f"{key}: {path} ({size:,} bytes) is not a readable .safetensors file ({e}); is it empty, "
                         "truncated or another format? Save the adapter again or copy it whole") from None
    lora = {k: v for k, v in shapes.items() if ".lora_A." in k or ".lora_B." in k}
    if not any(".lora_A." in k for k in lora):
        raise ValueError(f"{key}: {path} holds no LoRA tensor (no '.lora_A.' key among its "
                         f"{len(shapes)} tensors{', e.g. ' + repr(next(iter(shapes))) if shapes else ''}); give a "
                         "LoRA adapter's weights")
    return lora


def check_adapter(directory: str | Path, key: str = "pipeline.lora.path", rank: int | None = None) -> str:
    """:func:`adapter_format` of ``directory``, then its weights file's header (:func:`_lora_shapes`): each
    ``lora_A`` of shape ``[r, in]`` with its ``lora_B`` ``[out, r]``, and ``r`` the given ``rank``
    (``pipeline.lora.rank``; None: any). Reads no tensor data; errors name ``key`` and the file."""
    d = Path(directory).expanduser()
    fmt = adapter_format(d, key)
    path = d / (LORA_WEIGHT_NAME if fmt == "diffusers" else PEFT_WEIGHT_NAMES[0])
    if not path.is_file():
        return fmt                                              # peft's adapter_model.bin: no header to read
    shapes = _lora_shapes(path, key)
    ranks = {v[0] for k, v in shapes.items() if ".lora_A." in k and v}
    for a, shape in ((k, v) for k, v in shapes.items() if ".lora_A." in k):
        b = shapes.get(a.replace(".lora_A.", ".lora_B."))
        if b is None or len(b) < 2 or len(shape) < 2 or b[1] != shape[0]:
            raise ValueError(f"{key}: {path}: {a!r} of shape {shape} has no lora_B of rank {shape[0]} beside it "
                             f"(got {b}); the file is not a whole LoRA adapter: save it again")
    if rank is not None and ranks != {rank}:
        raise ValueError(f"{key}: {path} holds LoRA rank {'/'.join(map(str, sorted(ranks)))}, not pipeline.lora.rank="
                         f"{rank}; set pipeline.lora.rank to the adapter's rank (or null: the adapter's own)")
    return fmt


def _modules(names, marker: str = ".lora_A.") -> set[str]:
    """The module names of the LoRA weights ``names`` (the part before ``marker``, prefixes removed)."""
    return {n.split(marker)[0].removeprefix("transformer.").removeprefix(PEFT_PREFIX) for n in names if marker in n}


def load_adapter(transformer: nn.Module, directory: str | Path, trainable: bool = True,
                 key: str = "pipeline.lora.path") -> list[nn.Parameter]:
    """Load the LoRA adapter of ``directory``, in either format (:func:`adapter_format`), into ``transformer`` as its
    adapter "default"; its parameters trainable (``trainable``) and returned. A peft adapter whose weights do not fit
    the transformer's modules is a ValueError naming ``key``."""
    model = unwrap_model(transformer)
    d = Path(directory).expanduser()
    if adapter_format(d, key) == "diffusers":
        _load_diffusers(model, d, key)
    else:
        from peft import LoraConfig
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        model.add_adapter(LoraConfig.from_pretrained(str(d)), adapter_name="default")
        weights = {k.removeprefix(PEFT_PREFIX): v for k, v in load_peft_weights(str(d), device="cpu").items()}
        result = set_peft_model_state_dict(model, weights, adapter_name="default")
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing:
            shown = (result.unexpected_keys or missing)[:3]
            raise ValueError(f"{key} {d}: the peft adapter does not fit this {type(model).__name__} "
                             f"({'unexpected' if result.unexpected_keys else 'missing'} weights, e.g. {shown}); was it "
                             "trained on another model?")
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(trainable)
    return params


def _load_diffusers(model: nn.Module, d: Path, key: str) -> None:
    """Load ``d``'s diffusers adapter into ``model``; diffusers keeps the modules it finds and warns of the rest, so
    weights for modules the model lacks are one ValueError naming ``key`` and the file instead."""
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from safetensors import safe_open

    with safe_open(str(d / LORA_WEIGHT_NAME), "pt") as f:
        wanted = _modules(f.keys())
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            model.load_lora_adapter(str(d), prefix="transformer", adapter_name="default", weight_name=LORA_WEIGHT_NAME)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    strays = sorted(wanted - _modules(n for n, _ in model.named_parameters()))
    if strays:
        raise ValueError(f"{key}: {d / LORA_WEIGHT_NAME}: {len(strays)} of the adapter's {len(wanted)} modules are "
                         f"not modules of this {type(model).__name__} (e.g. {strays[:2]}); was it trained on another "
                         "model?")


def load_lora(transformer: nn.Module, directory: str | Path, trainable: bool = True) -> list[nn.Parameter]:
    """Load an adapter saved by :func:`save_lora` or :func:`save_adapter` (or any diffusers or peft LoRA of this
    family) into ``transformer`` as adapter "default" and make it trainable (resume). Returns its parameters."""
    return load_adapter(transformer, directory, trainable, "directory")
