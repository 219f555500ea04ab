"""Renamed names: an old keyword argument or config key keeps working, with a message that names the new one.

Each message is a :class:`DeprecationWarning` and, once per process, a line on stderr (Python hides
DeprecationWarnings raised inside a library by default, so the line is what a user of ``jagg train`` sees)."""

from __future__ import annotations

import sys
import warnings

_SHOWN: set[str] = set()


def warn_renamed(old: str, new: str) -> None:
    """Tell that ``old`` is deprecated and ``new`` replaces it (a DeprecationWarning; a stderr line once)."""
    message = f"{old} is deprecated: use {new} (the same setting under its new name)"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    if message not in _SHOWN:
        _SHOWN.add(message)
        print(f"jagg: {message}", file=sys.stderr)


def renamed(old: str, old_value, new: str, new_value, default=None):
    """The value of a renamed argument: ``new_value``, or ``old_value`` (warned) when only the old name was given.
    Both given is a TypeError."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"got both {old} (deprecated) and {new}; give {new} only")
    warn_renamed(old, new)
    return old_value
