"""``jagg bench meter``: what an estimator's error costs against the noise an update already carries.

A GRPO update is noise-dominated: the exact gradients of independent batches agree with cosine ~0. For an unbiased
estimator ``g^ = g + e`` the update's variance is ``V_b + E|e|^2``, where ``V_b`` is the batch-to-batch variance of
the exact gradient, so progress for the same work goes as (docs/design.md §3)

    efficiency      = (rows_exact / rows) * V_b / (V_b + E|e|^2)        (training-phase rows)
    time_efficiency = (t_exact / t)       * V_b / (V_b + E|e|^2)        (whole iterations, rollout included)

with plain SGD. The trainers use AdamW, whose step the noise normalises: there extra unbiased error costs its square
root, ``adam_efficiency = (rows_exact / rows) * sqrt(V_b / (V_b + E|e|^2))`` and ``adam_time_efficiency`` likewise
(docs/design.md §3.8). Both models hold for an unbiased estimator only; read ``bias_to_noise`` (and ``bias_z``) first.

This benchmark measures every term with the trainer's own sampler (:class:`jagg.trainers.shapes.ShapesSampler` of the
config, the main job by default; for a config with a ``pipeline:`` section, the user's diffusers model,
:class:`jagg.trainers.diffusers.DiffusersSampler`: its LoRA or trainable weights, prompts file and reward, as ``jagg
train`` builds them; no run directory) and :func:`jagg.policy_gradient`, no optimizer step. It draws ``--batches`` independent batches; on each it computes
the exact gradient once and every other estimator ``--draws`` times (fresh random picks per draw; one draw for a
deterministic estimator). Per estimator:

- ``rows_per_sample``: rows back-propagated per sample (the mean over draws);
- ``error_to_noise`` = ``E|e|^2 / V_b``: the mean squared error against the same batch's exact gradient;
- ``bias_to_noise`` = ``|b|^2 / V_b`` with its standard error: ``|b|^2`` is the agreement of the errors' means
  across batches, ``mean_{i != j} <e_i, e_j>``, an unbiased estimate of the squared norm of the error that repeats
  from batch to batch (the bias Adam integrates like a signal). 0 for an unbiased estimator up to its SE;
  ``bias_z`` = ``bias_to_noise / bias_to_noise_se`` (what it told about training: lab/NOTEBOOK.md);
- ``bias_to_signal`` = ``|b|^2 / |E g|^2`` (the signal's squared norm estimated the same way from the exact
  gradients) and ``bias_signal_cos``: a bias is harmless only when it is small against the signal Adam follows;
- ``efficiency``, ``time_efficiency``, ``adam_efficiency`` and ``adam_time_efficiency`` as above (times: medians
  of the training phase per batch in CPU seconds of this process, measured side by side, plus the rollout's median:
  sampling and reward; with ``threads=1`` CPU seconds do not count waiting for a core another process holds);
- ``adam_tensor_efficiency`` and ``adam_tensor_time_efficiency``: Adam's model per parameter tensor, each tensor's
  own ``E_t / V_t`` weighted by its share of Adam's progress (:func:`jagg.meter.tensor_weights`: by the signal where
  it is measured, ``tensor_weighting``), beside the global ratio; ``--by-tensor NAME`` lists the tensors that carry
  most of an estimator's error;
- ``prediction`` with ``rate_lo``, ``rate_hi`` (printed ``rate/update``; times the iteration ratio: ``time_rate_lo``,
  ``time_rate_hi``): the meter's answer, the per-update rate of exact's between SGD's model at the error's upper end
  ``E|e|^2/V_b + 2 SE`` and Adam's at its lower end ``- 2 SE`` (paired seeds fell between the two models), or
  ``unknown`` where no model holds: a repeating error (``bias_z >= 2``), or an error these batches do not resolve
  (the range wider than 0.5: heavy-tailed, one batch of a few can carry most of it; more ``--batches`` narrow it)
  (:func:`prediction`); with several updates per rollout, the mean over the ``--update`` positions predicts the
  job's per-update rate: ``--update all`` measures each position in turn and prints it (:func:`job_prediction`,
  records of ``kind`` ``job`` in ``--json``), ``unknown`` where any position's answer is;
- ``linearity`` and ``linearity_min``: routing's linearity score of a JAGG estimator's layout on the measured
  rollouts (:func:`layout_linearity`; NaN for one that interpolates nothing), the regime's rule of thumb that needs
  no backward pass;
- ``projected_iter_ratio`` and ``projected_time_efficiency``, ``projected_adam_time_efficiency``,
  ``projected_adam_tensor_time_efficiency``: the per-update efficiencies times the iteration ratio of a named cost
  structure (``--cost``, :mod:`jagg.bench.projection`; ``--gpu-bench-json``: B/F measured on a GPU), labelled
  projected, with the structure printed;
- the same extrapolated to ``--target-batch`` samples per update (default: the config's, samples per optimizer
  update): ``V_b`` and the unbiased part of the error fall as ``1 / B``, a bias does not.

Estimators: ``exact`` (the reference, always), ``config`` (the config's estimator), ``plain`` (the config's with
``correction_p=0``, the paper's JAGG), ``subsample`` (random timestep subsampling at the config's rows per sample,
DanceGRPO's timestep_fraction: the baseline a user would pick instead), or ``NAME:KEY=VALUE,...`` (estimator keys on
top of the config's, e.g. ``w8:window=8,correction_p=0.1``; every name once, a defined one not a built-in name).
Standard errors are jackknife over batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import torch
import yaml
from torch import Tensor

from ..audit import clip_flag, flat_grad
from ..meter import adam_efficiency, error_noise_stats, extrapolate, predicted_efficiency
from ..checks import check_unique_names, number_arg, parse_spec
from ..estimator import policy_gradient, reference_velocities
from ..estimator_config import EstimatorConfig
from ..knots import budget_rates, eligible_intervals, interval_rates, layout_intervals, plan_update
from ..routing import linearity_scores
from ..trainers.base import rollout_batch, take
from ..trainers.diffusers_config import DiffusersTrainConfig, has_pipeline_section
from ..trainers.shapes import ShapesSampler
from ..trainers.shapes_config import ShapesTrainConfig
from ..infra import config_loader as configuration
from ..trajectory import Trajectory
from .common import default_config_path, json_if_asked, set_threads, table
from .projection import CostStructure, add_cost_arguments, config_structure, default_cost, resolve

BUILT_IN = ("exact", "config", "plain", "subsample")
QUICK_SETS = ["sample.prompts_per_iter=4", "sample.group_size=4"]


BUDGET_RATES = "by_interval"         # correction_rates=by_interval: rates from the per-interval error (budget_rates)


def wants_budget_rates(spec: str) -> bool:
    """Whether ``spec`` asks for ``correction_rates=by_interval`` (:func:`budget_rates_of`)."""
    items = parse_spec(spec, "--estimator")[1]
    return any(k.removeprefix("estimator.") == "correction_rates" and v == BUDGET_RATES for k, v in items.items())


def parse_estimator(spec: str, base: EstimatorConfig, flag: str = "--estimator") -> tuple[str, EstimatorConfig | None]:
    """``NAME`` (built in) or ``NAME:KEY=VALUE,...`` -> (name, config); ``subsample`` is resolved later (None), and so
    is ``correction_rates=by_interval`` (left out here; :func:`wants_budget_rates`); errors name the option ``flag``."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"{flag} {spec!r}: give a name, e.g. w8:window=8")
    check_unique_names([spec], BUILT_IN, flag)
    if not rest:
        if name not in BUILT_IN:
            raise ValueError(f"{flag} {spec!r}: unknown name; built in: {', '.join(BUILT_IN)}, or give "
                             "NAME:KEY=VALUE,... of estimator keys")
        if name == "exact":
            return name, base.exact()
        if name == "plain":
            return name, base.plain()
        return name, (None if name == "subsample" else base)
    kv = {}
    for key, value in parse_spec(spec, flag)[1].items():
        key = key.removeprefix("estimator.")
        kv[key] = None if key == "correction_rates" and value == BUDGET_RATES else yaml.safe_load(value)
    return name, configuration.from_dict(EstimatorConfig, {**base.to_dict(), **kv}, "estimator")


