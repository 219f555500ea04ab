"""The ``pipeline:`` section of a real-model config: which diffusers model, how it samples, how it trains.

:class:`PipelineConfig` (the model, its sampler and guidance), :class:`LoraSettings` (its ``lora:`` sub-section:
LoRA or full fine-tuning) and :class:`VelocityConfig` (how :mod:`jagg.integrations.velocity_adapters` turns a transformer into
a velocity callable; derived from the pipeline section). Every value is checked when the object is built, with an
error naming the key. Plain dataclasses: nothing here imports diffusers.

The family's own settings (LoRA defaults, guidance, video or not, ...) are its record in
:mod:`jagg.integrations.families`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checks import Keys, check_eta
from ..infra.config_loader import from_dict, helped, read_yaml
from .families import DEFAULT_FAMILY, FAMILIES, Family

UNCOND_FORWARDS = ("separate", "batched")
SIGMA_GRIDS = ("pipeline", "dance")         # jagg.integrations.schedules makes them (it imports diffusers; this not)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


# the guidance keys that PipelineConfig passes on to VelocityConfig
_HELP = {
    "guidance_embed": "FLUX.1-dev's distilled guidance, fed to the network as an embedding (3.5; FLUX.2 [dev]: "
                      "4.0); null for models without guidance embeddings (required by those with them).",
    "detach_uncond": "Stop the gradient through CFG's unconditional branch in training. false (Flow-GRPO, train.cfg "
                     "= True): both branches go through the transformer with grad, as one batched forward. true: a "
                     "cheaper variant that changes the gradient (the conditional branch's only, times cfg_scale).",
    "uncond_forward": f"One of {UNCOND_FORWARDS}, used only with detach_uncond: true: the unconditional rows as a "
                      "separate no-grad forward (less activation memory) or one batched [uncond; cond] forward, "
                      "detached after.",
    "autocast": "Forward under torch.autocast(bf16|fp16), e.g. with fp32 master weights; null = cast the inputs to "
                "the transformer's dtype.",
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` (or a torch dtype) -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}; got {name!r}")
    return DTYPES[name]


@dataclass
class VelocityConfig:
    """How a transformer is turned into a velocity callable (:func:`jagg.integrations.velocity_adapter`)."""

    cfg_scale: float = field(default=1.0, metadata=helped(
        "Classifier-free guidance weight w in v = v_u + w (v_c - v_u); 1 = no CFG (one forward). Flow-GRPO SD3.5: "
        "4.5; FLUX.1-dev (guidance-distilled): 1. Qwen-Image (QwenImagePipeline's true_cfg_scale): the combination "
        "is rescaled to the conditional velocity's norm per 2x2 latent patch."))
    guidance_embed: float | None = field(default=None, metadata=helped(_HELP["guidance_embed"]))
    detach_uncond: bool = field(default=False, metadata=helped(_HELP["detach_uncond"]))
    uncond_forward: str = field(default="separate", metadata=helped(_HELP["uncond_forward"]))
    autocast: str | None = field(default=None, metadata=helped(_HELP["autocast"]))
    output_dtype: str = field(default="fp32", metadata=helped("Dtype of the returned velocity: 'fp32' or 'model' (the "
                              "network's own dtype). The core computes the SDE step in fp32 either way."))

    def __post_init__(self):
        if self.cfg_scale < 1.0:
            raise ValueError(f"cfg_scale must be >= 1 (1 = no classifier-free guidance); got {self.cfg_scale}")
        if self.uncond_forward not in UNCOND_FORWARDS:
            raise ValueError(f"uncond_forward must be one of {UNCOND_FORWARDS}; got {self.uncond_forward!r}")
        if self.autocast is not None and self.autocast not in ("bf16", "fp16"):
            raise ValueError(f"autocast must be None, 'bf16' or 'fp16'; got {self.autocast!r}")
        if self.output_dtype not in ("fp32", "model"):
            raise ValueError(f"output_dtype must be 'fp32' or 'model'; got {self.output_dtype!r}")


@dataclass
class LoraSettings:
    """LoRA or full fine-tuning. Unset rank / alpha / target_modules take Flow-GRPO's values for the family."""

    enabled: bool = field(default=True, metadata=helped("Train LoRA adapters (true) or all transformer weights "
                          "(false: full fine-tuning; the KL reference is then a frozen copy)."))
    rank: int | None = field(default=None, metadata=helped("LoRA rank r (Flow-GRPO: SD3 and Wan 32, FLUX and "
                                                                 "Qwen-Image 64)."))
    alpha: float | None = field(default=None, metadata=helped("LoRA alpha; scale = alpha / r (Flow-GRPO: 2 r)."))
    target_modules: list[str] | None = field(default=None, metadata=helped("Module-name suffixes that get adapters "
                                             "(default: Flow-GRPO's list for the family, see "
                                             "jagg.integrations.families)."))
    init: str = field(default="gaussian", metadata=helped("peft init_lora_weights: 'gaussian' (Flow-GRPO) or 'default' "
                      "(kaiming A); B starts at zero either way, so the policy starts at the base model."))
    dropout: float = field(default=0.0, metadata=helped("LoRA dropout."))
    fp32_params: bool = field(default=True, metadata=helped("Keep trainable parameters in fp32 (master weights: AdamW "
                              "updates below bf16's resolution are not lost). LoRA: the adapters, on the bf16 base. "
                              "Full fine-tuning: the whole transformer, so set pipeline.autocast: bf16 to compute in "
                              "bf16; the KL reference copy stays in pipeline.dtype."))
    path: str | None = field(default=None, metadata=helped("Start from a saved adapter directory (containing "
                             f"{LORA_WEIGHT_NAME}, or peft's adapter_config.json + adapter_model.safetensors); its "
                             "rank, alpha and modules are the adapter's, and a rank set here must be its rank "
                             "(null: any)."))

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
        record = FAMILIES[family]
        r0, a0, t0 = record.lora_rank, record.lora_alpha, record.lora_targets
        rank = self.rank or r0
        alpha = self.alpha if self.alpha is not None else (a0 if self.rank is None else 2.0 * rank)
        return rank, float(alpha), tuple(self.target_modules or t0)


