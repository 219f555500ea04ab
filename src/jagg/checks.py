"""The checks every layer shares, in one place: general value checks (finite numbers, vectors of numbers, numbers that
fit the dtype they are used in, seeds, command-line numbers, unique names, output files) and the checks of a rollout's
settings (the SDE's noise level, type and log-prob reduction; which steps are SDE steps and
trained; the schedule, the noise and the prompt group size).

The library functions (:mod:`jagg.trajectory`, :mod:`jagg.sde`, :mod:`jagg.schedule`, :mod:`jagg.estimator`,
:mod:`jagg.advantages`) and the trainers' config sections (:mod:`jagg.trainers.sections` and the two trainer
configs) call these same functions. A check raises a ValueError (a TypeError for a value of the wrong kind) that
names the setting as its caller knows it: an argument (``eta``) by default, a config key (``sample.eta``) when given
:class:`Keys`.
"""

from __future__ import annotations

import argparse
import math
import numbers
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SDE_TYPES = ("flow_grpo", "dance", "cps")
REDUCTIONS = ("mean", "sum")
SDE_WINDOW_SCHEDULES = ("fixed", "sliding")

# ----------------------------------------------------------------------------- general values


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


def check_count(value, name: str, minimum: int = 1) -> None:
    """Raise unless ``value`` is an integer (not a bool) >= ``minimum``; the message names it ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")


FLOAT32_MAX = float(np.finfo(np.float32).max)      # 3.4e38: a config's floats end up in float32 tensors
FLOAT32_TINY = float(np.finfo(np.float32).tiny)    # 1.2e-38: the smallest normal float32; below it precision is lost
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1            # integers end up in int64 tensors and numpy arrays
SEED_MAX = 2**32 - 1                               # seeds: numpy's generators need >= 0, and the seeds derived from one
                                                   # (seed * 1_000_003 + iteration, ...) must fit torch's 64 bits
MAX_THREADS = 1024                                 # torch threads: a C int, and each one a real thread


def _named(name: str, text: str) -> str:
    return f"{name}: {text}" if name else text


def shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 400-digit number in a message is noise)."""
    text = repr(value)
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


def parse_spec(spec: str, flag: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:KEY=VALUE,...`` (``--estimator``, ``--variant``, ``--cost``) -> ``(name, {key: value})``,
    the items split at the commas outside brackets (``r:correction_rates=[0.4,0.1],window=5`` is two items), keys and
    values stripped, empty items skipped; an item that is not ``KEY=VALUE`` is an error naming ``flag``."""
    name, _, rest = spec.partition(":")
    items, depth, cur = [], 0, ""
    for ch in rest + ",":
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth <= 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out = {}
    for item in filter(None, items):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{flag} {spec!r}: {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return name, out


def check_unique_names(names: list[str], reserved: tuple[str, ...] | dict, flag: str) -> None:
    """Raise unless the names given to ``flag`` (``--estimator``, ``--variant``: ``NAME`` or ``NAME:KEY=VALUE,...``)
    are unique and a defined one (``NAME:...``) does not take a ``reserved`` (built-in) name: one name, one row of
    the results, never one silently replacing another."""
    seen = set()
    for spec in names:
        name, defines, _ = spec.partition(":")
        if defines and name in reserved:
            raise ValueError(f"{flag} {spec!r}: {name!r} is a built-in name ({', '.join(reserved)}); give your "
                             f"definition another name, e.g. {flag} my_{name}:{spec.partition(':')[2]}")
        if name in seen:
            raise ValueError(f"{flag} {spec!r}: the name {name!r} is given twice; give every {flag} its own name")
        seen.add(name)


def check_no_repeats(values: list[str], flag: str) -> None:
    """Raise when a value is given to ``flag`` twice (``--rewards``, ``--variants``): each would be measured twice
    under one name."""
    repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if repeated is not None:
        raise ValueError(f"{flag}: {repeated!r} is given twice; give each once")


def check_output_file(path: str | Path, flag: str, overwrite: bool = False, suffixes: tuple[str, ...] = ()) -> Path:
    """The file a command will write for ``flag`` (``--out``, ``--json``), checked before any work: a non-empty path
    that is not a directory, whose parent is not a file, ending in one of ``suffixes`` (when given), and that does not
    exist unless ``overwrite`` (``--overwrite``): a user's file is never replaced without asking."""
    if str(path).strip() == "":
        raise ValueError(f"{flag} is empty; give the file to write")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give the file to write, e.g. {flag} "
                         f"{p / ('out' + (suffixes[0] if suffixes else ''))}")
    parent = next((a for a in p.parents if a.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: the file name must end in one of {', '.join(suffixes)} (the format is "
                         f"taken from it); got {p.suffix or 'no extension'!r}")
    if p.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another path")
    return p


def read_json(path: str | Path, what: str):
    """The JSON value of the file ``path``, a part of ``what`` (a model directory, an option); a file that is not valid
    JSON is a ValueError naming it, with the line and column, never a bare decoder error."""
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); repair the "
                         "file or copy it again") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {path} is not a UTF-8 JSON file (byte {e.start}: {e.reason})") from None