def parse_estimators(specs: list[str], base: EstimatorConfig) -> dict[str, EstimatorConfig | None]:
    """``exact`` and the ``--estimator`` specs -> ``{name: config}`` (:func:`parse_estimator`), every name once
    (``exact``, always measured, may be given too)."""
    check_unique_names(specs, BUILT_IN, "--estimator")
    return dict(parse_estimator(s, base) for s in ["exact", *[s for s in specs if s != "exact"]])


def check_estimators(specs: list[str], cfg, flag: str = "--estimator") -> None:
    """Every ``--estimator`` spec (or ``flag``'s) parsed and its layout checked against the job's trained steps
    (:func:`jagg.trainers.sections.check_layout`: ``correction_rates`` one per interval, ``window`` and
    ``exact_*_intervals`` within what they count) before the first batch; an error names the spec."""
    from ..trainers.sections import check_layout, steps_source, trained_steps

    s, n, key = cfg.sample, *num_steps_of(cfg)
    K, steps = trained_steps(s, n), steps_source(s, key, n)
    for spec in specs:
        try:
            est = parse_estimator(spec, cfg.estimator, flag)[1]
            if est is not None:
                check_layout(est, K, steps)
        except ValueError as e:
            raise ValueError(e if str(e).startswith(flag) else f"{flag} {spec!r}: {e}") from None


def check_update(update: int | str, cfg) -> None:
    """Refuse an ``--update N`` position the job does not have: its rollouts take ``U = grpo.inner_epochs x
    grpo.updates_per_epoch`` optimizer updates, at positions 0 .. U - 1 (measuring N >= U would report an off-policy
    position of a job that never makes one)."""
    g = cfg.grpo
    U = g.inner_epochs * g.updates_per_epoch
    if update != "all" and update >= U:
        raise ValueError(f"--update {update}: the job makes {U} optimizer update{'s' * (U != 1)} per rollout "
                         f"(grpo.inner_epochs={g.inner_epochs} x grpo.updates_per_epoch={g.updates_per_epoch}), at "
                         f"positions 0 to {U - 1}; give --update below {U} or --update all, or measure a job with more "
                         "updates per rollout (--set grpo.updates_per_epoch=...)")


def expected_rows(traj, cfg: EstimatorConfig, prompt_groups, draws: int = 64) -> float:
    """Rows with grad per sample of ``cfg`` on ``traj``, the mean over ``draws`` plans (no network call)."""
    gen = torch.Generator().manual_seed(0)
    n = draws if cfg.random else 1
    rows = [plan_update(traj, cfg, prompt_groups, generator=gen).rows for _ in range(n)]
    return statistics.fmean(rows) / traj.batch_size


Sampler = ShapesSampler        # or jagg.trainers.diffusers.DiffusersSampler: the same interface
TrainConfig = ShapesTrainConfig | DiffusersTrainConfig


def load_config(path: str, sets: list[str]) -> TrainConfig:
    """The trainer config of ``--config`` with ``--set``: a diffusers one when the YAML has a ``pipeline:`` section
    (as ``jagg train`` decides), the shapes world's otherwise."""
    kind = DiffusersTrainConfig if has_pipeline_section(path) else ShapesTrainConfig
    return configuration.load(kind, path, sets)


