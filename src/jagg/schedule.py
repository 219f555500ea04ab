"""Flow-matching sigma schedules (rectified-flow convention, SD3).

``x_sigma = (1 - sigma) * x0 + sigma * noise``; sampling walks sigma from 1 (noise) down to 0 (data).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_count, check_positive, check_sigmas, check_tensor, is_finite_number

SHIFT_HINT = "SD3 uses 3.0, 1.0 means no shift"


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's timestep shift ``s' = shift * s / (1 + (shift - 1) * s)``; ``shift=1`` is the identity.

    A shift > 1 spends more steps at high noise (SD3 uses 3.0). Works on any shape.
    """
    check_positive(shift, "shift", SHIFT_HINT)
    check_tensor(sigmas, "sigmas", "of sigmas in [0, 1] (any shape)")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigmas(num_steps: int, shift: float = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """DanceGRPO's and the JAGG authors' grid: the ``num_steps + 1`` sigmas ``shift(linspace(1, 0, N + 1))``, from 1
    down to 0 (:func:`shift_sigmas`). Returns a tensor of shape ``[num_steps + 1]``.

    The shapes world samples on it. It is not the grid of SD3's diffusers pipeline: ``StableDiffusion3Pipeline`` calls
    ``FlowMatchEulerDiscreteScheduler.set_timesteps(N)``, whose last sigma before 0 is 0.0089 at 10 steps with shift
    3, where this grid's is 0.25; FLUX.1, Qwen-Image and FLUX.2 pass ``linspace(1, 1/N, N)`` with their dynamic
    shift, which is this grid at that shift. A real model's rollouts use its own pipeline's grid
    (:mod:`jagg.integrations.schedules`, ``pipeline.sigma_grid``).
    """
    num_steps = check_count(num_steps, "num_steps")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (torch.float32, torch.float64); got {dtype!r}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(t, shift).to(dtype)


def check_schedule(num_steps: int, shift: float, name: str = "shift", steps_name: str = "num_steps") -> None:
    """Raise, naming ``name`` (the shift's key or option), unless the shifted schedule of ``num_steps`` steps keeps
    ``num_steps + 1`` distinct, strictly decreasing float32 sigmas: a shift of 1e30 (or 1e-38) fits float32 but
    squeezes every sigma onto 1 (or 0), and the rollout would fail in its first step."""
    check_positive(shift, name, SHIFT_HINT)
    try:
        check_sigmas(flow_sigmas(num_steps, shift))
    except ValueError:
        raise ValueError(f"{name}={shift:g} squeezes the sigma schedule of {steps_name}={num_steps} onto "
                         f"{'1' if shift > 1 else '0'}: its float32 sigmas are no longer distinct; use a shift nearer "
                         f"1 ({SHIFT_HINT})") from None


def stretch_to_terminal(sigmas: Tensor, terminal: float) -> Tensor:
    """diffusers' ``shift_terminal`` (Qwen-Image's scheduler: 0.02): stretch a schedule ``[T + 1]`` from 1 down to a
    final 0 so that its last sigma before the 0 is ``terminal``. ``1 - sigma`` of every sigma but the final 0 is
    scaled by ``(1 - terminal) / (1 - sigma_{T-1})``, so sigma_0 = 1 stays. Needs ``T >= 2``."""
    if not is_finite_number(terminal) or not 0 < terminal < 1:
        raise ValueError(f"shift_terminal must be a number in (0, 1); got {terminal!r}")
    if sigmas.ndim != 1 or sigmas.numel() < 3:
        raise ValueError(f"stretching to a terminal sigma needs a schedule of >= 2 steps ([T + 1] sigmas); got shape "
                         f"{tuple(sigmas.shape)}")
    head = sigmas[:-1]
    stretched = 1 - (1 - head) * ((1 - terminal) / (1 - head[-1]))
    return torch.cat([stretched, sigmas[-1:]])

