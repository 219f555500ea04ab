"""Benchmarks: ``jagg bench speed | fidelity | quality | e2e | signal | meter | paired`` (docs/benchmarks.md).

Every benchmark computes gradients with :func:`jagg.policy_gradient`, the function the trainer calls. Every one has
``--json PATH``, checked before any work and never replacing an existing file without ``--overwrite``
(:func:`jagg.checks.check_output_file`).
"""

from __future__ import annotations

import argparse
from typing import Callable

from ..arguments import overwrite_argument
from ..checks import check_output_file


def _output_checked(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` after the check of its ``--json`` file (before any work)."""
    def checked(args: argparse.Namespace) -> int:
        if args.json is not None:
            check_output_file(args.json, "--json", args.overwrite)
        return run(args)
    return checked


def add_bench_parser(sub) -> None:
    """Add ``bench`` and its sub-commands to the ``jagg`` argparse sub-parsers ``sub``."""
    from . import e2e, fidelity, meter, paired, quality, signal, speed

    b = sub.add_parser(
        "bench", help="benchmarks: speed, fidelity, quality, e2e, signal, meter, paired",
        description="Evidence for JAGG, each through jagg.policy_gradient (the trainer's function):\n"
                    "  speed     exact vs JAGG seconds per training phase, against the cost model\n"
                    "  fidelity  cosine / relative error of the JAGG gradient vs exact; the routing study\n"
                    "  quality   GRPO runs x paired seeds (default: exact and the config's estimator; --variant for\n"
                    "            others): reward vs updates and time\n"
                    "  e2e       whole GRPO iterations (sampling + reward + training) exact vs JAGG, round-robin\n"
                    "  signal    agreement of gradients from independent batches: is there anything to learn?\n"
                    "  meter     each estimator's error against the update's own noise: efficiency vs exact and vs\n"
                    "            random timestep subsampling at equal rows\n"
                    "  paired    did GRPO raise the test reward? two checkpoints paired over the test prompts\n"
                    "Each has --quick (a smoke-sized run) and --json PATH. See docs/benchmarks.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="{speed,fidelity,quality,e2e,signal,meter,paired}")
    speed.add_parser(bsub)
    fidelity.add_parser(bsub)
    quality.add_parser(bsub)
    e2e.add_parser(bsub)
    signal.add_parser(bsub)
    meter.add_parser(bsub)
    paired.add_parser(bsub)
    for p in bsub.choices.values():
        if p.get_default("overwrite") is None:            # bench paired has its own (benchmarks/paired_eval.py)
            overwrite_argument(p, "the --json file (quality: also its --plot)")
        p.set_defaults(func=_output_checked(p.get_default("func")))