def make_sampler(cfg: TrainConfig) -> Sampler:
    """The trainer's own sampler of ``cfg``: :class:`jagg.trainers.diffusers.DiffusersSampler` for a diffusers
    config (the model, LoRA, prompts and reward of ``jagg train``), :class:`ShapesSampler` otherwise."""
    if isinstance(cfg, DiffusersTrainConfig):
        from ..trainers.diffusers import DiffusersSampler

        return DiffusersSampler(cfg)
    return ShapesSampler(cfg)


def check_kl(cfg: TrainConfig) -> None:
    """Refuse ``estimator.kl_beta > 0`` on the shapes world (before any model loads): its sampler carries no KL
    reference (a diffusers config's does: the adapters off, or the frozen copy)."""
    if cfg.estimator.kl_beta > 0 and not isinstance(cfg, DiffusersTrainConfig):
        raise ValueError("estimator.kl_beta > 0: the shapes world's sampler has no KL reference here; "
                         "--set estimator.kl_beta=0")


def num_steps_of(cfg: TrainConfig) -> tuple[int, str]:
    """The sampling steps of ``cfg`` and their key (``pipeline.num_steps`` in a diffusers config)."""
    if isinstance(cfg, DiffusersTrainConfig):
        return cfg.pipeline.num_steps, "pipeline.num_steps"
    return cfg.sample.num_steps, "sample.num_steps"


def training_batch(sampler: Sampler, cfg: TrainConfig):
    """One training batch through the trainer's own pipeline (:func:`jagg.trainers.base.rollout_batch`): ``(traj,
    conditioning, advantages, prompt_groups, rollout CPU seconds)`` of the kept samples."""
    t0 = time.process_time()
    batch = rollout_batch(sampler.sample, sampler.score, cfg)
    seconds = time.process_time() - t0
    idx, ro = batch.keep_idx, batch.rollout
    return ro.traj.select(idx), take(ro.conditioning, idx), batch.advantages[idx], batch.prompt_groups[idx], seconds


def kept_batch(sampler: Sampler, cfg: TrainConfig) -> tuple[Batch, float]:
    """One :func:`training_batch` as a :class:`Batch`, with the KL reference's velocities when
    ``estimator.kl_beta > 0`` (as the trainers compute them once per rollout), and its rollout CPU seconds."""
    traj, cond, adv, prompt_groups, seconds = training_batch(sampler, cfg)
    e = cfg.estimator
    ref_v = reference_velocities(sampler.reference(cond), traj, e.micro_batch) if e.kl_beta > 0 else None
    return Batch(traj, cond, adv, prompt_groups, ref_v), seconds


def check_sizes(batches: int, draws: int, target_batch: int | None = None) -> None:
    """Raise unless ``--batches`` >= 3 (a variance and a bias across batches), ``--draws`` >= 1 and
    ``--target-batch`` (when given) >= 1."""
    if batches < 3:
        raise ValueError(f"--batches must be >= 3 (a variance and a bias across batches); got {batches}")
    if draws < 1:
        raise ValueError(f"--draws must be >= 1; got {draws}")
    if target_batch is not None and target_batch < 1:
        raise ValueError(f"--target-batch must be >= 1; got {target_batch}")


def bias_z(bias_to_noise: float, se: float) -> float:
    """The repeating error in standard errors (0 for an estimator without one, NaN when its SE is unknown)."""
    if bias_to_noise == 0:
        return 0.0
    return bias_to_noise / se if se > 0 else math.nan


def efficiencies(rows_ratio: float, time_ratio: float, error_to_noise: float, tensor_factor: float) -> dict:
    """The six efficiencies (module docstring) of an estimator with these work ratios against exact, this error and
    this per-update factor of Adam's per-tensor model (:func:`jagg.meter.adam_tensor_factor`)."""
    return {"efficiency": predicted_efficiency(rows_ratio, error_to_noise),
            "time_efficiency": predicted_efficiency(time_ratio, error_to_noise),
            "adam_efficiency": adam_efficiency(rows_ratio, error_to_noise),
            "adam_time_efficiency": adam_efficiency(time_ratio, error_to_noise),
            "adam_tensor_efficiency": rows_ratio * tensor_factor,
            "adam_tensor_time_efficiency": time_ratio * tensor_factor}


def budget_rates_of(cfg: TrainConfig, name: str, est: EstimatorConfig, batches: int,
                    pilots: dict | None = None) -> EstimatorConfig:
    """``est`` with ``correction_rates`` from :func:`jagg.knots.budget_rates`: ``D_j`` = plain JAGG's error against the
    noise in each interval (:func:`interval_errors`, on ``batches`` batches of their own: seed ``seed + 1``; kept in
    ``pilots`` for the next estimator of the same plain JAGG), ``r_j`` = the rows one correction runs (the inner
    steps), at the rows of ``est``'s uniform ``correction_p`` over the intervals it corrects."""
    pilot = dataclasses.replace(cfg, seed=cfg.seed + 1)
    pilots = {} if pilots is None else pilots
    key = repr(dataclasses.replace(est.plain(), interval_frac=1.0))
    if key not in pilots:
        pilots[key] = interval_errors(pilot, name, est.plain(), batches, 1)
    parts = pilots[key]
    inner = [r["inner_steps"] for r in parts]
    eligible = eligible_intervals([list(range(n + 2)) for n in inner], True, est)      # the intervals JAGG may take
    scope = interval_rates(eligible, dataclasses.replace(est, correction_p=1.0))         # 1 where corrected
    rows = [float(n) * scope[j] for j, n in enumerate(inner)]
    errors = [r["error_to_noise"] * scope[j] for j, r in enumerate(parts)]
    rates = budget_rates(errors, rows, est.correction_p * sum(rows))
    return dataclasses.replace(est, correction_rates=[round(r, 4) for r in rates])


