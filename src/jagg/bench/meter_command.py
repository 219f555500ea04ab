"""``jagg bench meter``: what an estimator's error costs against the noise an update already carries.

A GRPO update is noise-dominated: the exact gradients of independent batches agree with cosine ~0. For an unbiased
estimator ``g^ = g + e`` the update's variance is ``V_b + E|e|^2``, where ``V_b`` is the batch-to-batch variance of
the exact gradient, so progress for the same work goes as (docs/design.md §3)

    efficiency      = (rows_exact / rows) * V_b / (V_b + E|e|^2)        (training-phase rows)
    time_efficiency = (t_exact / t)       * V_b / (V_b + E|e|^2)        (whole iterations, rollout included)

with plain SGD. The trainers use AdamW, whose step the noise normalises: there extra unbiased error costs its square
root, ``adam_efficiency = (rows_exact / rows) * sqrt(V_b / (V_b + E|e|^2))`` and ``adam_time_efficiency`` likewise
(docs/design.md §3.8). Both models hold for an unbiased estimator only; read ``bias_to_noise`` (and ``bias_z``) first.

This benchmark measures every term with the trainer's own sampler (:class:`jagg.trainers.shapes_trainer.ShapesSampler` of the
config, the main job by default; for a config with a ``pipeline:`` section, the user's diffusers model,
:class:`jagg.trainers.diffusers_trainer.DiffusersSampler`: its LoRA or trainable weights, prompts file and reward, as ``jagg
train`` builds them; no run directory) and :func:`jagg.policy_gradient`, no optimizer step. It draws ``--batches`` independent batches; on each it computes
the exact gradient once and every other estimator ``--draws`` times (fresh random picks per draw; one draw for a
deterministic estimator). Per estimator:

- ``rows_per_sample``: rows back-propagated per sample (the mean over draws);
- ``error_to_noise`` = ``E|e|^2 / V_b``: the mean squared error against the same batch's exact gradient;
- ``bias_to_noise`` = ``|b|^2 / V_b`` with its standard error: ``|b|^2`` is the agreement of the errors' means
  across batches, ``mean_{i != j} <e_i, e_j>``, an unbiased estimate of the squared norm of the error that repeats
  from batch to batch (the bias Adam integrates like a signal). 0 for an unbiased estimator up to its SE;
  ``bias_z`` = ``bias_to_noise / bias_to_noise_se`` (what it told about training: docs/results.md);
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
  (:func:`prediction`); with several updates per iteration, the mean over the ``--update`` positions predicts the
  job's per-update rate: ``--update all`` measures each position in turn and prints it (:func:`job_prediction`,
  records of ``kind`` ``job`` in ``--json``), ``unknown`` where any position's answer is;
- the **verdict** (:func:`jagg.verdict.verdict`, printed last, ``kind`` ``verdict`` in ``--json``; none with
  ``--quick``, a smoke test): ``train with <estimator>`` where a candidate's range is known and its low end times the
  iteration ratio clears ``1 + estimator.preflight_margin`` at every update position of the job, else ``train with
  exact: <the reason>``, the rule ``estimator.mode: auto`` trains with; on an auto config the estimators measured by
  default are its candidates;
- ``linearity`` and ``linearity_min``: routing's linearity score of a JAGG estimator's layout on the measured
  rollouts (:func:`layout_linearity`; NaN for one that interpolates nothing), the regime's rule of thumb that needs
  no backward pass;
- ``projected_iter_ratio`` and ``projected_time_efficiency``, ``projected_adam_time_efficiency``,
  ``projected_adam_tensor_time_efficiency``: the per-update efficiencies times the iteration ratio of a named cost
  structure (``--cost``, :mod:`jagg.cost`; ``--gpu-bench-json``: B/F measured on a GPU), labelled
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

import torch
import yaml

from ..audit import clip_flag, flat_grad
from ..meter import error_noise_stats
from ..arguments import config_arguments
from ..checks import check_unique_names, number_arg, parse_spec
from ..estimator import policy_gradient
from ..estimator_config import AUTO, EstimatorConfig
from ..knots import budget_probs, eligible_intervals, interval_probs, layout_intervals
from ..trainers.diffusers_config import DiffusersTrainConfig, has_pipeline_section
from ..trainers.side_by_side import (Sampler, check_held_gradients, draw_batches, kept_batch, measure_positions,
                                     measure_records, restore_params, step_to_update, with_subsample)
from ..trainers.shapes_trainer import ShapesSampler
from ..trainers.shapes_config import ShapesTrainConfig
from ..infra import config_loader as configuration
from ..verdict import job_prediction, signal_note, verdict
from .common import json_if_asked, set_threads, table
from ..cost import CostStructure, add_cost_arguments, config_structure, default_cost, resolve

BUILT_IN = ("exact", "config", "plain", "subsample")
QUICK_SETS = ["sample.prompts_per_iter=4", "sample.group_size=4"]


BUDGET_RATES = "by_interval"         # correction_probs=by_interval: rates from the per-interval error (budget_probs)


def wants_budget_probs(spec: str) -> bool:
    """Whether ``spec`` asks for ``correction_probs=by_interval`` (:func:`budget_probs_of`)."""
    items = parse_spec(spec, "--estimator")[1]
    return any(k.removeprefix("estimator.") == "correction_probs" and v == BUDGET_RATES for k, v in items.items())


def parse_estimator(spec: str, base: EstimatorConfig, flag: str = "--estimator") -> tuple[str, EstimatorConfig | None]:
    """``NAME`` (built in) or ``NAME:KEY=VALUE,...`` -> (name, config); ``subsample`` is resolved later (None), and so
    is ``correction_probs=by_interval`` (left out here; :func:`wants_budget_probs`); errors name the option ``flag``."""
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
        kv[key] = None if key == "correction_probs" and value == BUDGET_RATES else yaml.safe_load(value)
    return name, configuration.from_dict(EstimatorConfig, {**base.to_dict(), **kv}, "estimator")


def parse_estimators(specs: list[str], base: EstimatorConfig) -> dict[str, EstimatorConfig | None]:
    """``exact`` and the ``--estimator`` specs -> ``{name: config}`` (:func:`parse_estimator`), every name once
    (``exact``, always measured, may be given too)."""
    check_unique_names(specs, BUILT_IN, "--estimator")
    return dict(parse_estimator(s, base) for s in ["exact", *[s for s in specs if s != "exact"]])


def check_estimators(specs: list[str], cfg, flag: str = "--estimator") -> None:
    """Every ``--estimator`` spec (or ``flag``'s) parsed and its layout checked against the job's trained steps
    (:func:`jagg.trainers.sections.check_estimator_fits`: ``correction_probs`` one per interval, ``window`` and
    ``exact_*_intervals`` within what they count) before the first batch; an error names the spec."""
    from ..trainers.sections import check_estimator_fits, steps_source, trained_steps

    s, n, key = cfg.sample, *num_steps_of(cfg)
    K, steps = trained_steps(s, n), steps_source(s, key, n)
    for spec in specs:
        try:
            est = parse_estimator(spec, spec_base(cfg), flag)[1]
            if est is not None:
                check_estimator_fits(est, K, steps)
        except ValueError as e:
            raise ValueError(e if str(e).startswith(flag) else f"{flag} {spec!r}: {e}") from None


def check_update(update: int | str, cfg) -> None:
    """Refuse an ``--update N`` position the job does not have: its rollouts take ``U = grpo.inner_epochs x
    grpo.updates_per_epoch`` optimizer updates, at positions 0 .. U - 1 (measuring N >= U would report an off-policy
    position of a job that never makes one)."""
    g = cfg.grpo
    U = g.inner_epochs * g.updates_per_epoch
    if update != "all" and update >= U:
        raise ValueError(f"--update {update}: the job makes {U} optimizer update{'s' * (U != 1)} per iteration "
                         f"(grpo.inner_epochs={g.inner_epochs} x grpo.updates_per_epoch={g.updates_per_epoch}), at "
                         f"positions 0 to {U - 1}; give --update below {U} or --update all, or measure a job with more "
                         "updates per iteration (--set grpo.updates_per_epoch=...)")


TrainConfig = ShapesTrainConfig | DiffusersTrainConfig


def load_config(path: str, sets: list[str]) -> TrainConfig:
    """The trainer config of ``--config`` with ``--set``: a diffusers one when the YAML has a ``pipeline:`` section
    (as ``jagg train`` decides), the shapes world's otherwise."""
    kind = DiffusersTrainConfig if has_pipeline_section(path) else ShapesTrainConfig
    return configuration.load(kind, path, sets)


def make_sampler(cfg: TrainConfig) -> Sampler:
    """The trainer's own sampler of ``cfg``: :class:`jagg.trainers.diffusers_trainer.DiffusersSampler` for a diffusers
    config (the model, LoRA, prompts and reward of ``jagg train``), :class:`ShapesSampler` otherwise."""
    if isinstance(cfg, DiffusersTrainConfig):
        from ..trainers.diffusers_trainer import DiffusersSampler
        from ..trainers.run_header import loaded_quietly

        return loaded_quietly(lambda: DiffusersSampler(cfg))      # the loading messages held, as the trainer does
    return ShapesSampler(cfg)


def check_fixed_estimator(cfg: TrainConfig, bench: str) -> TrainConfig:
    """Refuse ``estimator.mode: auto`` (the main job's) for a bench that measures the config's estimator as it is:
    the trainers resolve auto at a run's start, and a bench has no run. Returns ``cfg``."""
    if cfg.estimator.mode == AUTO:
        raise ValueError(f"estimator.mode is 'auto', which the trainers resolve at a run's start; {bench} measures a "
                         "fixed estimator: --set estimator.mode=jagg (or exact, subsample)")
    return cfg


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


def check_sizes(batches: int, draws: int, target_batch: int | None = None) -> None:
    """Raise unless ``--batches`` >= 3 (a variance and a bias across batches), ``--draws`` >= 1 and
    ``--target-batch`` (when given) >= 1."""
    if batches < 3:
        raise ValueError(f"--batches must be >= 3 (a variance and a bias across batches); got {batches}")
    if draws < 1:
        raise ValueError(f"--draws must be >= 1; got {draws}")
    if target_batch is not None and target_batch < 1:
        raise ValueError(f"--target-batch must be >= 1; got {target_batch}")


def check_counts(cfg: TrainConfig, batches: int, draws: int, estimators: int) -> None:
    """``--batches`` and ``--draws`` bounded before the first batch (:mod:`jagg.infra.sizes`): every batch is kept
    (its trajectories' memory) and each of the ``estimators`` is measured ``draws`` times on each (their time)."""
    from ..infra.sizes import check_memory, check_time, rollout_bytes

    steps, key = num_steps_of(cfg)
    latent, pixels, size = cfg.sample_size()
    batch = cfg.sample.batch_size
    check_memory(batches * rollout_bytes(batch, steps, latent, pixels), f"--batches {batches}: {batches} batches of "
                 f"{batch} trajectories of {key}={steps} at {size}, all kept,", "lower --batches")
    check_time(float(batches) * batch * (steps + draws * estimators), f"--batches {batches} x --draws {draws} x "
               f"{estimators} estimators:", "lower --batches or --draws")


def budget_probs_of(cfg: TrainConfig, name: str, est: EstimatorConfig, batches: int,
                    pilots: dict | None = None) -> EstimatorConfig:
    """``est`` with ``correction_probs`` from :func:`jagg.knots.budget_probs`: ``D_j`` = plain JAGG's error against the
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
    scope = interval_probs(eligible, dataclasses.replace(est, correction_p=1.0))         # 1 where corrected
    rows = [float(n) * scope[j] for j, n in enumerate(inner)]
    errors = [r["error_to_noise"] * scope[j] for j, r in enumerate(parts)]
    rates = budget_probs(errors, rows, est.correction_p * sum(rows))
    return dataclasses.replace(est, correction_probs=[round(r, 4) for r in rates])


def measured_estimators(cfg: TrainConfig, specs: list[str], batches: int) -> dict[str, EstimatorConfig | None]:
    """``exact`` and the ``--estimator`` specs -> ``{name: config}`` (:func:`parse_estimators` on the base
    :func:`spec_base`), with ``correction_probs=by_interval`` resolved (:func:`budget_probs_of`)."""
    ests = parse_estimators(specs, spec_base(cfg))
    pilots: dict = {}
    for spec in specs:
        if wants_budget_probs(spec):
            name = spec.partition(":")[0]
            ests[name] = budget_probs_of(cfg, name, ests[name], batches, pilots)
            print(f"{name}: correction_probs {ests[name].correction_probs} (budget_probs on {batches} batches of "
                  f"seed {cfg.seed + 1})")
    return ests


def spec_base(cfg: TrainConfig) -> EstimatorConfig:
    """What ``--estimator`` specs build on: the config's estimator, or for ``estimator.mode: auto`` the same in mode
    ``jagg`` (as its candidates are built: :meth:`jagg.EstimatorConfig.candidate_configs`)."""
    e = cfg.estimator
    return e.candidate_base() if e.mode == AUTO else e


def measure(cfg: TrainConfig, specs: list[str], batches: int, draws: int, target_batch: int | None,
            cost: CostStructure | None = None, update: int = 0) -> list[dict]:
    """One record per estimator (module docstring); ``cost``: the structure of the projected columns (None: the
    job's own, :func:`jagg.cost.config_structure`); ``update``: measure each batch as its rollout's
    ``update + 1``-th optimizer update, at the parameters :func:`step_to_update` reaches with ``update`` batches
    drawn after the measured ones (0: on-policy, at the sampling parameters)."""
    check_sizes(batches, draws, target_batch)
    ests = measured_estimators(cfg, specs, batches)
    sampler = make_sampler(cfg)
    check_held_gradients(sampler, ests, batches, draws)
    kept, rollout_s = draw_batches(sampler, cfg, batches)
    sampling_params = [p.detach().clone() for p in sampler.params] if update else None
    if update:                                     # off-policy: every batch measured where update `update` starts
        step_to_update(sampler, cfg, draw_batches(sampler, cfg, update)[0])
    ests = with_subsample(ests, kept[0], spec_base(cfg))
    try:
        return measure_records(sampler, cfg, ests, kept, rollout_s, draws, update, cfg.seed, target_batch, cost)
    finally:
        if sampling_params is not None:
            restore_params(sampler, sampling_params)


def measure_job(cfg: TrainConfig, specs: list[str], batches: int, draws: int, target_batch: int | None,
                cost: CostStructure | None = None, each=None) -> list[list[dict]]:
    """:func:`measure` at every update position of the job's rollout (``grpo.inner_epochs x
    grpo.updates_per_epoch``) on the same batches (:func:`jagg.trainers.side_by_side.measure_positions`: each position's
    records are :func:`measure`'s at ``update=u``); ``each(u, records)`` is called as each position is measured."""
    check_sizes(batches, draws, target_batch)
    ests = measured_estimators(cfg, specs, batches)
    updates = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch

    def after(u, records, measured):
        if each is not None:
            each(u, records)
        return measured

    return measure_positions(make_sampler(cfg), cfg, ests, batches, draws, updates, cfg.seed, target_batch, cost,
                             after)


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
    return interval_errors(cfg, *by_interval_estimator(spec, spec_base(cfg)), batches, draws)


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
    specs = args.estimator or default_specs(cfg)
    batches = args.batches if args.batches is not None else (3 if args.quick else 6)
    draws = args.draws if args.draws is not None else (2 if args.quick else 4)
    names = [s.partition(":")[0] for s in ["exact", *specs]]
    check_counts(cfg, batches, draws, len(names))
    if args.by_tensor is not None and args.by_tensor not in names:          # every argument is checked before the
        raise ValueError(f"--by-tensor {args.by_tensor!r}: not one of the estimators {names}")   # first batch
    check_kl(cfg)
    cost, cost_line = resolve(args.cost, config_structure(cfg), args.gpu_bench_json, default_cost(cfg))
    check_estimators(specs, cfg)
    if args.by_interval is not None:
        check_sizes(batches, draws, args.target_batch)
        by_interval_estimator(args.by_interval, spec_base(cfg))
        check_estimators([args.by_interval], cfg, "--by-interval")       # its window within the trained steps
        if args.update not in (0, "all"):
            raise ValueError(f"--by-interval measures the on-policy update (0) only; give it without --update "
                             f"{args.update}, in a run of its own")
    if args.update == "all" and (args.by_tensor is not None or args.by_interval is not None):
        raise ValueError("--by-tensor and --by-interval break one update position down: give --update N with them, "
                         "not --update all")
    updates = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    if args.update == "all":
        def each(u: int, recs: list[dict]) -> None:
            print(f"== update {u} of {updates} per iteration")
            _report(recs, batches, draws, u, cost_line)

        per_update = measure_job(cfg, specs, batches, draws, args.target_batch, cost, each)
    else:
        per_update = [measure(cfg, specs, batches, draws, args.target_batch, cost, args.update)]
        _report(per_update[0], batches, draws, args.update, cost_line)
    records = [r for recs in per_update for r in recs]
    if args.update == "all":
        job = job_prediction(per_update)
        print(f"\nthe job's per-update rate of exact's ({updates} updates per iteration): the mean of the "
              "positions' ranges, 'unknown' where any position's is")
        print(table(job, JOB_COLUMNS))
        records += job
    records.append(_print_verdict(records, cfg, args, cost))
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


def default_specs(cfg: TrainConfig) -> list[str]:
    """The estimators measured without ``--estimator``: ``config``, ``plain`` and ``subsample``; for
    ``estimator.mode: auto`` its candidates that fit the job (what the run measures:
    :func:`jagg.trainers.sections.auto_candidates`), a note printed for each default candidate left out (one the
    config names that does not fit is refused when the config loads)."""
    from ..trainers.sections import auto_candidates, steps_source, trained_steps

    e = cfg.estimator
    if e.mode != AUTO:
        return ["config", "plain", "subsample"]
    n, key = num_steps_of(cfg)
    fitting, left_out = auto_candidates(e, trained_steps(cfg.sample, n), steps_source(cfg.sample, key, n))
    for name, why in left_out.items():
        print(f"note: the default candidate {name!r} is left out, as estimator.mode: auto leaves it out: {why}")
    return [c for c in e.candidates if c.partition(":")[0] in fitting and c != "exact"]


def _print_verdict(records: list[dict], cfg: TrainConfig, args: argparse.Namespace, cost: CostStructure) -> dict:
    """Print the verdict of the measured records (:func:`jagg.verdict.verdict` at the config's
    ``estimator.preflight_margin``; none with ``--quick``) and return its record for the JSON (``kind`` ``verdict``)."""
    updates = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    if args.quick:
        print(f"\n--quick is a smoke test of the command (3 batches, {' '.join(QUICK_SETS)} instead of the config's "
              "batch sizes): no verdict; run without --quick for one")
        return {"kind": "verdict", "train_with": None, "reason": "--quick: a smoke test, no verdict"}
    margin = cfg.estimator.preflight_margin
    v = verdict([r for r in records if r.get("kind") is None], updates, margin, cost.name,
                "--update all measures every position")
    print(f"\nverdict (the rule of estimator.mode: auto): a candidate only where the low end of its per-update rate "
          f"range times the iteration ratio measured here clears 1 + {margin:g} (estimator.preflight_margin) x exact's "
          + (f"at each of the job's {updates} update positions" if updates > 1 else "per update")
          + "; unknown or not measured counts as exact's")
    note = signal_note([r for r in records if r.get("kind") is None])
    for line in v["lines"] + ([note] if note else []):
        print(f"  {line}")
    print(v["line"])
    return {"kind": "verdict", "train_with": v["estimator"], **{k: v[k] for k in ("reason", "line", "margin", "updates")},
            "candidates": v["candidates"], "signal": note or "resolved", "minibatches": cfg.minibatch_cut}


def _report(records: list[dict], batches: int, draws: int, update: int, cost_line: str) -> None:
    """Print one update position's measurement: the header line, the table, clip warnings and the projection."""
    r0 = records[0]
    print(f"{batches} batches of {r0['samples_per_batch']:.0f} samples (one update's minibatch of "
          f"{'whole prompt groups' if r0['minibatches'] == 'groups' else 'shuffled samples'}, as the trainer cuts it), "
          f"up to {draws} draws per estimator; V_b = "
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
          "(bias z >= 2) or the range is wider than 0.5 (measure more --batches); with U updates per iteration the "
          "job's per-update rate is the mean over --update 0 .. U-1 (--update all); linearity: "
          "routing's score of the estimator's layout on these rollouts (the paper's linearity test, no backward pass; "
          "over 17 regimes of the shapes world, >= 0.6 went with an error <= 0.24 of the noise: docs/results.md)")
    print(f"\nprojected, not measured: the per-update efficiency times the iteration ratio of {cost_line}")
    print(table(records, PROJECTED_COLUMNS))
    for r in records:
        r["cost_structure"] = cost_line


def add_parser(sub) -> None:
    p = sub.add_parser("meter", help="each estimator's error against the update's own noise, its projected "
                       "progress per second against exact's, and the verdict: which estimator to train with",
                       description="What an estimator's error costs against the noise an update already carries: "
                       "exact and each estimator on --batches independent batches of the job (no optimizer step), "
                       "one table per update position, the projected table, and the verdict (which estimator to "
                       "train with, the rule of estimator.mode: auto).",
                       epilog="Every column, the models behind them and the verdict's rule: "
                       "docs/benchmarks.md#jagg-bench-meter.")
    config_arguments(p, "the job measured (a pipeline: section: that model)")
    p.add_argument("--estimator", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help="config, plain, subsample or NAME:KEY=VALUE,... (repeatable) [default: config plain "
                        "subsample; an auto config: its candidates]")
    p.add_argument("--batches", type=number_arg(int, 3), help="independent batches (>= 3) [default: 6; 3 with --quick]")
    p.add_argument("--draws", type=number_arg(int, 1),
                   help="draws of a random estimator per batch [default: 4; 2 with --quick]")
    p.add_argument("--target-batch", type=number_arg(int, 1),
                   help="samples per update to extrapolate to [default: the config's]")
    p.add_argument("--by-interval", metavar="NAME[:KEY=VALUE,...]",
                   help="also break this JAGG estimator's error down by interval")
    p.add_argument("--update", type=update_arg, default=0, metavar="N|all",
                   help="measure at update position N of a rollout, or at each (all) [default: 0]")
    p.add_argument("--by-tensor", nargs="?", const="config", metavar="NAME",
                   help="also list the 10 tensors with most of this estimator's error [default: config]")
    add_cost_arguments(p, "the projected columns")
    p.add_argument("--json", help="also write the records to this JSON file")
    p.add_argument("--quick", action="store_true", help=f"a smoke-sized run: 3 batches, 2 draws, {' '.join(QUICK_SETS)}")
    p.set_defaults(func=_run)
