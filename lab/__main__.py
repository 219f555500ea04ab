"""``python -m lab TOOL ...``: the lab's tools (lab/README.md), run from the repository's root.

Tools with a ``--json`` result (``quality``, ``fidelity``, ``signal``, ``e2e``, ``paired``) share one parser and the
``jagg`` commands' conventions (``--quick``, ``--json`` checked before any work, ``--overwrite``); the scripts
(``plateau``, ``regime-map``, ``weight-changes``, ``trace-file-changes``, ``profile-training``) parse their own
arguments. Every tool ends as a ``jagg`` command does: a refusal is one line and exit 2, Ctrl-C one line and 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jagg.arguments import run_command
from jagg.bench import add_tools

# name -> module: the tools whose sub-command the module adds with add_parser(sub), with its help
TOOLS = {"quality": "lab.quality", "fidelity": "lab.fidelity", "signal": "lab.signal", "e2e": "lab.e2e",
         "paired": "lab.paired"}
# name -> (module, one line): the scripts, each with its own main(argv)
SCRIPTS = {
    "plateau": ("lab.plateau_mechanism", "a plateau gap read apart: the lag of the rate, a noise floor or a bias"),
    "regime-map": ("lab.regime_map", "the meter swept over step counts, SDEs, noise levels and trained windows"),
    "weight-changes": ("lab.weight_changes", "which of a run's weight changes carry its gain, which its artifacts"),
    "trace-file-changes": ("lab.trace_file_changes", "how often the real-model trainer's path changes source file"),
    "profile-training": ("lab.profile_training", "the main job's training phase under torch.profiler"),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the tools in :data:`TOOLS`; the scripts are named in its help and parse their own arguments."""
    p = argparse.ArgumentParser(prog="python -m lab", description="The lab's tools (lab/README.md); each has --help.")
    sub = p.add_subparsers(dest="tool", required=True, metavar="TOOL")
    add_tools(sub, [importlib.import_module(module) for module in TOOLS.values()])
    for name, (_, line) in SCRIPTS.items():
        sub.add_parser(name, help=line, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SCRIPTS:
        script = importlib.import_module(SCRIPTS[argv[0]][0])
        return run_command(f"python -m lab {argv[0]}", lambda rest: script.main(rest) or 0, argv[1:])
    args = build_parser().parse_args(argv)
    return run_command(f"python -m lab {args.tool}", lambda a: a.func(a), args)


if __name__ == "__main__":
    sys.exit(main())
