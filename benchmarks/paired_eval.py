"""Did GRPO raise the test reward? A paired comparison of two checkpoints on the test prompts.

Both checkpoints sample the same test prompts from the same seeded noise (ODE, as ``jagg eval``); per prompt the
mean reward of its images is taken, and the difference after - before is reported with its standard error
over prompts and a bootstrap 95% interval (resampling prompts), for all test prompts, the prompts built from
colour+shape pairs seen in pretraining and those using a held-out pair. Pairing removes most of the
evaluation noise that separate ``jagg eval`` runs would carry. Usage::

    python benchmarks/paired_eval.py BEFORE AFTER [--images-per-prompt 4] [--json PATH]
    python benchmarks/paired_eval.py builtin:tiny_dit runs/default/checkpoints/ckpt_000200.pt
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from jagg.shapes.weights import load_model
from jagg.shapes.evaluation import generate
from jagg.rewards import get_reward
from jagg.shapes import test_prompts
from jagg.shapes.scene import uses_held_out


def per_prompt_rewards(checkpoint: str, prompts: list[str], images: int, args) -> np.ndarray:
    """-> float [len(prompts)]: each prompt's mean reward over its `images` samples."""
    batch = [p for p in prompts for _ in range(images)]
    x = generate(load_model(checkpoint), batch, args.steps, args.guidance_scale, args.seed, args.shift)
    scores, _ = get_reward(args.reward)(x, batch, None)
    return np.asarray(scores, dtype=np.float64).reshape(len(prompts), images).mean(1)  # [P, images] -> [P]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="checkpoint: builtin:tiny_dit, a .safetensors, a training .pt or a run dir")
    ap.add_argument("after", help="checkpoint compared against `before`")
    ap.add_argument("--images-per-prompt", type=int, default=4, help="images per test prompt [default: 4]")
    ap.add_argument("--steps", type=int, default=10, help="ODE steps [default: 10]")
    ap.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale [default: 1.0, the main job's]")
    ap.add_argument("--shift", type=float, default=1.0, help="timestep shift [default: 1.0]")
    ap.add_argument("--seed", type=int, default=1234, help="noise seed [default: 1234, the trainer's eval seed]")
    ap.add_argument("--reward", default="geneval", help="reward name or module:function [default: geneval]")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples [default: 2000]")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.images_per_prompt < 1 or args.bootstrap < 1:
        ap.error("--images-per-prompt and --bootstrap must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = test_prompts()
    held = np.array([uses_held_out(p) for p in prompts])
    before, after = (per_prompt_rewards(c, prompts, args.images_per_prompt, args) for c in (args.before, args.after))
    rng = np.random.default_rng(0)
    out = {}
    for name, mask in (("all", np.ones_like(held)), ("seen_pairs", ~held), ("held_out_pairs", held)):
        d = after[mask] - before[mask]
        boot = d[rng.integers(0, len(d), (args.bootstrap, len(d)))].mean(1)
        out[name] = {"prompts": int(mask.sum()), "before": float(before[mask].mean()),
                     "after": float(after[mask].mean()), "diff": float(d.mean()),
                     "se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan"),
                     "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}
        r = out[name]
        print(f"{name:>15} ({r['prompts']} prompts): {r['before']:.3f} -> {r['after']:.3f}  "
              f"diff {r['diff']:+.3f} +- {r['se']:.3f}  95% [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**vars(args), "results": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
