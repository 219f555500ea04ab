"""Every estimator's gradient measured side by side on one trainer minibatch: the meter's measurement on a sampler.
The batches (:class:`MeasuredBatch`, drawn and cut as the trainer draws and cuts them), each estimator's gradients on
them at an update position of a rollout, and one record per estimator of its error against the update's noise, its
cost and the meter's answer (:func:`jagg.verdict.prediction`). ``jagg bench meter`` measures with it on a sampler of
its own (the module docstring of :mod:`jagg.bench.meter_command` says what each record holds); ``estimator.mode: auto``
(:mod:`jagg.trainers.auto`) keeps its records per update position (:func:`position_records`) on the run's own
sampler, at the run's start.

A sampler is :class:`jagg.trainers.shapes_trainer.ShapesSampler` or :class:`jagg.trainers.diffusers_trainer.DiffusersSampler`: its
``sample``, ``score``, ``velocity``, ``reference``, ``params``, ``param_names`` and ``zero_grad``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..audit import flat_grad
from ..cost import config_structure
from ..estimator import policy_gradient, reference_velocities
from ..estimator_config import EstimatorConfig
from ..infra.sizes import held_over_half
from ..knots import layout_intervals, plan_update
from ..meter import adam_efficiency, error_noise_stats, extrapolate, predicted_efficiency
from ..routing import linearity_scores
from ..trajectory import Trajectory
from ..verdict import prediction
from .rollout import rollout_batch, take
from .minibatches import cut_minibatches

Sampler = Any          # a ShapesSampler or a DiffusersSampler (module docstring)
TrainConfig = Any      # a ShapesTrainConfig or a DiffusersTrainConfig


@dataclass
class MeasuredBatch:
    """One batch as :func:`training_batch` drew it, kept so that every estimator runs on the same batches."""

    traj: Trajectory
    tokens: Tensor
    adv: Tensor
    prompt_groups: Tensor
    ref_v: Tensor | None = None       # the KL reference's velocities [B, T, *S] when estimator.kl_beta > 0


def training_batch(sampler: Sampler, cfg: TrainConfig):
    """One update's training batch through the trainer's own pipeline (:func:`jagg.trainers.rollout.rollout_batch`), cut
    as the trainer cuts its minibatches (``grpo.minibatches``, :func:`jagg.trainers.minibatches.cut_minibatches`: one
    of the rollout's ``grpo.updates_per_epoch``, drawn with the sampler's generator): ``(traj, conditioning,
    advantages, prompt_groups, rollout CPU seconds)`` of its kept samples."""
    t0 = time.process_time()
    batch = rollout_batch(sampler.sample, sampler.score, cfg)
    seconds = time.process_time() - t0
    idx, ro = batch.keep_idx, batch.rollout
    cut = cut_minibatches(batch.prompt_groups[idx], cfg.grpo.updates_per_epoch, cfg.minibatch_cut, sampler.gen)
    idx = idx[max(cut, key=lambda mb: mb.numel())]                  # one of the update's minibatches (not empty)
    return ro.traj.select(idx), take(ro.conditioning, idx), batch.advantages[idx], batch.prompt_groups[idx], seconds


def kept_batch(sampler: Sampler, cfg: TrainConfig) -> tuple[MeasuredBatch, float]:
    """One :func:`training_batch` as a :class:`MeasuredBatch`, with the KL reference's velocities when
    ``estimator.kl_beta > 0`` (as the trainers compute them once per rollout), and its rollout CPU seconds."""
    traj, cond, adv, prompt_groups, seconds = training_batch(sampler, cfg)
    e = cfg.estimator
    ref_v = reference_velocities(sampler.reference(cond), traj, e.micro_batch) if e.kl_beta > 0 else None
    return MeasuredBatch(traj, cond, adv, prompt_groups, ref_v), seconds


def expected_rows(traj, cfg: EstimatorConfig, prompt_groups, draws: int = 64) -> float:
    """Rows with grad per sample of ``cfg`` on ``traj``, the mean over ``draws`` plans (no network call)."""
    gen = torch.Generator().manual_seed(0)
    n = draws if cfg.random else 1
    rows = [plan_update(traj, cfg, prompt_groups, generator=gen).rows for _ in range(n)]
    return statistics.fmean(rows) / traj.batch_size


def bias_z(bias_to_noise: float, se: float) -> float:
    """The repeating error in standard errors (0 for an estimator without one, NaN when its SE is unknown)."""
    if bias_to_noise == 0:
        return 0.0
    return bias_to_noise / se if se > 0 else math.nan


def efficiencies(rows_ratio: float, time_ratio: float, error_to_noise: float, tensor_factor: float) -> dict:
    """The six efficiencies (:mod:`jagg.bench.meter_command`'s docstring) of an estimator with these work ratios against exact, this error and
    this per-update factor of Adam's per-tensor model (:func:`jagg.meter.adam_tensor_factor`)."""
    return {"efficiency": predicted_efficiency(rows_ratio, error_to_noise),
            "time_efficiency": predicted_efficiency(time_ratio, error_to_noise),
            "adam_efficiency": adam_efficiency(rows_ratio, error_to_noise),
            "adam_time_efficiency": adam_efficiency(time_ratio, error_to_noise),
            "adam_tensor_efficiency": rows_ratio * tensor_factor,
            "adam_tensor_time_efficiency": time_ratio * tensor_factor}


def projected_efficiencies(iter_ratio: float, error_to_noise: float, tensor_factor: float) -> dict:
    """``projected_iter_ratio`` (a :class:`~jagg.cost.CostStructure`'s) and the per-update efficiencies
    times it: ``projected_time_efficiency`` (SGD's model), ``projected_adam_time_efficiency``,
    ``projected_adam_tensor_time_efficiency``."""
    return {"projected_iter_ratio": iter_ratio,
            "projected_time_efficiency": predicted_efficiency(iter_ratio, error_to_noise),
            "projected_adam_time_efficiency": adam_efficiency(iter_ratio, error_to_noise),
            "projected_adam_tensor_time_efficiency": iter_ratio * tensor_factor}


def gradients(sampler: Sampler, batch: MeasuredBatch, est: EstimatorConfig, seeds: list[int],
              on_policy: bool = True) -> tuple[Tensor, list]:
    """``[len(seeds), P]`` gradients of ``est`` on ``batch`` (one per pick seed) and per draw ``(CPU seconds, rows
    with grad, no-grad rows)`` per sample and its clip fraction; ``on_policy``: whether the parameters are the batch's
    sampling ones (:func:`step_to_update`)."""
    vf = sampler.velocity(batch.tokens)
    out, costs = [], []
    for seed in seeds:
        sampler.zero_grad()
        c0 = time.process_time()
        with torch.enable_grad():
            st = policy_gradient(vf, batch.traj, batch.adv, est, ref_velocities=batch.ref_v,
                                 prompt_groups=batch.prompt_groups, generator=torch.Generator().manual_seed(seed),
                                 on_policy=on_policy)
        B = batch.traj.batch_size
        costs.append((time.process_time() - c0, st.backward_items / B, st.forward_nograd_items / B, st.clip_frac))
        out.append(flat_grad(sampler.params).double())
    return torch.stack(out), costs


def step_to_update(sampler: Sampler, cfg: TrainConfig, preceding: list[MeasuredBatch], opt=None):
    """Move the sampler's trainable parameters by one AdamW step (``cfg.optim``) on the exact gradient of each batch of
    ``preceding`` in turn, clipped as the trainer clips it: to where the ``len(preceding) + 1``-th optimizer update of
    a rollout starts, the updates before it made on other samples of the same policy's rollouts (the trainer's on the
    other minibatches of its rollout). ``opt``: the optimizer of the steps before these (None: a fresh one, at the
    rollout's start); returned, so that a caller can go on one position at a time. The caller restores the
    parameters (:func:`restore_params`)."""
    o = cfg.optim
    opt = opt if opt is not None else o.optimizer(sampler.params)
    for batch in preceding:
        sampler.zero_grad()
        with torch.enable_grad():
            policy_gradient(sampler.velocity(batch.tokens), batch.traj, batch.adv, cfg.estimator.exact(),
                            ref_velocities=batch.ref_v, prompt_groups=batch.prompt_groups)
        if o.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(sampler.params, o.max_grad_norm)
        opt.step()
    return opt


def restore_params(sampler: Sampler, values: list[Tensor]) -> None:
    """Copy ``values`` (saved with ``[p.detach().clone() for p in sampler.params]``) back into the sampler's
    trainable parameters, after :func:`step_to_update` or another in-place step."""
    with torch.no_grad():
        for p, v in zip(sampler.params, values):
            p.copy_(v)


def layout_linearity(batches: list[MeasuredBatch], est: EstimatorConfig) -> dict:
    """Routing's linearity score (:func:`jagg.routing.linearity_scores`, the paper's test, what ``jagg_frac`` ranks
    by) of a JAGG estimator's own layout on the measured rollouts, from their velocities alone (no backward pass):
    ``linearity``, the mean over samples and intervals of three or more steps (shorter ones are exact under JAGG),
    and ``linearity_min``, the lowest; NaN for an estimator that interpolates nothing. Across 17 sampling regimes
    the error against the noise fell as it rose (docs/results.md)."""
    scores = []
    for batch in batches:
        intervals, _, jagg = layout_intervals(batch.traj, est)
        if jagg:
            sc = linearity_scores(batch.traj.velocities, intervals)
            scores.append(sc[torch.isfinite(sc)].double().cpu())
    s = torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64)
    return {"linearity": float(s.mean()) if s.numel() else math.nan,
            "linearity_min": float(s.min()) if s.numel() else math.nan}


