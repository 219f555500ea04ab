"""The audit: how close the configured estimator's gradient is to the exact one, in total and per step range.

A same-batch gradient cosine is a diagnostic, not a verdict, and the total is decided by the clean steps, whose
upstream signals are largest; the noisy steps decide layout. So the audit compares per range of trained steps
(thirds: noisy, middle, clean) as well as in total. The trainers run it every ``estimator.audit_every`` iterations
on a few samples and log ``audit/*``; ``jagg bench fidelity`` reports the same numbers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .estimator import check_call, policy_gradient
from .estimator_config import EstimatorConfig
from .trajectory import Trajectory, VelocityFn

RANGE_NAMES = ("noisy", "middle", "clean")
# a step range whose same-batch cosine falls below this flags a biased estimator (plain JAGG) as at risk of drifting:
# in the SDE window [0, 8] of the main job, where plain JAGG collapsed training, the noisy third measured 0.52
FLAG_BELOW = 0.8


def audit_flag(result: dict, config: EstimatorConfig) -> str | None:
    """A warning when a biased estimator (JAGG without the unbiased correction) has a step range whose cosine to
    exact is below :data:`FLAG_BELOW`, else None. (With ``correction_p > 0`` the estimate is unbiased: a low
    same-batch cosine is then noise, which averages out over updates.)"""
    if config.mode != "jagg" or config.correction_p > 0:
        return None
    low = {k[4:]: v for k, v in result.items() if k.startswith("cos_") and v == v and v < FLAG_BELOW}
    if not low:
        return None
    where = ", ".join(f"{k} {v:.2f}" for k, v in low.items())
    return (f"audit: JAGG's gradient is far from exact in part of the trajectory (cosine {where}; below "
            f"{FLAG_BELOW}). Its error there is a bias that can repeat from batch to batch and drive the reward down; "
            "consider estimator.correction_p (e.g. 0.25: unbiased JAGG) or exact_first_groups")


def step_ranges(train_steps: Sequence[int], parts: int = 3) -> list[list[int]]:
    """The trained steps split into ``parts`` contiguous, near-equal ranges, noisiest first (fewer when there are
    fewer steps)."""
    steps = [int(k) for k in train_steps]
    return [list(map(int, r)) for r in np.array_split(steps, min(parts, len(steps))) if len(r)]


def _flat(params: Sequence[torch.nn.Parameter]) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def _cos(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else float("nan")


def audit_gradient(
    velocity_fn: VelocityFn,
    traj: Trajectory,
    advantages: Tensor | Sequence[float],
    config: EstimatorConfig,
    params: Sequence[torch.nn.Parameter],
    ref_velocities: Tensor | None = None,
    sample_groups: Tensor | Sequence | None = None,
    generator: torch.Generator | None = None,
    parts: int = 3,
) -> dict:
    """The configured estimator's gradient next to the exact one on the same batch, per step range and in total.

    Both come from :func:`jagg.policy_gradient` with ``only_steps`` set to each range (knots, routing and the
    unbiased correction's picks are those of the whole trajectory and the same for every range), so the ranges'
    gradients sum to the totals. The parameters' ``.grad`` are left as they were.

    Args:
        velocity_fn, traj, advantages, config, ref_velocities, sample_groups: as for :func:`jagg.policy_gradient`.
        params: the trainable parameters whose gradients are compared.
        generator: RNG of the correction's picks (one seed drawn from it serves every range).
        parts: number of step ranges (3: noisy, middle, clean thirds of the trained steps).

    Returns:
        ``{"cos": total cosine, "rel_err": ||g - g_exact|| / ||g_exact||, "cos_<range>": per range (``noisy``,
        ``middle``, ``clean`` for 3 parts, else ``range0`` ...), "rows": rows the audit ran through the network with
        grad, "seconds": its wall-clock}``. A cosine is NaN where a gradient is zero (e.g. all advantages 0).
    """
    check_call(velocity_fn, traj, config, generator=generator)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an integer >= 1 (3: noisy, middle and clean thirds); got {parts!r}")
    params = list(params)
    if not params or not all(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
        raise ValueError("params must be a non-empty sequence of parameters with requires_grad (the ones the "
                         "gradient is compared over)")
    t0 = time.perf_counter()
    saved = [p.grad for p in params]
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    exact = dataclasses.replace(config, mode="exact")
    ranges = step_ranges(traj.train_steps.tolist(), parts)
    names = list(RANGE_NAMES) if len(ranges) == 3 else [f"range{i}" for i in range(len(ranges))]
    out: dict = {}
    totals = {"exact": 0.0, "est": 0.0}
    rows = 0
    try:
        for name, steps in zip(names, ranges):
            grads = {}
            for key, cfg in (("exact", exact), ("est", config)):
                for p in params:
                    p.grad = None
                st = policy_gradient(velocity_fn, traj, advantages, cfg, ref_velocities=ref_velocities,
                                     sample_groups=sample_groups, generator=torch.Generator().manual_seed(seed),
                                     only_steps=steps)
                rows += st.backward_items
                grads[key] = _flat(params)
                totals[key] = totals[key] + grads[key]
            out[f"cos_{name}"] = _cos(grads["est"], grads["exact"])
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    ge, gj = totals["exact"], totals["est"]
    n = float(ge.norm())
    out["cos"] = _cos(gj, ge)
    out["rel_err"] = float((gj - ge).norm()) / n if n > 0 else float("nan")
    out["rows"] = rows
    out["seconds"] = time.perf_counter() - t0
    return out
