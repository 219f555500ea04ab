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
