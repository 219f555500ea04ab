"""Velocity adapters: a diffusers SD3 / FLUX / Qwen-Image / Wan / FLUX.2 transformer plus prompt embeddings -> a
velocity callable.

Prompt embeddings are :class:`PromptEmbeddings` (one row per prompt; :func:`encode_prompts` makes them with the
pipeline's text encoders, :meth:`PromptEmbeddings.save` / :meth:`~PromptEmbeddings.load` are the cache file).

A jagg velocity callable is ``(latents [N, C, H, W], sigma [N], sample_index [N] long) -> v [N, C, H, W]``.
The adapters own everything model specific, so the core (sampling, log-probs, estimators) stays generic:

- **latents** are always the VAE latents ``[N, 16, H/8, W/8]`` (fp32 in the stored trajectory). FLUX and Qwen-Image
  want them packed into 2x2 patches ``[N, (H/16)(W/16), 64]`` (``FluxPipeline._pack_latents``; Qwen-Image's video
  VAE has a frame axis of length 1, which ``QwenImagePipeline._pack_latents`` folds away the same way); their
  adapters pack on the way in and unpack on the way out (a pure permutation, so log-probs are unchanged). FLUX adds
  ``img_ids`` / ``txt_ids`` position ids, Qwen-Image ``img_shapes = [(1, H/16, W/16)]`` per sample.
- **timestep**: ``SD3Transformer2DModel`` takes ``timestep = sigma * 1000``; ``FluxTransformer2DModel`` and
  ``QwenImageTransformer2DModel`` take ``timestep = sigma`` (they multiply by 1000 inside; their pipelines pass
  ``t / 1000``) and, for guidance-distilled models (FLUX.1-dev), the guidance as an embedding (``guidance = 3.5``,
  also scaled inside).
- **video** (Wan 2.1, ``WanTransformer3DModel``): the latents have a frame axis, ``[N, 16, F, H/8, W/8]`` with ``F =
  (frames - 1) / 4 + 1`` latent frames, exactly as ``WanPipeline`` holds them (the network patchifies them itself,
  so nothing is packed here); ``timestep = sigma * 1000`` as SD3; UMT5 text embeddings zero-padded to
  ``max_sequence_length`` tokens, no pooled embedding and no text mask (``WanPipeline`` passes none); plain CFG.
- **FLUX.2** (``Flux2Transformer2DModel``; ``Flux2Pipeline`` for [dev], ``Flux2KleinPipeline`` for [klein]): the
  pipelines sample in the space of the VAE's 32 channels patchified 2x2 and batch-normalised, so jagg's latents are
  ``[N, 128, H/16, W/16]``; the adapter flattens them to tokens ``[N, (H/16)(W/16), 128]`` (a permutation) with
  position ids ``(t, h, w, l) = (0, row, col, 0)`` and text ids ``(0, 0, 0, token)``; ``timestep = sigma``; [dev]'s
  distilled guidance as an embedding (4.0), [klein]'s plain CFG with the negative prompt ``""``. Mistral / Qwen3
  embeddings, no pooled embedding, no mask.
- **conditioning**: :class:`PromptEmbeddings` holds one row per trajectory of the batch (``sample_index`` picks the
  row); classifier-free guidance ``v = v_u + w (v_c - v_u)`` uses one negative row (or one per sample). Qwen-Image
  (``QwenImagePipeline``'s true CFG) rescales that combination to the norm of ``v_c`` per packed token (a 2x2 patch
  of the 16 latent channels). Qwen-Image's prompts keep their own token counts: a batch is zero-padded to its longest
  prompt with a text mask (``encoder_hidden_states_mask``); SD3 and FLUX take no mask and no padding beyond their
  tokenizers'. By default both CFG branches run as one batched ``[uncond; cond]`` forward with grad, as Flow-GRPO's
  SD3 trainer (``train.cfg = True``). ``VelocityConfig.detach_uncond`` is a cheaper variant that changes the
  gradient: the unconditional branch gets none, run either as a separate no-grad forward
  (``uncond_forward="separate"``, saves the activations of half the rows) or inside the batched forward and detached
  (``"batched"``); both give the same values and gradient, ``w`` times the conditional branch's for plain CFG.
- **precision**: inputs are cast to the transformer's dtype (bf16 weights) or run under ``torch.autocast``;
  the returned velocity is fp32 (``output_dtype``), and the SDE step / scores in the core are fp32 anyway.

The wrapped module (DDP, FSDP, peft, ``torch.compile``) is called as given; the bare module under it is looked up
once per adapter (:func:`unwrap_model`), not on every call.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from ..checks import parse_json
from ..infra.checkpoint import UnsafeCheckpoint, load_file
from .config import VelocityConfig, torch_dtype
from .families import FAMILIES, Family


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
    """The name of the first family (:data:`jagg.integrations.families.FAMILIES`) whose transformer class is the
    (unwrapped, possibly peft-wrapped) transformer's class or a base class of it (FSDP2's ``fully_shard`` swaps the
    class for a subclass, ``FSDPSD3Transformer2DModel``)."""
    m = unwrap_model(transformer)
    base = getattr(getattr(m, "base_model", None), "model", m)        # peft PeftModel -> LoraModel -> model
    known = {}
    for f in FAMILIES.values():
        known.setdefault(f.transformer_class, f.name)
    for c in type(base).__mro__:
        if c.__name__ in known:
            return known[c.__name__]
    raise TypeError(f"unsupported transformer class {type(base).__name__}; jagg adapts diffusers' "
                    f"{', '.join(known)}. For your own DiT write a velocity callable (latents, sigma, index) -> v")


def _model_config(bare: nn.Module):
    return getattr(bare, "config", None) or bare.base_model.model.config


# ----------------------------------------------------------------------------------------------------------------
# prompt embeddings
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PromptEmbeddings:
    """Text conditioning of ``P`` prompts, as the transformers consume it.

    Attributes:
        prompt_embeds: ``[P, L, D]`` sequence embeddings (SD3: CLIP-L/G + T5, ``D = 4096``; FLUX: T5; Qwen-Image: the
            last hidden state of Qwen2.5-VL, ``D = 3584``; Wan: UMT5, ``D = 4096``, zero-padded to ``L`` tokens).
        pooled: ``[P, Dp]`` pooled embeddings (SD3: ``Dp = 2048``; FLUX: CLIP-L, ``Dp = 768``), or None (Qwen-Image
            has none).
        prompts: the ``P`` prompt strings (optional; needed by :meth:`lookup` and saved with the cache).
        mask: ``[P, L]`` bool, True at each prompt's tokens and False at the zero padding after them, or None (every
            row is all tokens). Qwen-Image's prompts keep their own lengths, so rows of different lengths are padded
            to the longest with this mask (``QwenImagePipeline.encode_prompt``'s ``prompt_embeds_mask``).
    """

    prompt_embeds: Tensor
    pooled: Tensor | None
    prompts: list[str] | None = None
    mask: Tensor | None = None

    def __post_init__(self):
        p = self.prompt_embeds.shape[0]
        if self.prompt_embeds.ndim != 3:
            raise ValueError(f"prompt_embeds must be [P, L, D]; got shape {tuple(self.prompt_embeds.shape)}")
        if self.pooled is not None and (self.pooled.ndim != 2 or self.pooled.shape[0] != p):
            raise ValueError(f"pooled must be [P, Dp] with P = {p} (or None); got shape {tuple(self.pooled.shape)}")
        if self.mask is not None:
            if self.mask.shape != self.prompt_embeds.shape[:2]:
                raise ValueError(f"mask must be [P, L] = {list(self.prompt_embeds.shape[:2])}; got shape "
                                 f"{tuple(self.mask.shape)}")
            self.mask = self.mask.bool()
        if self.prompts is not None and len(self.prompts) != p:
            raise ValueError(f"got {len(self.prompts)} prompts for {p} embedding rows")

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def take(self, index: Tensor) -> "PromptEmbeddings":
        """Rows ``index`` (a long tensor, on any device) without their prompt strings: no host synchronisation, for the
        adapters' per-call row lookup."""
        i = index.to(self.prompt_embeds.device)
        return PromptEmbeddings(self.prompt_embeds[i], None if self.pooled is None else self.pooled[i], None,
                                None if self.mask is None else self.mask[i])

    def select(self, index: Tensor | Sequence[int]) -> "PromptEmbeddings":
        """Rows ``index`` (e.g. one row per trajectory: ``embeds.select(prompt_of_sample)``)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.prompt_embeds.device)
        out = self.take(idx)
        out.prompts = None if self.prompts is None else [self.prompts[i] for i in idx.tolist()]
        return out

    def row(self, i: int) -> "PromptEmbeddings":
        """Row ``i`` alone and without its padding: ``[1, L_i, D]`` (a prompt-cache entry)."""
        embeds = self.prompt_embeds[i:i + 1]
        if self.mask is not None:
            n = int(self.mask[i].sum())
            if not bool(self.mask[i, :n].all()):
                raise ValueError(f"the text mask of row {i} is not its tokens followed by padding; jagg pads prompts "
                                 "at the end, as QwenImagePipeline does")
            embeds = embeds[:, :n]
        return PromptEmbeddings(embeds, None if self.pooled is None else self.pooled[i:i + 1],
                                None if self.prompts is None else [self.prompts[i]])

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
        """The embeddings on ``device`` in ``dtype`` (the mask stays bool)."""
        return PromptEmbeddings(self.prompt_embeds.to(device=device, dtype=dtype),
                                None if self.pooled is None else self.pooled.to(device=device, dtype=dtype),
                                self.prompts, None if self.mask is None else self.mask.to(device))

    def padded_mask(self, length: int) -> Tensor:
        """The text mask ``[P, length]``: this one (all True without a mask) with False appended."""
        p, n = self.prompt_embeds.shape[:2]
        mask = self.mask if self.mask is not None else torch.ones(p, n, dtype=torch.bool,
                                                                   device=self.prompt_embeds.device)
        return torch.nn.functional.pad(mask, (0, length - n), value=False)

    def rows(self) -> list["PromptEmbeddings"]:
        """Every row alone and without its padding (:meth:`row`): the prompt-cache entries of these embeddings."""
        return [self.row(i) for i in range(self.prompt_embeds.shape[0])]

    @staticmethod
    def cat(parts: Sequence["PromptEmbeddings"], device=None, dtype: torch.dtype | None = None) -> "PromptEmbeddings":
        """The rows of ``parts`` in order (on ``device`` in ``dtype`` when given: :meth:`to`). Parts of different
        lengths are zero-padded to the longest, with a mask; the result has no mask when every row is all tokens."""
        if len({p.pooled is None for p in parts}) > 1:
            raise ValueError("cannot concatenate embeddings with and without pooled embeddings (mixed families?)")
        length = max(p.prompt_embeds.shape[1] for p in parts)
        embeds = torch.cat([torch.nn.functional.pad(p.prompt_embeds, (0, 0, 0, length - p.prompt_embeds.shape[1]))
                            for p in parts])
        ragged = any(p.mask is not None or p.prompt_embeds.shape[1] < length for p in parts)
        mask = torch.cat([p.padded_mask(length) for p in parts]) if ragged else None
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        prompts = None if any(p.prompts is None for p in parts) else [s for p in parts for s in p.prompts]
        out = PromptEmbeddings(embeds, pooled, prompts, mask)
        return out if device is None and dtype is None else out.to(device, dtype)

    # -- the on-disk cache: {prompt -> embeddings} as .safetensors (prompts in the metadata) or .pt --------------

    def save(self, path: str | Path) -> None:
        """Write a prompt-embedding cache: ``.safetensors`` (prompts as JSON metadata) or ``.pt``."""
        if self.prompts is None:
            raise ValueError("a prompt-embedding cache needs the prompt strings (PromptEmbeddings.prompts)")
        from ..infra.atomic import atomic_write

        path = Path(path)
        tensors = {"prompt_embeds": self.prompt_embeds}
        if self.pooled is not None:
            tensors["pooled_prompt_embeds"] = self.pooled
        if self.mask is not None:
            tensors["prompt_embeds_mask"] = self.mask
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        if path.suffix == ".safetensors":
            from safetensors.torch import save

            atomic_write(path, lambda f: f.write(save(tensors, metadata={"prompts": json.dumps(self.prompts)})))
        elif path.suffix in (".pt", ".pth"):
            atomic_write(path, lambda f: torch.save({**tensors, "prompts": list(self.prompts)}, f))
        else:
            raise ValueError(f"prompt-embedding cache must end in .safetensors or .pt; got {path}")

    @classmethod
    def load(cls, path: str | Path) -> "PromptEmbeddings":
        """Read a cache written by :meth:`save`, or a ``.pt`` dict ``{prompt: (prompt_embeds [L, D], pooled [Dp] or
        None)}`` (rows of different lengths are padded, with a mask)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"prompt-embedding cache {path} does not exist; build it where the text "
                                    "encoders are available: python -m jagg.integrations.pipeline cache --config "
                                    "<yaml> --prompts <prompts.txt> --out <cache.safetensors>")
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
                if "prompts" not in meta or "prompt_embeds" not in keys:
                    raise ValueError(f"{path} is not a jagg prompt-embedding cache: it needs a tensor 'prompt_embeds' "
                                     "(and 'pooled_prompt_embeds', 'prompt_embeds_mask' where the family has them) "
                                     "and 'prompts' metadata")
                optional = {k: f.get_tensor(k) if k in keys else None
                            for k in ("pooled_prompt_embeds", "prompt_embeds_mask")}
                return cls(f.get_tensor("prompt_embeds"), optional["pooled_prompt_embeds"],
                           parse_json(meta["prompts"], f"{path}: its 'prompts' metadata", "list", "rebuild the cache"),
                           optional["prompt_embeds_mask"])
        if path.suffix in (".pt", ".pth"):
            try:
                data = load_file(path)               # tensors and plain data only: a cache from elsewhere runs no code
            except UnsafeCheckpoint:
                raise
            except Exception as e:                   # truncated, corrupt, not a torch file
                raise ValueError(f"{path} is not a readable prompt-embedding cache ({type(e).__name__}: "
                                 f"{str(e)[:200]}); rebuild it") from None
            if isinstance(data, dict) and "prompt_embeds" in data:
                return cls(data["prompt_embeds"], data.get("pooled_prompt_embeds"), list(data["prompts"]),
                           data.get("prompt_embeds_mask"))
            if isinstance(data, dict) and data and all(isinstance(k, str) for k in data):
                rows = [(r["prompt_embeds"], r.get("pooled_prompt_embeds")) if isinstance(r, dict) else r
                        for r in data.values()]
                return cls.cat([cls(e[None], None if po is None else po[None], [p])
                                for p, (e, po) in zip(data, rows)])
            raise ValueError(f"{path}: expected {{'prompt_embeds', 'pooled_prompt_embeds', 'prompts'}} or "
                             "{prompt: (prompt_embeds, pooled)}")
        raise ValueError(f"prompt-embedding cache must end in .safetensors or .pt; got {path}")