@dataclass
class Batch:
    """One batch as :func:`training_batch` drew it, kept so that every estimator runs on the same batches."""

    traj: Trajectory
    tokens: Tensor
    adv: Tensor
    prompt_groups: Tensor
    ref_v: Tensor | None = None       # the KL reference's velocities [B, T, *S] when estimator.kl_beta > 0


def _gradients(sampler: Sampler, batch: Batch, est: EstimatorConfig, seeds: list[int],
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


def step_to_update(sampler: Sampler, cfg: TrainConfig, preceding: list[Batch]) -> None:
    """Move the sampler's trainable parameters by one AdamW step (``cfg.optim``, a fresh optimizer) on the exact
    gradient of each batch of ``preceding`` in turn, clipped as the trainer clips it: to where the
    ``len(preceding) + 1``-th optimizer update of a rollout starts, the updates before it made on other samples of the
    same policy's rollouts (the trainer's on the other minibatches of its rollout). The caller restores them."""
    o = cfg.optim
    opt = o.optimizer(sampler.params)
    for batch in preceding:
        sampler.zero_grad()
        with torch.enable_grad():
            policy_gradient(sampler.velocity(batch.tokens), batch.traj, batch.adv, cfg.estimator.exact(),
                            ref_velocities=batch.ref_v, prompt_groups=batch.prompt_groups)
        if o.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(sampler.params, o.max_grad_norm)
        opt.step()


def restore_params(sampler: Sampler, values: list[Tensor]) -> None:
    """Copy ``values`` (saved with ``[p.detach().clone() for p in sampler.params]``) back into the sampler's
    trainable parameters, after :func:`step_to_update` or another in-place step."""
    with torch.no_grad():
        for p, v in zip(sampler.params, values):
            p.copy_(v)


def measure(cfg: TrainConfig, specs: list[str], batches: int, draws: int, target_batch: int | None,
            cost: CostStructure | None = None, update: int = 0) -> list[dict]:
    """One record per estimator (module docstring); ``cost``: the structure of the projected columns (None: the
    job's own, :func:`jagg.bench.projection.config_structure`); ``update``: measure each batch as its rollout's
    ``update + 1``-th optimizer update, at the parameters :func:`step_to_update` reaches with ``update`` batches
    drawn after the measured ones (0: on-policy, at the sampling parameters)."""
    check_sizes(batches, draws, target_batch)
    ests = parse_estimators(specs, cfg.estimator)
    pilots: dict = {}
    for spec in specs:
        if wants_budget_rates(spec):
            name = spec.partition(":")[0]
            ests[name] = budget_rates_of(cfg, name, ests[name], batches, pilots)
            print(f"{name}: correction_rates {ests[name].correction_rates} (budget_rates on {batches} batches of "
                  f"seed {cfg.seed + 1})")
    sampler = make_sampler(cfg)
    sizes = [p.numel() for p in sampler.params]
    tensor_names = sampler.param_names                                                     # sampler.params' order
    grads = {name: [] for name in ests}        # name -> per batch [draws, P]
    costs = {name: [] for name in ests}        # name -> per draw (CPU seconds, rows, no-grad rows) per sample
    rollout_s, kept = [], []

    def run(b: int, name: str, est: EstimatorConfig, e_i: int) -> None:
        seeds = [cfg.seed * 1_000_003 + b * 1009 + d * 31 + e_i for d in range(draws if est.random else 1)]
        g, c = _gradients(sampler, kept[b], est, seeds, on_policy=not update)
        grads[name].append(g)
        costs[name] += c

    for _ in range(batches):
        batch, seconds = kept_batch(sampler, cfg)
        rollout_s.append(seconds)
        kept.append(batch)
    sampling_params = [p.detach().clone() for p in sampler.params] if update else None
    if update:                                     # off-policy: every batch measured where update `update` starts
        step_to_update(sampler, cfg, [kept_batch(sampler, cfg)[0] for _ in range(update)])
    if ests.get("subsample", 0) is None:           # subsample at the config's rows, fixed from the first batch
        first, base = kept[0], cfg.estimator
        frac = min(1.0, expected_rows(first.traj, base, first.prompt_groups) / first.traj.train_steps.numel())
        ests["subsample"] = dataclasses.replace(base, mode="subsample", subsample_frac=frac, interval_frac=1.0)
    for b in range(batches):                       # side by side: every estimator on a batch, then the next batch
        for e_i, (name, est) in enumerate(ests.items()):
            run(b, name, est, e_i)
    exact = torch.stack([g[0] for g in grads["exact"]])                      # [batches, P]
    t_roll = statistics.median(rollout_s)
    t_exact = statistics.median(c[0] for c in costs["exact"])
    r_exact = statistics.fmean(c[1] for c in costs["exact"])
    if sampling_params is not None:
        restore_params(sampler, sampling_params)
    n_samples = statistics.fmean(b.traj.batch_size for b in kept)
    target = target_batch or cfg.sample.batch_size // cfg.grpo.updates_per_epoch
    cost = cost or config_structure(cfg)
    nograd_exact = statistics.fmean(c[2] for c in costs["exact"])
    clip_exact = statistics.fmean(c[3] for c in costs["exact"])
    records = []
    for name, est in ests.items():
        st = error_noise_stats(exact, grads[name], sizes)
        r = statistics.fmean(c[1] for c in costs[name])
        t = statistics.median(c[0] for c in costs[name])
        nograd = statistics.fmean(c[2] for c in costs[name]) - nograd_exact
        time_ratio = (t_roll + t_exact) / (t_roll + t)
        tensors = [{"tensor": n, **t} for n, t in zip(tensor_names, st.pop("tensors"))]
        rec = {"estimator": name, "mode": est.mode, "batches": batches, "draws": draws if est.random else 1,
               "samples_per_batch": n_samples, "target_batch": target, "rows_per_sample": r,
               "nograd_per_sample": nograd, "rows_ratio": r_exact / r, "train_s": t, "rollout_s": t_roll,
               "iter_ratio": time_ratio, "update": update, "clip_frac": statistics.fmean(c[3] for c in costs[name]),
               "clip_frac_exact": clip_exact, **st, "bias_z": bias_z(st["bias_to_noise"], st["bias_to_noise_se"]),
               **efficiencies(r_exact / r, time_ratio, st["error_to_noise"], st["adam_tensor_factor"]),
               **projected_efficiencies(cost.iteration_ratio(r / r_exact, nograd / r_exact), st["error_to_noise"],
                                        st["adam_tensor_factor"]),
               **layout_linearity(kept, est), "estimator_config": est.to_dict(), "tensors": tensors}
        at = extrapolate({**st, "tensors": tensors}, n_samples, target)
        rec.update({f"{k}_at_target": v for k, v in at.items()})
        at_eff = efficiencies(r_exact / r, time_ratio, at["error_to_noise"], at["adam_tensor_factor"])
        rec.update({f"{k}_at_target": v for k, v in at_eff.items()})
        records.append({**rec, **prediction(rec)})
    return records


def layout_linearity(batches: list[Batch], est: EstimatorConfig) -> dict:
    """Routing's linearity score (:func:`jagg.routing.linearity_scores`, the paper's test, what ``jagg_frac`` ranks
    by) of a JAGG estimator's own layout on the measured rollouts, from their velocities alone (no backward pass):
    ``linearity``, the mean over samples and intervals of three or more steps (shorter ones are exact under JAGG),
    and ``linearity_min``, the lowest; NaN for an estimator that interpolates nothing. Across 17 sampling regimes
    the error against the noise fell as it rose (lab/NOTEBOOK.md §9.6)."""
    scores = []
    for batch in batches:
        intervals, _, jagg = layout_intervals(batch.traj, est)
        if jagg:
            sc = linearity_scores(batch.traj.velocities, intervals)
            scores.append(sc[torch.isfinite(sc)].double().cpu())
    s = torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64)
    return {"linearity": float(s.mean()) if s.numel() else math.nan,
            "linearity_min": float(s.min()) if s.numel() else math.nan}


