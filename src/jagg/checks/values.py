"""Checks of single values: finite numbers, vectors of numbers, counts, numbers that fit the dtype they are used in
(float32, int64), seeds, thread counts, positive numbers and probabilities, and the command-line number parser
(:func:`number_arg`). A check raises a ValueError (a TypeError for a value of the wrong kind) naming the setting."""

from __future__ import annotations

import argparse
import math
import numbers

import numpy as np
import torch
from torch import Tensor


def is_finite_number(value) -> bool:
    """True for a finite real number (int, float, numpy scalar); False for bool, NaN, infinity and non-numbers."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def first_non_finite(values: dict) -> str | None:
    """The name of the first of ``values`` (name -> value) that is not a finite number (:func:`is_finite_number`), or
    None: several arguments checked in one call."""
    return next((name for name, value in values.items() if not is_finite_number(value)), None)


def as_vector(values, name: str, dtype=np.float32) -> Tensor:
    """A flat tensor from a tensor or any array-like of numbers (list, numpy array); a TypeError naming ``name``
    otherwise. Tensors keep their dtype and device."""
    if not isinstance(values, Tensor):
        try:
            values = torch.as_tensor(np.asarray(values, dtype=dtype))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be a tensor or an array-like of numbers; got {type(values).__name__}: "
                            f"{e}") from None
    return values.detach().flatten()


def as_steps(values, name: str) -> list[int]:
    """``values`` as a list of Python ints (a sequence or 1-D tensor of integers, e.g. trained steps), non-empty; a
    TypeError or ValueError naming ``name`` otherwise."""
    if isinstance(values, Tensor):
        values = values.tolist() if values.ndim == 1 and not values.is_floating_point() else None
    if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a non-empty sequence of integer steps; got {type(values).__name__}")
    if not len(values) or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of integer steps; got {shown(list(values))}")
    return [int(v) for v in values]


def as_increasing_steps(values, name: str) -> list[int]:
    """:func:`as_steps`, each step ``>= 0`` and every one above the one before (steps index a trajectory in order); a
    ValueError naming ``name`` and the first step out of order otherwise."""
    steps = as_steps(values, name)
    for j, (a, b) in enumerate(zip([-1, *steps], steps)):
        if b <= a:
            raise ValueError(f"{name} must be increasing steps >= 0 (each an index into the trajectory, in order); "
                             f"{name}[{j}] = {b} {'is negative' if b < 0 else f'does not follow {a}'}; got "
                             f"{shown(steps)}")
    return steps


def check_finite_tensor(value: Tensor, name: str, what: str = "") -> Tensor:
    """Raise unless every entry of the tensor ``value`` is finite (one ``isfinite(...).all()``: a single device sync
    per call), naming it ``name`` (``what``: where such values come from, what to check). Returns it."""
    if value.numel() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} must be finite; {bad} of its {value.numel()} entries are NaN or infinite"
                         f"{f' ({what})' if what else ''}")
    return value


def check_number(value, name: str, low: float | None = None, high: float | None = None, strict: bool = False,
                 why: str = "") -> float:
    """``value`` as a float: a finite real number (not a bool), in ``[low, high]`` (above ``low`` when ``strict``);
    a TypeError for a non-number, else a ValueError naming ``name`` (``why``: what it is)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number{f' ({why})' if why else ''}; got {type(value).__name__}")
    if low is not None and high is not None:
        bounds = f"in {'(' if strict else '['}{low:g}, {high:g}]"
    else:
        bounds = (f"> {low:g}" if strict else f">= {low:g}") if low is not None else (
            f"<= {high:g}" if high is not None else "")
    if (not math.isfinite(value) or (low is not None and (value <= low if strict else value < low))
            or (high is not None and value > high)):
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}"
                         f"{f' ({why})' if why else ''}; got {shown(value)}")
    return float(value)


def check_count(value, name: str, minimum: int = 1) -> int:
    """Raise unless ``value`` is an integer (not a bool; a numpy integer counts) >= ``minimum``; the message names it
    ``name``. Returns it as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {shown(value)}")
    return int(value)


def check_flag(value, name: str) -> bool:
    """Raise unless ``value`` is True or False (a numpy bool counts), e.g. an argument passed in the wrong position
    (a number where a flag goes); returns it as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__} {shown(value)} (an argument in "
                        "the wrong position? pass it by name)")
    return bool(value)


def check_callable(value, name: str, signature: str) -> None:
    """Raise unless ``value`` is callable (``signature`` says what it is called with and returns)."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, {signature}; got {type(value).__name__}")


def check_tensor(value, name: str, shape: str) -> Tensor:
    """Raise unless ``value`` is a torch.Tensor (``shape`` says which, e.g. ``[B, T, *S]``); returns it."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}; got {type(value).__name__} (an argument in the "
                        "wrong position? pass it by name)")
    return value


