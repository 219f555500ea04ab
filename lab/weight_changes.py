"""Which of a GRPO run's weight changes carry its gain, and which its artifacts (lab/README.md).

Loads a shapes-trainer checkpoint and the model it started from, then evaluates the start, the trained weights, and,
for each --keep REGEX, the start with only the changes of the parameters whose names match REGEX applied (the others
left at the start). Each on the held-out test prompts, the same noise for all: the GenEval-like score and the
background measure (``background_rms``: 0 on rendered scenes, a patch grid raises it).

    python -m lab weight-changes runs/full_ft/checkpoints/ckpt_000200.pt --keep '^text' --keep '^blocks'
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from jagg.arguments import overwrite_argument
from jagg.checks import check_output_file, number_arg
from jagg.shapes import test_prompts
from jagg.shapes.evaluation import background_rms, generate
from jagg.shapes.geneval import GenevalReward
from jagg.shapes.weights import load_model
from jagg.infra.checkpoint import read_checkpoint


def changes(start: dict, trained: dict, keep: str) -> dict:
    """``start`` with the tensors whose names match ``keep`` taken from ``trained``."""
    pattern = re.compile(keep)
    return {k: (trained[k] if pattern.search(k) else v) for k, v in start.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab weight-changes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a shapes-trainer checkpoint .pt (its raw weights, not the EMA)")
    p.add_argument("--start", default="builtin:tiny_dit", help="the model the run started from [builtin:tiny_dit]")
    p.add_argument("--keep", action="append", default=[], metavar="REGEX",
                   help="apply only the changes of the parameters matching REGEX (repeatable)")
    p.add_argument("--images-per-prompt", type=number_arg(int, 1), default=4, help="[4]")
    p.add_argument("--seed", type=number_arg(int, 0), default=1234, help="the evaluation noise [1234]")
    p.add_argument("--json", help="also write the rows to this file")
    overwrite_argument(p, "--json")
    args = p.parse_args(argv)
    for keep in args.keep:
        try:
            re.compile(keep)
        except re.error as e:
            p.error(f"--keep {keep!r}: not a regular expression ({e})")
    try:
        if args.json:
            check_output_file(args.json, "--json", args.overwrite)
        trained = read_checkpoint(args.checkpoint)["model"]
        model = load_model(args.start, use_ema=True).eval()
    except (OSError, ValueError, KeyError) as e:
        p.error(f"{e}")
    torch.set_num_threads(1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    missing = sorted(set(start) ^ set(trained))
    if missing:
        p.error(f"{args.checkpoint} and {args.start} differ in their parameters ({missing[:3]} ...): not one run's")
    prompts = [q for q in test_prompts() for _ in range(args.images_per_prompt)]
    reward = GenevalReward()
    rows = []
    for name, weights in [("start", start), ("trained", trained)] + [(f"keep {k}", changes(start, trained, k))
                                                                     for k in args.keep]:
        model.load_state_dict(weights)
        images = generate(model, prompts, 10, 1.0, args.seed)
        rows.append({"weights": name, "test_reward": float(reward(images, prompts)[0].mean()),
                     "background_rms": float(background_rms(images).mean())})
        print(f"{name:40s} test reward {rows[-1]['test_reward']:.3f}  background_rms {rows[-1]['background_rms']:.2f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
