"""`python -m lab paired`: did GRPO raise the test reward? two checkpoints, paired over the test prompts."""

import json

import pytest
import torch

from lab.__main__ import main


def test_bench_paired(tiny_ckpt, tmp_path):
    """python -m lab paired: a checkpoint against itself differs
    by exactly 0; against another model the difference is non-zero, inside its interval, and the whole split is the
    prompt-weighted mean of its parts."""
    import argparse

    from lab import paired
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    js_same = tmp_path / "same.json"
    assert main(["paired", tiny_ckpt, tiny_ckpt, "--quick", "--json", str(js_same)]) == 0
    same = json.loads(js_same.read_text())["results"]
    assert all(r["diff"] == 0 and r["ci95"] == [0, 0] for r in same.values())
    assert same["all"]["prompts"] == same["seen_pairs"]["prompts"] + same["held_out_pairs"]["prompts"] == 69

    torch.manual_seed(1)
    other = tmp_path / "other.safetensors"
    m = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, dim=32, depth=1, heads=2, text_dim=16, text_depth=1,
                          text_heads=2, patch_size=8))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)          # a non-zero output layer: images differ from tiny_ckpt's
    save_pretrained(m, other)
    js = tmp_path / "paired.json"
    args = [tiny_ckpt, str(other), "--images-per-prompt", "1", "--steps", "2", "--reward", "jpeg_compressibility"]
    assert main(["paired", *args, "--json", str(js)]) == 0
    r = paired.compare(paired.resolve(paired.add_arguments(argparse.ArgumentParser()).parse_args(args)))
    a, s, h = r["all"], r["seen_pairs"], r["held_out_pairs"]
    assert a["diff"] != 0 and a["ci95"][0] <= a["diff"] <= a["ci95"][1]
    assert abs(a["diff"] * 69 - s["diff"] * s["prompts"] - h["diff"] * h["prompts"]) < 1e-9
    assert json.loads(js.read_text())["results"]["all"]["diff"] == pytest.approx(a["diff"])
