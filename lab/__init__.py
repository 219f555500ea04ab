"""The lab: what the team runs to find things out, outside the installed package (``python -m lab --help``).

It imports :mod:`jagg` and is never imported by it. Each tool and what it measured: lab/README.md.
"""
