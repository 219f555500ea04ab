"""``python -m lab e2e``: one whole GRPO iteration (sampling + reward + training), exact vs JAGG, side by side.

One :class:`jagg.trainers.shapes_trainer.ShapesGRPO` per variant (the trainer's iteration, in memory: no run directory) is
built from the same config (the main job or ``--config``, plus ``--set``) and seed; their iterations then run
round-robin in one process (``exact``, ``jagg``, ``exact``, ``jagg``, ... after one warm-up iteration each), so a
busy stretch of the machine slows every variant alike.
Reported per variant: the median seconds of sampling ``S``, reward ``R``, training ``T`` and the whole
iteration, the iteration ratio exact / variant, and its ideal

    ideal = (S + R + T) / (S + R + T / limit)

from the exact trainer's medians and the cost-model limit of the variant (docs/design.md §3, ``B = 2F``, the config's
trained steps, window, routed fraction and exact first/last intervals): what the ratio would be if sampling and
rewards stayed as they are and training shrank by exactly the cost model.
"""

from __future__ import annotations

import argparse
import statistics

from jagg.arguments import config_arguments
from jagg.infra import config_loader as configuration
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.checks import check_no_repeats, number_arg
from jagg.bench.common import json_if_asked, table
from jagg.cost import estimator_limit
from lab.fixed_keys import OVERWRITTEN, refuse_fixed_keys

VARIANTS = {
    "exact": ["estimator.mode=exact"],
    "jagg_fresh": ["estimator.mode=jagg", "estimator.intermediate=fresh"],
    "jagg_interp": ["estimator.mode=jagg", "estimator.intermediate=interp"],
}
KEYS = ("sample_s", "reward_s", "train_s", "iter_s")
QUICK_SETS = ["sample.prompts_per_iter=2"]           # --quick: 2 prompt groups of the config's size, 2 iterations


def routed_limit(cfg: ShapesTrainConfig) -> float:
    """:func:`~jagg.cost.estimator_limit` (``B = 2F``) of the config's estimator on its trained steps: knot
    layout, window, routed fraction, exact first/last intervals, the correction and interval subsampling; with
    ``intermediate: auto`` all but the first of an iteration's updates run ``fresh``."""
    steps = cfg.sample.sde_steps(cfg.sample.num_steps)[0]     # a sliding SDE window has the same size throughout
    updates = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    return estimator_limit(cfg.estimator, int(steps.numel()), off_policy_share=(updates - 1) / updates)


def run_e2e(config: str | None, sets: list[str], variants: list[str], iterations: int) -> list[dict]:
    """Per variant: the median phase seconds of ``iterations`` round-robin iterations after a warm-up (module
    docstring)."""
    from jagg.trainers.shapes_trainer import ShapesGRPO

    if iterations < 1:
        raise ValueError(f"--iterations must be >= 1; got {iterations}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    check_no_repeats(list(variants), "--variants")
    cfgs = {v: configuration.load(ShapesTrainConfig, config, list(sets) + VARIANTS[v]) for v in variants}
    trainers = {v: ShapesGRPO(cfg) for v, cfg in cfgs.items()}
    times = {v: {k: [] for k in KEYS} for v in variants}
    backward = {v: [] for v in variants}
    for it in range(iterations + 1):                       # iteration 0 is the warm-up
        for v, t in trainers.items():
            rec = t.step()
            if it:
                for k in KEYS:
                    times[v][k].append(rec[k])
                backward[v].append(rec.get("backward_items", 0))
    med = {v: {k: statistics.median(xs) for k, xs in times[v].items()} for v in variants}
    out = []
    ex = med.get("exact")
    for v in variants:
        m = med[v]
        lim = routed_limit(trainers[v].cfg)
        rec = {"variant": v, "iterations": iterations, "limit": lim, **m,
               "backward_items": statistics.fmean(backward[v])}
        if ex is not None:
            sr = ex["sample_s"] + ex["reward_s"]
            rec["iter_ratio"] = ex["iter_s"] / m["iter_s"]
            rec["train_ratio"] = ex["train_s"] / m["train_s"]
            rec["iter_ratio_ideal"] = (sr + ex["train_s"]) / (sr + ex["train_s"] / lim)
            rec["fraction_of_ideal"] = (rec["iter_ratio"] - 1) / (rec["iter_ratio_ideal"] - 1) \
                if rec["iter_ratio_ideal"] > 1 else None
        out.append(rec)
    return out


COLUMNS = [("variant", "variant", ""), ("sample_s", "sample s", ".3f"), ("reward_s", "reward s", ".3f"),
           ("train_s", "train s", ".3f"), ("iter_s", "iter s", ".3f"), ("backward_items", "bwd rows", ".0f"),
           ("train_ratio", "train ratio", ".2f"), ("limit", "limit", ".2f"), ("iter_ratio", "iter ratio", ".2f"),
           ("iter_ratio_ideal", "ideal", ".2f")]


def _run(args: argparse.Namespace) -> int:
    variants = args.variants or ["exact", "jagg_interp"]
    if "exact" not in variants:
        variants = ["exact", *variants]
    iterations = args.iterations if args.iterations is not None else (2 if args.quick else 20)
    refuse_fixed_keys(args.set, dict.fromkeys(sorted({v.split("=")[0] for sets in VARIANTS.values() for v in sets}),
                                              "its variants (--variants)"), "python -m lab e2e", OVERWRITTEN)
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    records = run_e2e(args.config, sets, variants, iterations)
    print(f"median seconds over {iterations} round-robin iterations per variant (after a warm-up)")
    print(table(records, COLUMNS))
    json_if_asked(args.json, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("e2e", help="whole GRPO iterations exact vs JAGG, round-robin: ratio vs its ideal",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(p, "the job every variant runs")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   help="variants besides exact (always included) [default: exact jagg_interp]")
    p.add_argument("--iterations", type=number_arg(int, 1),
                   help="timed iterations per variant [default: 20; 2 with --quick]")
    p.add_argument("--json", help="also write the records to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke-sized run: 2 timed iterations, {' '.join(QUICK_SETS)} (before --set)")
    p.set_defaults(func=_run)