FLOAT32_MAX = float(np.finfo(np.float32).max)      # 3.4e38: a config's floats end up in float32 tensors
FLOAT32_TINY = float(np.finfo(np.float32).tiny)    # 1.2e-38: the smallest normal float32; below it precision is lost
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1            # integers end up in int64 tensors and numpy arrays
SEED_MAX = 2**32 - 1                               # seeds: numpy's generators need >= 0, and the seeds derived from one
                                                   # (seed * 1_000_003 + iteration, ...) must fit torch's 64 bits
MAX_THREADS = 1024                                 # torch threads: a C int, and each one a real thread


def _named(name: str, text: str) -> str:
    return f"{name}: {text}" if name else text


def shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 400-digit number in a message is noise); a sequence (list,
    tuple, tensor, array) of more than 6 items as its first 3 and last 2 and its length, without writing the rest
    (a schedule of 10**8 sigmas in a message would be gigabytes)."""
    items = value.detach().flatten() if isinstance(value, Tensor) else (
        value.ravel() if isinstance(value, np.ndarray) else value if isinstance(value, (list, tuple)) else None)
    if items is not None and len(items) > 6:
        one = lambda x: shown(x.item() if isinstance(x, (Tensor, np.generic)) else x, 20)
        return (f"[{', '.join(one(x) for x in items[:3])}, ..., {', '.join(one(x) for x in items[-2:])}] "
                f"({len(items)} values)")
    text = repr(items.tolist() if isinstance(items, (Tensor, np.ndarray)) else value)
    return text if len(text) <= limit else f"{text[:limit - 13]}... ({len(text)} characters)"


def check_float32(value: float, name: str = "") -> None:
    """Raise unless the finite float ``value`` fits float32, the dtype a config's numbers are used in: at most
    :data:`FLOAT32_MAX` in magnitude, and 0 or at least :data:`FLOAT32_TINY` (a smaller one becomes 0 or loses its
    precision there). The message names the setting ``name``."""
    if abs(value) > FLOAT32_MAX:
        raise ValueError(_named(name, f"{shown(value)} overflows float32, the dtype it is used in (at most "
                                      f"{FLOAT32_MAX:.3g} in magnitude)"))
    if 0 < abs(value) < FLOAT32_TINY:
        raise ValueError(_named(name, f"{shown(value)} underflows float32, the dtype it is used in (0, or at least "
                                      f"{FLOAT32_TINY:.3g} in magnitude)"))


def check_int64(value: int, name: str = "") -> None:
    """Raise unless the integer ``value`` fits int64, the dtype integers are used in (tensor sizes, numpy arrays)."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(_named(name, f"{shown(value)} does not fit a 64-bit integer, the dtype it is used in "
                                      "(|x| < 2**63)"))


def check_seed(value, name: str = "") -> None:
    """Raise unless ``value`` is an integer seed in ``[0, SEED_MAX]`` (:data:`SEED_MAX`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= SEED_MAX:
        raise ValueError(f"{name + ' ' if name else ''}must be an integer in [0, {SEED_MAX}] (a seed); got "
                         f"{shown(value)}")


def check_threads(value: int, name: str) -> None:
    """Raise unless ``value`` is a number of torch CPU threads in ``[0, MAX_THREADS]`` (0: torch's default)."""
    if not 0 <= value <= MAX_THREADS:
        raise ValueError(f"{name} must be in [0, {MAX_THREADS}] (torch CPU threads; 0 = torch's default); got "
                         f"{shown(value)}")


def parse_number(text: str, kind: type = float, low: float | None = None, strict: bool = False,
                 seed: bool = False) -> int | float:
    """``text`` as a finite ``kind`` (int or float) that fits its dtype (:func:`check_int64`, :func:`check_float32`),
    at or above ``low`` (above it when ``strict``), a seed (:func:`check_seed`) when ``seed``; a ValueError saying
    what is wrong otherwise (for a command-line option: :func:`number_arg` names it)."""
    try:
        value = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, got {shown(text)}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {shown(text)}")
    if seed:
        check_seed(value)
    (check_int64 if kind is int else check_float32)(value)
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
    return value


def number_arg(kind: type = float, low: float | None = None, strict: bool = False, seed: bool = False):
    """An argparse ``type`` for a number option (:func:`parse_number`): argparse names the option in the error,
    ``argument --seed: must be an integer in [0, 4294967295] (a seed); got -1``."""
    def parse(text: str):
        try:
            return parse_number(text, kind, low, strict, seed)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = kind.__name__
    return parse



def check_positive(value, name: str, why: str = "") -> None:
    """Raise unless ``value`` is a finite number > 0; the message names it ``name`` and adds ``why`` in brackets."""
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0{f' ({why})' if why else ''}; got {value!r}")


def check_probabilities(values, name: str) -> list[float]:
    """``values`` as a list of floats, each a finite number in [0, 1]; raise naming ``name`` and the first bad entry
    unless it is a non-empty sequence of such numbers."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of probabilities in [0, 1]; got {values!r}")
    for j, v in enumerate(values):
        if not is_finite_number(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}[{j}] must be a finite number in [0, 1]; got {v!r}")
    return [float(v) for v in values]
