"""Callables a config names as ``package.module:attribute``: a user reward (:mod:`jagg.rewards.registry`) or an OCR
engine (:mod:`jagg.rewards.ocr`). Every failure is a ValueError naming what was asked for and what it must be."""

from __future__ import annotations

import importlib


def resolve(path: str, what: str, call: str):
    """The attribute ``package.module:attribute`` names (imported, not called); a ValueError naming ``what`` (e.g.
    ``"user reward"``) when it cannot be loaded or is not callable (``call``: the signature it must have)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} {path!r} must look like 'package.module:function'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {what} {path!r}: {e}") from e
    return callable_or_refused(obj, path, what, call)


def instantiated(path: str, what: str, call: str):
    """What ``package.module:attribute`` names, a function, or a class instantiated with no arguments (see
    :func:`resolve`)."""
    obj = resolve(path, what, call)
    return callable_or_refused(obj() if isinstance(obj, type) else obj, path, what, call)


def callable_or_refused(obj, path: str, what: str, call: str):
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is a {type(obj).__name__}, not a callable {call}")
    return obj