def check_json_files(directory: str | Path, what: str, limit: int = 64 * 2**20) -> None:
    """Every ``*.json`` file of ``directory`` and of its subdirectories one level down (a model directory's
    ``model_index.json``, ``transformer/config.json``, a tokenizer's files), up to ``limit`` bytes each, read as JSON
    (:func:`read_json`): a broken one is named before a library loads it with a bare decoder error."""
    d = Path(directory)
    for path in sorted([*d.glob("*.json"), *d.glob("*/*.json")]):
        if path.is_file() and path.stat().st_size <= limit:
            read_json(path, what)


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


class Keys(dict):
    """The names the checks' messages give the settings they check: ``Keys()`` the argument names themselves (``eta``),
    ``Keys("sample.")`` the keys of a ``sample:`` config section (``sample.eta``), and
    ``Keys("sample.", eta="pipeline.eta")`` the same with ``eta`` in another section."""

    def __init__(self, prefix: str = "", **moved: str):
        super().__init__(moved)
        self.prefix = prefix

    def __missing__(self, name: str) -> str:
        return self.prefix + name


ARGUMENTS = Keys()

# ----------------------------------------------------------------------------- the SDE's settings


def check_eta(eta, keys: Keys = ARGUMENTS) -> None:
    """Raise unless the SDE noise level ``eta`` is a finite number > 0."""
    check_positive(eta, keys["eta"], "the SDE steps need noise")


