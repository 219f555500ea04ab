"""The former home of ``jagg bench paired`` (docs/benchmarks.md), kept because the measurements recorded in
docs/RESULTS.md name this path: the same arguments, the same output.

    python benchmarks/paired_eval.py BEFORE AFTER [--images-per-prompt 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from jagg.bench.paired import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="benchmarks/paired_eval.py", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
