"""Config sections both trainers share (optimizer, GRPO, reward, logging) and the sample keys both have.

One typed dataclass per concern, validated in ``__post_init__`` with the checks of :mod:`jagg.checks` (the ones the
library's functions apply to their arguments); ``jagg train --help`` lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import (FLOAT32_MAX, Keys, check_group_size, check_positive, check_sde_steps, check_sde_type,
                      check_sde_window_schedule, check_threads)
from ..estimator_config import EstimatorConfig
from ..knots import check_layout
from ..rewards.registry import check_spec
from ..infra.config_loader import helped
from ..infra.wandb_run import WANDB_MODES
from ..trajectory import select_train_steps, sliding_sde_window
from .lr_schedule import SCHEDULES
from .minibatches import GROUPS, check_groups_fit, resolve_cut

SAMPLE_KEYS = Keys("sample.")                 # how the checks name the sample: section's keys


# the SDE window's keys, which both trainers' sample: sections declare (sde_window_field): key -> (default, help)
SDE_WINDOW_KEYS = {
    "sde_window": (None, "[start, end): only these steps are SDE steps and trained; the rest are ODE steps "
                         "(Flow-GRPO-Fast). With sde_window_schedule: sliding, the steps the SDE window slides through."),
    "sde_window_schedule": ("fixed", "'fixed': sde_window is the SDE window of every iteration. 'sliding' (MixGRPO): "
                                     "an SDE window of sde_window_size steps slides through sde_window (null: all "
                                     "steps), sde_window_stride steps later every sde_window_every iterations, and "
                                     "returns to the start when it would run past the end; logged as sde_window_start."),
    "sde_window_size": (None, "Steps of the sliding SDE window (MixGRPO's window_size); only with sde_window_schedule: "
                              "sliding."),
    "sde_window_stride": (1, "Steps the sliding SDE window moves at a time (MixGRPO's shift)."),
    "sde_window_every": (25, "Iterations between two moves of the sliding SDE window (MixGRPO's iters_per_group)."),
}


def sde_window_field(key: str):
    """The dataclass field of the SDE window's key ``key`` (:data:`SDE_WINDOW_KEYS`)."""
    default, text = SDE_WINDOW_KEYS[key]
    return field(default=default, metadata=helped(text))


