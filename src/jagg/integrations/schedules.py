"""The sigmas a real model's rollout samples on: its own pipeline's grid, or DanceGRPO's (``pipeline.sigma_grid``).

``pipeline.sigma_grid: pipeline`` (the default): the ``N + 1`` sigmas the family's diffusers pipeline samples on at
``N`` steps and the run's resolution, made by the model's own scheduler (its ``scheduler/scheduler_config.json``)
called with the arguments, and through the helper functions, of its pipeline's ``__call__``:

============  =======================================================================================================
family        how the pipeline calls its scheduler
============  =======================================================================================================
SD3/SD3.5     ``StableDiffusion3Pipeline``: ``set_timesteps(N)``, the default grid of ``FlowMatchEulerDiscreteScheduler``
              (``linspace`` in t from 1 to the shifted ``sigma_min``, then shifted: 1, 0.960, ..., 0.278, 0.0089, 0 at
              10 steps with shift 3); ``mu`` of the patch count when the scheduler config asks for dynamic shifting
FLUX.1        ``FluxPipeline``: ``set_timesteps(sigmas=linspace(1, 1/N, N), mu)``, ``mu = calculate_shift`` of the
              packed image tokens ``(H/16)(W/16)`` (the resolution-dependent shift)
Qwen-Image    ``QwenImagePipeline``: the same, then the scheduler's ``shift_terminal`` stretch (0.02)
FLUX.2        ``Flux2Pipeline`` / ``Flux2KleinPipeline``: the same sigmas, ``mu = compute_empirical_mu(tokens, N)``
Wan 2.1       ``WanPipeline``: ``set_timesteps(N)`` of the directory's scheduler (Wan2.1-T2V-Diffusers ships
              ``UniPCMultistepScheduler`` with ``flow_shift`` 3, whose flow sigmas start just below 1)
============  =======================================================================================================

A ``pipeline.shift`` given in the config replaces the model's own: the scheduler is built with that static shift
(``shift`` / ``flow_shift``), no dynamic shifting and no terminal stretch, and called as above.

``pipeline.sigma_grid: dance``: DanceGRPO's and the JAGG authors' grid ``shift(linspace(1, 0, N + 1))``
(:func:`jagg.flow_sigmas`), with ``pipeline.shift`` or else the model's own shift (:func:`default_shift`: the static
shift of SD3 and Wan, the resolution-dependent ``exp(mu)`` of FLUX.1, Qwen-Image and FLUX.2) and, with the model's own
shift, Qwen-Image's terminal stretch. It equals the pipeline grid for FLUX.1, Qwen-Image and FLUX.2 at the model's own
shift, and differs for SD3 (last step 0.25 -> 0 at 10 steps with shift 3, against 0.0089 -> 0) and Wan.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch
from torch import Tensor

from ..checks import check_sigmas
from ..schedule import flow_sigmas, stretch_to_terminal
from .families import FAMILIES

DEFAULT_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
# the scheduler-config keys that an explicit pipeline.shift sets: a static shift, nothing dynamic, no stretch
STATIC_SHIFT = {"use_dynamic_shifting": False, "shift_terminal": None}


def _pipeline_module(family: str):
    import importlib

    return importlib.import_module(f"diffusers.pipelines.{FAMILIES[family].pipeline_module}")


def make_scheduler(scheduler_config: dict | None, shift: float | None = None):
    """The diffusers scheduler of ``scheduler_config`` (a model directory's ``scheduler_config.json``, its class in
    ``_class_name``; ``FlowMatchEulerDiscreteScheduler`` where it names none); with ``shift``, a static shift in place
    of the model's own (``shift`` or ``flow_shift``, whichever the class takes; no dynamic shifting, no stretch)."""
    import diffusers

    config = {k: v for k, v in (scheduler_config or {}).items() if not k.startswith("_")}
    name = (scheduler_config or {}).get("_class_name") or DEFAULT_SCHEDULER
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "set_timesteps"):
        raise ValueError(f"the model's scheduler config names {name!r}, not a diffusers scheduler; repair "
                         "scheduler/scheduler_config.json, or sample on DanceGRPO's grid (pipeline.sigma_grid: dance)")
    if shift is not None:
        accepted = inspect.signature(cls.__init__).parameters
        config.update({k: v for k, v in {**STATIC_SHIFT, "shift": shift, "flow_shift": shift}.items()
                       if k in accepted})
    return cls.from_config(config)


def pipeline_sigmas(family: str, num_steps: int, scheduler_config: dict | None, image_tokens: int,
                    shift: float | None = None) -> Tensor:
    """The ``[num_steps + 1]`` float32 sigmas, from (about) 1 down to 0, of ``family``'s diffusers pipeline at
    ``num_steps`` steps on latents of ``image_tokens`` image tokens (the sequence length its dynamic shift reads: the
    packed ``(H/16)(W/16)`` of FLUX.1 / Qwen-Image, FLUX.2's ``(H/16)(W/16)``, SD3's patch count): the scheduler of
    ``scheduler_config`` (:func:`make_scheduler`, ``shift``: a static shift in place of the model's own) called as the
    pipeline calls it (the module docstring). A grid that is not strictly decreasing in [0, 1] ending at 0 is a
    ValueError naming the scheduler."""
    scheduler = make_scheduler(scheduler_config, shift)
    module, record = _pipeline_module(family), FAMILIES[family]
    c = scheduler.config
    if record.packed:                                       # explicit sigmas and mu
        sigmas = None if getattr(c, "use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        module.retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas,
                                  mu=_pipeline_mu(record.shift_rule, module, c, image_tokens, num_steps))
    elif record.shift_rule == "scheduler":                  # e.g. WanPipeline: set_timesteps(N) on its scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
    else:                                                   # e.g. StableDiffusion3Pipeline: mu if the config asks
        kwargs = {}
        if c.get("use_dynamic_shifting", None):
            kwargs["mu"] = _pipeline_mu(record.shift_rule, module, c, image_tokens, num_steps)
        module.retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
    out = torch.as_tensor(scheduler.sigmas, dtype=torch.float32).flatten()
    try:
        if out.numel() != num_steps + 1 or float(out[-1]) != 0.0:
            raise ValueError(f"{out.numel()} sigmas ending at {float(out[-1]):g}, not {num_steps + 1} ending at 0")
        check_sigmas(out)
    except ValueError as e:
        raise ValueError(f"the model's scheduler ({type(scheduler).__name__}) does not give a flow-matching grid of "
                         f"{num_steps} steps: {e}; sample on DanceGRPO's grid (pipeline.sigma_grid: dance)") from None
    return out


