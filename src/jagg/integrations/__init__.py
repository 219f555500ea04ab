"""Real models through diffusers: SD3/SD3.5 and FLUX velocity adapters, LoRA (peft), loading from a local path.

Needs the ``diffusers`` extra (``pip install 'jagg[diffusers]'``: diffusers, peft, transformers, accelerate);
diffusers and peft are imported only when a function needs them.
"""

from .diffusers_adapters import (FluxVelocity, PromptEmbeddings, SD3Velocity, TransformerVelocity, VelocityConfig,
                                 model_family, pack_latents, unpack_latents, unwrap_model, velocity_adapter)
from .lora import (FLUX_TARGET_MODULES, SD3_TARGET_MODULES, LoraSettings, adapters_disabled, add_lora, frozen_copy,
                   full_finetune, load_lora, reference_velocity, save_lora)
from .pipeline import (PipelineConfig, RealModel, check_model_dir, decode_latents, encode_prompts, load_model,
                       load_pipeline, load_pipeline_config)

__all__ = [
    "FLUX_TARGET_MODULES", "FluxVelocity", "LoraSettings", "PipelineConfig", "PromptEmbeddings", "RealModel",
    "SD3Velocity", "SD3_TARGET_MODULES", "TransformerVelocity", "VelocityConfig", "adapters_disabled", "add_lora",
    "check_model_dir", "decode_latents", "encode_prompts", "frozen_copy", "full_finetune", "load_lora", "load_model",
    "load_pipeline", "load_pipeline_config", "model_family", "pack_latents", "reference_velocity", "save_lora",
    "unpack_latents", "unwrap_model", "velocity_adapter",
]
