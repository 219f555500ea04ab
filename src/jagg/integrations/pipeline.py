"""A local diffusers model directory: its checks, loading it, and the prompt-embedding cache builder.

Weights are never downloaded: ``path`` must be a local diffusers model directory (``model_index.json`` plus a
``transformer/`` subfolder), e.g. made with ``huggingface-cli download stabilityai/stable-diffusion-3.5-medium
--local-dir /models/sd3.5-medium`` on a machine with internet access. The text encoders (T5-XXL is ~9 GB in bf16,
Qwen-Image's Qwen2.5-VL-7B ~16 GB) are only needed to embed prompts: precompute a prompt-embedding cache once::

    python -m jagg.integrations.pipeline cache --config <yaml> --prompts <file> --out <cache.safetensors>

and point ``pipeline.prompt_cache`` at it; the text encoders are then not loaded at all. The policy built on the
loaded pipeline (trainable weights, reference, prompts, velocity, decoding) is
:class:`jagg.integrations.policy.Policy`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from torch import nn

from ..checks import check_output_file
from ..infra.prompt_sets import read_prompt_set
from .config import DTYPES, PipelineConfig, load_pipeline_config
from .model_dir import ModelFiles, check_model, check_model_dir  # noqa: F401  (check_model_dir: re-exported)
from .velocity_adapters import encode_prompts

TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")


def _components(config: PipelineConfig) -> tuple[type, set[str]]:
    """The family's diffusers pipeline class and the components it takes."""
    import diffusers

    cls = getattr(diffusers, config.record.pipeline_class)
    return cls, set(cls._get_signature_keys(cls)[0])


def load_pipeline(config: PipelineConfig, skip: Sequence[str] = (), checked: ModelFiles | None = None):
    """The diffusers pipeline from ``config.path`` (no transformer changes, on CPU). Text encoders / tokenizers are
    skipped unless needed (see ``load_text_encoders``); components missing from the directory or named in ``skip``
    load as None. ``checked``: what :func:`jagg.integrations.model_dir.check_model` returned for this config, when
    the caller checked the directory already (else it is checked here)."""
    import diffusers

    index = (checked or check_model(config)).index
    cls, expected = _components(config)
    load_text = config.load_text_encoders if config.load_text_encoders is not None else config.prompt_cache is None
    none = {name: None for name in expected if name not in index or index[name] in (None, [None, None])}
    none.update({name: None for name in skip if name in expected})
    if not load_text:
        none.update({name: None for name in TEXT_COMPONENTS if name in expected})
    # recent diffusers name the argument `dtype` (and deprecate `torch_dtype`); older versions only know torch_dtype
    new_api = hasattr(getattr(diffusers.utils, "deprecation_utils", None), "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    dtype = DTYPES[config.dtype]                                                       # checked by PipelineConfig
    if new_api:                                   # the VAE loaded in its own dtype (not cast after: its fp32 modules)
        dtype_kw = {"dtype": {"default": dtype, "vae": DTYPES[config.vae_dtype]}}
    else:
        dtype_kw = {"torch_dtype": dtype}
    pipe = cls.from_pretrained(str(Path(config.path).expanduser()), **dtype_kw, **none)
    if getattr(pipe, "vae", None) is not None and pipe.vae.dtype != DTYPES[config.vae_dtype]:
        pipe.vae.to(DTYPES[config.vae_dtype])
    return pipe


# ----------------------------------------------------------------------------------------------------------------
# python -m jagg.integrations.pipeline cache --config <yaml> --prompts <txt> --out <cache>
# ----------------------------------------------------------------------------------------------------------------


def build_prompt_cache(config: PipelineConfig, prompts: Sequence[str], out: str | Path, batch_size: int = 16) -> Path:
    """Embed ``prompts`` (plus the negative prompt) with the model's text encoders and write the cache file."""
    cfg = dataclasses.replace(config, prompt_cache=None, load_text_encoders=True)
    index = check_model_dir(cfg.path, cfg.family)
    # a pipeline that takes a third text encoder (SD3's T5) the directory lacks reads its width from the transformer
    # config; otherwise the transformer is not needed
    need_transformer = "text_encoder_3" in _components(cfg)[1] and index.get("text_encoder_3") in (None, [None, None])
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
    """``python -m jagg.integrations.pipeline cache ...``; returns 0, or 2 after printing what is wrong."""
    ap = argparse.ArgumentParser(prog="python -m jagg.integrations.pipeline",
                                 description="Precompute a prompt-embedding cache with the model's text encoders.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cache", help="embed prompts (a .txt or .jsonl prompt set) into a .safetensors/.pt cache")
    c.add_argument("--config", required=True, help="YAML with a pipeline: section (e.g. configs/sd35_medium.yaml)")
    c.add_argument("--prompts", required=True, help="the prompts: a .txt (one a line) or a .jsonl (a 'prompt' field "
                   "a line), as sample.prompts_file")
    c.add_argument("--out", required=True, help="cache file to write (.safetensors or .pt)")
    c.add_argument("--batch-size", type=int, default=16, help="prompts per text-encoder call (default 16)")
    c.add_argument("--path", default=None, help="override pipeline.path")
    c.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args(argv)
    try:
        check_output_file(args.out, "--out", args.overwrite, (".safetensors", ".pt", ".pth"))
        cfg = load_pipeline_config(args.config, {"path": args.path} if args.path else None)
        prompts = read_prompt_set(args.prompts, "--prompts").prompts
        out = build_prompt_cache(cfg, prompts, args.out, args.batch_size)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(set(prompts))} prompt embeddings (+ negative prompt) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
