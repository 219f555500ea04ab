"""LoRA (peft) or full fine-tuning of a diffusers transformer, the KL reference, and adapter checkpoints.

Flow-GRPO's settings (``scripts/train_sd3.py``, ``scripts/train_flux.py`` in yifan123/flow_grpo), the defaults
here:

=========  ====  =====  ==========  =================================================================================
family     rank  alpha  init        target modules
=========  ====  =====  ==========  =================================================================================
SD3/SD3.5  32    64     gaussian    ``attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, attn.to_k,
                                    attn.to_out.0, attn.to_q, attn.to_v``
FLUX.1     64    128    gaussian    the SD3 list plus ``ff.net.0.proj, ff.net.2, ff_context.net.0.proj,
                                    ff_context.net.2``
=========  ====  =====  ==========  =================================================================================

(``attn.to_q`` matches ``transformer_blocks.i.attn.to_q`` but not SD3.5's second attention ``attn2``.)

Adapters are added with diffusers' own ``transformer.add_adapter(LoraConfig)``, so the transformer keeps its class
(forward signature, ``config``, ``enable_gradient_checkpointing``) and checkpoints are exactly what
``StableDiffusion3Pipeline.load_lora_weights`` / ``FluxPipeline.load_lora_weights`` read: the peft state dict
(``get_peft_model_state_dict``) saved with ``<Pipeline>.save_lora_weights`` plus the adapter's LoraConfig as metadata
(so ``alpha != rank`` survives the round trip). Note: ``convert_state_dict_to_diffusers`` must *not* be applied to
transformer adapters in current diffusers: it renames keys to the old UNet ``lora.down/up`` format and
``load_lora_weights`` then silently drops the attention adapters.

The KL reference policy is the same network with the adapters switched off (:func:`adapters_disabled`,
:func:`reference_velocity`). With full fine-tuning the reference is a frozen copy of the initial weights
(:func:`frozen_copy`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from .diffusers_adapters import FAMILIES, TransformerVelocity, model_family, unwrap_model

SD3_TARGET_MODULES = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                      "attn.to_out.0", "attn.to_q", "attn.to_v")
FLUX_TARGET_MODULES = SD3_TARGET_MODULES + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
FLOW_GRPO_LORA = {"sd3": (32, 64.0, SD3_TARGET_MODULES), "flux": (64, 128.0, FLUX_TARGET_MODULES)}
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@dataclass
class LoraSettings:
    """LoRA or full fine-tuning. Unset rank / alpha / target_modules take Flow-GRPO's values for the family."""

    enabled: bool = field(default=True, metadata={"help": "Train LoRA adapters (true) or all transformer weights "
                          "(false: full fine-tuning; the KL reference is then a frozen copy)."})
    rank: int | None = field(default=None, metadata={"help": "LoRA rank r (Flow-GRPO: SD3 32, FLUX 64)."})
    alpha: float | None = field(default=None, metadata={"help": "LoRA alpha; scale = alpha / r (Flow-GRPO: 2 r)."})
    target_modules: list[str] | None = field(default=None, metadata={"help": "Module-name suffixes that get "
                                             "adapters (default: Flow-GRPO's list for the family, see "
                                             "jagg.integrations.lora)."})
    init: str = field(default="gaussian", metadata={"help": "peft init_lora_weights: 'gaussian' (Flow-GRPO) or "
                      "'default' (kaiming A); B starts at zero either way, so the policy starts at the base model."})
    dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    fp32_params: bool = field(default=True, metadata={"help": "Keep trainable parameters in fp32 (master weights: "
                              "AdamW updates below bf16's resolution are not lost). LoRA: the adapters, on the bf16 "
                              "base. Full fine-tuning: the whole transformer, so set pipeline.autocast: bf16 to "
                              "compute in bf16; the KL reference copy stays in pipeline.dtype."})
    path: str | None = field(default=None, metadata={"help": "Resume from a saved adapter directory "
                             f"(containing {LORA_WEIGHT_NAME})."})

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(f"lora.rank must be an integer >= 1; got {self.rank!r}")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0; got {self.alpha}")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("lora.target_modules must be a non-empty list (or null for Flow-GRPO's default)")
        if self.init not in ("gaussian", "default"):
            raise ValueError(f"lora.init must be 'gaussian' or 'default'; got {self.init!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1); got {self.dropout}")
        if self.path is not None and not self.enabled:
            raise ValueError("lora.path (resume an adapter) needs lora.enabled: true")

    def resolved(self, family: str) -> tuple[int, float, tuple[str, ...]]:
        """``(rank, alpha, target_modules)`` with the family's Flow-GRPO defaults filled in."""
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")
        r0, a0, t0 = FLOW_GRPO_LORA[family]
        rank = self.rank or r0
        alpha = self.alpha if self.alpha is not None else (a0 if self.rank is None else 2.0 * rank)
        return rank, float(alpha), tuple(self.target_modules or t0)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"LoRA target modules {unmatched} match no Linear layer of {type(model).__name__}; "
                         f"examples of valid names: {names[:6]}")