def check_sde_type(sde_type: str, eta: float | None = None, keys: Keys = ARGUMENTS) -> None:
    """Raise unless ``sde_type`` is one of :data:`SDE_TYPES` and, for ``cps`` (when ``eta`` is given), ``0 < eta <= 1``."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"{keys['sde_type']} must be one of {SDE_TYPES}; got {sde_type!r}")
    if sde_type == "cps" and eta is not None and not 0 < eta <= 1:
        raise ValueError(f"{keys['sde_type']} 'cps' needs 0 < eta <= 1 (its step std is sigma_next * sin(eta * pi / 2)); "
                         f"got {keys['eta']}={eta}")


def check_sampler(eta: float, sde_type: str, logprob_reduction: str = "mean", keys: Keys = ARGUMENTS) -> None:
    """Raise unless the SDE's settings fit: ``eta`` (:func:`check_eta`), the SDE type (:func:`check_sde_type`) and the
    log-prob reduction (one of :data:`REDUCTIONS`)."""
    check_eta(eta, keys)
    check_sde_type(sde_type, eta, keys)
    check_reduction(logprob_reduction, keys)


def check_reduction(logprob_reduction: str, keys: Keys = ARGUMENTS) -> None:
    """Raise unless the log-prob reduction over the latent dimensions is one of :data:`REDUCTIONS`."""
    if logprob_reduction not in REDUCTIONS:
        raise ValueError(f"{keys['logprob_reduction']} must be one of {REDUCTIONS}; got {logprob_reduction!r}")


def cps_last_step_error(keys: Keys = ARGUMENTS) -> ValueError:
    """The error for a ``cps`` rollout whose last step, to sigma = 0, would be an SDE step."""
    return ValueError(f"{keys['sde_type']} 'cps' cannot take an SDE step to sigma = 0 (its noise, sigma_next * "
                      f"sin(eta pi / 2), is 0 there): make the last step an ODE step ({keys['sde_window']} [start, end] "
                      f"with end < {keys['num_steps']})")


# ----------------------------------------------------------------------------- which steps are SDE steps and trained


def check_sde_steps(num_steps: int, timestep_fraction: float = 1.0, sde_window=None, sde_type: str | None = None,
                    keys: Keys = ARGUMENTS) -> None:
    """Raise unless the choice of SDE and trained steps among ``num_steps`` fits: ``timestep_fraction`` in (0, 1] and
    training at least one step; ``sde_window`` None or ``[start, end]`` with ``0 <= start < end <= num_steps``; only
    one of the two set; and with ``sde_type`` ``cps`` the last step an ODE step (the window ending before
    ``num_steps``)."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"{keys['timestep_fraction']} must be in (0, 1]; got {timestep_fraction}")
    if sde_window is None:
        if int(num_steps * timestep_fraction) < 1:
            raise ValueError(f"{keys['timestep_fraction']}={timestep_fraction} of {keys['num_steps']}={num_steps} "
                             "trains no step; raise it")
        if sde_type == "cps":
            raise cps_last_step_error(keys)
        return
    if timestep_fraction != 1.0:
        raise ValueError(f"set either {keys['timestep_fraction']} or {keys['sde_window']}, not both")
    if len(sde_window) != 2 or not 0 <= sde_window[0] < sde_window[1] <= num_steps:
        raise ValueError(f"{keys['sde_window']} must be [start, end] with 0 <= start < end <= {keys['num_steps']}="
                         f"{num_steps}; got {list(sde_window)}")
    if sde_type == "cps" and sde_window[1] >= num_steps:
        raise cps_last_step_error(keys)


def check_sliding_window(span: tuple[int, int], size, stride, every, keys: Keys = ARGUMENTS) -> None:
    """Raise unless a sliding SDE window fits: ``size``, ``stride`` and ``every`` are integers >= 1, and the window of
    ``size`` steps fits in the steps ``span = (start, end)`` it slides over (``0 <= start < end``)."""
    for name, value in (("sde_window_size", size), ("sde_window_stride", stride), ("sde_window_every", every)):
        check_count(value, keys[name])
    if (not isinstance(span, (tuple, list)) or len(span) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in span)
            or not 0 <= span[0] < span[1]):
        raise ValueError(f"the steps a sliding SDE window slides over ({keys['sde_window']}) must be [start, end) with "
                         f"0 <= start < end integers; got {span!r}")
    start, end = span
    if size > end - start:
        raise ValueError(f"{keys['sde_window_size']}={size} is longer than the {end - start} steps [{start}, {end}) it "
                         f"slides over ({keys['sde_window']}); lower it or widen {keys['sde_window']}")


