"""Tiny random CLIP models built offline: a character-level CLIP tokenizer, and the preference rewards' CLIPModel
with its CLIPProcessor saved as a model directory (:func:`save_tiny_clip`). Importing this module needs transformers:
a test module calls ``pytest.importorskip("transformers")`` first."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers

WIDTH, EMBED, SIDE, PATCH = 16, 8, 32, 8      # the reward CLIP's width, embedding size, image side and patch size


def tiny_clip_tokenizer(cls, vocab: dict, tmp_dir: Path | None = None):
    """A character-level CLIP tokenizer (transformers >= 5 takes the vocab directly; 4.x reads files, written to
    ``tmp_dir``)."""
    try:
        return cls(vocab=vocab, merges=[], model_max_length=77)
    except TypeError:
        d = Path(tmp_dir or tempfile.mkdtemp())
        (d / "vocab.json").write_text(json.dumps(vocab))
        (d / "merges.txt").write_text("#version: 0.2\n")
        return cls(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt"), model_max_length=77)


def tiny_vocab() -> dict:
    """Characters, then CLIP's start and end tokens with the highest ids (as in CLIP's vocabulary, where open_clip pools
    the text at the highest id, the end token)."""
    vocab = {}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def save_tiny_clip(path, seed=0):
    """A tiny random CLIPModel (exact GELU and a 4x MLP: open_clip's ViT) with its CLIPProcessor, saved to ``path``."""
    vocab = tiny_vocab()
    n = len(vocab)
    tok = tiny_clip_tokenizer(transformers.CLIPTokenizer, vocab, path)
    proc = transformers.CLIPProcessor(image_processor=transformers.CLIPImageProcessor(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}), tokenizer=tok)
    layer = dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=2, num_attention_heads=2,
                 hidden_act="gelu")
    cfg = transformers.CLIPConfig(text_config=dict(layer, vocab_size=n, max_position_embeddings=77,
                                                   bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1),
                                  vision_config=dict(layer, image_size=SIDE, patch_size=PATCH), projection_dim=EMBED)
    torch.manual_seed(seed)
    transformers.CLIPModel(cfg).save_pretrained(path)
    proc.save_pretrained(path)
    return path
