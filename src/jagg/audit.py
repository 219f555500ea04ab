"""The audit: how close the configured estimator's gradient is to the exact one, in total and per step range.

A same-batch gradient cosine is a diagnostic, not a verdict, and the total is decided by the clean steps, whose
upstream signals are largest; the noisy steps decide layout. So the audit compares per range of trained steps
(thirds: noisy, middle, clean) as well as in total. The trainers run it every ``estimator.meter_every`` iterations
on a few samples and log ``audit/*``; ``python -m lab fidelity`` reports the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .checks import check_count
from .estimator import check_batch_arguments, check_call, policy_gradient
from .estimator_config import EstimatorConfig
from .trajectory import Trajectory, VelocityFn

RANGE_NAMES = ("noisy", "middle", "clean")
FLAG_BELOW = 0.8     # a step range whose same-batch cosine falls below this flags a biased estimator (plain JAGG)


def audit_flag(result: dict, config: EstimatorConfig) -> str | None:
    """A warning when a biased estimator (JAGG without the unbiased correction) has a step range whose cosine to
    exact is below :data:`FLAG_BELOW`, else None. (With the correction on, ``correction_p > 0`` or a rate of
    ``correction_probs``, the estimate is unbiased: a low same-batch cosine is then noise, which averages out over
    updates.)"""
    if config.mode != "jagg" or config.corrects:
        return None
    low = {k[4:]: v for k, v in result.items() if k.startswith("cos_") and v is not None and v < FLAG_BELOW}
    if not low:
        return None
    where = ", ".join(f"{k} {v:.2f}" for k, v in low.items())
    return (f"audit: JAGG's gradient is far from exact in part of the trajectory (cosine {where}; below "
            f"{FLAG_BELOW}). Its error there is a bias that can repeat from batch to batch and drive the reward down; "
            "consider estimator.correction_p (e.g. 0.25: unbiased JAGG), or keep exact the intervals where the error "
            "lives (exact_first_intervals / exact_last_intervals; jagg bench meter --by-interval finds them)")


CLIP_RATIO_FLAG = 1.5   # an estimator clipping more than this times exact's terms (plus CLIP_FLOOR) is flagged
CLIP_FLOOR = 0.01


def clip_flag(result: dict) -> str | None:
    """A warning when the estimator clips clearly more (sample, step) terms than exact on the same samples and
    parameters (more than :data:`CLIP_RATIO_FLAG` x exact's fraction + :data:`CLIP_FLOOR`), else None: its inner steps'
    velocities are off, e.g. ``intermediate: interp`` in an off-policy update (``update`` > 0 of a rollout), and every
    wrongly clipped term's gradient is lost."""
    est, exact = result.get("clip_frac_est"), result.get("clip_frac_exact")
    if est is None or exact is None or not est > CLIP_RATIO_FLAG * exact + CLIP_FLOOR:
        return None
    where = f" at update {result['update']} of the rollout" if "update" in result else ""
    return (f"audit: the estimator clips {est:.3f} of its terms against exact's {exact:.3f}{where}: its inner steps' "
            "ratios are off (off-policy, intermediate: interp extrapolates them); use estimator.intermediate=auto "
            "(interp on-policy, fresh off-policy) or fresh")


def step_ranges(train_steps: Sequence[int], parts: int = 3) -> list[list[int]]:
    """The trained steps split into ``parts`` contiguous, near-equal ranges, noisiest first (fewer when there are
    fewer steps)."""
    steps = [int(k) for k in train_steps]
    return [list(map(int, r)) for r in np.array_split(steps, min(parts, len(steps))) if len(r)]


def flat_grad(params: Sequence[torch.nn.Parameter]) -> Tensor:
    """All ``.grad`` concatenated into one fp64 vector ``[P]`` (zeros where a grad is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def cosine(a: Tensor, b: Tensor) -> float | None:
    """Cosine similarity of two vectors; None (undefined, never a NaN passed off as a number) when either is zero."""
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else None


def rel_err(approx: Tensor, ref: Tensor) -> float | None:
    """``||approx - ref|| / ||ref||``; None (undefined) when ``ref`` is zero."""
    n = float(ref.norm())
    return float((approx - ref).norm()) / n if n > 0 else None


def _rows(traj: Trajectory, config: EstimatorConfig, prompt_groups, seed: int) -> int:
    """Rows with grad of one update of ``config`` on ``traj`` with the audit's picks."""
    from .knots import plan_update

    return plan_update(traj, config, prompt_groups, generator=torch.Generator().manual_seed(seed)).rows


@dataclass
class _SubBatch:
    """One sub-batch of the audit (a ``split`` id's samples): its trajectory, advantages, prompt groups, reference
    velocities, the seed of its picks, its share ``n / B`` of the audit batch and its samples' positions ``[n]`` in
    it (None: the whole batch)."""

    traj: Trajectory
    advantages: Tensor
    prompt_groups: Tensor | Sequence | None
    ref_velocities: Tensor | None
    seed: int
    share: float
    index: Tensor | None = None

    def velocity(self, velocity_fn: VelocityFn) -> VelocityFn:
        """The audit batch's velocity callable for this sub-batch: its sample ``i`` is the batch's ``index[i]``."""
        if self.index is None:
            return velocity_fn
        index = self.index
        return lambda x, sigma, sample_index: velocity_fn(x, sigma, index.to(sample_index.device)[sample_index])


def _sub_batches(traj: Trajectory, advantages, prompt_groups, ref_velocities, split, seed: int) -> list[_SubBatch]:
    """The audit batch cut by ``split`` (one id per sample; None: one sub-batch, the whole batch)."""
    B = traj.batch_size
    split_ids = torch.zeros(B, dtype=torch.long) if split is None else torch.as_tensor(split).flatten().cpu()
    if split_ids.numel() != B:
        raise ValueError(f"split must have one id per sample ([{B}]); got {tuple(split_ids.shape)}")
    subs = [torch.nonzero(split_ids == u).flatten() for u in torch.unique(split_ids)]
    out = []
    for j, idx in enumerate(subs):
        members = None if prompt_groups is None else (
            [prompt_groups[int(i)] for i in idx] if not isinstance(prompt_groups, Tensor) else prompt_groups[idx])
        if len(subs) == 1:
            out.append(_SubBatch(traj, advantages, members, ref_velocities, seed + j, idx.numel() / B))
            continue
        ref = None if ref_velocities is None else ref_velocities[idx.to(ref_velocities.device)]
        out.append(_SubBatch(traj.select(idx.to(traj.latents.device)), advantages[idx.to(advantages.device)], members,
                             ref, seed + j, idx.numel() / B, idx))
    return out


def _range_gradients(velocity_fn, config: EstimatorConfig, params: list, subs: list[_SubBatch],
                     ranges: list[list[int]], names: list[str], on_policy: bool | None = None) -> tuple[dict, dict]:
    """Per step range, the exact and the configured gradients of every sub-batch (``policy_gradient(...,
    only_steps=range)``): the ranges' cosines ``{"cos_<name>": ...}``, the clip fractions of both over all their terms
    (``clip_frac_exact``, ``clip_frac_est``), and each sub-batch's gradients summed over the ranges ``{"exact": [m],
    "est": [m]}``."""
    exact = config.exact()
    out: dict = {}
    part_grads = {"exact": [0.0] * len(subs), "est": [0.0] * len(subs)}
    clipped, terms = {"exact": 0.0, "est": 0.0}, 0
    for name, steps in zip(names, ranges):
        grads = {"exact": 0.0, "est": 0.0}
        for j, sub in enumerate(subs):
            for key, cfg in (("exact", exact), ("est", config)):
                for p in params:
                    p.grad = None
                st = policy_gradient(sub.velocity(velocity_fn), sub.traj, sub.advantages, cfg,
                                     ref_velocities=sub.ref_velocities, prompt_groups=sub.prompt_groups,
                                     generator=torch.Generator().manual_seed(sub.seed), only_steps=steps,
                                     on_policy=on_policy)
                if all(p.grad is None for p in params):
                    raise ValueError(f"params: velocity_fn does not use any of these {len(params)} parameters (no "
                                     "gradient reached them), so every cosine would be undefined; pass the parameters "
                                     "velocity_fn trains, e.g. [p for p in model.parameters() if p.requires_grad]")
                clipped[key] += st.clip_frac * len(steps) * sub.traj.batch_size
                g = flat_grad(params)
                grads[key] = grads[key] + g * sub.share                    # the whole audit batch's gradient
                part_grads[key][j] = part_grads[key][j] + g
            terms += len(steps) * sub.traj.batch_size
        out[f"cos_{name}"] = cosine(grads["est"], grads["exact"])
    out["clip_frac_exact"], out["clip_frac_est"] = clipped["exact"] / max(terms, 1), clipped["est"] / max(terms, 1)
    return out, part_grads


def audit_parts(velocity_fn, traj, advantages, config, params, ref_velocities=None, prompt_groups=None,
                generator=None, parts: int = 3, split=None,
                on_policy: bool | None = None) -> tuple[dict, Tensor, Tensor]:
    """:func:`audit_gradient`, also returning the exact and the estimator's gradients of each sub-batch of ``split``
    (``[n]`` ids, e.g. the prompt groups): ``(result, exact [m, P], estimate [m, P])``, float64, each sub-batch's
    gradient a mean over its own samples (so the ``m`` rows are independent estimates of one update's gradient)."""
    check_call(velocity_fn, traj, config, generator=generator)
    advantages = check_batch_arguments(traj, config, advantages, ref_velocities, prompt_groups)
    parts = check_count(parts, "parts (3: noisy, middle and clean thirds)")
    params = list(params) if hasattr(params, "__iter__") and not isinstance(params, (Tensor, str)) else params
    if not isinstance(params, list) or not params or not all(isinstance(p, Tensor) and p.requires_grad
                                                             for p in params):
        raise ValueError("params must be a non-empty sequence of parameters with requires_grad (the ones the "
                         f"gradient is compared over, e.g. list(model.parameters())); got {type(params).__name__}")
    t0 = time.perf_counter()
    subs = _sub_batches(traj, advantages, prompt_groups, ref_velocities, split, 0)
    saved = [p.grad for p in params]
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    for sub in subs:
        sub.seed += seed
    ranges = step_ranges(traj.train_steps.tolist(), parts)
    names = list(RANGE_NAMES) if len(ranges) == 3 else [f"range{i}" for i in range(len(ranges))]
    exact = config.exact()
    try:
        out, part_grads = _range_gradients(velocity_fn, config, params, subs, ranges, names, on_policy)
        rows = {key: sum(_rows(s.traj, cfg, s.prompt_groups, s.seed) for s in subs)
                for key, cfg in (("exact", exact), ("est", config))}
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    ge = sum(g * s.share for g, s in zip(part_grads["exact"], subs))
    gj = sum(g * s.share for g, s in zip(part_grads["est"], subs))
    out["cos"] = cosine(gj, ge)
    out["rel_err"] = rel_err(gj, ge)
    out["rows_exact"], out["rows_estimator"] = rows["exact"], rows["est"]
    out["rows"] = rows["exact"] + rows["est"]
    out["seconds"] = time.perf_counter() - t0
    return out, torch.stack(part_grads["exact"]), torch.stack(part_grads["est"])


def audit_gradient(
    velocity_fn: VelocityFn,
    traj: Trajectory,
    advantages: Tensor | Sequence[float],
    config: EstimatorConfig,
    params: Sequence[torch.nn.Parameter],
    ref_velocities: Tensor | None = None,
    prompt_groups: Tensor | Sequence | None = None,
    generator: torch.Generator | None = None,
    parts: int = 3,
    on_policy: bool | None = None,
) -> dict:
    """The configured estimator's gradient next to the exact one on the same batch, per step range and in total.

    Both come from :func:`jagg.policy_gradient` with ``only_steps`` set to each range (knots, routing and the
    unbiased correction's picks are those of the whole trajectory and the same for every range), so the ranges'
    gradients sum to the totals. The parameters' ``.grad`` are left as they were.

    Args:
        velocity_fn, traj, advantages, config, ref_velocities, prompt_groups: as for :func:`jagg.policy_gradient`.
        params: the trainable parameters whose gradients are compared.
        generator: RNG of the correction's picks (one seed drawn from it serves every range).
        parts: number of step ranges (3: noisy, middle, clean thirds of the trained steps).
        on_policy: as for :func:`jagg.policy_gradient`: whether ``params`` are those ``traj`` was sampled with (it
            decides ``intermediate="auto"``). Audit off-policy updates too: ``interp``'s error shows only there.

    Returns:
        ``{"cos": total cosine, "rel_err": ||g - g_exact|| / ||g_exact||, "cos_<range>": per range (``noisy``,
        ``middle``, ``clean`` for 3 parts, else ``range0`` ...), "rows_exact", "rows_estimator": rows with grad of
        one update of each on the audit's samples, "rows": rows the audit ran through the network with grad (the
        two together), "clip_frac_exact", "clip_frac_est": the fraction of (sample, step) terms whose
        ratio each clipped, "seconds": its wall-clock}``. A cosine (and ``rel_err``) is None, undefined, where a
        gradient is zero (e.g. all advantages 0), never NaN.

    Raises (naming the argument) on arguments :func:`jagg.policy_gradient` refuses, ``params`` that are not a
    non-empty list of trainable tensors, and parameters ``velocity_fn`` does not use (no gradient reaches them:
    every cosine would be undefined).
    """
    return audit_parts(velocity_fn, traj, advantages, config, params, ref_velocities, prompt_groups, generator,
                       parts, on_policy=on_policy)[0]
