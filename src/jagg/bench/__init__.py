"""What a user runs to decide: ``jagg bench meter | speed`` (docs/benchmarks.md).

- ``meter``: each estimator's error against the noise an update already carries, on the user's own config, and the
  verdict: which estimator to train with;
- ``speed``: seconds per training phase, exact against JAGG, on the user's hardware, against the cost model.

Both compute gradients with :func:`jagg.policy_gradient`, the function the trainers call. Each has ``--json PATH``,
checked before any work and never replacing an existing file without ``--overwrite``
(:func:`jagg.checks.check_output_file`). The team's research tools (paired seeds, fidelity and signal studies) live
in the repository's ``lab/``, outside the package, and register their commands with :func:`add_tools`.
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


def add_tools(sub, modules) -> None:
    """Add each module's sub-command (``module.add_parser(sub)``) to the argparse sub-parsers ``sub``, each with
    ``--overwrite`` (where it has none of its own) and its ``--json`` checked before any work."""
    for module in modules:
        module.add_parser(sub)
    for p in sub.choices.values():
        if p.get_default("overwrite") is None:
            overwrite_argument(p, "the --json file")
        p.set_defaults(func=_output_checked(p.get_default("func")))


def add_bench_parser(sub) -> None:
    """Add ``bench`` and its sub-commands to the ``jagg`` argparse sub-parsers ``sub``."""
    from . import meter_command, speed_command

    b = sub.add_parser(
        "bench", help="decide on your model: meter (which estimator pays), speed (seconds per training phase)",
        description="Measure on your own config, each through jagg.policy_gradient (the trainer's function):\n"
                    "  meter     each estimator's error against the update's own noise, and the progress per second\n"
                    "            it projects against exact's\n"
                    "  speed     exact vs JAGG seconds per training phase, against the cost model\n"
                    "Each has --quick (a smoke-sized run) and --json PATH. See docs/benchmarks.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="{meter,speed}")
    add_tools(bsub, [meter_command, speed_command])