def draw_batches(sampler: Sampler, cfg: TrainConfig, n: int) -> tuple[list[MeasuredBatch], list[float]]:
    """``n`` batches of the sampler (:func:`kept_batch`, in turn) and their rollout CPU seconds."""
    drawn = [kept_batch(sampler, cfg) for _ in range(n)]
    return [b for b, _ in drawn], [s for _, s in drawn]


def with_subsample(ests: dict[str, EstimatorConfig | None], first: MeasuredBatch,
                   base: EstimatorConfig) -> dict[str, EstimatorConfig]:
    """``ests`` with ``subsample`` given as None resolved: random timestep subsampling at ``base``'s rows per sample
    (:func:`expected_rows` on the first batch), the baseline a user would pick instead."""
    if ests.get("subsample", 0) is not None:
        return ests
    frac = min(1.0, expected_rows(first.traj, base, first.prompt_groups) / first.traj.train_steps.numel())
    return {**ests, "subsample": dataclasses.replace(base, mode="subsample", subsample_frac=frac, interval_frac=1.0)}


def measure_records(sampler: Sampler, cfg: TrainConfig, ests: dict[str, EstimatorConfig], kept: list[MeasuredBatch],
                    rollout_s: list[float], draws: int, update: int, seed: int, target_batch: int | None = None,
                    cost=None, index: dict[str, int] | None = None) -> list[dict]:
    """One record per estimator of ``ests`` (``exact`` among them) on the batches ``kept`` at the sampler's current
    parameters, which are those of the rollout's update ``update`` (0: on-policy): every estimator's gradients on a
    batch, then the next batch (side by side), ``draws`` per batch of a random one, each with the pick seed of
    ``seed``, the batch and its ``index`` (default: its place in ``ests``); ``rollout_s``: the batches' rollout CPU
    seconds; ``target_batch``: the samples per update to extrapolate to (default: the config's per optimizer update);
    ``cost``: the :class:`jagg.cost.CostStructure` of the projected columns (None: the job's own)."""
    index = index or {name: i for i, name in enumerate(ests)}
    grads = {name: [] for name in ests}        # name -> per batch [draws, P]
    costs = {name: [] for name in ests}        # name -> per draw (CPU seconds, rows, no-grad rows) per sample
    for b, batch in enumerate(kept):           # side by side: every estimator on a batch, then the next batch
        for name, est in ests.items():
            seeds = [seed * 1_000_003 + b * 1009 + d * 31 + index[name] for d in range(draws if est.random else 1)]
            g, c = gradients(sampler, batch, est, seeds, on_policy=not update)
            grads[name].append(g)
            costs[name] += c
    linearity = {name: layout_linearity(kept, est) for name, est in ests.items()}
    target = target_batch or cfg.sample.batch_size // cfg.grpo.updates_per_epoch
    return position_records(cfg, ests, grads, costs, rollout_s, [b.traj.batch_size for b in kept], linearity, update,
                            (sampler.params, sampler.param_names), draws, target, cost)


