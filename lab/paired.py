"""``python -m lab paired``: did GRPO raise the test reward? A paired comparison of two checkpoints on the test prompts.

Both checkpoints sample the same test prompts from the same seeded noise (ODE, as ``jagg eval``); per prompt the
mean reward of its images is taken, and the difference after - before is reported with its standard error
over prompts and a bootstrap 95% interval (resampling prompts, :mod:`lab.statistics`), for all test prompts, the prompts built from
colour+shape pairs seen in pretraining and those using a held-out pair. Pairing removes most of the
evaluation noise that separate ``jagg eval`` runs would carry. The defaults are the main job's evaluation settings,
and the sampling options are ``jagg eval``'s (they refuse the same values); ``--quick`` only fills the options not
given.

    python -m lab paired BEFORE AFTER [--images-per-prompt 4] [--json PATH]
    python -m lab paired builtin:tiny_dit runs/default/checkpoints/ckpt_000200.pt
"""

from __future__ import annotations

import argparse

import numpy as np

from jagg.arguments import (check_sampling, evaluation_arguments, main_job_defaults, overwrite_argument,
                         sampling_arguments)
from jagg.checks import check_output_file, number_arg
from jagg.rewards import get_reward
from jagg.shapes import test_prompts
from jagg.shapes.evaluation import generate
from jagg.shapes.scene import uses_held_out
from jagg.shapes.weights import load_model
from jagg.bench.common import set_threads
from jagg.infra.atomic import write_json
from lab.statistics import BOOTSTRAP, interval, resamples


def per_prompt_rewards(checkpoint: str, prompts: list[str], images: int, args: argparse.Namespace,
                       reward) -> np.ndarray:
    """-> float [len(prompts)]: each prompt's mean ``reward`` over its ``images`` samples."""
    batch = [p for p in prompts for _ in range(images)]
    x = generate(load_model(checkpoint), batch, args.steps, args.guidance_scale, args.seed, args.shift)
    scores, _ = reward(x, batch, None)
    return np.asarray(scores, dtype=np.float64).reshape(len(prompts), images).mean(1)  # [P, images] -> [P]


def compare(args: argparse.Namespace) -> dict:
    """The paired difference after - before per split (``all``, ``seen_pairs``, ``held_out_pairs``): prompts,
    before, after, diff, its standard error over prompts and a bootstrap 95% interval; printed as it goes."""
    prompts = test_prompts()
    held = np.array([uses_held_out(p) for p in prompts])
    reward = get_reward(args.reward)
    before, after = (per_prompt_rewards(c, prompts, args.images_per_prompt, args, reward)
                     for c in (args.before, args.after))
    out = {}
    for name, mask in (("all", np.ones_like(held)), ("seen_pairs", ~held), ("held_out_pairs", held)):
        d = after[mask] - before[mask]
        boot = d[resamples(len(d), args.bootstrap)].mean(1)       # the benchmarks' one bootstrap, over prompts
        out[name] = {"prompts": int(mask.sum()), "before": float(before[mask].mean()),
                     "after": float(after[mask].mean()), "diff": float(d.mean()),
                     "se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan"),
                     "ci95": list(interval(boot))}
        r = out[name]
        print(f"{name:>15} ({r['prompts']} prompts): {r['before']:.3f} -> {r['after']:.3f}  "
              f"diff {r['diff']:+.3f} +- {r['se']:.3f}  95% [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]")
    return out


QUICK = {"images_per_prompt": 1, "steps": 2, "bootstrap": 50}       # --quick: a smoke-sized comparison


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options not given: ``--quick``'s smoke sizes (never over an explicit value), then the main job's
    evaluation settings (:func:`jagg.arguments.main_job_defaults`); returns ``args``."""

    for k, v in (QUICK if args.quick else {"bootstrap": BOOTSTRAP}).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    main_job_defaults(args, eval_seed=True)
    from jagg.infra.sizes import check_memory

    prompts = len(test_prompts())
    check_sampling(args, 2 * prompts * args.images_per_prompt, f"two checkpoints x {prompts} test prompts x "
                   f"--images-per-prompt {args.images_per_prompt}", "lower --images-per-prompt")
    check_memory(8.0 * args.bootstrap * prompts, f"--bootstrap {args.bootstrap}: the resamples' indices "
                 f"({args.bootstrap} x {prompts} prompts, int64)", "lower --bootstrap (2000 is plenty for a 95% interval)")
    return args


def run(args: argparse.Namespace) -> int:
    """The command: fill the options not given (:func:`resolve`), check the ``--json`` file, compare, print, and
    write ``--json``."""
    resolve(args)
    if args.json is not None:
        check_output_file(args.json, "--json", args.overwrite)
    set_threads(args.threads)
    out = compare(args)
    if args.json is not None:
        write_json(args.json, {**{k: v for k, v in vars(args).items() if k != "func"}, "results": out})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command's arguments (``python -m lab paired``): the sampling
    and evaluation options are ``jagg eval``'s (:func:`jagg.arguments.sampling_arguments`)."""

    p.add_argument("before", help="checkpoint: builtin:tiny_dit, a .safetensors, a training .pt or a run dir")
    p.add_argument("after", help="checkpoint compared against `before`")
    sampling_arguments(p, checkpoint=False)
    evaluation_arguments(p)
    p.add_argument("--bootstrap", type=number_arg(int, 1), help=f"bootstrap resamples [default: {BOOTSTRAP}]")
    p.add_argument("--threads", type=number_arg(int, 0), default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--json", help="also write the results to this JSON file")
    overwrite_argument(p, "--json")
    p.add_argument("--quick", action="store_true", help="a smoke-sized comparison: 1 image per prompt, 2 ODE steps, "
                   "50 bootstrap resamples (the options not given; the ones given are kept)")
    p.set_defaults(func=run)
    return p


def add_parser(sub) -> None:
    add_arguments(sub.add_parser("paired", help="did GRPO raise the test reward? two checkpoints, paired over the "
                                 "test prompts, with intervals", description=__doc__.replace("``", ""),
                                 formatter_class=argparse.RawDescriptionHelpFormatter))