# the widest range of a per-update rate the meter still answers with (docs/design.md §3.8): a wider one cannot tell
# an estimator that keeps most of exact's learning from one that loses most of it
MAX_RANGE = 0.5


def rate_range(error_to_noise: float, se: float) -> tuple[float, float]:
    """The per-update rate (of exact's) an unbiased error ``E|e|^2/V_b = error_to_noise`` (jackknife SE ``se``) leaves:
    from SGD's variance model at the error's upper end ``+ 2 SE`` to Adam's first-order model at its lower end
    ``- 2 SE`` (clamped at 0). Paired seeds fell between the two models and on both of their sides (lab/NOTEBOOK.md
    §9.5), so neither alone is the prediction."""
    return predicted_efficiency(1.0, error_to_noise + 2 * se), adam_efficiency(1.0, max(error_to_noise - 2 * se, 0.0))


def prediction(rec: dict) -> dict:
    """The meter's answer for one estimator's record: the per-update rate between SGD's model at the error's upper end
    and Adam's at its lower end (:func:`rate_range`: ``rate_lo``, ``rate_hi``; times the iteration ratio
    ``time_rate_lo``, ``time_rate_hi``) and ``prediction``: ``range``, or ``unknown`` where the models do not hold, a
    significant repeating error (``bias_z >= 2``), or where the range is wider than :data:`MAX_RANGE` (a heavy-tailed
    error that these batches do not resolve: more ``--batches`` narrow it). ``prediction_range`` prints it. For a job
    of ``U`` updates per rollout the per-update rate is the mean of the ranges at ``--update 0 .. U-1``
    (lab/NOTEBOOK.md §9.5)."""
    lo, hi = rate_range(rec["error_to_noise"], rec["error_to_noise_se"])
    ratio, z = rec["iter_ratio"], rec["bias_z"]
    if z is not None and math.isfinite(z) and z >= 2:
        why = "unknown: a significant repeating error (bias z >= 2)"
    elif not hi - lo <= MAX_RANGE:
        why = f"unknown: the error is not resolved (the range is wider than {MAX_RANGE}: measure more --batches)"
    else:
        why = "range"
    return {"rate_lo": lo, "rate_hi": hi, "time_rate_lo": ratio * lo, "time_rate_hi": ratio * hi, "prediction": why,
            "prediction_range": f"{lo:.2f}-{hi:.2f}" if why == "range" else "unknown"}