@dataclass
class SampleBatch:
    """The keys both trainers' ``sample:`` sections share, one definition each (the shapes trainer's
    :class:`jagg.trainers.shapes_config.SampleSection` adds its sampler's steps, noise and guidance, which a real model
    keeps in ``pipeline:``): the batch of ``prompts_per_iter`` prompt groups of ``group_size`` samples, the SDE steps of
    each iteration (a fixed or sliding SDE window, or a timestep fraction), the SDE, the rows per sampling call, and the
    checks of these keys."""

    prompts_per_iter: int = field(default=8, metadata=helped(
        "Distinct prompts per iteration, over all processes (Flow-GRPO: 48 on 32 GPUs)."))
    group_size: int = field(default=8, metadata=helped(
        "Images per prompt: the size of a prompt group, at least 2 (Flow-GRPO: 24)."))
    shared_noise: bool = field(default=False, metadata=helped("Share the initial noise within a prompt group."))
    timestep_fraction: float = field(default=1.0, metadata=helped(
        "Train the first fraction of the sampling steps (all steps are SDE steps)."))
    sde_window: list[int] | None = sde_window_field("sde_window")
    sde_window_schedule: str = sde_window_field("sde_window_schedule")
    sde_window_size: int | None = sde_window_field("sde_window_size")
    sde_window_stride: int = sde_window_field("sde_window_stride")
    sde_window_every: int = sde_window_field("sde_window_every")
    sde_type: str = field(default="flow_grpo", metadata=helped(
        "SDE of the sampled steps, with the noise level eta (sample.eta; a real model's pipeline.eta): 'flow_grpo' "
        "(Flow-GRPO: std eta sqrt(s/(1-s)) sqrt(-dt) per step), 'dance' (DanceGRPO and the JAGG authors: a constant "
        "eta sqrt(-dt) per step) or 'cps' (coefficients-preserving: std sigma_next sin(eta pi/2), 0 < eta <= 1, last "
        "step outside the sde_window); docs/design.md §2."))
    micro_batch: int = field(default=8, metadata=helped(
        "Rows per network call while sampling (a row: one trajectory at one step). A real model also seeds each "
        "piece's SDE noise by (seed, iteration, position), so that a rollout does not depend on the number of "
        "processes when each process's shard is a multiple of it."))

    @property
    def batch_size(self) -> int:
        """Samples per iteration: ``prompts_per_iter x group_size``."""
        return self.prompts_per_iter * self.group_size

    def check_batch(self, positive: tuple[str, ...]) -> None:
        """Raise unless the keys ``positive`` are >= 1 and ``group_size`` >= 2 (:func:`jagg.checks.check_group_size`)."""
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"sample.{name} must be >= 1; got {getattr(self, name)}")
        check_group_size(self.group_size, SAMPLE_KEYS)

    def check_steps(self, num_steps: int, eta: float, keys: Keys = SAMPLE_KEYS) -> None:
        """Raise unless ``sample.sde_type`` fits ``eta`` (:func:`jagg.checks.check_sde_type`) and the SDE and trained
        steps among ``num_steps`` fit (``timestep_fraction``, ``sde_window``: :func:`jagg.checks.check_sde_steps`);
        ``keys`` name the settings (``eta`` and ``num_steps`` live elsewhere in the diffusers trainer's config)."""
        check_sde_type(self.sde_type, eta, keys)
        check_sde_steps(num_steps, self.timestep_fraction, self.sde_window, self.sde_type, keys)
        check_sde_window_schedule(num_steps, self.timestep_fraction, self.sde_window, self.sde_window_schedule,
                                  self.sde_window_size, self.sde_window_stride, self.sde_window_every, keys)

    def sde_window_at(self, num_steps: int, iteration: int = 0) -> tuple[int, int] | None:
        """The SDE window ``[start, end)`` of iteration ``iteration`` (counted from 0) of ``num_steps`` sampling steps:
        ``sde_window`` when fixed (None: no SDE window), :func:`jagg.sliding_sde_window` when sliding."""
        if self.sde_window_schedule == "sliding":
            span = tuple(self.sde_window) if self.sde_window else (0, num_steps)
            return sliding_sde_window(iteration, span, self.sde_window_size, self.sde_window_stride,
                                      self.sde_window_every)
        return tuple(self.sde_window) if self.sde_window else None

    def sde_steps(self, num_steps: int, iteration: int = 0):
        """The trained steps ``[K]`` and the SDE mask ``[T]`` of iteration ``iteration`` (:meth:`sde_window_at`,
        :func:`jagg.select_train_steps`)."""
        return select_train_steps(num_steps, self.timestep_fraction, self.sde_window_at(num_steps, iteration))


def trained_steps(sample, num_steps: int) -> int:
    """The trained steps ``K`` of one iteration's trajectories by the ``sample:`` section ``sample`` (the same in
    every iteration: a sliding SDE window keeps its size)."""
    return int(sample.sde_steps(num_steps, 0)[0].numel())


def steps_source(sample, num_steps_key: str, num_steps: int) -> str:
    """Where an iteration's trained steps come from, as the keys say it (``sample.num_steps=10, sample.sde_window=[0,
    8]``), for the messages of :func:`check_estimator_fits`."""
    parts = [f"{num_steps_key}={num_steps}"]
    if sample.sde_window:
        parts.append(f"sample.sde_window={list(sample.sde_window)}")
    if sample.sde_window_schedule == "sliding":
        parts.append(f"sample.sde_window_size={sample.sde_window_size}")
    if sample.timestep_fraction != 1.0:
        parts.append(f"sample.timestep_fraction={sample.timestep_fraction}")
    return ", ".join(parts)


def check_run(sample, estimator: EstimatorConfig, num_steps: int, num_steps_key: str, eta: float | None = None,
              keys: Keys = SAMPLE_KEYS) -> None:
    """The checks of a run's steps that need more than one section, in one call: with ``eta``, the ``sample:``
    section's SDE and trained steps among ``num_steps`` (:meth:`SampleBatch.check_steps`, ``keys`` naming the
    settings); then the estimator's counts against the trained steps (:func:`check_estimator_fits`;
    ``num_steps_key`` names where ``num_steps`` is set)."""
    if eta is not None:
        sample.check_steps(num_steps, eta, keys)
    check_estimator_fits(estimator, trained_steps(sample, num_steps), steps_source(sample, num_steps_key, num_steps))


