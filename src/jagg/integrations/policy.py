"""The policy of one SD3 / FLUX / Qwen-Image / Wan / FLUX.2 model, owned in one place: :class:`Policy`.

    cfg = load_pipeline_config("configs/sd35_medium.yaml")        # the `pipeline:` section (+ `lora:` inside it)
    policy = load_model(cfg)                                       # SD3.5 / FLUX pipeline, LoRA added, on the GPU
    v = policy.velocity(prompts)                                   # jagg velocity callable, one row per sample
    traj = jagg.sample_trajectories(v, policy.noise(len(prompts)), policy.sigmas(), cfg.eta)
    images = policy.decode(traj.latents[:, -1])                    # uint8 [B, H, W, 3] (Wan: [B, F, H, W, 3])
    ref = policy.reference(v)                                      # adapters off (KL reference)
    policy.save_adapter("adapter/")                                # load_lora_weights and PeftModel read it

The policy holds the transformer and its trainable weights (LoRA adapters, or every weight for full fine-tuning,
optionally as fp32 master weights), the KL reference (the same network with the adapters switched off, or a frozen
copy of the initial weights), the prompt embeddings, the sampler's latent shape and sigmas, the velocity callable
(:mod:`jagg.integrations.velocity_adapters`) and the VAE that decodes rollouts. It unwraps the transformer once, at
construction; a DDP / FSDP / accelerate wrapper put in ``policy.transformer`` afterwards is what the velocity
callables call.

The free functions (:func:`add_lora`, :func:`full_finetune`, :func:`frozen_copy`, :func:`adapters_disabled`,
:func:`reference_velocity`) are the same operations on a bare transformer, for your own loop. Adapters are added with
diffusers' own ``transformer.add_adapter(LoraConfig)``, so the transformer keeps its class (forward signature,
``config``, ``enable_gradient_checkpointing``); their files, in diffusers' and in peft's format
(:func:`~jagg.integrations.lora_files.save_adapter`, :func:`~jagg.integrations.lora_files.load_adapter`), are
:mod:`jagg.integrations.lora_files`'.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .lora_files import load_adapter, save_adapter
from .config import DTYPES, LoraSettings, PipelineConfig
from .model_dir import ModelFiles
from .pipeline import TEXT_COMPONENTS, load_pipeline
from .schedules import dance_sigmas, default_shift, pipeline_sigmas
from .velocity_adapters import (PromptEmbeddings, TransformerVelocity, adapter_class, encode_prompts,
                                model_family, unwrap_model)

# ----------------------------------------------------------------------------------------------------------------
# trainable weights, reference, adapter files (on a bare or wrapped transformer)
# ----------------------------------------------------------------------------------------------------------------


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"LoRA target modules {unmatched} match no Linear layer of {type(model).__name__}; "
                         f"examples of valid names: {names[:6]}")


def add_lora(transformer: nn.Module, settings: LoraSettings, family: str | None = None) -> list[nn.Parameter]:
    """Freeze ``transformer`` and add a trainable LoRA adapter ("default"). Returns the trainable parameters.

    With ``settings.path`` the adapter is loaded from a directory saved by
    :func:`jagg.integrations.lora_files.save_adapter` (or any diffusers or peft LoRA of the family) instead.
    """
    model = unwrap_model(transformer)
    return _add_lora(model, settings, family or model_family(model))


def _add_lora(model: nn.Module, settings: LoraSettings, family: str) -> list[nn.Parameter]:
    if not settings.enabled:
        raise ValueError("add_lora called with lora.enabled = false; use full_finetune() instead")
    from peft import LoraConfig

    model.requires_grad_(False)
    if settings.path is not None:
        load_adapter(model, settings.path)
    else:
        rank, alpha, targets = settings.resolved(family)
        _check_targets(model, targets)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=settings.dropout,
                                     init_lora_weights=True if settings.init == "default" else "gaussian",
                                     target_modules=list(targets)))
    params = [p for p in model.parameters() if p.requires_grad]
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
    return list(model.parameters())


def frozen_copy(transformer: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy (the KL reference of a full fine-tune; one more model in memory)."""
    return copy.deepcopy(unwrap_model(transformer)).eval().requires_grad_(False)