@torch.no_grad()
def encode_prompts(pipe, family: str, prompts: Sequence[str], max_sequence_length: int = 128,
                   batch_size: int = 16, device=None) -> PromptEmbeddings:
    """Embed ``prompts`` with the pipeline's own ``encode_prompt`` (its text encoders must be loaded). Qwen-Image's
    embeddings keep each prompt's own length: batches are padded to their longest prompt, with a mask."""
    if getattr(pipe, "text_encoder", None) is None:
        raise RuntimeError("the pipeline was loaded without text encoders (a prompt_cache is configured); add the "
                           "missing prompts to the cache or set pipeline.load_text_encoders: true")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    device = device or pipe.text_encoder.device
    adapter = adapter_class(family)
    parts = []
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s:s + batch_size])
        parts.append(adapter.encode(pipe, chunk, device, max_sequence_length).to("cpu"))
    return PromptEmbeddings.cat(parts)


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

    title = ""                     # the model in words, for messages
    takes_pooled = True            # the network takes pooled text embeddings (SD3, FLUX; not Qwen-Image, Wan)
    takes_mask = False             # the network takes a text mask, so prompts may differ in length (Qwen-Image)
    latent_dims = 4                # [N, C, H, W]; a video family's latents have a frame axis, [N, C, F, H, W]
    latent_downsample = 1          # latent pixels per VAE latent (FLUX.2: its latents are patchified 2x2)

    def __init__(self, transformer: nn.Module, cond: PromptEmbeddings, uncond: PromptEmbeddings | None = None,
                 config: VelocityConfig | None = None):
        self.transformer = transformer
        self.config = config or VelocityConfig()
        if self.config.cfg_scale > 1.0 and uncond is None:
            raise ValueError(f"cfg_scale={self.config.cfg_scale} needs negative-prompt embeddings (uncond=); "
                             "encode the empty prompt '' (Flow-GRPO) or set cfg_scale=1")
        if uncond is not None and len(uncond) not in (1, len(cond)):
            raise ValueError(f"uncond must have 1 row or one per sample ({len(cond)}); got {len(uncond)}")
        for name, emb in (("cond", cond), ("uncond", uncond)):
            if emb is not None:
                self._check_text(name, emb)
        self.cond, self.uncond = cond, uncond
        self.bare = unwrap_model(transformer)                  # once: the module under DDP / FSDP / compile
        self.model_config = _model_config(self.bare)
        self._autocast_dtype = None if self.config.autocast is None else torch_dtype(self.config.autocast)

    def _check_text(self, name: str, emb: PromptEmbeddings) -> None:
        if self.takes_pooled != (emb.pooled is not None):
            raise ValueError(f"{name}: the {self.title} transformer takes "
                             f"{'pooled embeddings; these have none' if self.takes_pooled else 'no pooled embeddings'}"
                             " (embeddings of another model family?)")
        if emb.mask is not None and not self.takes_mask:
            raise ValueError(f"{name}: the {self.title} transformer takes no text mask, so every prompt must have the "
                             "same length (its tokenizers pad them); these embeddings carry one")

    # -- family specific -----------------------------------------------------------------------------------------

    @classmethod
    def latent_channels(cls, model_config) -> int:
        """Channels of the VAE latents ``[N, C, H/8, W/8]`` the network denoises (its config's ``in_channels``)."""
        return model_config.in_channels

    @classmethod
    def image_tokens(cls, height: int, width: int, model_config=None) -> int:
        """Image tokens of latents ``height x width``, the sequence length a dynamic shift depends on: 2x2 patches."""
        return (height // 2) * (width // 2)

    @classmethod
    def encode(cls, pipe, prompts: list[str], device, max_sequence_length: int) -> PromptEmbeddings:
        """The prompts embedded by the pipeline's own ``encode_prompt``, as this transformer takes them (the base
        class: the sequence embeddings alone, no pooled embedding, no mask)."""
        embeds = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)[0]
        return PromptEmbeddings(embeds, None, prompts)

    def forward(self, latents: Tensor, sigma: Tensor, text: PromptEmbeddings) -> Tensor:
        """One network call: ``latents [n, C, H, W]``, ``sigma [n]`` fp32, ``text`` one row per latent (already in
        the input dtype) -> velocity ``[n, C, H, W]`` in the network's dtype."""
        raise NotImplementedError

    def guide(self, v_u: Tensor, v_c: Tensor) -> Tensor:
        """Classifier-free guidance ``v_u + w (v_c - v_u)`` of the unconditional and conditional velocities."""
        return v_u + self.config.cfg_scale * (v_c - v_u)

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

    def _rows(self, emb: PromptEmbeddings, index: Tensor, dtype: torch.dtype, device) -> PromptEmbeddings:
        return emb.take(torch.zeros_like(index) if len(emb) == 1 else index).to(device, dtype)

    def _call(self, latents: Tensor, sigma: Tensor, text: PromptEmbeddings) -> Tensor:
        with self._autocast(latents.device):
            return self.forward(latents, sigma, text)

    def __call__(self, latents: Tensor, sigma: Tensor, sample_index: Tensor) -> Tensor:
        """``latents [N, C, H, W]`` (video: ``[N, C, F, H, W]``), ``sigma [N]``, ``sample_index [N]`` long -> velocity
        of the latents' shape."""
        if latents.ndim != self.latent_dims:
            want = "[N, C, H, W]" if self.latent_dims == 4 else "[N, C, F, H, W] (a frame axis)"
            raise ValueError(f"{self.title} latents must be {want}; got shape {tuple(latents.shape)}")
        n, dt, dev = latents.shape[0], self.input_dtype, latents.device
        if sigma.shape != (n,) or sample_index.shape != (n,):
            raise ValueError(f"sigma and sample_index must be [N] = [{n}]; got {tuple(sigma.shape)} and "
                             f"{tuple(sample_index.shape)}")
        if sample_index.device.type == "cpu" and int(sample_index.max()) >= len(self.cond):   # no GPU sync
            raise IndexError(f"sample_index {int(sample_index.max())} out of range: the adapter holds "
                             f"{len(self.cond)} prompt rows; build it with one row per trajectory")
        x, s = latents.to(dt), sigma.float()
        cond = self._rows(self.cond, sample_index, dt, dev)
        if self.config.cfg_scale == 1.0:
            v = self._call(x, s, cond)
        else:
            uncond = self._rows(self.uncond, sample_index, dt, dev)
            c = self.config
            if torch.is_grad_enabled() and c.detach_uncond and c.uncond_forward == "separate":
                with torch.no_grad():
                    v_u = self._call(x, s, uncond)
                v_c = self._call(x, s, cond)
            else:
                both = self._call(torch.cat([x, x]), torch.cat([s, s]), PromptEmbeddings.cat([uncond, cond]))
                v_u, v_c = both.chunk(2)
                if self.config.detach_uncond:
                    v_u = v_u.detach()
            v = self.guide(v_u, v_c)
        return v.float() if self.config.output_dtype == "fp32" else v