def check_estimator_fits(e: EstimatorConfig, K: int, steps: str) -> None:
    """Raise, naming the key, when a count of the estimator is larger than what it counts in a run whose trajectories
    have ``K`` trained steps (``steps`` says where ``K`` comes from): :func:`jagg.knots.check_layout`, which
    :func:`jagg.policy_gradient` runs too. Checked at load, before a run directory exists (at the first update it
    would fail after run.json, metrics.jsonl and tensorboard/ were written)."""
    if e.mode == "auto":                                # mode auto: every candidate, named (auto_candidates)
        auto_candidates(e, K, steps)
        return
    check_layout(e, K, steps, "estimator.")


def auto_candidates(e: EstimatorConfig, K: int, steps: str) -> tuple[dict[str, EstimatorConfig], dict[str, str]]:
    """``estimator.mode: auto``'s estimators for a run of ``K`` trained steps (``steps``: where ``K`` comes from):
    ``({name: config}`` of exact and the candidates whose layout fits (:func:`check_estimator_fits`), ``{name:
    why}`` of the others``)``. The default list (:data:`jagg.estimator_config.DEFAULT_CANDIDATES`) adapts to the
    job: a default candidate that does not fit is left out, with why; a list the config gives is checked: one that
    does not fit is an error naming it."""
    from ..estimator_config import DEFAULT_CANDIDATES

    specs = {spec.partition(":")[0]: spec for spec in e.candidates}
    fitting, left_out = {}, {}
    for name, cand in e.candidate_configs().items():
        try:
            check_estimator_fits(cand, K, steps)
            fitting[name] = cand
        except ValueError as err:
            if e.candidates != list(DEFAULT_CANDIDATES):
                raise ValueError(f"estimator.candidates: {specs.get(name, name)!r}: {err}") from None
            left_out[name] = str(err)
    return fitting, left_out


def check_updates_divide_batch(batch_size: int, updates_per_epoch: int) -> None:
    """Raise unless one iteration's samples split evenly into ``grpo.updates_per_epoch`` updates."""
    if batch_size % updates_per_epoch:
        raise ValueError(f"sample.prompts_per_iter * sample.group_size = {batch_size} samples must be divisible "
                         f"by grpo.updates_per_epoch = {updates_per_epoch}")


@dataclass
class OptimSection:
    lr: float = field(default=3e-4, metadata=helped("AdamW learning rate."))
    betas: list[float] = field(default_factory=[0.9, 0.999].copy, metadata=helped("AdamW betas."))
    weight_decay: float = field(default=1e-4, metadata=helped("AdamW weight decay."))
    max_grad_norm: float = field(default=1.0, metadata=helped("Gradient-norm clipping (0 = off)."))
    ema_decay: float = field(default=0.0, metadata=helped(
        "EMA of the trained weights, updated after each optimizer step, saved in every checkpoint and used by "
        "evaluation; a real model's checkpoints also export it (adapter_<n>/ema/, transformer_<n>/ema/). 0 = off."))
    lr_schedule: str = field(default="constant", metadata=helped(
        "Learning-rate schedule over the run's optimizer updates (grpo.iterations x inner_epochs x updates_per_epoch): "
        "constant, cosine (to 0 at the end) or linear (to 0 at the end), after the warm-up; resumes bit-identically "
        "(a decay keeps its grpo.iterations). Logged as lr."))
    warmup_steps: int = field(default=0, metadata=helped(
        "Optimizer updates of linear warm-up (update k < warmup_steps uses lr x (k + 1) / warmup_steps), counted in "
        "updates, not iterations; 0 = none."))

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0; got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1); got {self.betas}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim.weight_decay and optim.max_grad_norm must be >= 0")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"optim.ema_decay must be in [0, 1); got {self.ema_decay}")
        first = self.lr / (1 - self.betas[0])             # AdamW's step size at its first update
        if first > FLOAT32_MAX:
            raise ValueError(f"optim.lr={self.lr:g}: AdamW's first step size, optim.lr / (1 - optim.betas[0]) = "
                             f"{first:.3g}, overflows float32; lower optim.lr")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"optim.weight_decay={self.weight_decay:g} with optim.lr={self.lr:g}: AdamW multiplies "
                             f"every weight by 1 - lr x weight_decay = {1 - self.lr * self.weight_decay:.3g} at each "
                             "step, which must stay above 0 (it would flip and blow up the weights); lower "
                             "optim.weight_decay (or optim.lr)")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {', '.join(SCHEDULES)}; got {self.lr_schedule!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer >= 0 (optimizer updates; 0 = none); got "
                             f"{self.warmup_steps!r}")

    def optimizer(self, params):
        """The AdamW these settings describe, over ``params`` (the trainers', and the benchmarks' stand-ins for them)."""
        import torch

        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), weight_decay=self.weight_decay)


