"""Velocity adapters: a diffusers SD3 / FLUX transformer plus prompt embeddings -> a jagg velocity callable.

Prompt embeddings are :class:`PromptEmbeddings` (one row per prompt; :func:`encode_prompts` makes them with the
pipeline's text encoders, :meth:`PromptEmbeddings.save` / :meth:`~PromptEmbeddings.load` are the cache file).

A jagg velocity callable is ``(latents [N, C, H, W], sigma [N], sample_index [N] long) -> v [N, C, H, W]``.
The adapters own everything model specific, so the core (sampling, log-probs, estimators) stays generic:

- **latents** are always the VAE latents ``[N, 16, H/8, W/8]`` (fp32 in the stored trajectory). FLUX wants them
  packed into 2x2 patches ``[N, (H/16)(W/16), 64]`` with ``img_ids`` / ``txt_ids`` position ids; its adapter packs
  on the way in and unpacks on the way out (a pure permutation, so log-probs are unchanged).
- **timestep**: ``SD3Transformer2DModel`` takes ``timestep = sigma * 1000``; ``FluxTransformer2DModel`` takes
  ``timestep = sigma`` (it multiplies by 1000 inside; the diffusers pipeline passes ``t / 1000``) and, for
  FLUX.1-dev, the distilled guidance as an embedding (``guidance = 3.5``, also scaled inside).
- **conditioning**: :class:`PromptEmbeddings` holds one row per trajectory of the batch (``sample_index`` picks the
  row); classifier-free guidance ``v = v_u + w (v_c - v_u)`` uses one negative row (or one per sample).
  By default both branches run as one batched ``[uncond; cond]`` forward with grad, as Flow-GRPO's SD3 trainer
  (``train.cfg = True``). ``VelocityConfig.detach_uncond`` is a cheaper variant that changes the gradient: the
  unconditional branch gets none, run either as a separate no-grad forward (``uncond_forward="separate"``, saves
  the activations of half the rows) or inside the batched forward and detached (``"batched"``); both give the
  same values and gradient, ``w`` times the conditional branch's.
- **precision**: inputs are cast to the transformer's dtype (bf16 weights) or run under ``torch.autocast``;
  the returned velocity is fp32 (``output_dtype``), and the SDE step / scores in the core are fp32 anyway.

The wrapped module (DDP, FSDP, peft, ``torch.compile``) is called as given; the bare module under it is looked up
once per adapter (:func:`unwrap_model`), not on every call.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from .config import FAMILIES, VelocityConfig, torch_dtype


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module under DDP / FSDP(1) / DeepSpeed (``.module``) and ``torch.compile`` (``._orig_mod``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def model_family(transformer: nn.Module) -> str:
    """``"sd3"`` or ``"flux"`` from the (unwrapped, possibly peft-wrapped) transformer's class or a base class of it
    (FSDP2's ``fully_shard`` swaps the class for a subclass, ``FSDPSD3Transformer2DModel``)."""
    m = unwrap_model(transformer)
    base = getattr(getattr(m, "base_model", None), "model", m)        # peft PeftModel -> LoraModel -> model
    classes = {c.__name__ for c in type(base).__mro__}
    if "SD3Transformer2DModel" in classes:
        return "sd3"
    if "FluxTransformer2DModel" in classes:
        return "flux"
    raise TypeError(f"unsupported transformer class {type(base).__name__}; jagg adapts diffusers' "
                    "SD3Transformer2DModel and FluxTransformer2DModel. For your own DiT write a velocity callable "
                    "(latents, sigma, index) -> v")


def _model_config(bare: nn.Module):
    return getattr(bare, "config", None) or bare.base_model.model.config


# ----------------------------------------------------------------------------------------------------------------
# prompt embeddings
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PromptEmbeddings:
    """Text conditioning of ``P`` prompts, as the transformers consume it.

    Attributes:
        prompt_embeds: ``[P, L, D]`` sequence embeddings (SD3: CLIP-L/G + T5, ``D = 4096``; FLUX: T5).
        pooled: ``[P, Dp]`` pooled embeddings (SD3: ``Dp = 2048``; FLUX: CLIP-L, ``Dp = 768``).
        prompts: the ``P`` prompt strings (optional; needed by :meth:`lookup` and saved with the cache).
    """

    prompt_embeds: Tensor
    pooled: Tensor
    prompts: list[str] | None = None

    def __post_init__(self):
        if self.prompt_embeds.ndim != 3:
            raise ValueError(f"prompt_embeds must be [P, L, D]; got shape {tuple(self.prompt_embeds.shape)}")
        if self.pooled.ndim != 2 or self.pooled.shape[0] != self.prompt_embeds.shape[0]:
            raise ValueError(f"pooled must be [P, Dp] with P = {self.prompt_embeds.shape[0]}; "
                             f"got shape {tuple(self.pooled.shape)}")
        if self.prompts is not None and len(self.prompts) != self.prompt_embeds.shape[0]:
            raise ValueError(f"got {len(self.prompts)} prompts for {self.prompt_embeds.shape[0]} embedding rows")

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def select(self, index: Tensor | Sequence[int]) -> "PromptEmbeddings":
        """Rows ``index`` (e.g. one row per trajectory: ``embeds.select(prompt_of_sample)``)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.prompt_embeds.device)
        prompts = None if self.prompts is None else [self.prompts[i] for i in idx.tolist()]
        return PromptEmbeddings(self.prompt_embeds[idx], self.pooled[idx], prompts)

    def lookup(self, prompts: Sequence[str]) -> "PromptEmbeddings":
        """The rows of ``prompts`` (in that order, repeats allowed); raises naming the prompts not cached."""
        if self.prompts is None:
            raise ValueError("these embeddings carry no prompt strings; use select(index) instead of lookup()")
        table = {p: i for i, p in enumerate(self.prompts)}
        missing = [p for p in dict.fromkeys(prompts) if p not in table]
        if missing:
            shown = ", ".join(repr(p) for p in missing[:5])
            raise KeyError(f"{len(missing)} prompt(s) are not in the prompt-embedding cache ({shown}"
                           f"{', ...' if len(missing) > 5 else ''}); rebuild the cache with them "
                           "(python -m jagg.integrations.pipeline cache ...) or load the text encoders")
        return self.select([table[p] for p in prompts])

    def to(self, device=None, dtype: torch.dtype | None = None) -> "PromptEmbeddings":
        return PromptEmbeddings(self.prompt_embeds.to(device=device, dtype=dtype),
                                self.pooled.to(device=device, dtype=dtype), self.prompts)

    @staticmethod
    def cat(parts: Sequence["PromptEmbeddings"]) -> "PromptEmbeddings":
        prompts = None if any(p.prompts is None for p in parts) else [s for p in parts for s in p.prompts]
        return PromptEmbeddings(torch.cat([p.prompt_embeds for p in parts]), torch.cat([p.pooled for p in parts]),
                                prompts)

    # -- the on-disk cache: {prompt -> embeddings} as .safetensors (prompts in the metadata) or .pt --------------

    def save(self, path: str | Path) -> None:
        """Write a prompt-embedding cache: ``.safetensors`` (prompts as JSON metadata) or ``.pt``."""
        if self.prompts is None:
            raise ValueError("a prompt-embedding cache needs the prompt strings (PromptEmbeddings.prompts)")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"prompt_embeds": self.prompt_embeds.detach().cpu().contiguous(),
                   "pooled_prompt_embeds": self.pooled.detach().cpu().contiguous()}
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(path), metadata={"prompts": json.dumps(self.prompts)})
        elif path.suffix in (".pt", ".pth"):
            torch.save({**tensors, "prompts": list(self.prompts)}, path)
        else:
            raise ValueError(f"prompt-embedding cache must end in .safetensors or .pt; got {path}")

    @classmethod
    def load(cls, path: str | Path) -> "PromptEmbeddings":
        """Read a cache written by :meth:`save`, or a ``.pt`` dict ``{prompt: (prompt_embeds [L, D], pooled [Dp])}``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"prompt-embedding cache {path} does not exist; build it where the text "
                                    "encoders are available: python -m jagg.integrations.pipeline cache --config "
                                    "<yaml> --prompts <prompts.txt> --out <cache.safetensors>")
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if "prompts" not in meta or not {"prompt_embeds", "pooled_prompt_embeds"} <= set(f.keys()):
                    raise ValueError(f"{path} is not a jagg prompt-embedding cache: it needs tensors "
                                     "'prompt_embeds', 'pooled_prompt_embeds' and 'prompts' metadata")
                return cls(f.get_tensor("prompt_embeds"), f.get_tensor("pooled_prompt_embeds"),
                           json.loads(meta["prompts"]))
        if path.suffix in (".pt", ".pth"):
            data = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(data, dict) and "prompt_embeds" in data:
                return cls(data["prompt_embeds"], data["pooled_prompt_embeds"], list(data["prompts"]))
            if isinstance(data, dict) and data and all(isinstance(k, str) for k in data):
                prompts = list(data)
                rows = [data[p] for p in prompts]
                rows = [(r["prompt_embeds"], r["pooled_prompt_embeds"]) if isinstance(r, dict) else r for r in rows]
                return cls(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), prompts)
            raise ValueError(f"{path}: expected {{'prompt_embeds', 'pooled_prompt_embeds', 'prompts'}} or "
                             "{prompt: (prompt_embeds, pooled)}")
        raise ValueError(f"prompt-embedding cache must end in .safetensors or .pt; got {path}")


