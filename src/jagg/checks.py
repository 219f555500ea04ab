"""The checks every layer shares, in one place: general value checks (finite numbers, vectors of numbers) and the
checks of a rollout's settings (the SDE's noise level, type and log-prob reduction; which steps are SDE steps and
trained; the schedule, the noise and the prompt group size).

The library functions (:mod:`jagg.trajectory`, :mod:`jagg.sde`, :mod:`jagg.schedule`, :mod:`jagg.estimator`,
:mod:`jagg.advantages`) and the trainers' config sections (:mod:`jagg.trainers.sections` and the two trainer
configs) call these same functions. A check raises a ValueError (a TypeError for a value of the wrong kind) that
names the setting as its caller knows it: an argument (``eta``) by default, a config key (``sample.eta``) when given
:class:`Keys`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

SDE_TYPES = ("flow_grpo", "dance", "cps")
REDUCTIONS = ("mean", "sum")

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
