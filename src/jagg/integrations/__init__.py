"""Real models through diffusers: SD3/SD3.5, FLUX, Qwen-Image, Wan 2.1 (video) and FLUX.2, LoRA (peft) or full
fine-tuning, from a local path.

Modules: :mod:`~jagg.integrations.families` (one record per model family: everything jagg knows about it),
:mod:`~jagg.integrations.config` (the ``pipeline:`` section: model, LoRA, guidance),
:mod:`~jagg.integrations.velocity_adapters` (prompt embeddings and the SD3 / FLUX / Qwen-Image / Wan / FLUX.2
velocity adapters),
:mod:`~jagg.integrations.pipeline` (a local diffusers directory: checks, loading, the prompt-cache builder
``python -m jagg.integrations.pipeline cache``), :mod:`~jagg.integrations.schedules` (the sigma grid of each family's
pipeline, and DanceGRPO's), :mod:`~jagg.integrations.lora_files` (LoRA files in diffusers' and peft's formats),
:mod:`~jagg.integrations.policy` (the owner of the policy: trainable weights, KL reference, prompts, sampler,
velocity, decoding),
:mod:`jagg.trainers.diffusers_trainer` and :mod:`jagg.trainers.diffusers_config` (``jagg train`` on these models) live
with the other trainer in :mod:`jagg.trainers`.

Needs the ``diffusers`` extra (``pip install 'jagg[diffusers]'``: diffusers, peft, transformers, accelerate);
diffusers and peft are imported only when a function needs them.
"""

from .config import LoraSettings, PipelineConfig, VelocityConfig, load_pipeline_config
from .families import FAMILIES, Family, register_family
from .lora_files import adapter_format, load_adapter, load_lora, save_adapter, save_lora, save_peft
from .pipeline import check_model_dir, load_pipeline
from .policy import (Policy, RealModel, adapters_disabled, add_lora, decode_latents, frozen_copy, full_finetune,
                     load_model, reference_velocity, save_transformer)
from .velocity_adapters import (Flux2Velocity, FluxVelocity, PromptEmbeddings, QwenImageVelocity, SD3Velocity,
                                TransformerVelocity, WanVelocity, encode_prompts, model_family, pack_latents,
                                unpack_latents, unwrap_model, velocity_adapter)

__all__ = [
    "FAMILIES", "Family", "FluxVelocity", "LoraSettings", "PipelineConfig", "Policy", "PromptEmbeddings",
    "QwenImageVelocity", "RealModel", "SD3Velocity",
    "TransformerVelocity", "VelocityConfig", "adapters_disabled", "add_lora", "check_model_dir", "decode_latents",
    "encode_prompts", "frozen_copy", "full_finetune", "load_lora", "load_model", "load_pipeline",
    "load_pipeline_config", "model_family", "pack_latents", "reference_velocity", "save_lora", "save_transformer",
    "unpack_latents",
    "unwrap_model", "velocity_adapter", "WanVelocity", "register_family",
    "Flux2Velocity", "adapter_format", "load_adapter", "save_adapter", "save_peft",
]
