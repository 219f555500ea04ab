"""Tiny random diffusers models for the real-model tests: no downloads, CPU, seconds.

The transformers and VAEs of every family jagg trains (SD3, FLUX.1, Qwen-Image, FLUX.2, Wan 2.1) at 1-2 layers on
16x16 latents, their text encoders (two tiny CLIPs for SD3, a 1-layer Qwen2.5-VL for Qwen-Image), prompt embeddings of
the shapes each family takes, and whole pipelines saved as local diffusers directories (the ``sd3_dir`` and
``qwen_dir`` fixtures of conftest.py). Importing this module needs diffusers and peft: a test module calls
``pytest.importorskip`` for both first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage, AutoencoderKLWan,
                       FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel, FluxTransformer2DModel,
                       QwenImagePipeline, QwenImageTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline, WanTransformer3DModel)

from jagg.integrations import PromptEmbeddings
from tiny_clip import tiny_clip_tokenizer

C, H, W = 4, 16, 16          # latent channels and size
L, D, DP = 5, 16, 8          # text tokens, text width, pooled width

# Qwen/Qwen-Image's scheduler/scheduler_config.json (dynamic exponential shift, stretched to 0.02)
QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                      shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
# FLUX.2's: mu comes from the pipeline
FLUX2_SCHEDULER = dict(use_dynamic_shifting=True, time_shift_type="exponential", shift=3.0)


def tiny_sd3(seed=0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=H, patch_size=2, in_channels=C, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=D, caption_projection_dim=16,
                                 pooled_projection_dim=DP, out_channels=C, pos_embed_max_size=16,
                                 dual_attention_layers=(0,), qk_norm="rms_norm")


def tiny_flux(seed=0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=4 * C, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=D,
                                  pooled_projection_dim=DP, guidance_embeds=True, axes_dims_rope=(2, 2, 4))


def tiny_qwen(seed=0) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=4 * C, out_channels=C, num_layers=2,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=D,
                                       axes_dims_rope=(2, 2, 4))


def tiny_qwen_vae() -> AutoencoderKLQwenImage:
    """Qwen-Image's video VAE at 8x (3 spatial downsamplings, as the real one), with its per-channel normalisation."""
    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=C, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                  latents_std=[1.5, 0.7, 1.1, 0.9])


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8,) * 4, layers_per_block=1,
                         latent_channels=C, norm_num_groups=4, sample_size=32, scaling_factor=1.5305,
                         shift_factor=0.0609)


def tiny_flux2(seed=0, guidance=True) -> Flux2Transformer2DModel:
    """FLUX.2 [dev] (``guidance``: embedded guidance) or [klein] on latents of ``4 C`` channels (2x2-patchified)."""
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(patch_size=1, in_channels=4 * C, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=D,
                                   timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=guidance)


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    """FLUX.2's VAE at 8x, its batch norm over the 2x2-patchified latents given non-trivial running statistics."""
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), latent_channels=C, norm_num_groups=4, layers_per_block=1)
    vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, 4 * C))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 4 * C))
    return vae.eval()


def tiny_wan(seed=0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=C,
                                 out_channels=C, text_dim=D, freq_dim=16, ffn_dim=32, num_layers=2,
                                 rope_max_seq_len=32)


def tiny_wan_vae() -> AutoencoderKLWan:
    """Wan's video VAE at 8x spatial and 4x temporal compression (as the real one), with its per-channel
    normalisation."""
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=C, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                            latents_std=[1.5, 0.7, 1.1, 0.9])


def embeds(seed=0, prompts=("a red cube", "a blue ball"), family="sd3") -> tuple[PromptEmbeddings, PromptEmbeddings]:
    """One row per sample (each prompt twice) and the negative prompt. SD3 / FLUX: L tokens each, pooled embeddings;
    Qwen-Image: no pooled embedding and a token count of each prompt's own (L, L - 2, ...; the negative prompt 2),
    padded with a mask."""
    g = torch.Generator().manual_seed(seed)
    if family == "qwen_image":
        cond = PromptEmbeddings.cat([PromptEmbeddings(torch.randn(1, L - 2 * (i % 2), D, generator=g), None, [p])
                                     for i, p in enumerate(prompts)])
        neg = PromptEmbeddings(torch.randn(1, 2, D, generator=g), None, [" "])
    else:
        cond = PromptEmbeddings(torch.randn(len(prompts), L, D, generator=g),
                                torch.randn(len(prompts), DP, generator=g), list(prompts))
        neg = PromptEmbeddings(torch.randn(1, L, D, generator=g), torch.randn(1, DP, generator=g), [""])
    return cond.select([0, 0, 1, 1]), neg


def tiny_clip_text_encoder(seed=0):
    """A character-level CLIP tokenizer and a 1-layer CLIPTextModelWithProjection (SD3's two text encoders)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    tok = tiny_clip_tokenizer(CLIPTokenizer, vocab)
    cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=D // 2, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=DP // 2,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    return tok, CLIPTextModelWithProjection(cfg)


def tiny_qwen_text_encoder():
    """A byte-level Qwen2 tokenizer (the 256 byte symbols, no merges) and a 1-layer Qwen2.5-VL of width D."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    n = len(vocab)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=D, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=n,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=D),
        vocab_size=n, vision_start_token_id=n, vision_end_token_id=n + 1, vision_token_id=n + 2, image_token_id=n + 3,
        video_token_id=n + 4)
    torch.manual_seed(0)
    return tok, Qwen2_5_VLForConditionalGeneration(cfg).eval()


def save_sd3_pipeline(path: Path) -> Path:
    """A tiny random SD3 pipeline (2 tiny CLIP text encoders, no T5) saved as a local diffusers directory."""
    tok, te = tiny_clip_text_encoder(0)
    tok2, te2 = tiny_clip_text_encoder(1)
    pipe = StableDiffusion3Pipeline(transformer=tiny_sd3(), vae=tiny_vae(),
                                    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    text_encoder=te, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok2,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(path)
    return path


def save_qwen_pipeline(path: Path) -> Path:
    """A tiny random Qwen-Image pipeline with its text encoder and tokenizer, saved as a local diffusers directory."""
    tok, te = tiny_qwen_text_encoder()
    pipe = QwenImagePipeline(transformer=tiny_qwen(), vae=tiny_qwen_vae(), text_encoder=te, tokenizer=tok,
                             scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER))
    pipe.save_pretrained(path)
    return path
