import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/toy.py
torch.set_num_threads(1)  # tiny models: threads only add contention (30-60x slower on a busy 2-core box)

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny random TinyDiT checkpoint (fast to sample and train)."""
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, dim=32, depth=1, heads=2, text_dim=16,
                              text_depth=1, text_heads=2, patch_size=8))
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_pretrained(model, path)
    return str(path)


def real_model_config(tmp_path, model_dir: str = "model"):
    """A real-model (`pipeline:`) trainer config whose model directory ``tmp_path/model_dir`` does not exist: enough
    for the CLI's parsing, help and run-directory paths, which come before the model is loaded."""
    (tmp_path / "prompts.txt").write_text("a red cube\na blue ball\n")
    cfg = tmp_path / "real.yaml"
    cfg.write_text(f"pipeline: {{family: sd3, path: {tmp_path / model_dir}, num_steps: 4}}\n"
                   f"reward: {{name: jpeg_compressibility}}\n"
                   f"sample: {{prompts_file: {tmp_path / 'prompts.txt'}, prompts_per_iter: 2, group_size: 2}}\n")
    return cfg


def tiny_train_args(ckpt: str, out, iterations: int = 3, *extra: str) -> list[str]:
    """`jagg train` arguments for a seconds-long run."""
    sets = [f"model.checkpoint={ckpt}", f"grpo.iterations={iterations}", "sample.num_steps=4",
            "sample.prompts_per_iter=2", "sample.group_size=2", "sample.sde_window=null", "eval.every=2", "eval.num_prompts=4",
            "eval.images_per_prompt=1", "eval.num_steps=3", "eval.grid_size=4", "log.checkpoint_every=1",
            "log.progress=false", "estimator.micro_batch=4", "estimator.window=2", "grpo.drop_zero_spread=false",
            "optim.lr=0.01", "threads=1", "model.trainable=all", "reward.weights=null", "estimator.exact_last_intervals=0",
            *extra]
    return ["train", "--output-dir", str(out)] + [a for s in sets for a in ("--set", s)]