@dataclass
class PipelineConfig:
    """A real text-to-image (or text-to-video) model to fine-tune (defaults: Flow-GRPO's SD3.5-Medium settings)."""

    family: str = field(default=DEFAULT_FAMILY, metadata=helped(f"Model family, one of {tuple(FAMILIES)} "
                        f"({', '.join(dict.fromkeys(f.title for f in FAMILIES.values()))}: jagg.integrations.families "
                        "holds each one's record)."))
    path: str = field(default="", metadata=helped("Local diffusers model directory (model_index.json + transformer/)."))
    dtype: str = field(default="bf16", metadata=helped("Transformer / text-encoder weights dtype: bf16, fp16 or fp32."))
    vae_dtype: str = field(default="fp32", metadata=helped("VAE dtype (Flow-GRPO decodes in fp32)."))
    device: str = field(default="auto", metadata=helped("'auto' (cuda if available, else cpu), 'cuda', 'cuda:1', "
                                                       "'cpu'."))
    resolution: int = field(default=512, metadata=helped("Image (or video) height in pixels, and its width unless "
                            "pipeline.width is set (multiple of 16)."))
    width: int | None = field(default=None, metadata=helped("Width in pixels (multiple of 16); null = resolution, "
                              "square (Flow-GRPO's Wan 2.1: 240 x 416)."))
    num_frames: int | None = field(default=None, metadata=helped("Video frames (family wan: 4k + 1, the VAE compresses "
                                   "4 frames into one latent frame; Flow-GRPO's Wan 2.1: 33); null = WanPipeline's 81 "
                                   "for wan, one image for the image families (which take only null or 1)."))
    num_steps: int = field(default=10, metadata=helped("Sampling steps of a training rollout (Flow-GRPO SD3: 10)."))
    eval_num_steps: int = field(default=40, metadata=helped("Steps of the evaluation sampler (Flow-GRPO SD3: 40)."))
    shift: float | None = field(default=None, metadata=helped("Static timestep shift (SD3's rule); null = the "
                                "model's own, as its scheduler config says: SD3 the scheduler's shift (3.0), Wan its "
                                "flow_shift (3.0 for 480p), FLUX and Qwen-Image the resolution-dependent exp(mu), "
                                "Qwen-Image then stretched to its shift_terminal (0.02), FLUX.2 exp(mu) of the image "
                                "tokens and the number of steps."))
    sigma_grid: str = field(default="pipeline", metadata=helped(
        "The sigmas of a rollout and an evaluation: 'pipeline', the grid the family's diffusers pipeline samples on "
        "at the same steps and resolution (its scheduler called as the pipeline calls it: SD3's set_timesteps(N), "
        "FLUX.1 / Qwen-Image / FLUX.2's explicit sigmas with their dynamic shift and terminal stretch, Wan's "
        "scheduler), as Flow-GRPO samples; or 'dance', DanceGRPO's and the JAGG authors' shift(linspace(1, 0, N + 1)) "
        "(jagg.integrations.schedules)."))
    eta: float = field(default=0.7, metadata=helped("SDE noise level (Flow-GRPO: SD3 0.7, FLUX 0.9)."))
    cfg_scale: float = field(default=4.5, metadata=helped("Classifier-free guidance weight in sampling and training "
                             "(Flow-GRPO SD3.5 and Wan 2.1: 4.5; FLUX.1-dev: 1, it is guidance-distilled)."))
    guidance_embed: float | None = field(default=None, metadata=helped(_HELP["guidance_embed"]))
    negative_prompt: str = field(default="", metadata=helped("Negative prompt of classifier-free guidance "
                                 "(Flow-GRPO: '' for SD3, ' ' for Qwen-Image)."))
    detach_uncond: bool = field(default=False, metadata=helped(_HELP["detach_uncond"]))
    uncond_forward: str = field(default="separate", metadata=helped(_HELP["uncond_forward"]))
    autocast: str | None = field(default=None, metadata=helped(_HELP["autocast"]))
    max_sequence_length: int = field(default=128, metadata=helped("Text tokens per prompt: T5's for SD3 and FLUX "
                                     "(Flow-GRPO: 128), Qwen2.5-VL's for Qwen-Image (QwenImagePipeline: 512, at most "
                                     "1024), where shorter prompts keep their own length; "
                                     "UMT5's for Wan (Flow-GRPO and WanPipeline: 512, zero-padded)."))
    prompt_cache: str | None = field(default=None, metadata=helped("Precomputed prompt-embedding cache (.safetensors "
                                     "or .pt); with it the text encoders are not loaded."))
    load_text_encoders: bool | None = field(default=None, metadata=helped("Load the text encoders (needed to embed "
                                            "prompts missing from the cache); null = only without prompt_cache."))
    gradient_checkpointing: bool = field(default=False, metadata=helped("Recompute transformer activations in the "
                                         "backward (enable_gradient_checkpointing): less memory, ~30% more time."))
    keep_reference: bool = field(default=False, metadata=helped("Full fine-tuning only: keep a frozen copy of the "
                                 "initial transformer as the KL reference (one more model in memory)."))
    lora: LoraSettings = field(default_factory=LoraSettings, metadata=helped("LoRA settings (see LoraSettings)."))

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = from_dict(LoraSettings, self.lora, "pipeline.lora")
        record = FAMILIES[self.family]                          # a ValueError naming pipeline.family
        for name in ("dtype", "vae_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"pipeline.{name} must be one of {tuple(DTYPES)}; got {getattr(self, name)!r}")
        for name in ("resolution", "width"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value % 16):
                raise ValueError(f"pipeline.{name} must be a positive multiple of 16 (VAE /8, 2x2 packing); "
                                 f"got {value}")
        self._check_frames()
        for name in ("num_steps", "eval_num_steps", "max_sequence_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline.{name} must be >= 1; got {getattr(self, name)}")
        most = record.max_text_tokens
        if most is not None and self.max_sequence_length > most:
            raise ValueError(f"pipeline.max_sequence_length must be <= {most} for {self.family} "
                             f"({record.pipeline_class}'s limit); got {self.max_sequence_length}")
        if self.sigma_grid not in SIGMA_GRIDS:
            raise ValueError(f"pipeline.sigma_grid must be one of {SIGMA_GRIDS} (the model's pipeline grid, or "
                             f"DanceGRPO's); got {self.sigma_grid!r}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"pipeline.shift must be > 0 or null; got {self.shift}")
        check_eta(self.eta, Keys(eta="pipeline.eta"))
        try:
            self.velocity_config()                                  # validates cfg_scale, uncond_forward, autocast
        except ValueError as e:
            raise ValueError(f"pipeline.{e}") from None
        if self.keep_reference and self.lora.enabled:
            raise ValueError("pipeline.keep_reference is for full fine-tuning (lora.enabled: false); with LoRA the "
                             "reference is the base model with the adapters disabled")

    def _check_frames(self) -> None:
        if self.num_frames is None:
            return
        if self.video:
            if isinstance(self.num_frames, bool) or self.num_frames < 1 or (self.num_frames - 1) % 4:
                raise ValueError(f"pipeline.num_frames must be 4k + 1 for {self.family} (1, 5, ..., 33, ..., 81: its "
                                 f"VAE compresses 4 frames into one latent frame); got {self.num_frames}")
        elif self.num_frames != 1:
            videos = tuple(f.name for f in FAMILIES.values() if f.video)
            raise ValueError(f"pipeline.num_frames is for video families {videos}; family {self.family!r} "
                             f"makes images: leave it null (got {self.num_frames})")

    @property
    def frames(self) -> int:
        """Frames per sample: ``num_frames``, or its default (81 for a video family, else 1)."""
        if self.num_frames is not None:
            return self.num_frames
        return 81 if self.video else 1

    @property
    def record(self) -> Family:
        """The family's record (:mod:`jagg.integrations.families`)."""
        return FAMILIES[self.family]

    @property
    def video(self) -> bool:
        """Whether the family makes videos (latents with a frame axis)."""
        return self.record.video

    @property
    def cost_preset(self) -> str | None:
        """The :mod:`jagg.cost` preset of the family, or None for the default (:func:`jagg.cost.default_cost`)."""
        return self.record.cost_preset

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels."""
        return self.resolution, self.width if self.width is not None else self.resolution

    def velocity_config(self) -> VelocityConfig:
        return VelocityConfig(cfg_scale=self.cfg_scale, guidance_embed=self.guidance_embed,
                              detach_uncond=self.detach_uncond, uncond_forward=self.uncond_forward,
                              autocast=self.autocast)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def load_pipeline_config(path: str | Path, overrides: dict | None = None) -> PipelineConfig:
    """The ``pipeline:`` section of a YAML config (other sections belong to the trainer) -> :class:`PipelineConfig`;
    the file is read as every config is (:func:`jagg.infra.config_loader.read_yaml`)."""
    data = read_yaml(path)
    if "pipeline" not in data:
        raise ValueError(f"{path} has no 'pipeline:' section (see configs/sd35_medium.yaml)")
    section = dict(data["pipeline"] or {})
    section.update(overrides or {})
    return from_dict(PipelineConfig, section, "pipeline")