@dataclass
class GRPOSection:
    iterations: int = field(default=100, metadata=helped("Sampling + training iterations (epochs)."))
    inner_epochs: int = field(default=1, metadata=helped("Passes of optimizer updates over each iteration's samples."))
    updates_per_epoch: int = field(default=2, metadata=helped(
        "Optimizer updates per inner epoch; the samples are split into this many minibatches."))
    minibatches: str = field(default="auto", metadata=helped(
        "How the samples are split into the minibatches: samples (shuffled samples, Flow-GRPO's habit: a prompt group "
        "spreads over several updates), groups (whole prompt groups per update, shuffled by group: JAGG's error, "
        "shared within a group, cancels there) or auto (groups for mode jagg and auto, samples for exact and "
        "subsample); jagg.trainers.minibatches."))
    adv_clip_max: float = field(default=5.0, metadata=helped("Advantages are clipped to [-adv_clip_max, adv_clip_max]."))
    global_std: bool = field(default=False, metadata=helped("Normalise advantages by the batch std, not per prompt."))
    drop_zero_spread: bool = field(default=True, metadata=helped(
        "Skip training on prompt groups whose rewards are all equal (no signal)."))
    max_consecutive_skips: int = field(default=5, metadata=helped(
        "Abort after this many consecutive updates skipped for a non-finite loss or gradient (0 = never)."))
    max_empty_iterations: int = field(default=10, metadata=helped(
        "Abort after this many consecutive iterations that trained no sample (no prompt group with reward spread, "
        "e.g. every reward weight 0); the first is warned about with its reason (0 = never abort)."))

    def __post_init__(self):
        for name in ("iterations", "inner_epochs", "updates_per_epoch"):
            if getattr(self, name) < 1:
                raise ValueError(f"grpo.{name} must be >= 1; got {getattr(self, name)}")
        resolve_cut(self.minibatches, "exact")                  # a known value
        for name in ("max_consecutive_skips", "max_empty_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0 (0 = never); got {getattr(self, name)}")
        check_positive(self.adv_clip_max, "grpo.adv_clip_max")


@dataclass
class RewardSection:
    name: str | None = field(default=None, metadata=helped(
        "Reward: a registry name (geneval, jpeg_compressibility, jpeg_incompressibility, the preference models "
        "clip_score, pickscore, hpsv2, aesthetic, and Flow-GRPO's flow_grpo_remote, vlm_judge, ocr), its options after "
        "a colon (pickscore:path=/models/PickScore_v1,batch_size=16; jagg.rewards.registry), or module:function "
        "(geneval when neither name nor weights is set)."))
    weights: dict[str, float] | None = field(default=None, metadata=helped(
        "Weighted sum of registry rewards, e.g. {geneval: 1.0, jpeg_compressibility: 0.1} (a key may carry options: "
        "'pickscore:path=/models/PickScore_v1'); a component of weight 0 is computed and reported (reward/<name>, the "
        "name without its options) but not trained. Set this or name, not both."))

    def __post_init__(self):
        if self.name and self.weights:
            raise ValueError(f"set reward.name or reward.weights, not both (name {self.name!r}, weights "
                             f"{self.weights}): for a single reward add --set reward.weights=null")
        if self.name == "" or self.weights == {}:
            raise ValueError(f"reward.{'name' if self.name == '' else 'weights'} is empty; give a reward (or null "
                             "for the default, geneval)")
        if not self.name and not self.weights:
            self.name = "geneval"
        try:
            check_spec(self.spec)          # every name known, its options and weights, before anything loads
        except ValueError as e:
            raise ValueError(f"reward.{'weights' if self.weights else 'name'}: {e}") from None

    @property
    def spec(self) -> str | dict:
        """What :func:`jagg.rewards.registry.get_reward` takes: the weights when set, else the name."""
        return self.weights or self.name