def check_sde_window_schedule(num_steps: int, timestep_fraction: float, sde_window, schedule: str, size, stride, every,
                              keys: Keys = ARGUMENTS) -> None:
    """Raise unless the SDE window's schedule fits: ``schedule`` one of :data:`SDE_WINDOW_SCHEDULES`; ``fixed`` without
    a size (``sde_window`` is then the SDE window of every iteration, :func:`check_sde_steps`); ``sliding`` without a
    ``timestep_fraction`` and with a window that fits in the steps it slides over, ``sde_window`` or else all
    ``num_steps`` (:func:`check_sliding_window`), and that moves: not filling those steps, its stride at most the steps
    it can move (a config's count larger than what it counts never moves the window)."""
    if schedule not in SDE_WINDOW_SCHEDULES:
        raise ValueError(f"{keys['sde_window_schedule']} must be one of {SDE_WINDOW_SCHEDULES}; got {schedule!r}")
    if schedule == "fixed":
        if size is not None:
            raise ValueError(f"{keys['sde_window_size']} is the size of a sliding SDE window: set "
                             f"{keys['sde_window_schedule']}=sliding, or drop it (null)")
        return
    if timestep_fraction != 1.0:
        raise ValueError(f"set either {keys['timestep_fraction']} or a sliding SDE window ({keys['sde_window_schedule']}"
                         "=sliding), not both")
    if size is None:
        raise ValueError(f"{keys['sde_window_schedule']}=sliding needs {keys['sde_window_size']}: the SDE steps of "
                         "one iteration (MixGRPO: 4)")
    start, end = tuple(sde_window) if sde_window else (0, num_steps)
    check_sliding_window((start, end), size, stride, every, keys)
    room = end - start - size                        # the steps the window can move
    if room == 0:
        raise ValueError(f"{keys['sde_window_size']}={size} fills the {end - start} steps [{start}, {end}) it slides "
                         f"over ({keys['sde_window']}): the window never moves; lower it, widen {keys['sde_window']}, "
                         f"or use {keys['sde_window_schedule']}=fixed")
    if stride > room:
        raise ValueError(f"{keys['sde_window_stride']}={stride} is more than the {room} step{'s' * (room != 1)} a "
                         f"window of {size} can move in [{start}, {end}) ({keys['sde_window']}): it would never move; "
                         f"lower it to at most {room}")


def check_group_size(group_size: int, keys: Keys = ARGUMENTS) -> None:
    """Raise unless the prompt group size is >= 2: advantages are relative to a prompt group, so a prompt group of one
    image has no reward spread, every advantage is 0 and GRPO trains nothing."""
    if group_size < 2:
        raise ValueError(f"{keys['group_size']} must be >= 2 (GRPO compares the images of one prompt; a prompt group "
                         f"of {group_size} has no reward spread and trains nothing); got {group_size}")


# ----------------------------------------------------------------------------- what a rollout takes


def check_noise(noise: Tensor) -> None:
    """Raise unless ``noise`` is a finite tensor ``[B, *S]`` with at least one latent dimension."""
    if not isinstance(noise, Tensor):
        raise TypeError(f"noise must be a torch.Tensor [B, *S]; got {type(noise).__name__}")
    if noise.ndim < 2 or noise.shape[0] == 0:
        raise ValueError(f"noise must have shape [B, *S] (a batch of B >= 1 latents); got {tuple(noise.shape)}")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("noise contains NaN or infinity")


def check_sigmas(sigmas: Tensor) -> None:
    """Raise unless ``sigmas`` is a 1-D strictly decreasing schedule inside [0, 1] (what a rollout and a
    :class:`jagg.Trajectory` take; :func:`jagg.flow_sigmas` makes one)."""
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of num_steps + 1 >= 2 values; got shape {tuple(sigmas.shape)}")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(
            "sigmas must be strictly decreasing (sampling runs from sigma=1, noise, to sigma=0, data); "
            f"got {sigmas.tolist()}"
        )
    if float(sigmas.max()) > 1.0 or float(sigmas.min()) < 0.0:
        raise ValueError(f"sigmas must lie in [0, 1]; got min {float(sigmas.min())}, max {float(sigmas.max())}")


def check_train_steps(ts: Tensor, num_steps: int) -> None:
    """Raise unless ``ts`` is a non-empty 1-D integer tensor of sorted, unique steps in ``[0, num_steps)``."""
    if not isinstance(ts, Tensor) or ts.ndim != 1 or ts.numel() == 0 or ts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"train_steps must be a non-empty 1-D integer tensor; got {ts!r}")
    if int(ts.min()) < 0 or int(ts.max()) >= num_steps:
        raise ValueError(f"train_steps must lie in [0, {num_steps - 1}]; got {ts.tolist()}")
    if not bool((ts[1:] > ts[:-1]).all()):
        raise ValueError(f"train_steps must be sorted and unique; got {ts.tolist()}")