class SD3Velocity(TransformerVelocity):
    """``SD3Transformer2DModel`` (SD3, SD3.5): ``timestep = sigma * 1000``; latents ``[N, 16, H/8, W/8]``."""

    title = "SD3"

    @classmethod
    def image_tokens(cls, height, width, model_config=None):
        """StableDiffusion3Pipeline counts the transformer's patches."""
        p = getattr(model_config, "patch_size", 2)
        return (height // p) * (width // p)

    @classmethod
    def encode(cls, pipe, prompts, device, max_sequence_length):
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, None, None, device=device, do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
        return PromptEmbeddings(embeds, pooled, prompts)

    def forward(self, latents, sigma, text):
        return self.transformer(hidden_states=latents, timestep=sigma * 1000.0,
                                encoder_hidden_states=text.prompt_embeds, pooled_projections=text.pooled,
                                return_dict=False)[0]


def pack_latents(latents: Tensor) -> Tensor:
    """2x2 packing: ``[N, C, H, W]`` -> ``[N, (H/2)(W/2), 4C]`` (as ``FluxPipeline._pack_latents`` and, on Qwen-Image's
    one-frame latents ``[N, 1, C, H, W]``, ``QwenImagePipeline._pack_latents``)."""
    n, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"packed latents (FLUX, Qwen-Image) need even height and width (resolution divisible by 16); "
                         f"got {h}x{w}")
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


