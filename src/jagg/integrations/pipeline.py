"""Real models from a local diffusers directory: configuration, loading, prompt embeddings, schedules, decoding.

    cfg = load_pipeline_config("configs/sd35_medium.yaml")        # the `pipeline:` section (+ `lora:` inside it)
    model = load_model(cfg)                                        # SD3.5 / FLUX pipeline, LoRA added, on the GPU
    v = model.velocity(prompts)                                    # jagg velocity callable, one row per sample
    traj = jagg.sample_trajectories(v, model.noise(len(prompts)), model.sigmas(), cfg.eta)
    images = model.decode(traj.latents[:, -1])                     # uint8 [B, H, W, 3] for the reward
    ref = model.reference(v)                                       # adapters off (KL reference)

Weights are never downloaded: ``path`` must be a local diffusers model directory (``model_index.json`` plus a
``transformer/`` subfolder), e.g. made with ``huggingface-cli download stabilityai/stable-diffusion-3.5-medium
--local-dir /models/sd3.5-medium`` on a machine with internet access. The text encoders (T5-XXL is ~9 GB in bf16)
are only needed to embed prompts: precompute a prompt-embedding cache once (``python -m
jagg.integrations.pipeline cache --config <yaml> --prompts <file> --out <cache.safetensors>``) and point
``prompt_cache`` at it; the text encoders are then not loaded at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..training.config_loader import from_dict
from ..schedule import flow_sigmas
from .diffusers_adapters import (FAMILIES, UNCOND_FORWARDS, PromptEmbeddings, TransformerVelocity, VelocityConfig,
                                 torch_dtype, unwrap_model, velocity_adapter)
from .lora import LoraSettings, add_lora, frozen_copy, full_finetune, reference_velocity, save_lora

PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PipelineConfig:
    """A real text-to-image model to fine-tune (defaults: Flow-GRPO's SD3.5-Medium settings)."""

    family: str = field(default="sd3", metadata=_help(f"Model family, one of {FAMILIES} (SD3/SD3.5 or FLUX.1)."))
    path: str = field(default="", metadata=_help("Local diffusers model directory (model_index.json + transformer/)."))
    dtype: str = field(default="bf16", metadata=_help("Transformer / text-encoder weights dtype: bf16, fp16 or fp32."))
    vae_dtype: str = field(default="fp32", metadata=_help("VAE dtype (Flow-GRPO decodes in fp32)."))
    device: str = field(default="auto", metadata=_help("'auto' (cuda if available, else cpu), 'cuda', 'cuda:1', "
                                                       "'cpu'."))
    resolution: int = field(default=512, metadata=_help("Image height = width in pixels (multiple of 16)."))
    num_steps: int = field(default=10, metadata=_help("Sampling steps of a training rollout (Flow-GRPO SD3: 10)."))
    eval_num_steps: int = field(default=40, metadata=_help("Steps of the evaluation sampler (Flow-GRPO SD3: 40)."))
    shift: float | None = field(default=None, metadata=_help("Timestep shift; null = the model's own: SD3 the "
                                "scheduler's shift (3.0), FLUX the resolution-dependent exp(mu)."))
    eta: float = field(default=0.7, metadata=_help("SDE noise level (Flow-GRPO: SD3 0.7, FLUX 0.9)."))
    cfg_scale: float = field(default=4.5, metadata=_help("Classifier-free guidance weight in sampling and training "
                             "(Flow-GRPO SD3.5: 4.5; FLUX.1-dev: 1, it is guidance-distilled)."))
    guidance_embed: float | None = field(default=None, metadata=_help("FLUX.1-dev's embedded guidance (3.5); null "
                                         "for models without guidance embeddings."))
    negative_prompt: str = field(default="", metadata=_help("Negative prompt of classifier-free guidance."))
    detach_uncond: bool = field(default=True, metadata=_help("No gradient through the unconditional branch "
                                                             "(Flow-GRPO)."))
    uncond_forward: str = field(default="separate", metadata=_help(f"One of {UNCOND_FORWARDS}: unconditional rows as a "
                                "separate no-grad forward or one batched [uncond; cond] forward."))
    autocast: str | None = field(default=None, metadata=_help("Forward under torch.autocast(bf16|fp16), e.g. with fp32 "
                                 "weights; null = cast inputs to the weights' dtype."))
    max_sequence_length: int = field(default=128, metadata=_help("T5 tokens per prompt (Flow-GRPO: 128)."))
    prompt_cache: str | None = field(default=None, metadata=_help("Precomputed prompt-embedding cache (.safetensors "
                                     "or .pt); with it the text encoders are not loaded."))
    load_text_encoders: bool | None = field(default=None, metadata=_help("Load the text encoders (needed to embed "
                                            "prompts missing from the cache); null = only without prompt_cache."))
    gradient_checkpointing: bool = field(default=False, metadata=_help("Recompute transformer activations in the "
                                         "backward (enable_gradient_checkpointing): less memory, ~30% more time."))
    keep_reference: bool = field(default=False, metadata=_help("Full fine-tuning only: keep a frozen copy of the "
                                 "initial transformer as the KL reference (one more model in memory)."))
    lora: LoraSettings = field(default_factory=LoraSettings, metadata=_help("LoRA settings (see LoraSettings)."))

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = from_dict(LoraSettings, self.lora, "pipeline.lora")
        if self.family not in FAMILIES:
            raise ValueError(f"pipeline.family must be one of {FAMILIES}; got {self.family!r}")
        for name in ("dtype", "vae_dtype"):
            torch_dtype(getattr(self, name))
        if self.resolution < 16 or self.resolution % 16:
            raise ValueError(f"pipeline.resolution must be a positive multiple of 16 (VAE /8, FLUX packing /2); "
                             f"got {self.resolution}")
        for name in ("num_steps", "eval_num_steps", "max_sequence_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline.{name} must be >= 1; got {getattr(self, name)}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"pipeline.shift must be > 0 or null; got {self.shift}")
        if self.eta <= 0:
            raise ValueError(f"pipeline.eta must be > 0 (the SDE needs noise); got {self.eta}")
        VelocityConfig(cfg_scale=self.cfg_scale, guidance_embed=self.guidance_embed, uncond_forward=self.uncond_forward,
                       autocast=self.autocast)                                       # validates those fields
        if self.keep_reference and self.lora.enabled:
            raise ValueError("pipeline.keep_reference is for full fine-tuning (lora.enabled: false); with LoRA the "
                             "reference is the base model with the adapters disabled")

    def velocity_config(self) -> VelocityConfig:
        return VelocityConfig(cfg_scale=self.cfg_scale, guidance_embed=self.guidance_embed,
                              detach_uncond=self.detach_uncond, uncond_forward=self.uncond_forward,
                              autocast=self.autocast)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def load_pipeline_config(path: str | Path, overrides: dict | None = None) -> PipelineConfig:
    """The ``pipeline:`` section of a YAML config (other sections belong to the trainer) -> :class:`PipelineConfig`."""
    import yaml

    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if "pipeline" not in data:
        raise ValueError(f"{path} has no 'pipeline:' section (see configs/sd35_medium.yaml)")
    section = dict(data["pipeline"] or {})
    section.update(overrides or {})
    return from_dict(PipelineConfig, section, "pipeline")


# ----------------------------------------------------------------------------------------------------------------
# the model directory
# ----------------------------------------------------------------------------------------------------------------


def check_model_dir(path: str | Path, family: str) -> dict:
    """Raise a clear error unless ``path`` is a local diffusers model directory of ``family``; return model_index."""
    p = Path(path).expanduser() if path else None
    hint = ("download it once on a machine with internet, e.g. `huggingface-cli download "
            "stabilityai/stable-diffusion-3.5-medium --local-dir /models/sd3.5-medium` (FLUX: "
            "black-forest-labs/FLUX.1-dev), copy it here and set pipeline.path")
    if p is None or not p.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; jagg never downloads weights: {hint}")
    if not p.is_dir():
        raise NotADirectoryError(f"model path {p} is a file; it must be a diffusers model directory "
                                 "(model_index.json, transformer/, vae/, ...), not a single checkpoint file")
    if not (p / "model_index.json").is_file():
        raise FileNotFoundError(f"{p} is not a diffusers model directory: no model_index.json. Point pipeline.path "
                                f"at the directory that contains model_index.json; {hint}")
    if not (p / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no transformer/ subfolder (transformer/config.json): it is not an SD3/FLUX "
                                "diffusers directory (UNet models such as SD1.5/SDXL are not flow-matching DiTs)")
    index = json.loads((p / "model_index.json").read_text())
    expected = PIPELINE_CLASSES[family]
    found = index.get("_class_name", "")
    known = {v: k for k, v in PIPELINE_CLASSES.items()}
    if found in known and found != expected:
        raise ValueError(f"{p} holds a {found} but pipeline.family is {family!r}; set pipeline.family: "
                         f"{known[found]!r}")
    return index


def load_pipeline(config: PipelineConfig, skip: Sequence[str] = ()):
    """The diffusers pipeline from ``config.path`` (no transformer changes, on CPU). Text encoders / tokenizers are
    skipped unless needed (see ``load_text_encoders``); components missing from the directory or named in ``skip``
    load as None."""
    import diffusers

    index = check_model_dir(config.path, config.family)
    cls = getattr(diffusers, PIPELINE_CLASSES[config.family])
    expected, _ = cls._get_signature_keys(cls)
    load_text = config.load_text_encoders if config.load_text_encoders is not None else config.prompt_cache is None
    none = {name: None for name in expected if name not in index or index[name] in (None, [None, None])}
    none.update({name: None for name in skip if name in expected})
    if not load_text:
        none.update({name: None for name in TEXT_COMPONENTS if name in expected})
    # recent diffusers name the argument `dtype` (and deprecate `torch_dtype`); older versions only know torch_dtype
    new_api = hasattr(getattr(diffusers.utils, "deprecation_utils", None), "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    dtype_kw = {"dtype" if new_api else "torch_dtype": torch_dtype(config.dtype)}
    pipe = cls.from_pretrained(str(Path(config.path).expanduser()), **dtype_kw, **none)
    if getattr(pipe, "vae", None) is not None:
        pipe.vae.to(torch_dtype(config.vae_dtype))
    return pipe


# ----------------------------------------------------------------------------------------------------------------
# prompts, schedules, decoding
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(pipe, family: str, prompts: Sequence[str], max_sequence_length: int = 128,
                   batch_size: int = 16, device=None) -> PromptEmbeddings:
    """Embed ``prompts`` with the pipeline's own ``encode_prompt`` (its text encoders must be loaded)."""
    if getattr(pipe, "text_encoder", None) is None:
        raise RuntimeError("the pipeline was loaded without text encoders (a prompt_cache is configured); add the "
                           "missing prompts to the cache or set pipeline.load_text_encoders: true")
    device = device or pipe.text_encoder.device
    out = []
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s:s + batch_size])
        if family == "sd3":
            pe, _, pooled, _ = pipe.encode_prompt(chunk, None, None, device=device, do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
        else:
            pe, pooled, _ = pipe.encode_prompt(chunk, None, device=device, max_sequence_length=max_sequence_length)
        out.append(PromptEmbeddings(pe.cpu(), pooled.cpu(), chunk))
    return PromptEmbeddings.cat(out)


def flux_shift(resolution: int, scheduler_config: dict | None = None) -> float:
    """FLUX's resolution-dependent shift ``exp(mu)``, ``mu`` linear in the packed image sequence length (diffusers'
    ``calculate_shift``). ``exp(mu) t / (exp(mu) t + 1 - t)`` is :func:`jagg.shift_sigmas` with ``shift = exp(mu)``."""
    c = scheduler_config or {}
    seq = (resolution // 16) ** 2
    lo, hi = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    b0, b1 = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
    mu = b0 + (b1 - b0) * (seq - lo) / (hi - lo)
    return math.exp(mu)


def default_shift(family: str, resolution: int, scheduler_config: dict | None = None) -> float:
    """The model's own timestep shift: SD3 the scheduler's static ``shift`` (3.0), FLUX :func:`flux_shift`."""
    c = dict(scheduler_config or {})
    if family == "flux" or c.get("use_dynamic_shifting", False):
        return flux_shift(resolution, c)
    return float(c.get("shift", 3.0))


@torch.no_grad()
def decode_latents(vae: nn.Module, latents: Tensor, micro_batch: int = 8) -> np.ndarray:
    """VAE latents ``[B, 16, H/8, W/8]`` -> uint8 images ``[B, H, W, 3]`` (``z / scaling_factor + shift_factor``)."""
    cfg = vae.config
    shift = getattr(cfg, "shift_factor", None) or 0.0
    param = next(vae.parameters())
    out = []
    for s in range(0, latents.shape[0], micro_batch):
        z = latents[s:s + micro_batch].to(device=param.device, dtype=torch.float32) / cfg.scaling_factor + shift
        img = vae.decode(z.to(param.dtype), return_dict=False)[0].float()
        img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        out.append(img.permute(0, 2, 3, 1).cpu().numpy())
    return np.concatenate(out)


# ----------------------------------------------------------------------------------------------------------------
# the loaded model
# ----------------------------------------------------------------------------------------------------------------


class RealModel:
    """A loaded SD3/FLUX pipeline ready for jagg: trainable transformer, velocity adapters, reference, decoder.

    Build it with :func:`load_model` (from a directory) or directly from an existing pipeline / components.
    Attributes: ``config``, ``pipe`` (or None), ``transformer`` (replace it by its DDP/FSDP/accelerate wrapper after
    ``prepare``; adapters made afterwards call the wrapper), ``vae``, ``params`` (trainable), ``device``.
    """

    def __init__(self, config: PipelineConfig, transformer: nn.Module, vae: nn.Module | None = None, pipe=None,
                 scheduler_config: dict | None = None, prompt_cache: PromptEmbeddings | None = None):
        self.config, self.pipe, self.vae = config, pipe, vae
        self.device = config.resolve_device()
        self.transformer = transformer
        base = unwrap_model(transformer)
        base.to(self.device)
        if vae is not None:
            vae.to(self.device).requires_grad_(False).eval()
        # the full fine-tuning reference is copied before any fp32 upcast: it stays in the load dtype
        self.reference_model = frozen_copy(base) if config.keep_reference else None
        if config.lora.enabled:
            self.params = add_lora(base, config.lora, config.family)
        else:
            self.params = full_finetune(base, fp32_params=config.lora.fp32_params)
        if config.gradient_checkpointing:
            base.enable_gradient_checkpointing()
        self.scheduler_config = dict(scheduler_config or {})
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}
        if prompt_cache is not None:
            self.add_embeddings(prompt_cache)

    # -- geometry and schedule ------------------------------------------------------------------------------------

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/8, W/8)``: the VAE latent shape the adapters and trajectories use."""
        base = unwrap_model(self.transformer)
        cfg = getattr(base, "config", None)
        c = cfg.in_channels if self.config.family == "sd3" else cfg.in_channels // 4
        f = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 8
        return c, self.config.resolution // f, self.config.resolution // f

    @property
    def shift(self) -> float:
        if self.config.shift is not None:
            return self.config.shift
        return default_shift(self.config.family, self.config.resolution, self.scheduler_config)

    def sigmas(self, num_steps: int | None = None) -> Tensor:
        """``[T + 1]`` sigmas from 1 to 0 with the model's shift (as its diffusers scheduler)."""
        return flow_sigmas(num_steps or self.config.num_steps, shift=self.shift).to(self.device)

    def noise(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """Initial noise ``[B, C, H/8, W/8]`` fp32 on the model's device."""
        return torch.randn(batch, *self.latent_shape, generator=generator).to(self.device)

    # -- prompts --------------------------------------------------------------------------------------------------

    def add_embeddings(self, emb: PromptEmbeddings) -> None:
        if emb.prompts is None:
            raise ValueError("cached embeddings need their prompt strings")
        for i, p in enumerate(emb.prompts):
            self._cache[p] = (emb.prompt_embeds[i], emb.pooled[i])

    def embeddings(self, prompts: Sequence[str]) -> PromptEmbeddings:
        """``PromptEmbeddings`` of ``prompts`` (one row each): from the cache, the rest encoded with the pipeline."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing:
            if self.pipe is None or getattr(self.pipe, "text_encoder", None) is None:
                shown = ", ".join(repr(p) for p in missing[:5])
                raise KeyError(f"{len(missing)} prompt(s) are not in the prompt-embedding cache ({shown}) and the "
                               "text encoders are not loaded: rebuild the cache (python -m "
                               "jagg.integrations.pipeline cache ...) or set pipeline.load_text_encoders: true")
            self.add_embeddings(encode_prompts(self.pipe, self.config.family, missing,
                                               self.config.max_sequence_length))
        rows = [self._cache[p] for p in prompts]
        dt = torch_dtype(self.config.dtype)
        return PromptEmbeddings(torch.stack([r[0] for r in rows]).to(self.device, dt),
                                torch.stack([r[1] for r in rows]).to(self.device, dt), list(prompts))

    def negative(self) -> PromptEmbeddings:
        return self.embeddings([self.config.negative_prompt])

    # -- velocity, reference, decoding ----------------------------------------------------------------------------

    def velocity(self, prompts: Sequence[str] | PromptEmbeddings) -> TransformerVelocity:
        """The velocity callable for a batch: one prompt (or embedding row) per trajectory."""
        cond = prompts if isinstance(prompts, PromptEmbeddings) else self.embeddings(prompts)
        uncond = self.negative() if self.config.cfg_scale > 1 else None
        return velocity_adapter(self.transformer, cond, uncond, self.config.velocity_config(), self.config.family)

    def reference(self, velocity: TransformerVelocity) -> Callable:
        """KL reference velocity callable: adapters disabled (LoRA) or the frozen initial copy (full fine-tuning)."""
        if not self.config.lora.enabled and self.reference_model is None:
            raise ValueError("full fine-tuning has no KL reference unless pipeline.keep_reference: true")
        return reference_velocity(velocity, self.reference_model)

    def decode(self, latents: Tensor) -> np.ndarray:
        """Latents ``[B, C, H/8, W/8]`` -> uint8 images ``[B, H, W, 3]``."""
        if self.vae is None:
            raise RuntimeError("no VAE loaded: the model directory has no vae/ component")
        return decode_latents(self.vae, latents)

    def save_adapter(self, directory: str | Path, is_main_process: bool = True) -> Path:
        return save_lora(self.transformer, directory, self.config.family, is_main_process)

    def free_text_encoders(self) -> None:
        """Drop the text encoders once every prompt is embedded (T5-XXL alone is ~9 GB)."""
        if self.pipe is not None:
            for name in TEXT_COMPONENTS:
                if hasattr(self.pipe, name):
                    setattr(self.pipe, name, None)


def load_model(config: PipelineConfig) -> RealModel:
    """Load the pipeline of ``config`` from its local directory and prepare it for training (LoRA or full weights,
    gradient checkpointing, prompt cache, device)."""
    cache = PromptEmbeddings.load(config.prompt_cache) if config.prompt_cache else None
    pipe = load_pipeline(config)
    model = RealModel(config, pipe.transformer, getattr(pipe, "vae", None), pipe, dict(pipe.scheduler.config), cache)
    for name in TEXT_COMPONENTS:
        enc = getattr(pipe, name, None)
        if isinstance(enc, nn.Module):
            enc.to(model.device).requires_grad_(False).eval()
    return model


# ----------------------------------------------------------------------------------------------------------------
# python -m jagg.integrations.pipeline cache --config <yaml> --prompts <txt> --out <cache>
# ----------------------------------------------------------------------------------------------------------------


def build_prompt_cache(config: PipelineConfig, prompts: Sequence[str], out: str | Path, batch_size: int = 16) -> Path:
    """Embed ``prompts`` (plus the negative prompt) with the model's text encoders and write the cache file."""
    cfg = dataclasses.replace(config, prompt_cache=None, load_text_encoders=True)
    index = check_model_dir(cfg.path, cfg.family)
    # SD3 without T5 reads the T5 width from the transformer config; otherwise the transformer is not needed
    need_transformer = cfg.family == "sd3" and index.get("text_encoder_3") in (None, [None, None])
    pipe = load_pipeline(cfg, skip=("vae",) if need_transformer else ("vae", "transformer"))
    device = cfg.resolve_device()
    for name in TEXT_COMPONENTS:
        enc = getattr(pipe, name, None)
        if isinstance(enc, nn.Module):
            enc.to(device)
    unique = list(dict.fromkeys([*prompts, config.negative_prompt]))
    emb = encode_prompts(pipe, cfg.family, unique, cfg.max_sequence_length, batch_size, device)
    emb.save(out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jagg.integrations.pipeline",
                                 description="Precompute a prompt-embedding cache with the model's text encoders.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cache", help="embed prompts (one per line) into a .safetensors/.pt cache")
    c.add_argument("--config", required=True, help="YAML with a pipeline: section (e.g. configs/sd35_medium.yaml)")
    c.add_argument("--prompts", required=True, help="text file, one prompt per line")
    c.add_argument("--out", required=True, help="cache file to write (.safetensors or .pt)")
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--path", default=None, help="override pipeline.path")
    args = ap.parse_args(argv)
    cfg = load_pipeline_config(args.config, {"path": args.path} if args.path else None)
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    out = build_prompt_cache(cfg, prompts, args.out, args.batch_size)
    print(f"wrote {len(set(prompts))} prompt embeddings (+ negative prompt) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