def position_records(cfg: TrainConfig, ests: dict[str, EstimatorConfig], grads: dict[str, list[Tensor]],
                     costs: dict[str, list[tuple]], rollout_s: list[float], batch_sizes: list[int], linearity: dict,
                     update: int, params: tuple[list, list[str]], draws: int, target: int, cost=None) -> list[dict]:
    """The records of one update position from what was measured there: per estimator of ``ests``, its gradients
    ``grads[name]`` (per batch ``[draws, P]``, exact's first draw the reference), ``costs[name]`` (per draw ``(CPU
    seconds, rows, no-grad rows, clip fraction)``, rows per sample), the batches' rollout CPU seconds and sizes, and its
    layout's ``linearity`` (:func:`layout_linearity`); ``params``: the trainable parameters and their names;
    ``target``: the samples per update the error is extrapolated to (the batches' own size: none)."""
    exact = torch.stack([g[0] for g in grads["exact"]])                      # [batches, P]
    t_roll = statistics.median(rollout_s)
    t_exact = statistics.median(c[0] for c in costs["exact"])
    r_exact = statistics.fmean(c[1] for c in costs["exact"])
    n_samples = statistics.fmean(batch_sizes)
    cost = cost or config_structure(cfg)
    nograd_exact = statistics.fmean(c[2] for c in costs["exact"])
    clip_exact = statistics.fmean(c[3] for c in costs["exact"])
    sizes, tensor_names = [p.numel() for p in params[0]], params[1]                          # the parameters' order
    records = []
    for name, est in ests.items():
        st = error_noise_stats(exact, grads[name], sizes)
        r = statistics.fmean(c[1] for c in costs[name])
        t = statistics.median(c[0] for c in costs[name])
        nograd = statistics.fmean(c[2] for c in costs[name]) - nograd_exact
        time_ratio = (t_roll + t_exact) / (t_roll + t)
        tensors = [{"tensor": n, **t} for n, t in zip(tensor_names, st.pop("tensors"))]
        rec = {"estimator": name, "mode": est.mode, "minibatches": cfg.minibatch_cut, "batches": len(batch_sizes),
               "draws": draws if est.random else 1,
               "samples_per_batch": n_samples, "target_batch": target, "rows_per_sample": r,
               "nograd_per_sample": nograd, "rows_ratio": r_exact / r, "train_s": t, "rollout_s": t_roll,
               "iter_ratio": time_ratio, "update": update, "clip_frac": statistics.fmean(c[3] for c in costs[name]),
               "clip_frac_exact": clip_exact, **st, "bias_z": bias_z(st["bias_to_noise"], st["bias_to_noise_se"]),
               **efficiencies(r_exact / r, time_ratio, st["error_to_noise"], st["adam_tensor_factor"]),
               **projected_efficiencies(cost.iteration_ratio(r / r_exact, nograd / r_exact), st["error_to_noise"],
                                        st["adam_tensor_factor"]),
               **linearity[name], "estimator_config": est.to_dict(), "tensors": tensors}
        at = extrapolate({**st, "tensors": tensors}, n_samples, target)
        rec.update({f"{k}_at_target": v for k, v in at.items()})
        at_eff = efficiencies(r_exact / r, time_ratio, at["error_to_noise"], at["adam_tensor_factor"])
        rec.update({f"{k}_at_target": v for k, v in at_eff.items()})
        records.append({**rec, **prediction(rec)})
    return records