def job_prediction(per_update: list[list[dict]]) -> list[dict]:
    """The meter's answer for a job of ``U`` optimizer updates per rollout, from its records at ``--update 0 .. U-1``
    (``per_update[u]``: :func:`measure`'s records at position ``u``, the same estimators in the same order). Per
    estimator: ``rate_lo``, ``rate_hi`` (and ``time_rate_lo``, ``time_rate_hi``), the means of the positions'
    :func:`prediction` ranges, for the job's per-update rate is the mean of its updates'; ``prediction`` is ``range``
    only where every position's is, else the first position's reason, with ``unknown_at`` listing the positions;
    ``positions`` prints each position's range (lab/NOTEBOOK.md §9.5)."""
    if not per_update:
        raise ValueError("job_prediction: no update positions given")
    names = [r["estimator"] for r in per_update[0]]
    for u, recs in enumerate(per_update):
        if [r["estimator"] for r in recs] != names:
            raise ValueError(f"job_prediction: update {u} measured the estimators {[r['estimator'] for r in recs]}, "
                             f"update 0 measured {names}")
    out = []
    for i, name in enumerate(names):
        preds = [prediction(recs[i]) for recs in per_update]
        unknown = [u for u, p in enumerate(preds) if p["prediction"] != "range"]
        mean = {k: statistics.fmean(p[k] for p in preds) for k in ("rate_lo", "rate_hi", "time_rate_lo", "time_rate_hi")}
        out.append({"kind": "job", "estimator": name, "updates": len(per_update), **mean,
                    "prediction": preds[unknown[0]]["prediction"] if unknown else "range", "unknown_at": unknown,
                    "prediction_range": "unknown" if unknown else f"{mean['rate_lo']:.2f}-{mean['rate_hi']:.2f}",
                    "positions": " ".join(p["prediction_range"] for p in preds)})
    return out


def projected_efficiencies(iter_ratio: float, error_to_noise: float, tensor_factor: float) -> dict:
    """``projected_iter_ratio`` (a :class:`~jagg.bench.projection.CostStructure`'s) and the per-update efficiencies
    times it: ``projected_time_efficiency`` (SGD's model), ``projected_adam_time_efficiency``,
    ``projected_adam_tensor_time_efficiency``."""
    return {"projected_iter_ratio": iter_ratio,
            "projected_time_efficiency": predicted_efficiency(iter_ratio, error_to_noise),
            "projected_adam_time_efficiency": adam_efficiency(iter_ratio, error_to_noise),
            "projected_adam_tensor_time_efficiency": iter_ratio * tensor_factor}


def tensor_breakdown(record: dict, top: int = 10) -> list[dict]:
    """The ``top`` parameter tensors of one estimator's record by their share of its squared error: each tensor's
    ``error_share``, ``noise_share``, ``error_to_noise`` (``E_t / V_t``) and Adam ``weight``."""
    tensors = record["tensors"]
    err = sum(max(t["error_sq"], 0.0) for t in tensors)
    noise = sum(t["noise"] for t in tensors)
    rows = [{"estimator": record["estimator"], "tensor": t["tensor"], "numel": t["numel"],
             "error_share": max(t["error_sq"], 0.0) / err if err > 0 else 0.0,
             "noise_share": t["noise"] / noise if noise > 0 else 0.0, "error_to_noise": t["error_to_noise"],
             "weight": t["weight"]} for t in tensors]
    return sorted(rows, key=lambda r: -r["error_share"])[:top]


def by_interval_estimator(spec: str, base: EstimatorConfig) -> tuple[str, EstimatorConfig]:
    """``--by-interval``'s estimator (:func:`parse_estimator`), which must be a JAGG one."""
    name, est = parse_estimator(spec, base, "--by-interval")
    if est is None or est.mode != "jagg":
        raise ValueError(f"--by-interval {spec!r}: give a JAGG estimator (config, plain or NAME:KEY=VALUE,...)")
    return name, est


def by_interval(cfg: TrainConfig, spec: str, batches: int, draws: int) -> list[dict]:
    """``--by-interval SPEC``: :func:`interval_errors` of the JAGG estimator ``spec`` (:func:`by_interval_estimator`)."""
    return interval_errors(cfg, *by_interval_estimator(spec, cfg.estimator), batches, draws)


def interval_errors(cfg: TrainConfig, name: str, est: EstimatorConfig, batches: int, draws: int) -> list[dict]:
    """Where one estimator's error lives: for each interval of its layout (steps ``a..b``), the error of the gradient
    restricted to that interval's loss terms (``only_steps``) against the whole update's noise ``V_b``, and its
    repeating part, on the same batches as :func:`measure` (same seed)."""
    check_sizes(batches, draws)
    exact = est.exact()
    sampler = make_sampler(cfg)
    intervals, totals, parts = None, [], {}
    for b in range(batches):
        batch = kept_batch(sampler, cfg)[0]
        traj, adv, prompt_groups = batch.traj, batch.adv, batch.prompt_groups
        vf = sampler.velocity(batch.tokens)
        intervals = intervals or layout_intervals(traj, est)[0]

        def grad(c, steps, seed):
            sampler.zero_grad()
            with torch.enable_grad():
                policy_gradient(vf, traj, adv, c, ref_velocities=batch.ref_v, prompt_groups=prompt_groups,
                                only_steps=steps, generator=torch.Generator().manual_seed(seed))
            return flat_grad(sampler.params).double()

        totals.append(grad(exact, None, 0))
        for j, iv in enumerate(intervals):
            g_ex = grad(exact, iv, 0)
            seeds = [cfg.seed * 1_000_003 + b * 1009 + d * 31 for d in range(draws if est.random else 1)]
            parts.setdefault(j, []).append((g_ex, torch.stack([grad(est, iv, sd) for sd in seeds])))
    exact_total = torch.stack(totals)                                      # [batches, P]
    noise = float(((exact_total - exact_total.mean(0)) ** 2).sum()) / (batches - 1)
    sig = cfg.sample
    sigmas = traj.sigmas.tolist()
    records = []
    for j, iv in enumerate(intervals):
        g_ex = torch.stack([p[0] for p in parts[j]])
        st = error_noise_stats(g_ex, [p[1] for p in parts[j]])
        scale = st["noise"] / noise if noise > 0 else math.nan               # ratios against the whole update's V_b
        records.append({"estimator": name, "interval": j, "steps": f"{iv[0]}-{iv[-1]}", "inner_steps": len(iv) - 2,
                        "sigmas": f"{sigmas[iv[0]]:.2f}-{sigmas[iv[-1]]:.2f}", "sde_type": sig.sde_type,
                        "error_to_noise": st["error_to_noise"] * scale, "bias_to_noise": st["bias_to_noise"] * scale,
                        "bias_to_noise_se": st["bias_to_noise_se"] * scale, "same_batch_cosine":
                        st["same_batch_cosine"]})
    return records