class PackedVelocity(TransformerVelocity):
    """FLUX.1 and Qwen-Image: the network takes 2x2-packed latents (packed here, unpacked after: latents in and out
    are ``[N, 16, H/8, W/8]``), ``timestep = sigma`` (scaled by 1000 inside) and, if it is guidance-distilled
    (``guidance_embeds``, FLUX.1-dev), the guidance as an embedding (``config.guidance_embed``). Subclasses define
    :meth:`packed_forward`."""

    def __init__(self, transformer, cond, uncond=None, config=None):
        super().__init__(transformer, cond, uncond, config)
        self.guidance_embeds = bool(getattr(self.model_config, "guidance_embeds", False))
        if self.guidance_embeds and self.config.guidance_embed is None:
            raise ValueError(f"this {self.title} transformer has guidance_embeds=True (guidance-distilled): set "
                             "pipeline.guidance_embed (VelocityConfig.guidance_embed), e.g. its pipeline's default guidance_scale "
                             "(the family's guidance_embed in jagg.integrations.families)")

    @classmethod
    def latent_channels(cls, model_config) -> int:
        return model_config.in_channels // 4

    def packed_forward(self, packed: Tensor, sigma: Tensor, text: PromptEmbeddings, guidance: Tensor | None,
                       height: int, width: int) -> Tensor:
        """One network call on ``packed [n, (H/2)(W/2), 4C]`` latents of latent size ``height x width``, ``guidance
        [n]`` fp32 or None -> packed velocity in the network's dtype."""
        raise NotImplementedError

    def forward(self, latents, sigma, text):
        n, _, h, w = latents.shape
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((n,), float(self.config.guidance_embed), device=latents.device, dtype=torch.float32)
        return unpack_latents(self.packed_forward(pack_latents(latents), sigma, text, guidance, h, w), h, w)