# after(u, records, ests) -> the estimators to measure at update u + 1 (exact among them), or None to stop there
After = Callable[[int, list[dict], dict[str, EstimatorConfig]], "dict[str, EstimatorConfig] | None"]


def check_held_gradients(sampler: Sampler, ests: dict[str, EstimatorConfig | None], batches: int, draws: int) -> None:
    """Refuse, before a batch is drawn, a measurement whose gradients at one update position (float64, one per batch
    and estimator draw; None: random timestep subsampling, drawn ``draws`` times) would take more than half this
    machine's memory, naming what to lower."""
    vectors = batches * sum(draws if est is None or est.random else 1 for est in ests.values())
    numel = sum(p.numel() for p in sampler.params)
    why = held_over_half(8.0 * vectors * numel, f"the meter holds {vectors} float64 gradients of the {numel:,} "
                         f"trainable parameters at an update position (--batches {batches} x the estimators' draws)")
    if why is not None:
        raise ValueError(f"{why}; measure a LoRA of the job (a proxy), or lower --batches, --draws or the estimators")


def measure_positions(sampler: Sampler, cfg: TrainConfig, ests: dict[str, EstimatorConfig | None], batches: int,
                      draws: int, updates: int, seed: int, target_batch: int | None = None, cost=None,
                      after: After | None = None) -> list[list[dict]]:
    """:func:`measure_records` at update positions ``0 .. updates-1`` of a rollout, on the same ``batches`` batches
    drawn first: position ``u`` at the parameters :func:`step_to_update` reaches with ``u`` batches drawn after them,
    so each position's records are those of a measurement of that position alone with the same seeds (``jagg bench
    meter --update u``). ``after`` (optional) picks the estimators of the next position from a position's records, or
    stops (None). The sampler's parameters are restored at the end. Returns the records per measured position."""
    check_held_gradients(sampler, ests, batches, draws)
    kept, rollout_s = draw_batches(sampler, cfg, batches)
    e = cfg.estimator
    ests = with_subsample(ests, kept[0], e.candidate_base() if e.mode == "auto" else e)
    index = {name: i for i, name in enumerate(ests)}
    sampling = [p.detach().clone() for p in sampler.params]
    preceding, opt, out = [], None, []
    try:
        for u in range(updates):
            if u:                                  # one more update before this position, on a batch of its own
                here = [p.detach().clone() for p in sampler.params]
                restore_params(sampler, sampling)  # sampled as the rollout's other minibatches: at its parameters
                preceding.append(kept_batch(sampler, cfg)[0])
                restore_params(sampler, here)
                opt = step_to_update(sampler, cfg, preceding[-1:], opt)
            out.append(measure_records(sampler, cfg, ests, kept, rollout_s, draws, u, seed, target_batch, cost, index))
            ests = ests if after is None else after(u, out[-1], ests)
            if ests is None:
                break
    finally:
        restore_params(sampler, sampling)
        sampler.zero_grad()
    return out
