"""Checks of a rollout's settings: the SDE's noise level, type and log-prob reduction; which steps are SDE steps and
trained (a fixed or sliding SDE window, a timestep fraction); the prompt group size; the noise, the sigma schedule and
the trained steps a rollout takes. The library functions (:mod:`jagg.trajectory`, :mod:`jagg.sde`,
:mod:`jagg.schedule`, :mod:`jagg.estimator`) and the trainers' config sections call these same functions, which name a
setting as their caller knows it: an argument (``eta``) by default, a config key (``sample.eta``) with :class:`Keys`."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .values import check_count, check_float32, check_positive, is_finite_number, shown


SDE_TYPES = ("flow_grpo", "dance", "cps")
REDUCTIONS = ("mean", "sum")
SDE_WINDOW_SCHEDULES = ("fixed", "sliding")


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
    """Raise unless the SDE noise level ``eta`` is a finite number > 0 that fits float32 (the SDE step's dtype)."""
    check_positive(eta, keys["eta"], "the SDE steps need noise")
    check_float32(eta, keys["eta"])


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
    if not is_finite_number(timestep_fraction) or not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"{keys['timestep_fraction']} must be a number in (0, 1]; got {timestep_fraction!r}")
    if sde_window is None:
        if int(num_steps * timestep_fraction) < 1:
            raise ValueError(f"{keys['timestep_fraction']}={timestep_fraction} of {keys['num_steps']}={num_steps} "
                             "trains no step; raise it")
        if sde_type == "cps":
            raise cps_last_step_error(keys)
        return
    if timestep_fraction != 1.0:
        raise ValueError(f"set either {keys['timestep_fraction']} or {keys['sde_window']}, not both")
    if (len(sde_window) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in sde_window)
            or not 0 <= sde_window[0] < sde_window[1] <= num_steps):
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
            f"got {shown(sigmas, 200)}"
        )
    if float(sigmas.max()) > 1.0 or float(sigmas.min()) < 0.0:
        raise ValueError(f"sigmas must lie in [0, 1]; got min {float(sigmas.min())}, max {float(sigmas.max())}")


def check_train_steps(ts: Tensor, num_steps: int) -> None:
    """Raise unless ``ts`` is a non-empty 1-D integer tensor of sorted, unique steps in ``[0, num_steps)``."""
    if not isinstance(ts, Tensor) or ts.ndim != 1 or ts.numel() == 0 or ts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"train_steps must be a non-empty 1-D integer tensor; got {shown(ts, 200)}")
    if int(ts.min()) < 0 or int(ts.max()) >= num_steps:
        raise ValueError(f"train_steps must lie in [0, {num_steps - 1}]; got {shown(ts, 200)}")
    if not bool((ts[1:] > ts[:-1]).all()):
        raise ValueError(f"train_steps must be sorted and unique; got {shown(ts, 200)}")