class FluxVelocity(PackedVelocity):
    """``FluxTransformer2DModel`` (FLUX.1-dev / -schnell): packed latents with ``img_ids`` and all-zero ``txt_ids``,
    CLIP-L pooled embeddings, the distilled guidance embedding of FLUX.1-dev (3.5)."""

    title = "FLUX.1"

    @classmethod
    def encode(cls, pipe, prompts, device, max_sequence_length):
        embeds, pooled, _ = pipe.encode_prompt(prompts, None, device=device, max_sequence_length=max_sequence_length)
        return PromptEmbeddings(embeds, pooled, prompts)

    def __init__(self, transformer, cond, uncond=None, config=None):
        super().__init__(transformer, cond, uncond, config)
        self._ids: dict = {}

    def packed_forward(self, packed, sigma, text, guidance, height, width):
        key = (height, width, packed.device, packed.dtype, text.prompt_embeds.shape[1])
        if key not in self._ids:
            self._ids = {key: (latent_image_ids(height, width, packed.device, packed.dtype),
                               torch.zeros(text.prompt_embeds.shape[1], 3, device=packed.device, dtype=packed.dtype))}
        img_ids, txt_ids = self._ids[key]
        return self.transformer(hidden_states=packed, timestep=sigma, guidance=guidance, pooled_projections=text.pooled,
                                encoder_hidden_states=text.prompt_embeds, txt_ids=txt_ids, img_ids=img_ids,
                                return_dict=False)[0]