INTERVAL_COLUMNS = [("interval", "interval", ""), ("steps", "steps", ""), ("sigmas", "sigma", ""),
                    ("error_to_noise", "E|e_j|^2/V_b", ".4f"), ("bias_to_noise", "bias_j^2/V_b", ".4f"),
                    ("bias_to_noise_se", "± SE", ".4f"), ("same_batch_cosine", "cos to exact", ".3f")]


COLUMNS = [("estimator", "estimator", ""), ("rows_per_sample", "rows/sample", ".2f"),
           ("error_to_noise", "E|e|^2/V_b", ".4f"), ("bias_to_noise", "bias^2/V_b", ".4f"),
           ("bias_to_noise_se", "± SE", ".4f"), ("bias_z", "bias z", ".1f"), ("clip_frac", "clipped", ".3f"),
           ("bias_to_signal", "bias^2/signal^2", ".2f"), ("efficiency", "efficiency", ".2f"),
           ("iter_ratio", "iter ratio", ".2f"), ("time_efficiency", "time eff.", ".2f"),
           ("adam_time_efficiency", "Adam time eff.", ".2f"), ("prediction_range", "rate/update", ""),
           ("linearity", "linearity", ".3f"), ("adam_tensor_time_efficiency", "per tensor", ".2f"), ("bias_to_noise_at_target", "bias^2/V_b @T", ".4f"), ("adam_time_efficiency_at_target", "Adam @T", ".2f")]
PROJECTED_COLUMNS = [("estimator", "estimator", ""), ("rows_ratio", "rows ratio", ".2f"),
                     ("projected_iter_ratio", "iter ratio", ".2f"), ("projected_time_efficiency", "time eff.", ".2f"),
                     ("projected_adam_time_efficiency", "Adam time eff.", ".2f"),
                     ("projected_adam_tensor_time_efficiency", "per tensor", ".2f")]
JOB_COLUMNS = [("estimator", "estimator", ""), ("updates", "updates", ""), ("positions", "rate/update at each", ""),
               ("prediction_range", "the job's rate/update", ""), ("time_rate_lo", "x iter ratio, low", ".2f"),
               ("time_rate_hi", "high", ".2f")]
TENSOR_COLUMNS = [("tensor", "tensor", ""), ("numel", "numel", ""), ("error_share", "share of E|e|^2", ".3f"),
                  ("noise_share", "share of V_b", ".3f"), ("error_to_noise", "E_t/V_t", ".4f"),
                  ("weight", "Adam weight", ".3f")]


def update_arg(text: str) -> int | str:
    """``--update``: ``all``, or an update position ``N >= 0``."""
    return "all" if text.strip() == "all" else number_arg(int, 0)(text)


def _run(args: argparse.Namespace) -> int:
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    cfg = load_config(args.config, sets)
    check_update(args.update, cfg)
    set_threads(cfg.threads)
    specs = args.estimator or ["config", "plain", "subsample"]
    batches = args.batches if args.batches is not None else (3 if args.quick else 6)
    draws = args.draws if args.draws is not None else (2 if args.quick else 4)
    names = [s.partition(":")[0] for s in ["exact", *specs]]
    if args.by_tensor is not None and args.by_tensor not in names:          # every argument is checked before the
        raise ValueError(f"--by-tensor {args.by_tensor!r}: not one of the estimators {names}")   # first batch
    check_kl(cfg)
    cost, cost_line = resolve(args.cost, config_structure(cfg), args.gpu_bench_json, default_cost(cfg))
    check_estimators(specs, cfg)
    if args.by_interval is not None:
        check_sizes(batches, draws, args.target_batch)
        by_interval_estimator(args.by_interval, cfg.estimator)
        check_estimators([args.by_interval], cfg, "--by-interval")       # its window within the trained steps
        if args.update not in (0, "all"):
            raise ValueError(f"--by-interval measures the on-policy update (0) only; give it without --update "
                             f"{args.update}, in a run of its own")
    if args.update == "all" and (args.by_tensor is not None or args.by_interval is not None):
        raise ValueError("--by-tensor and --by-interval break one update position down: give --update N with them, "
                         "not --update all")
    positions = range(cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch) if args.update == "all" else [args.update]
    per_update = []
    for update in positions:
        if args.update == "all":
            print(f"== update {update} of {len(positions)} per rollout")
        per_update.append(measure(cfg, specs, batches, draws, args.target_batch, cost, update))
        _report(per_update[-1], batches, draws, update, cost_line)
    records = [r for recs in per_update for r in recs]
    if args.update == "all":
        job = job_prediction(per_update)
        print(f"\nthe job's per-update rate of exact's ({len(positions)} updates per rollout): the mean of the "
              "positions' ranges, 'unknown' where any position's is")
        print(table(job, JOB_COLUMNS))
        records += job
    extra = []
    if args.by_tensor is not None:
        rec = per_update[0][names.index(args.by_tensor)]
        parts = tensor_breakdown(rec)
        print(f"\nwhere {args.by_tensor}'s error lives, by parameter tensor (the 10 with the largest share of E|e|^2; "
              f"{len(rec['tensors'])} tensors)")
        print(table(parts, TENSOR_COLUMNS))
        extra += [{**r, "kind": "tensor"} for r in parts]
    if args.by_interval is not None:
        parts = by_interval(cfg, args.by_interval, batches, draws)
        print(f"\nwhere {args.by_interval.split(':')[0]}'s error lives: each interval's terms alone, against the whole "
              "update's noise V_b")
        print(table(parts, INTERVAL_COLUMNS))
        extra += [{**r, "kind": "interval"} for r in parts]
    json_if_asked(args.json, records + extra)
    return 0