def _pipeline_mu(rule: str, module, c, image_tokens: int, num_steps: int) -> float:
    """The ``mu`` a pipeline passes to its scheduler by the family's shift rule, with the pipeline module's own
    helper."""
    if rule == "empirical_mu":
        return module.compute_empirical_mu(image_seq_len=image_tokens, num_steps=num_steps)
    return module.calculate_shift(image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                  c.get("base_shift", 0.5), c.get("max_shift", 1.15))


# ----------------------------------------------------------------------------------------------------------------
# the model's own shift, for DanceGRPO's grid
# ----------------------------------------------------------------------------------------------------------------


def dynamic_shift(image_seq_len: int, scheduler_config: dict | None = None) -> float:
    """FLUX's and Qwen-Image's resolution-dependent shift: ``mu`` linear in the packed image sequence length
    (diffusers' ``calculate_shift``, with the scheduler config's ``base_image_seq_len``, ``max_image_seq_len``,
    ``base_shift``, ``max_shift``; the pipelines' defaults 256, 4096, 0.5, 1.15 where it has none), then ``exp(mu)``
    (``time_shift_type: exponential``, the default) or ``mu`` (``linear``). The scheduler's ``exp(mu) / (exp(mu) +
    1 / t - 1)`` is :func:`jagg.shift_sigmas` with this shift."""
    c = scheduler_config or {}
    lo, hi = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    b0, b1 = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
    mu = b0 + (b1 - b0) * (image_seq_len - lo) / (hi - lo)
    kind = c.get("time_shift_type", "exponential")
    if kind not in ("exponential", "linear"):
        raise ValueError(f"scheduler time_shift_type must be 'exponential' or 'linear'; got {kind!r}")
    return math.exp(mu) if kind == "exponential" else mu


def flux2_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's ``mu`` (``Flux2Pipeline``'s ``compute_empirical_mu``, from black-forest-labs/flux2): linear in the
    image sequence length, interpolated between its fits for 10 and 200 steps up to 4300 tokens."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


def default_shift(family: str, image_seq_len: int, scheduler_config: dict | None = None,
                  num_steps: int | None = None) -> float:
    """The model's own timestep shift, as its scheduler config says: with ``use_dynamic_shifting`` (FLUX.1-dev,
    Qwen-Image, FLUX.2; the default of the packed families when the config does not say) :func:`dynamic_shift` of the
    packed image sequence length ``(H/16)(W/16)`` (a family whose shift rule is ``empirical_mu``, FLUX.2: ``exp`` of
    :func:`flux2_mu` of it and ``num_steps``, as its pipelines pass ``mu``), else the static ``flow_shift`` (Wan
    2.1's ``UniPCMultistepScheduler``: 3.0) or ``shift`` (SD3: 3.0)."""
    c, record = dict(scheduler_config or {}), FAMILIES[family]
    if c.get("use_dynamic_shifting", record.packed):
        if record.shift_rule == "empirical_mu":
            if num_steps is None:
                raise ValueError(f"{record.title}'s shift depends on the number of steps: pass num_steps")
            return math.exp(flux2_mu(image_seq_len, num_steps))
        return dynamic_shift(image_seq_len, c)
    return float(c.get("flow_shift", c.get("shift", 3.0)))


def dance_sigmas(num_steps: int, shift: float, terminal: float | None = None) -> Tensor:
    """DanceGRPO's and the JAGG authors' ``[num_steps + 1]`` float32 grid ``shift(linspace(1, 0, N + 1))``
    (:func:`jagg.flow_sigmas`), stretched so that its last sigma before 0 is ``terminal`` when given (Qwen-Image's
    ``shift_terminal`` with its own shift: :func:`jagg.schedule.stretch_to_terminal`)."""
    sigmas = flow_sigmas(num_steps, shift=shift, dtype=torch.float64)
    if terminal is not None:
        sigmas = stretch_to_terminal(sigmas, terminal)
    return sigmas.float()


def grid_name(sigma_grid: str, family: str, scheduler_config: dict | None, shift: float | None) -> str:
    """How ``sigma_grid`` makes a rollout's sigmas, in a few words (the run header)."""
    if sigma_grid == "dance":
        own = "the model's own shift" if shift is None else f"shift {shift:g}"
        return f"DanceGRPO's shift(linspace(1, 0, N + 1)), {own}"
    name = (scheduler_config or {}).get("_class_name") or DEFAULT_SCHEDULER
    how = "explicit sigmas and mu" if FAMILIES[family].packed else "set_timesteps(N)"
    return f"the {family} pipeline's: {name} with {how}" + ("" if shift is None else f", static shift {shift:g}")