def add_lora(transformer: nn.Module, settings: LoraSettings, family: str | None = None) -> list[nn.Parameter]:
    """Freeze ``transformer`` and add a trainable LoRA adapter ("default"). Returns the trainable parameters.

    With ``settings.path`` the adapter is loaded from a directory saved by :func:`save_lora` instead.
    """
    if not settings.enabled:
        raise ValueError("add_lora called with lora.enabled = false; use full_finetune() instead")
    from peft import LoraConfig

    model = unwrap_model(transformer)
    family = family or model_family(model)
    model.requires_grad_(False)
    if settings.path is not None:
        load_lora(model, settings.path)
    else:
        rank, alpha, targets = settings.resolved(family)
        _check_targets(model, targets)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=settings.dropout,
                                     init_lora_weights=True if settings.init == "default" else "gaussian",
                                     target_modules=list(targets)))
    params = trainable_parameters(model)
    if settings.fp32_params:
        for p in params:
            p.data = p.data.float()
    return params


def full_finetune(transformer: nn.Module, fp32_params: bool = False) -> list[nn.Parameter]:
    """Make every transformer weight trainable (full fine-tuning). Returns the parameters.

    ``fp32_params`` upcasts them to fp32 master weights (pair with ``autocast`` to keep bf16 compute)."""
    model = unwrap_model(transformer)
    model.requires_grad_(True)
    if fp32_params:
        model.float()
    return trainable_parameters(model)


def frozen_copy(transformer: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy (the KL reference of a full fine-tune; one more model in memory)."""
    ref = copy.deepcopy(unwrap_model(transformer)).eval()
    return ref.requires_grad_(False)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model: every LoRA adapter of ``model`` (diffusers ``add_adapter`` or a peft ``PeftModel``, possibly
    under DDP / FSDP) is switched off inside the block. ``requires_grad`` flags are restored exactly on exit (peft's
    toggles change them)."""
    inner = unwrap_model(model)
    flags = [(p, p.requires_grad) for p in inner.parameters()]
    try:
        if hasattr(inner, "disable_adapter") and not hasattr(inner, "disable_adapters"):   # peft PeftModel
            with inner.disable_adapter():
                yield model
        else:
            if not getattr(inner, "_hf_peft_config_loaded", False):
                raise ValueError(f"{type(inner).__name__} has no LoRA adapter to disable; for full fine-tuning use "
                                 "frozen_copy(transformer) as the reference")
            inner.disable_adapters()
            try:
                yield model
            finally:
                inner.enable_adapters()
    finally:
        for p, f in flags:
            p.requires_grad_(f)


def reference_velocity(velocity: TransformerVelocity, reference: nn.Module | None = None) -> Callable:
    """The KL reference policy's velocity callable ``(latents [N,*S], sigma [N], index [N]) -> v [N,*S]``.

    LoRA: the same adapter (same prompts, guidance, dtype) run with the adapters disabled, under ``no_grad``.
    Full fine-tuning: pass ``reference=frozen_copy(initial transformer)``. Feed it to
    ``jagg.reference_velocities(ref_fn, traj)`` once per rollout.
    """
    if reference is not None:
        ref = velocity.with_prompts(velocity.cond, velocity.uncond)
        ref.transformer = reference

        @torch.no_grad()
        def ref_fn(latents: Tensor, sigma: Tensor, index: Tensor) -> Tensor:
            return ref(latents, sigma, index)
        return ref_fn

    @torch.no_grad()
    def lora_ref_fn(latents: Tensor, sigma: Tensor, index: Tensor) -> Tensor:
        with adapters_disabled(velocity.transformer):
            return velocity(latents, sigma, index)
    return lora_ref_fn


def _pipeline_class(family: str):
    import diffusers

    return {"sd3": diffusers.StableDiffusion3Pipeline, "flux": diffusers.FluxPipeline}[family]


def save_lora(transformer: nn.Module, directory: str | Path, family: str | None = None,
              is_main_process: bool = True) -> Path:
    """Save the LoRA adapter in the format ``<Pipeline>.load_lora_weights(directory)`` reads.

    Writes ``directory/pytorch_lora_weights.safetensors`` (peft keys under ``transformer.``; the LoraConfig as
    metadata). Returns the directory. Under DDP/FSDP call it on every rank with ``is_main_process``.
    """
    from peft.utils import get_peft_model_state_dict

    model = unwrap_model(transformer)
    family = family or model_family(model)
    if not getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError("the transformer has no LoRA adapter to save (full fine-tuning: use "
                         "transformer.save_pretrained(dir) instead)")
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    cls = _pipeline_class(family)
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


def load_lora(transformer: nn.Module, directory: str | Path, trainable: bool = True) -> list[nn.Parameter]:
    """Load an adapter saved by :func:`save_lora` (or any diffusers LoRA of this family) into ``transformer`` as
    adapter "default" and make it trainable (resume). Returns the adapter parameters."""
    directory = Path(directory)
    if not (directory / LORA_WEIGHT_NAME).is_file():
        raise FileNotFoundError(f"no LoRA adapter at {directory}: expected {directory / LORA_WEIGHT_NAME} "
                                "(written by jagg.integrations.lora.save_lora / <Pipeline>.save_lora_weights)")
    model = unwrap_model(transformer)
    model.load_lora_adapter(str(directory), prefix="transformer", adapter_name="default",
                             weight_name=LORA_WEIGHT_NAME)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(trainable)
    return params