@contextlib.contextmanager
def _adapters_off(bare: nn.Module) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in bare.parameters()]
    try:
        if hasattr(bare, "disable_adapter") and not hasattr(bare, "disable_adapters"):   # peft PeftModel
            with bare.disable_adapter():
                yield
        else:
            if not getattr(bare, "_hf_peft_config_loaded", False):
                raise ValueError(f"{type(bare).__name__} has no LoRA adapter to disable; for full fine-tuning use "
                                 "frozen_copy(transformer) as the reference")
            bare.disable_adapters()
            try:
                yield
            finally:
                bare.enable_adapters()
    finally:
        for p, f in flags:
            p.requires_grad_(f)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model: every LoRA adapter of ``model`` (diffusers ``add_adapter`` or a peft ``PeftModel``, possibly
    under DDP / FSDP) is switched off inside the block. ``requires_grad`` flags are restored exactly on exit (peft's
    toggles change them)."""
    with _adapters_off(unwrap_model(model)):
        yield model


def reference_velocity(velocity: TransformerVelocity, reference: nn.Module | None = None) -> Callable:
    """The KL reference policy's velocity callable ``(latents [N,*S], sigma [N], index [N]) -> v [N,*S]``.

    LoRA: the same adapter (same prompts, guidance, dtype) run with the adapters disabled, under ``no_grad``.
    Full fine-tuning: pass ``reference=frozen_copy(initial transformer)``. Feed it to
    ``jagg.reference_velocities(ref_fn, traj)`` once per rollout.
    """
    if reference is not None:
        ref = velocity.with_transformer(reference)

        @torch.no_grad()
        def ref_fn(latents: Tensor, sigma: Tensor, index: Tensor) -> Tensor:
            return ref(latents, sigma, index)
        return ref_fn

    bare = velocity.bare                                    # unwrapped once, by the adapter

    @torch.no_grad()
    def lora_ref_fn(latents: Tensor, sigma: Tensor, index: Tensor) -> Tensor:
        with _adapters_off(bare):
            return velocity(latents, sigma, index)
    return lora_ref_fn


def save_transformer(transformer: nn.Module, directory: str | Path,
                     state_dict: dict[str, Tensor] | None = None) -> Path:
    """``save_pretrained`` of a full fine-tune, which ``<Transformer>.from_pretrained(directory)`` reads: the
    transformer's config and weights (``state_dict``, e.g. gathered from FSDP shards; default its own), in their
    dtype. The model written is rebuilt from its config without memory for weights, then given ``state_dict``, so a
    sharded or wrapped transformer saves as the plain diffusers class. Returns the directory."""
    model = unwrap_model(transformer)
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("diffusers."))
    state = state_dict if state_dict is not None else model.state_dict()
    with torch.device("meta"):
        plain = cls.from_config(model.config)
    plain.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, assign=True)
    plain.save_pretrained(str(directory))
    return Path(directory)


def _not_cached(missing: Sequence[str], where: str) -> str:
    shown = ", ".join(repr(p) for p in missing[:5])
    return (f"{len(missing)} prompt(s){where} are not in the prompt-embedding cache and the text encoders are not "
            f"loaded ({shown}{', ...' if len(missing) > 5 else ''}): rebuild the cache with them (python -m "
            "jagg.integrations.pipeline cache --config <yaml> --prompts <file> --out <cache>) or set "
            "pipeline.load_text_encoders: true")


# ----------------------------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------------------------


def vae_scale_factor(vae: nn.Module) -> int:
    """Pixels per latent along each side, as the pipelines compute it: ``2 ** len(temperal_downsample)`` for
    Qwen-Image's video VAE (``AutoencoderKLQwenImage``), ``2 ** (len(block_out_channels) - 1)`` for
    ``AutoencoderKL``."""
    cfg = vae.config
    if _is_video_vae(vae):
        return 2 ** len(cfg.temperal_downsample)
    return 2 ** (len(cfg.block_out_channels) - 1)


def _is_video_vae(vae: nn.Module) -> bool:
    return getattr(vae.config, "temperal_downsample", None) is not None


def vae_temporal_factor(vae: nn.Module | None) -> int:
    """Frames per latent frame of a video VAE, ``2 ** sum(temperal_downsample)`` (Wan 2.1's ``AutoencoderKLWan``:
    4, as ``WanPipeline.vae_scale_factor_temporal``); 4 without a VAE."""
    if vae is None:
        return 4
    return 2 ** sum(bool(d) for d in vae.config.temperal_downsample)


def _vae_space(vae: nn.Module, z: Tensor) -> Tensor:
    """Sampler latents (fp32, on the VAE's device) -> the decoder's input, undoing each pipeline's normalisation:
    ``AutoencoderKL`` (SD3, FLUX) ``z / scaling_factor + shift_factor``; the video VAEs (Qwen-Image's
    ``AutoencoderKLQwenImage``, Wan's ``AutoencoderKLWan``) ``z * latents_std + latents_mean`` per channel, an image
    as one frame ``[B, C, 1, h, w]``; FLUX.2's ``AutoencoderKLFlux2`` its batch norm's running statistics, then the
    2x2 patches back to ``[B, C/4, 2h, 2w]`` (``Flux2Pipeline._unpatchify_latents``)."""
    cfg = vae.config
    if _is_video_vae(vae):
        mean, std = (torch.tensor(v, dtype=torch.float32, device=z.device).view(1, -1, 1, 1, 1)
                     for v in (cfg.latents_mean, cfg.latents_std))
        return (z if z.ndim == 5 else z[:, :, None]) * std + mean
    if isinstance(getattr(vae, "bn", None), nn.BatchNorm2d):
        mean = vae.bn.running_mean.float().view(1, -1, 1, 1)
        z = z * torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + cfg.batch_norm_eps) + mean
        b, c4, h, w = z.shape
        return z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)
    return z / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)


@torch.no_grad()
def decode_latents(vae: nn.Module, latents: Tensor, micro_batch: int = 8) -> np.ndarray:
    """VAE latents ``[B, C, H/8, W/8]`` (FLUX.2: ``[B, 4C, H/16, W/16]``) -> uint8 images ``[B, H, W, 3]``; video
    latents ``[B, C, F, H/8, W/8]`` -> uint8 videos ``[B, 4 (F - 1) + 1, H, W, 3]`` (:func:`_vae_space` says how
    each VAE's latents are normalised)."""
    param = next(vae.parameters())
    video, frames = _is_video_vae(vae), latents.ndim == 5
    out = []
    for s in range(0, latents.shape[0], micro_batch):
        z = _vae_space(vae, latents[s:s + micro_batch].to(device=param.device, dtype=torch.float32))
        img = vae.decode(z.to(param.dtype), return_dict=False)[0].float()
        img = img if frames or not video else img[:, :, 0]
        img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        out.append(img.movedim(1, -1).cpu().numpy())           # [b, H, W, 3] or, video, [b, F, H, W, 3]
    return np.concatenate(out)


# ----------------------------------------------------------------------------------------------------------------
# the policy
# ----------------------------------------------------------------------------------------------------------------


class Policy:
    """The policy of one SD3 / FLUX / Qwen-Image / Wan / FLUX.2 model: trainable transformer, KL reference, prompts,
    sampler, velocity, decoder.

    Build it with :func:`load_model` (from a local diffusers directory) or directly from components.

    Args:
        config: the :class:`PipelineConfig` (family, dtype, device, sampler, guidance, ``lora:``).
        transformer: the diffusers ``SD3Transformer2DModel`` / ``FluxTransformer2DModel`` /
            ``QwenImageTransformer2DModel`` / ``WanTransformer3DModel`` / ``Flux2Transformer2DModel`` (bare or
            wrapped); LoRA adapters are added to it (or all its weights made
            trainable) here.
        vae: the pipeline's VAE (for :meth:`decode`), or None.
        pipe: the diffusers pipeline, whose text encoders embed prompts missing from the cache, or None.
        scheduler_config: the scheduler's config, its class in ``_class_name`` (:meth:`sigmas` builds that scheduler;
            the model's own timestep shift and terminal stretch).
        prompt_cache: :class:`PromptEmbeddings` with prompt strings, e.g. loaded from ``pipeline.prompt_cache``.
        place: move the transformer (and the reference copy) to ``config``'s device and upcast a full fine-tune to
            fp32 master weights here; False leaves both to a wrapper that shards first (:mod:`jagg.infra.engine`).

    Attributes: ``config``, ``pipe``, ``vae``, ``device``, ``transformer`` (the module the velocity callables call:
    replace it by its DDP / FSDP / accelerate wrapper after ``prepare``), ``bare`` (the unwrapped module, fixed at
    construction), ``named_params`` / ``params`` (the trainable weights), ``reference_model`` (the frozen copy of
    a full fine-tune with ``keep_reference``, else None), ``latent_shape`` (``(C, H/8, W/8)``; video: ``(C, F,
    H/8, W/8)`` with ``F = (num_frames - 1) / 4 + 1`` latent frames), ``image_tokens`` (the sequence length a
    dynamic shift reads), ``shift`` and ``shift_terminal`` (DanceGRPO's grid, ``pipeline.sigma_grid: dance``: the
    shift at ``pipeline.num_steps``, and the scheduler's ``shift_terminal`` the sigmas are stretched to when
    ``pipeline.shift`` is null, else None); :meth:`sigmas` says which grid a rollout samples on.
    """

    def __init__(self, config: PipelineConfig, transformer: nn.Module, vae: nn.Module | None = None, pipe=None,
                 scheduler_config: dict | None = None, prompt_cache: PromptEmbeddings | None = None,
                 place: bool = True):
        self.config, self.pipe, self.vae = config, pipe, vae
        self.device = config.resolve_device()
        self.transformer = transformer
        self.bare = unwrap_model(transformer)
        if place:
            self.bare.to(self.device)
        if vae is not None:
            vae.to(self.device).requires_grad_(False).eval()
        # the full fine-tuning reference is copied before any fp32 upcast: it stays in the load dtype
        self.reference_model = frozen_copy(self.bare) if config.keep_reference else None
        if config.lora.enabled:
            _add_lora(self.bare, config.lora, config.family)
        else:
            full_finetune(self.bare, config.lora.fp32_params and place)
        self.refresh_params()
        if config.gradient_checkpointing:
            self.bare.enable_gradient_checkpointing()
        self._adapter = adapter_class(config.family)
        f = vae_scale_factor(vae) if vae is not None else 8
        h, w = (side // (f * self._adapter.latent_downsample) for side in config.size)
        frames = ((config.frames - 1) // vae_temporal_factor(vae) + 1,) if self._adapter.latent_dims == 5 else ()
        self.latent_shape: tuple[int, ...] = (self._adapter.latent_channels(self.bare.config), *frames, h, w)
        self.scheduler_config = dict(scheduler_config or {})
        self.image_tokens = self._adapter.image_tokens(h, w, self.bare.config)  # what a dynamic shift reads
        # DanceGRPO's grid: an explicit pipeline.shift is a static shift; the model's own may end in a stretch
        self.shift = (config.shift if config.shift is not None
                      else default_shift(config.family, self.image_tokens, self.scheduler_config, config.num_steps))
        self._sigmas: dict[int, Tensor] = {}                  # sigmas() of each number of steps
        self.shift_terminal: float | None = None
        if config.shift is None and self.scheduler_config.get("shift_terminal"):
            self.shift_terminal = float(self.scheduler_config["shift_terminal"])
        self.velocity_config = config.velocity_config()
        self._dtype = DTYPES[config.dtype]                    # checked by PipelineConfig
        self._cache: dict[str, PromptEmbeddings] = {}         # one unpadded row per prompt
        self._negative: PromptEmbeddings | None = None
        if prompt_cache is not None:
            self.add_embeddings(prompt_cache)

    # -- sampler --------------------------------------------------------------------------------------------------

    def refresh_params(self) -> None:
        """Re-read :attr:`named_params` / :attr:`params` (the trainable weights) from :attr:`bare`, after a wrapper
        replaced its parameters (FSDP2's ``fully_shard`` makes them sharded ``DTensor`` parameters)."""
        self.named_params = {n: p for n, p in self.bare.named_parameters() if p.requires_grad}
        self.params = list(self.named_params.values())

    def sigmas(self, num_steps: int | None = None) -> Tensor:
        """The ``[T + 1]`` float32 sigmas of ``num_steps`` sampling steps (default ``pipeline.num_steps``), from (about)
        1 down to 0, on the model's device, by ``pipeline.sigma_grid`` (:mod:`jagg.integrations.schedules`):
        ``pipeline``, the grid the family's diffusers pipeline samples on at this resolution (its scheduler called as
        the pipeline calls it; SD3: ``set_timesteps(N)``, last sigma before 0 0.0089 at 10 steps with shift 3);
        ``dance``, DanceGRPO's ``shift(linspace(1, 0, N + 1))`` with :attr:`shift` (and :attr:`shift_terminal`)."""
        n = num_steps or self.config.num_steps
        if n not in self._sigmas:
            if self.config.sigma_grid == "pipeline":
                grid = pipeline_sigmas(self.config.family, n, self.scheduler_config, self.image_tokens,
                                       self.config.shift)
            else:
                shift = self.shift if n == self.config.num_steps or self.config.shift is not None else \
                    default_shift(self.config.family, self.image_tokens, self.scheduler_config, n)
                grid = dance_sigmas(n, shift, self.shift_terminal)
            self._sigmas[n] = grid
        return self._sigmas[n].to(self.device)

    def noise(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """Initial noise ``[B, *latent_shape]`` fp32 on the model's device."""
        return torch.randn(batch, *self.latent_shape, generator=generator).to(self.device)

    # -- prompts --------------------------------------------------------------------------------------------------

    @property
    def can_encode(self) -> bool:
        """Whether the text encoders are loaded (prompts missing from the cache can be embedded)."""
        return self.pipe is not None and getattr(self.pipe, "text_encoder", None) is not None

    def add_embeddings(self, emb: PromptEmbeddings) -> None:
        """Cache the rows of ``emb`` under their prompt strings (e.g. a loaded prompt-embedding cache)."""
        if emb.prompts is None:
            raise ValueError("cached embeddings need their prompt strings (PromptEmbeddings.prompts)")
        self._cache.update(zip(emb.prompts, emb.rows()))

    def embeddings(self, prompts: Sequence[str]) -> PromptEmbeddings:
        """``PromptEmbeddings`` of ``prompts`` (one row each): from the cache, the rest encoded with the pipeline's
        text encoders one prompt at a time (so an embedding never depends on its batch) and cached, together with
        the negative prompt when classifier-free guidance needs it."""
        missing = self._missing(prompts)
        if missing:
            if not self.can_encode:
                raise KeyError(_not_cached(missing, ""))
            self.add_embeddings(encode_prompts(self.pipe, self.config.family, missing,
                                               self.config.max_sequence_length, batch_size=1))
        return PromptEmbeddings.cat([self._cache[p] for p in prompts], self.device, self._dtype)

    def negative(self) -> PromptEmbeddings:
        """The negative prompt's embeddings (one row), computed once."""
        if self._negative is None:
            self._negative = self.embeddings([self.config.negative_prompt])
        return self._negative

    def require_prompts(self, prompts: Sequence[str], source: str) -> None:
        """Without text encoders, raise a ValueError naming the prompts of ``source`` (and the negative prompt, with
        CFG) that the prompt cache lacks, before anything runs."""
        missing = [] if self.can_encode else self._missing(prompts)
        if missing:
            raise ValueError(_not_cached(missing, f" of {source} (cache: {self.config.prompt_cache})"))

    def _missing(self, prompts: Sequence[str]) -> list[str]:
        """The distinct prompts, with CFG's negative prompt, that the cache lacks."""
        negative = [self.config.negative_prompt] if self.config.cfg_scale > 1 else []
        return [p for p in dict.fromkeys([*prompts, *negative]) if p not in self._cache]

    def free_text_encoders(self) -> None:
        """Drop the text encoders once every prompt is embedded (T5-XXL alone is ~9 GB)."""
        if self.pipe is not None:
            for name in TEXT_COMPONENTS:
                if hasattr(self.pipe, name):
                    setattr(self.pipe, name, None)

    # -- velocity, reference, decoding, adapter files -------------------------------------------------------------

    def velocity(self, prompts: Sequence[str] | PromptEmbeddings) -> TransformerVelocity:
        """The velocity callable for a batch: one prompt (or embedding row) per trajectory."""
        cond = prompts if isinstance(prompts, PromptEmbeddings) else self.embeddings(prompts)
        uncond = self.negative() if self.config.cfg_scale > 1 else None
        return self._adapter(self.transformer, cond, uncond, self.velocity_config)

    def reference(self, velocity: TransformerVelocity) -> Callable:
        """KL reference velocity callable of ``velocity``'s batch: adapters disabled (LoRA) or the frozen initial
        copy (full fine-tuning with ``keep_reference``)."""
        if not self.config.lora.enabled and self.reference_model is None:
            raise ValueError("full fine-tuning has no KL reference unless pipeline.keep_reference: true")
        return reference_velocity(velocity, self.reference_model)

    def decode(self, latents: Tensor) -> np.ndarray:
        """Latents ``[B, *latent_shape]`` -> uint8 images ``[B, H, W, 3]`` (a video family: videos ``[B, F, H, W,
        3]``, which the reward scores frame by frame, :mod:`jagg.rewards.registry`)."""
        if self.vae is None:
            raise RuntimeError("no VAE loaded: the model directory has no vae/ component")
        return decode_latents(self.vae, latents)

    def save_adapter(self, directory: str | Path, state: dict[str, Tensor] | None = None) -> Path:
        """Write the LoRA adapter in both formats (:func:`jagg.integrations.lora_files.save_adapter`):
        ``<Pipeline>.load_lora_weights(directory)``, ``PeftModel.from_pretrained(transformer, directory)`` and
        ``pipeline.lora.path`` read it. ``state``: weights by parameter name to write instead (the EMA's, or the
        weights gathered from FSDP's shards)."""
        return save_adapter(self.bare, directory, self.config.family, state)


RealModel = Policy          # the former name, kept for existing code


def load_model(config: PipelineConfig, place: bool = True, checked: ModelFiles | None = None) -> Policy:
    """Load the pipeline of ``config`` from its local directory and build its :class:`Policy` (LoRA or full weights,
    gradient checkpointing, prompt cache, device; ``place``: as :class:`Policy`'s; ``checked``: as
    :func:`jagg.integrations.pipeline.load_pipeline`'s)."""
    cache = PromptEmbeddings.load(config.prompt_cache) if config.prompt_cache else None
    pipe = load_pipeline(config, checked=checked)
    scheduler = {**pipe.scheduler.config, "_class_name": type(pipe.scheduler).__name__}   # the class sigmas() builds
    policy = Policy(config, pipe.transformer, getattr(pipe, "vae", None), pipe, scheduler, cache, place)
    for name in TEXT_COMPONENTS:
        enc = getattr(pipe, name, None)
        if isinstance(enc, nn.Module):
            enc.to(policy.device).requires_grad_(False).eval()
    return policy
