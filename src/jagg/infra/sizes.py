"""Sizes that fit their dtype but not the machine: an estimate of the memory a setting needs, refused with the
estimate when it is more than this machine has (before a run directory or an output file exists).

A config's integers are checked to fit int64 at load (:mod:`jagg.infra.config_loader`); a ``group_size`` of
9223372036854775807 fits and would still grow until the kernel kills the process. The estimates here are lower
bounds of what the named arrays take (float32 latents of every sampling step, the images, the bootstrap's indices),
so a refused setting never fits; a setting that passes may still be too large for a model's activations.
"""

from __future__ import annotations

import os

FLOAT = 4                                 # bytes of a float32
TINY_DIT_LATENT = 3 * 32 * 32             # the TinyDiT's image (channels x size x size): its latent and its pixels


def machine_memory() -> int:
    """This machine's physical memory in bytes (``os.sysconf``; 1 TiB where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 2**40


def shown_bytes(n: float) -> str:
    """``n`` bytes as ``12.3 GB`` (powers of 1000), ``4.2e+07 TB`` beyond."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 1e6 else f"{value:.2g} {unit}"
    return f"{n:.0f} bytes"


def check_memory(need: float, what: str, fix: str) -> None:
    """Raise a ValueError when ``need`` bytes (an estimate of ``what``, e.g. ``"sample.group_size=... : one
    iteration's 9e18 trajectories"``) are more than this machine's memory; ``fix`` says what to lower."""
    have = machine_memory()
    if need > have:
        raise ValueError(f"{what} need about {shown_bytes(need)} of memory, more than this machine's "
                         f"{shown_bytes(have)}; {fix}")


def held_over_half(need: float, what: str) -> str | None:
    """Why ``need`` bytes of ``what`` (e.g. ``"measuring holds 60 flat gradients ..."``) cannot be held: more than half
    this machine's memory (the model, its rollouts and the optimizer need the rest), or None."""
    have = machine_memory()
    if need <= have / 2:
        return None
    return f"{what}: {shown_bytes(need)}, more than half this machine's {shown_bytes(have)}"


def rollout_bytes(samples: int, num_steps: int, latent: int, pixels: int) -> float:
    """A lower bound of one iteration's rollout: every sample's latents at each of the ``num_steps + 1`` sigmas and its
    velocity at each step (float32, ``latent`` numbers each), and its image (``pixels`` bytes)."""
    return float(samples) * ((2 * num_steps + 1) * latent * FLOAT + pixels)


def check_rollout_memory(prompts_per_iter: int, group_size: int, num_steps: int, latent: int, pixels: int,
                         steps: str) -> None:
    """Raise, naming ``sample.prompts_per_iter`` and ``sample.group_size``, when one iteration's rollout
    (:func:`rollout_bytes`; ``steps`` says its steps, e.g. ``"sample.num_steps=10"``) needs more memory than this
    machine has."""
    batch = prompts_per_iter * group_size
    check_memory(rollout_bytes(batch, num_steps, latent, pixels),
                 f"sample.prompts_per_iter={prompts_per_iter} x sample.group_size={group_size}: one iteration's "
                 f"{batch} trajectories of {steps}", "lower sample.prompts_per_iter or sample.group_size")


def images_bytes(images: int, latent: int = TINY_DIT_LATENT, pixels: int = TINY_DIT_LATENT) -> float:
    """A lower bound of sampling ``images`` images at once: a float32 latent, its velocity and the uint8 image each."""
    return float(images) * (2 * latent * FLOAT + pixels)


# the time estimates: a lower bound of one model evaluation (a forward pass) of one sample at one step, whatever the
# model and the device (a GPU's kernel launches alone take microseconds per call); one iteration, one evaluation or
# one measurement estimated at more than a day at that rate is refused (what it refuses never ends in a day)
EVALUATION_S = 1e-6
WORK_LIMIT_S = 86400.0
# a sampling schedule's steps: its num_steps + 1 float32 sigmas in [0, 1] are distinct only below 2**24 steps
MAX_STEPS = 2**24


def check_steps(num_steps: int, key: str) -> None:
    """Raise, naming ``key``, when a schedule of ``num_steps`` steps cannot keep its float32 sigmas apart (more than
    :data:`MAX_STEPS`), before any schedule of that size is built."""
    if num_steps > MAX_STEPS:
        raise ValueError(f"{key}={num_steps}: more steps than a float32 schedule from 1 to 0 keeps distinct (at most "
                         f"{MAX_STEPS}, and a few hundred are plenty); lower {key}")


def shown_seconds(s: float) -> str:
    """``s`` seconds as ``3.2 hours``, ``41 days`` or ``2.5e+04 years``."""
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s:.3g} seconds"


def check_time(evaluations: float, what: str, fix: str) -> None:
    """Raise a ValueError when ``evaluations`` model evaluations of one sample (``what`` says of what, naming the
    keys, e.g. ``"eval.images_per_prompt=... x eval.num_steps=...: an evaluation's"``) take more than
    :data:`WORK_LIMIT_S` even at :data:`EVALUATION_S` each; ``fix`` says what to lower."""
    seconds = float(evaluations) * EVALUATION_S
    if seconds > WORK_LIMIT_S:
        raise ValueError(f"{what} {float(evaluations):.3g} model evaluations take at least {shown_seconds(seconds)} "
                         f"(at {EVALUATION_S * 1e6:g} microsecond each, a lower bound), more than a day; {fix}")


def check_run_counts(prompts_per_iter: int, group_size: int, num_steps: int, passes: int, latent: int, pixels: int,
                     steps: str, lower: str, preflight: tuple[int, int] | None) -> None:
    """The counts of one iteration of a run, refused naming their keys before anything of their size is built: its
    sampling steps (:func:`check_steps`; ``steps`` says them, e.g. ``"sample.num_steps=10"``, ``lower`` what makes one
    trajectory smaller), the memory of one trajectory and of the batch's (:func:`check_rollout_memory`), its time
    (the batch sampled over ``num_steps``, then ``passes`` = ``grpo.inner_epochs`` passes of at least one trained step
    each) and, with ``preflight`` (``(estimator.preflight_batches, estimator.preflight_draws)``: mode auto), the time
    of the measured iterations (their gradients' memory depends on the model: known only once it loads)."""
    check_steps(num_steps, steps.split("=")[0])
    check_memory(rollout_bytes(1, num_steps, latent, pixels), f"one trajectory of {steps}", f"lower {lower}")
    check_rollout_memory(prompts_per_iter, group_size, num_steps, latent, pixels, steps)
    batch = prompts_per_iter * group_size
    check_time(float(batch) * (num_steps + passes), f"grpo.inner_epochs={passes} passes over {batch} samples of "
               f"{steps}: one iteration's", "lower grpo.inner_epochs")
    if preflight is not None:
        batches, draws = preflight
        check_time(float(batches) * batch * (num_steps + draws),
                   f"estimator.preflight_batches={batches} x estimator.preflight_draws={draws}: the measured "
                   "iterations'", "lower estimator.preflight_batches or estimator.preflight_draws")


def check_eval_counts(images: int, num_steps: int, images_key: str, steps_key: str) -> None:
    """An evaluation of ``images`` images over ``num_steps`` steps (``steps_key``), refused naming the keys when its
    schedule or its time cannot be (:func:`check_steps`, :func:`check_time`); its memory is the caller's check."""
    check_steps(num_steps, steps_key)
    check_time(float(images) * num_steps, f"{images_key} x {steps_key}={num_steps}: an evaluation's {images} images' ",
               f"lower {images_key} or {steps_key}")