@torch.no_grad()
def encode_prompts(pipe, family: str, prompts: Sequence[str], max_sequence_length: int = 128,
                   batch_size: int = 16, device=None) -> PromptEmbeddings:
    """Embed ``prompts`` with the pipeline's own ``encode_prompt`` (its text encoders must be loaded)."""
    if getattr(pipe, "text_encoder", None) is None:
        raise RuntimeError("the pipeline was loaded without text encoders (a prompt_cache is configured); add the "
                           "missing prompts to the cache or set pipeline.load_text_encoders: true")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    device = device or pipe.text_encoder.device
    embeds, pooled = [], []
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s:s + batch_size])
        if family == "sd3":
            pe, _, po, _ = pipe.encode_prompt(chunk, None, None, device=device, do_classifier_free_guidance=False,
                                              max_sequence_length=max_sequence_length)
        else:
            pe, po, _ = pipe.encode_prompt(chunk, None, device=device, max_sequence_length=max_sequence_length)
        embeds.append(pe.cpu())
        pooled.append(po.cpu())
    return PromptEmbeddings(torch.cat(embeds), torch.cat(pooled), list(prompts))



# ----------------------------------------------------------------------------------------------------------------
# adapters
# ----------------------------------------------------------------------------------------------------------------


class TransformerVelocity:
    """Base adapter: CFG, prompt indexing, dtype handling. Subclasses define :meth:`forward`.

    Args:
        transformer: the diffusers transformer, optionally wrapped (DDP, FSDP, peft, ``torch.compile``): it is
            called as given, so the wrapper's hooks (gradient all-reduce, sharding) run.
        cond: :class:`PromptEmbeddings` with one row per trajectory of the batch (``sample_index`` picks it).
        uncond: negative-prompt embeddings, 1 row (shared) or one per trajectory; required when ``cfg_scale > 1``.
        config: :class:`VelocityConfig`.
    """

    family = ""

    def __init__(self, transformer: nn.Module, cond: PromptEmbeddings, uncond: PromptEmbeddings | None = None,
                 config: VelocityConfig | None = None):
        self.transformer = transformer
        self.config = config or VelocityConfig()
        if self.config.cfg_scale > 1.0 and uncond is None:
            raise ValueError(f"cfg_scale={self.config.cfg_scale} needs negative-prompt embeddings (uncond=); "
                             "encode the empty prompt '' (Flow-GRPO) or set cfg_scale=1")
        if uncond is not None and len(uncond) not in (1, len(cond)):
            raise ValueError(f"uncond must have 1 row or one per sample ({len(cond)}); got {len(uncond)}")
        self.cond, self.uncond = cond, uncond
        self.bare = unwrap_model(transformer)                  # once: the module under DDP / FSDP / compile
        self.model_config = _model_config(self.bare)
        self._autocast_dtype = None if self.config.autocast is None else torch_dtype(self.config.autocast)

    # -- family specific -----------------------------------------------------------------------------------------

    def forward(self, latents: Tensor, sigma: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor:
        """One network call: ``latents [n, C, H, W]``, ``sigma [n]`` fp32, ``embeds [n, L, D]``, ``pooled [n, Dp]``
        (already in the input dtype) -> velocity ``[n, C, H, W]`` in the network's dtype."""
        raise NotImplementedError

    # -- generic ------------------------------------------------------------------------------------------------

    def with_prompts(self, cond: PromptEmbeddings, uncond: PromptEmbeddings | None = None) -> "TransformerVelocity":
        """The same transformer and settings for another batch of prompts (``uncond`` defaults to the current)."""
        return type(self)(self.transformer, cond, self.uncond if uncond is None else uncond, self.config)

    def with_transformer(self, transformer: nn.Module) -> "TransformerVelocity":
        """The same prompts and settings on another transformer (e.g. the frozen KL reference copy)."""
        return type(self)(transformer, self.cond, self.uncond, self.config)

    @property
    def input_dtype(self) -> torch.dtype:
        """fp32 under autocast, else the dtype of the (frozen) base weights, e.g. bf16 (fp32 LoRA weights aside)."""
        if self.config.autocast is not None:
            return torch.float32
        for name, p in self.bare.named_parameters():
            if p.is_floating_point() and "lora_" not in name:
                return p.dtype
        return torch.float32

    def _autocast(self, device: torch.device):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self._autocast_dtype)

    def _rows(self, emb: PromptEmbeddings, index: Tensor, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        if len(emb) == 1:
            index = torch.zeros_like(index)
        index = index.to(emb.prompt_embeds.device)
        return (emb.prompt_embeds[index].to(device=device, dtype=dtype),
                emb.pooled[index].to(device=device, dtype=dtype))

    def _call(self, latents: Tensor, sigma: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor:
        with self._autocast(latents.device):
            return self.forward(latents, sigma, embeds, pooled)

    def __call__(self, latents: Tensor, sigma: Tensor, sample_index: Tensor) -> Tensor:
        """``latents [N, C, H, W]``, ``sigma [N]``, ``sample_index [N]`` long -> velocity ``[N, C, H, W]``."""
        if latents.ndim != 4:
            raise ValueError(f"latents must be [N, C, H, W]; got shape {tuple(latents.shape)}")
        n, dt, dev = latents.shape[0], self.input_dtype, latents.device
        if sigma.shape != (n,) or sample_index.shape != (n,):
            raise ValueError(f"sigma and sample_index must be [N] = [{n}]; got {tuple(sigma.shape)} and "
                             f"{tuple(sample_index.shape)}")
        if sample_index.device.type == "cpu" and int(sample_index.max()) >= len(self.cond):   # no GPU sync
            raise IndexError(f"sample_index {int(sample_index.max())} out of range: the adapter holds "
                             f"{len(self.cond)} prompt rows; build it with one row per trajectory")
        x, s = latents.to(dt), sigma.float()
        ce, cp = self._rows(self.cond, sample_index, dt, dev)
        w = self.config.cfg_scale
        if w == 1.0:
            v = self._call(x, s, ce, cp)
        else:
            ue, up = self._rows(self.uncond, sample_index, dt, dev)
            c = self.config
            if torch.is_grad_enabled() and c.detach_uncond and c.uncond_forward == "separate":
                with torch.no_grad():
                    v_u = self._call(x, s, ue, up)
                v_c = self._call(x, s, ce, cp)
            else:
                both = self._call(torch.cat([x, x]), torch.cat([s, s]), torch.cat([ue, ce]), torch.cat([up, cp]))
                v_u, v_c = both.chunk(2)
                if self.config.detach_uncond:
                    v_u = v_u.detach()
            v = v_u + w * (v_c - v_u)
        return v.float() if self.config.output_dtype == "fp32" else v


class SD3Velocity(TransformerVelocity):
    """``SD3Transformer2DModel`` (SD3, SD3.5): ``timestep = sigma * 1000``; latents ``[N, 16, H/8, W/8]``."""

    family = "sd3"

    def forward(self, latents, sigma, embeds, pooled):
        return self.transformer(hidden_states=latents, timestep=sigma * 1000.0, encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False)[0]


def pack_latents(latents: Tensor) -> Tensor:
    """FLUX 2x2 packing: ``[N, C, H, W]`` -> ``[N, (H/2)(W/2), 4C]`` (as ``FluxPipeline._pack_latents``)."""
    n, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"FLUX latents need even height and width (resolution divisible by 16); got {h}x{w}")
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: Tensor, height: int, width: int) -> Tensor:
    """Inverse of :func:`pack_latents`: ``[N, (H/2)(W/2), 4C]`` -> ``[N, C, H, W]`` (latent height/width)."""
    n, _, c4 = packed.shape
    x = packed.view(n, height // 2, width // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, c4 // 4, height, width)


def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """FLUX position ids ``[(H/2)(W/2), 3]`` of the packed latent tokens: ``(0, row, col)``."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxVelocity(TransformerVelocity):
    """``FluxTransformer2DModel`` (FLUX.1-dev / -schnell): ``timestep = sigma`` (scaled by 1000 inside), the
    distilled guidance embedding (``config.guidance_embed``, FLUX.1-dev: 3.5), packed latents with ``img_ids``
    and all-zero ``txt_ids``. Latents in and out are unpacked ``[N, 16, H/8, W/8]``."""

    family = "flux"

    def __init__(self, transformer, cond, uncond=None, config=None):
        super().__init__(transformer, cond, uncond, config)
        self.guidance_embeds = bool(getattr(self.model_config, "guidance_embeds", False))
        if self.guidance_embeds and self.config.guidance_embed is None:
            raise ValueError("this FLUX transformer has guidance_embeds=True (FLUX.1-dev): set "
                             "VelocityConfig.guidance_embed (Flow-GRPO and diffusers use 3.5)")
        self._ids: dict = {}

    def forward(self, latents, sigma, embeds, pooled):
        n, _, h, w = latents.shape
        key = (h, w, latents.device, latents.dtype, embeds.shape[1])
        if key not in self._ids:
            self._ids = {key: (latent_image_ids(h, w, latents.device, latents.dtype),
                               torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=latents.dtype))}
        img_ids, txt_ids = self._ids[key]
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((n,), float(self.config.guidance_embed), device=latents.device, dtype=torch.float32)
        out = self.transformer(hidden_states=pack_latents(latents), timestep=sigma, guidance=guidance,
                               pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=txt_ids,
                               img_ids=img_ids, return_dict=False)[0]
        return unpack_latents(out, h, w)


ADAPTERS = {"sd3": SD3Velocity, "flux": FluxVelocity}


def velocity_adapter(transformer: nn.Module, cond: PromptEmbeddings, uncond: PromptEmbeddings | None = None,
                     config: VelocityConfig | None = None, family: str | None = None) -> TransformerVelocity:
    """The adapter for ``transformer``'s family (detected from its class unless ``family`` is given)."""
    family = family or model_family(transformer)
    if family not in ADAPTERS:
        raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")
    return ADAPTERS[family](transformer, cond, uncond, config)