def _report(records: list[dict], batches: int, draws: int, update: int, cost_line: str) -> None:
    """Print one update position's measurement: the header line, the table, clip warnings and the projection."""
    r0 = records[0]
    print(f"{batches} batches of {r0['samples_per_batch']:.0f} samples, up to {draws} draws per estimator; V_b = "
          f"{r0['noise']:.3e} (|g| = {r0['grad_norm']:.3e}), signal |E g|^2 / V_b = {r0['signal_to_noise']:.4f} +- "
          f"{r0['signal_to_noise_se']:.4f}; @T = extrapolated to {r0['target_batch']} samples per "
          f"update; rollout {r0['rollout_s']:.2f} s, exact training phase {r0['train_s']:.2f} s (medians)"
          + (f"; off-policy: update {update} of each rollout" if update else "; on-policy (update 0)"))
    print(table(records, COLUMNS))
    for r in records:
        flag = clip_flag({**r, "clip_frac_est": r["clip_frac"]})
        if flag:
            print(f"warning: {r['estimator']}: {flag.removeprefix('audit: ')}")
    print("time eff.: plain SGD's variance model; Adam time eff.: the trainers' AdamW (the step normalised by the "
          f"noise), per tensor: Adam per parameter tensor (weighted by {r0['tensor_weighting']}), for an estimator "
          "whose repeating error is not significant (bias z < 2); all predict from this checkpoint's gradients, paired "
          "seeds measure (docs/design.md §3.8); rate/update: the meter's prediction, the rate per update of exact's "
          "between SGD's model at E|e|^2/V_b + 2 jackknife SE and Adam's at - 2 SE, 'unknown' where no model holds "
          "(bias z >= 2) or the range is wider than 0.5 (measure more --batches); with U updates per rollout the "
          "job's per-update rate is the mean over --update 0 .. U-1 (--update all; lab/NOTEBOOK.md §9.5); linearity: "
          "routing's score of the estimator's layout on these rollouts (the paper's linearity test, no backward pass; "
          "over 17 regimes of the shapes world, >= 0.6 went with an error <= 0.24 of the noise: lab/NOTEBOOK.md §9.6)")
    print(f"\nprojected, not measured: the per-update efficiency times the iteration ratio of {cost_line}")
    print(table(records, PROJECTED_COLUMNS))
    for r in records:
        r["cost_structure"] = cost_line


def add_parser(sub) -> None:
    p = sub.add_parser("meter", help="each estimator's error against the update's own noise: efficiency vs exact "
                       "and vs random timestep subsampling", description=__doc__.replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config_path(),
                   help="trainer YAML; one with a pipeline: section measures that diffusers model (as jagg train "
                        "loads it) [default: the main job, jagg/shapes/main_job.yaml]")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a trainer config key (repeatable), e.g. sample.eta=0.3")
    p.add_argument("--estimator", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help="an estimator (repeatable): config, plain, subsample, or NAME:KEY=VALUE,... of estimator "
                        "keys on top of the config's; exact is always measured [default: config plain subsample]")
    p.add_argument("--batches", type=number_arg(int, 3), help="independent batches (>= 3) [default: 6; 3 with --quick]")
    p.add_argument("--draws", type=number_arg(int, 1),
                   help="draws of a random estimator per batch [default: 4; 2 with --quick]")
    p.add_argument("--target-batch", type=number_arg(int, 1),
                   help="samples per update to extrapolate to [default: the config's "
                   "sample.prompts_per_iter x sample.group_size / grpo.updates_per_epoch]")
    p.add_argument("--by-interval", metavar="NAME[:KEY=VALUE,...]",
                   help="also break this JAGG estimator's error down by the intervals of its layout (where does it "
                        "live, and does it repeat there?), on the same batches")
    p.add_argument("--update", type=update_arg, default=0, metavar="N|all",
                   help="measure every batch as the (N+1)-th optimizer update of its rollout: the parameters first take "
                        "N AdamW steps (the config's optim) on the exact gradients of N other batches of the same "
                        "policy, as the updates before it would; every estimator and exact are then compared there "
                        "(off-policy for N > 0, where intermediate interp's extrapolation enters the inner steps' "
                        "ratios); 'all': each of the job's grpo.inner_epochs x grpo.updates_per_epoch positions in "
                        "turn (that many times the time), then the job's answer, the mean of their ranges "
                        "[default: 0, on-policy]")
    p.add_argument("--by-tensor", nargs="?", const="config", metavar="NAME",
                   help="also list where this estimator's error lives by parameter tensor (the 10 with the largest "
                        "share), with Adam's per-tensor weights [NAME default: config]")
    add_cost_arguments(p, "the projected time columns")
    p.add_argument("--json", help="also write the records to this JSON file")
    p.add_argument("--quick", action="store_true", help=f"a smoke-sized run: 3 batches, 2 draws, {' '.join(QUICK_SETS)}")
    p.set_defaults(func=_run)