class QwenImageVelocity(PackedVelocity):
    """``QwenImageTransformer2DModel`` (Qwen-Image), as ``QwenImagePipeline`` calls it: packed latents with
    ``img_shapes = [(1, H/16, W/16)]`` per sample, Qwen2.5-VL text embeddings with their text mask (prompts of
    different lengths), no pooled embedding; true CFG (:meth:`guide`) rescaled to the conditional norm."""

    title = "Qwen-Image"
    takes_pooled = False
    takes_mask = True
    MIN_DIFFUSERS = (0, 37)        # from 0.37 the transformer masks the text padding (encoder_hidden_states_mask)

    def __init__(self, transformer, cond, uncond=None, config=None):
        import diffusers

        found = tuple(int(x) for x in re.findall(r"\d+", diffusers.__version__)[:2])
        if found < self.MIN_DIFFUSERS:
            raise RuntimeError(f"Qwen-Image needs diffusers >= {'.'.join(map(str, self.MIN_DIFFUSERS))} (earlier "
                               "QwenImageTransformer2DModel attends to the padding of shorter prompts); found "
                               f"{diffusers.__version__}: pip install -U 'diffusers>=0.37'")
        super().__init__(transformer, cond, uncond, config)

    @classmethod
    def encode(cls, pipe, prompts, device, max_sequence_length):
        """Each prompt keeps its own length: the batch is padded to its longest prompt, with a mask."""
        embeds, mask = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)
        return PromptEmbeddings(embeds, None, prompts, mask)

    def packed_forward(self, packed, sigma, text, guidance, height, width):
        return self.transformer(hidden_states=packed, timestep=sigma, guidance=guidance,
                                encoder_hidden_states=text.prompt_embeds, encoder_hidden_states_mask=text.mask,
                                img_shapes=[[(1, height // 2, width // 2)]] * packed.shape[0], return_dict=False)[0]

    def guide(self, v_u, v_c):
        """``QwenImagePipeline``'s true CFG: ``comb = v_u + w (v_c - v_u)``, then ``comb * ||v_c|| / ||comb||`` with
        the norms taken per packed token (over the ``4C = 64`` values of a 2x2 patch of latents), differentiable in
        both branches."""
        comb = super().guide(v_u, v_c)
        n, c, h, w = comb.shape

        def patches(v: Tensor) -> Tensor:                      # [n, C, H/2, 2, W/2, 2]: one token per (H/2, W/2)
            return v.reshape(n, c, h // 2, 2, w // 2, 2)

        def norm(v: Tensor) -> Tensor:
            return torch.linalg.vector_norm(patches(v), dim=(1, 3, 5), keepdim=True)

        return (patches(comb) * (norm(v_c) / norm(comb))).reshape(n, c, h, w)


class WanVelocity(TransformerVelocity):
    """``WanTransformer3DModel`` (Wan 2.1 text-to-video), as ``WanPipeline`` calls it: latents ``[N, 16, F, H/8,
    W/8]`` as they are (the network patchifies them, 1x2x2), ``timestep = sigma * 1000``, UMT5 embeddings without
    pooled embedding or mask (zero-padded to ``max_sequence_length``), plain CFG."""

    title = "Wan"
    takes_pooled = False
    latent_dims = 5

    @classmethod
    def encode(cls, pipe, prompts, device, max_sequence_length):
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=device,
                                       max_sequence_length=max_sequence_length)
        return PromptEmbeddings(embeds, None, prompts)

    def forward(self, latents, sigma, text):
        return self.transformer(hidden_states=latents, timestep=sigma * 1000.0,
                                encoder_hidden_states=text.prompt_embeds, return_dict=False)[0]


def flux2_ids(length: int, height: int = 1, width: int = 1, text: bool = False, device=None) -> Tensor:
    """FLUX.2's 4-axis position ids ``(t, h, w, l)``: of text tokens ``(0, 0, 0, i)`` for ``i < length``
    (``Flux2Pipeline._prepare_text_ids``), of latent tokens ``(0, row, col, 0)`` row-major
    (``Flux2Pipeline._prepare_latent_ids``)."""
    zero = torch.zeros(1, dtype=torch.long)
    if text:
        ids = torch.cartesian_prod(zero, zero, zero, torch.arange(length))
    else:
        ids = torch.cartesian_prod(zero, torch.arange(height), torch.arange(width), zero)
    return ids.to(device)


class Flux2Velocity(PackedVelocity):
    """``Flux2Transformer2DModel`` as ``Flux2Pipeline`` / ``Flux2KleinPipeline`` call it: latents ``[N, 128, H/16,
    W/16]`` (32 VAE channels patchified 2x2, batch-normalised) flattened row-major to tokens, 4-axis position ids
    (:func:`flux2_ids`), ``timestep = sigma``, [dev]'s guidance embedding or [klein]'s plain CFG; no pooled
    embedding, no mask."""

    title = "FLUX.2"
    takes_pooled = False
    latent_downsample = 2

    def __init__(self, transformer, cond, uncond=None, config=None):
        super().__init__(transformer, cond, uncond, config)
        self._ids: dict = {}

    @classmethod
    def latent_channels(cls, model_config) -> int:
        return model_config.in_channels

    @classmethod
    def image_tokens(cls, height, width, model_config=None):
        return height * width

    def forward(self, latents, sigma, text):
        n, c, h, w = latents.shape
        key = (h, w, latents.device, text.prompt_embeds.shape[1])
        if key not in self._ids:
            self._ids = {key: (flux2_ids(0, h, w, device=latents.device),
                               flux2_ids(text.prompt_embeds.shape[1], text=True, device=latents.device))}
        img_ids, txt_ids = self._ids[key]
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((n,), float(self.config.guidance_embed), device=latents.device, dtype=torch.float32)
        out = self.transformer(hidden_states=latents.reshape(n, c, h * w).transpose(1, 2), timestep=sigma,
                               guidance=guidance, encoder_hidden_states=text.prompt_embeds, img_ids=img_ids,
                               txt_ids=txt_ids, return_dict=False)[0]
        return out.transpose(1, 2).reshape(n, c, h, w)


def adapter_class(family: str | Family) -> type[TransformerVelocity]:
    """The velocity adapter class its record names for ``family`` (a name or a record); a ValueError when the record
    names no adapter of this module or one whose packing disagrees with the record's ``packed``."""
    record = family if isinstance(family, Family) else FAMILIES[family]
    cls = globals().get(record.adapter)
    if not (isinstance(cls, type) and issubclass(cls, TransformerVelocity)):
        raise ValueError(f"family {record.name}: adapter {record.adapter!r} is not a velocity adapter of "
                         "jagg.integrations.velocity_adapters (e.g. 'SD3Velocity')")
    if issubclass(cls, PackedVelocity) != record.packed:
        raise ValueError(f"family {record.name}: packed={record.packed} but its adapter {record.adapter} "
                         f"{'is' if issubclass(cls, PackedVelocity) else 'is not'} a PackedVelocity; make them agree")
    return cls


def velocity_adapter(transformer: nn.Module, cond: PromptEmbeddings, uncond: PromptEmbeddings | None = None,
                     config: VelocityConfig | None = None, family: str | None = None) -> TransformerVelocity:
    """The adapter for ``transformer``'s family (detected from its class unless ``family`` is given)."""
    return adapter_class(family or model_family(transformer))(transformer, cond, uncond, config)