@dataclass
class LogSection:
    output_dir: str = field(default="runs/default", metadata=helped("Run directory: metrics, plots, checkpoints."))
    checkpoint_every: int = field(default=25, metadata=helped("Save a checkpoint every N iterations (0 = only at the end)."))
    keep_last: int = field(default=2, metadata=helped("Checkpoints kept (older ones are deleted)."))
    tensorboard: bool = field(default=True, metadata=helped("Write TensorBoard events (needs the tensorboard package)."))
    progress: bool = field(default=True, metadata=helped("Show a progress bar."))
    wandb: bool = field(default=False, metadata=helped(
        "Also log to Weights & Biases (pip install 'jagg[wandb]'): the config, every metric under its TensorBoard name, "
        "the sample grids; --resume continues the same wandb run (its id is run.json's run_id)."))
    wandb_project: str = field(default="jagg", metadata=helped("wandb project of the run."))
    wandb_entity: str | None = field(default=None, metadata=helped("wandb entity (user or team; null: wandb's default)."))
    wandb_mode: str | None = field(default=None, metadata=helped(
        "wandb mode: online, offline (files only, `wandb sync` later) or disabled; null: wandb's own choice "
        "($WANDB_MODE, else online)."))

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("log.output_dir must be set")
        if self.checkpoint_every < 0 or self.keep_last < 1:
            raise ValueError("log.checkpoint_every must be >= 0 and log.keep_last >= 1")
        if not self.wandb_project or (self.wandb_entity is not None and not self.wandb_entity):
            raise ValueError(f"log.wandb_project must be a name and log.wandb_entity a name or null; got "
                             f"{self.wandb_project!r} and {self.wandb_entity!r}")
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"log.wandb_mode must be one of {WANDB_MODES} or null; got {self.wandb_mode!r}")


@dataclass
class TrainerSections:
    """The top-level keys both trainers' configs share: seed, threads, and the estimator, optimizer and GRPO sections.
    :class:`jagg.trainers.shapes_config.ShapesTrainConfig` and
    :class:`jagg.trainers.diffusers_config.DiffusersTrainConfig` extend it with their own model, sampling, reward and
    logging sections (which must include ``sample.batch_size`` and ``sample.group_size``)."""

    seed: int = field(default=0, metadata=helped(
        "Seed of prompts, noise, initialisation, minibatches and unbiased JAGG's picks."))
    threads: int = field(default=0, metadata=helped(
        "torch CPU threads; 0: on a CPU, before each iteration, the cores the machine's other processes left free over "
        "the last one (jagg.infra.cpu_share; reproducible bit for bit only on an equally loaded machine)."))
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)

    @property
    def minibatch_cut(self) -> str:
        """``samples`` or ``groups``: ``grpo.minibatches`` with ``auto`` resolved for ``estimator.mode`` (one process)."""
        return self.cut_for(1)

    def cut_for(self, processes: int, mode: str | None = None) -> str:
        """:attr:`minibatch_cut` on ``processes`` processes, for the estimator mode ``mode`` (default
        ``estimator.mode``)."""
        g = self.grpo
        return resolve_cut(g.minibatches, mode or self.estimator.mode, self.sample.prompts_per_iter,
                           g.updates_per_epoch, processes)

    def __post_init__(self):
        check_threads(self.threads, "threads")
        check_updates_divide_batch(self.sample.batch_size, self.grpo.updates_per_epoch)
        if self.grpo.minibatches == GROUPS:
            check_groups_fit(self.sample.prompts_per_iter, self.grpo.updates_per_epoch)
        updates = self.grpo.iterations * self.grpo.inner_epochs * self.grpo.updates_per_epoch
        if self.optim.warmup_steps >= updates:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be below the run's optimizer "
                             f"updates (grpo.iterations x inner_epochs x updates_per_epoch = {updates}), or the "
                             "learning rate never reaches optim.lr")
