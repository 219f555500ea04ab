"""The GRPO loop both trainers share, once: :class:`GRPO` runs one iteration at a time and names the hooks each
trainer fills; :class:`GRPOTrainer` runs it in a run directory.

One iteration (:meth:`GRPO.step`): the trainer's :meth:`~GRPO.rollout` samples this process's share of the global
batch and :meth:`~GRPO.score` rewards it; the loop gathers the rewards, computes group-relative advantages per
prompt group on the global batch, drops the prompt groups without reward spread, computes the KL reference velocities
(:meth:`~GRPO.reference`), runs the estimator audit when due, and makes ``inner_epochs x updates_per_epoch`` optimizer
updates, each from the trainer's :meth:`~GRPO.gradient` of a minibatch (:meth:`~GRPO.minibatches`; the first one
on-policy), at the learning rate of ``optim.lr_schedule`` (:meth:`~GRPO.scheduled_lr`), skipped when its loss or
gradient norm is not finite. :class:`GRPO` holds no run directory, logger or checkpoint (``python -m lab e2e`` times
its iterations as they are). Around it, :class:`GRPOTrainer` adds the run directory (new, resumed or moved
aside, :mod:`jagg.infra.rundir`), the metrics logger, checkpoints at ``log.checkpoint_every``, the aborts
(:class:`TrainingAborted`) after ``grpo.max_consecutive_skips`` skipped updates and after ``grpo.max_empty_iterations``
iterations that trained no sample (warned at the first, with the reason), the save after a failure before an
iteration's first update, and SIGINT/SIGTERM (finish the iteration, save, exit); :meth:`GRPOTrainer.run` is how
``jagg train`` starts either trainer.

What the loop passes along (the draw, the rollout, its batch, the minibatches, the iteration's outcome) is
:mod:`jagg.trainers.rollout`; whether a checkpoint's run may continue under the current config,
:mod:`jagg.trainers.resume`. The two trainers are :mod:`jagg.trainers.shapes_trainer` and
:mod:`jagg.trainers.diffusers_trainer`.
"""

from __future__ import annotations

import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from ..audit import audit_flag, audit_parts, clip_flag
from ..meter import Meter, meter_flag
from ..estimator import reference_velocities
from ..estimator_config import AUTO, EstimatorConfig
from ..infra.distributed import end_process_group, gather_objects, init_process_group_from_env
from ..infra.after_launch import launched, say_after_launcher, shutdown_timeout
from ..infra.config_loader import to_dict
from ..infra.cpu_share import CpuShare
from ..infra.metrics import MetricsLogger
from ..infra.rundir import TRAIN, RunHints, discard_new_run, open_run, outputs, read_run_file, write_run_file
from ..infra.wandb_run import WandbRun, check_start as check_wandb_start
from ..trajectory import Trajectory, VelocityFn
from .lr_schedule import check_resumable_schedule, how_to_continue, lr_factor, schedules_lr
from .resume import RESUMABLE_CHANGES
from .rollout import Iteration, Minibatch, Rollout, RolloutInputs, rollout_batch, rollout_inputs, take


class TrainingAborted(RuntimeError):
    """A run that stopped itself because it cannot go on (non-finite updates, nothing to learn), after saving a
    checkpoint; ``jagg`` prints the message on one line and exits 1."""


class GRPO(ABC):
    """GRPO one iteration at a time (:meth:`step`, the module docstring), in memory: no run directory, no logger, no
    checkpoint (:class:`GRPOTrainer` adds them). ``GRPO(cfg)`` builds everything through the trainer's :meth:`setup`.

    What a trainer provides (the abstract methods): :meth:`setup` (model, optimizer ``opt``, trainable ``params``,
    reward, prompts, RNGs), :meth:`rollout`, :meth:`score`, :meth:`velocity`, :meth:`reference`, :meth:`minibatches`,
    :meth:`gradient` and :meth:`record`; optionally :meth:`after_step` (e.g. an EMA) and the
    attribute :attr:`multiprocess` (several processes). ``cfg`` must have ``seed``, ``threads``, ``estimator``,
    ``optim``, ``grpo`` and ``sample`` (``group_size``, ``batch_size``), and for a :class:`GRPOTrainer` ``log``
    (:class:`jagg.trainers.sections.TrainerSections`).
    """

    device = torch.device("cpu")
    multiprocess = False                                 # torchrun / accelerate: a process group from the environment

    def __init__(self, cfg):
        """The threads, the process group (:attr:`multiprocess`) and the counters; then :meth:`before_setup` (a
        :class:`GRPOTrainer`: its run directory) and the trainer's :meth:`setup`."""
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.rank, self.world = init_process_group_from_env() if self.multiprocess else (0, 1)
        self.main = self.rank == 0
        self.iteration, self.wall, self.cpu = 0, 0.0, 0.0    # seconds in iterations (not eval), across resumes
        self.skipped_updates = self.consecutive_skips = self.consecutive_empty = 0
        self.empty_iteration = self._empty_warned = False    # whether the last iteration had nothing to learn from
        self.logger: MetricsLogger | None = None             # a GRPOTrainer's, on its main process
        self.meter: Meter | None = None                 # the meter, from the first audit on
        # the estimator the updates use: the config's, or with estimator.mode auto exact while measuring, then the decision (None
        # until decide_estimator() made it, before the first iteration; a resumed run's from its checkpoint)
        self.estimator: EstimatorConfig | None = None if cfg.estimator.mode == AUTO else cfg.estimator
        self.decision: dict | None = None
        self.before_setup()
        self.setup()

    def before_setup(self) -> None:
        """Called by the constructor before :meth:`setup` (nothing here; a :class:`GRPOTrainer` opens its run
        directory)."""

    # ------------------------------------------------------------------ what each trainer provides

    @abstractmethod
    def setup(self) -> None:
        """Build the model, ``self.opt``, ``self.params`` (the trainable parameters), the reward, and what
        :meth:`draw_batch` draws from (``self.prompts``, ``self.latent_shape``, ``self.num_steps``, the RNGs
        ``self.np_rng`` and ``self.gen``); in a :class:`GRPOTrainer`, after the
        run directory is decided and before a checkpoint is restored."""

    @abstractmethod
    def rollout(self, draw: RolloutInputs) -> Rollout:
        """Sample this process's trajectories of the iteration's draw (its share of the global batch)."""

    @abstractmethod
    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        """This process's rewards ``[n]`` (float32) of ``rollout`` and the reward's info."""

    @abstractmethod
    def velocity(self, conditioning) -> VelocityFn:
        """The velocity callable of the samples whose conditioning (rows of
        :attr:`jagg.trainers.rollout.Rollout.conditioning`) is given."""

    @abstractmethod
    def reference(self, conditioning) -> VelocityFn:
        """The KL reference's velocity callable of those samples (called when ``estimator.kl_beta > 0``)."""

    @abstractmethod
    def minibatches(self, prompt_groups: Tensor) -> list[Tensor]:
        """One epoch's minibatches, cut by ``grpo.minibatches`` (:func:`jagg.trainers.minibatches.cut_minibatches`):
        positions into this process's kept samples, whose prompt groups are ``prompt_groups`` ``[n]`` (advances an
        RNG)."""

    @abstractmethod
    def gradient(self, mb: Minibatch) -> dict:
        """Accumulate the minibatch's policy gradient into the parameters' ``.grad`` (zeroed before) and return its
        statistics (``loss`` and :class:`jagg.GradientStats`' counts, ``samples``: the minibatch's size over the
        processes), or ``{}`` when no process has a sample."""

    def after_step(self) -> None:
        """Called after each optimizer step that was taken (e.g. an EMA of the weights)."""

    def decide_estimator(self) -> None:
        """``estimator.mode: auto``: set :attr:`estimator` (and :attr:`decision`) before the first iteration; a
        trainer provides it with :class:`jagg.trainers.auto.AutoEstimator`."""
        raise ValueError(f"estimator.mode auto needs a trainer that measures (jagg.trainers.auto.AutoEstimator); "
                         f"{type(self).__name__} has none: choose estimator.mode")

    def update_cut(self) -> str:
        """How this iteration's updates are cut (``grpo.minibatches`` resolved): for the estimator that trains, and with
        ``estimator.mode: auto`` the mode's own cut until it has decided, then the chosen estimator's."""
        mode = AUTO if self.cfg.estimator.mode == AUTO and self.decision is None else (self.estimator or
                                                                                     self.cfg.estimator).mode
        return self.cfg.cut_for(self.world, mode)

    def beside(self, mb: Minibatch, stats: dict, cpu: float) -> None:
        """Called after each update's gradient of ``mb`` is in ``.grad`` (its statistics and CPU seconds), before the
        step: ``estimator.mode: auto`` measures other estimators on the same minibatch here."""

    def iteration_done(self, rollout_cpu: float, iteration_cpu: float) -> None:
        """Called at the end of each iteration with its rollout's and its own CPU seconds (``estimator.mode: auto``
        decides here)."""

    @abstractmethod
    def record(self, it: Iteration) -> dict:
        """The iteration's ``train`` record (of ``metrics.jsonl``, in a :class:`GRPOTrainer`)."""

    # ------------------------------------------------------------------ one iteration

    def draw_batch(self) -> RolloutInputs:
        """The coming iteration's global batch (:func:`~jagg.trainers.rollout.rollout_inputs`) from ``self.prompts``
        with ``self.np_rng`` and ``self.gen``, of latents ``self.latent_shape`` and ``self.num_steps`` sampling
        steps."""
        return rollout_inputs(self.cfg.sample, self.prompts, self.latent_shape, self.num_steps, self.np_rng,
                                      self.gen, self.iteration)

    def step(self) -> dict:
        """One GRPO iteration: sample, reward, advantages (:func:`~jagg.trainers.rollout.rollout_batch`), updates.
        Returns the metrics record."""
        c = self.cfg
        if self.estimator is None:                               # mode auto, not decided yet
            self.decide_estimator()
        self._updating = False
        if not c.threads and self.device.type == "cpu":          # threads: 0: the cores the machine leaves free
            self.cpu_share = getattr(self, "cpu_share", None) or CpuShare()
            self.cpu_share.adjust()
        t0, c0 = time.perf_counter(), time.process_time()
        draw = self.draw_batch()
        batch = rollout_batch(lambda: self.rollout(draw), self.score, c, self.device)
        rollout_cpu = time.process_time() - c0
        self.empty_iteration = not batch.spread                 # no advantage but 0: nothing to learn from
        t2 = time.perf_counter()
        self._updating = True
        keep_idx = batch.keep_idx
        per_update, audit_s, audit_cpu = self.train_on(batch.rollout, batch.advantages, keep_idx, bool(batch.keep.all()))
        t3 = time.perf_counter() - audit_s                 # the audit is a diagnostic: not the iteration's cost
        cpu = time.process_time() - c0 - audit_cpu
        self.iteration += 1
        self.wall += t3 - t0
        self.cpu += cpu
        times = {**batch.times, "train_s": t3 - t2, "iter_s": t3 - t0, "wall_s": self.wall}
        rec = self.record(Iteration(batch.rollout, batch.scores, batch.info, batch.rewards, int(keep_idx.numel()),
                                    per_update, times, cpu))
        if c.sample.sde_window_schedule == "sliding":
            rec["sde_window_start"] = int(draw.train_steps[0])
        rec["threads"] = torch.get_num_threads()
        self.iteration_done(rollout_cpu, cpu)
        return rec

    def train_on(self, rollout: Rollout, adv: Tensor, keep_idx: Tensor, all_kept: bool) -> tuple[list[dict], float,
                                                                                                   float]:
        """The training phase of one iteration on the kept samples ``keep_idx`` (local positions): the KL reference
        velocities, the audit when due, and the updates. Returns the updates' statistics and the audit's seconds and
        CPU seconds."""
        c = self.cfg
        prompt_groups = (torch.arange(len(rollout.prompts)) // c.sample.group_size)[rollout.local][keep_idx]
        cond = take(rollout.conditioning, keep_idx)
        adv = adv[keep_idx].to(self.device)
        traj = rollout.traj if all_kept else rollout.traj.select(keep_idx.to(self.device))
        n = int(keep_idx.numel())
        ref_v, audit_s, audit_cpu = None, 0.0, 0.0
        if c.estimator.kl_beta > 0:
            ref_v = self.reference_rows(cond, traj, n)
        audit_at = self.audit_position() if self.audit_due() else -1
        per_update, u = [], 0
        self._update_index = 0                                  # the update's place in the iteration (the lr schedule)
        for _ in range(c.grpo.inner_epochs):
            for mb in self.minibatches(prompt_groups):
                if u == audit_at:
                    audit_s, audit_cpu = self._audit_update(cond, traj, adv, ref_v, prompt_groups, u)
                rows = mb.tolist()
                dev = mb.to(self.device)
                sub = traj if rows == list(range(n)) else traj.select(dev) if rows else None   # no copy of the whole
                stats = self.update(Minibatch(sub, take(cond, mb), adv[dev], None if ref_v is None else ref_v[dev],
                                              prompt_groups[mb.cpu()], len(rows), position=u))
                u += 1
                if stats:
                    per_update.append(stats)
        if audit_at >= u:                                   # fewer updates than its position: after the last one
            audit_s, audit_cpu = self._audit_update(cond, traj, adv, ref_v, prompt_groups, u)
        return per_update, audit_s, audit_cpu

    def reference_rows(self, cond, traj: Trajectory, n: int) -> Tensor | None:
        """The KL reference velocities ``[n, T, *S]`` of the ``n`` kept samples (None when ``n`` is 0), once per
        rollout; every process calls it, with or without samples."""
        return reference_velocities(self.reference(cond), traj, self.cfg.estimator.micro_batch) if n else None

    def _audit_update(self, cond, traj, adv, ref_v, prompt_groups, u: int) -> tuple[float, float]:
        """The audit before update ``u`` of the rollout (the main process audits its own samples); returns its
        ``(seconds, CPU seconds)`` (0 off the main process)."""
        out = (0.0, 0.0)
        if self.main and traj.batch_size:
            out = self.audit(lambda sub: self.velocity(take(cond, sub)), traj, adv, ref_v, prompt_groups, self.params,
                             update=u)
        return out

    @torch.enable_grad()
    def update(self, mb: Minibatch) -> dict:
        """One optimizer update: the trainer's gradient of the minibatch, clipped to ``optim.max_grad_norm``, and the
        guarded step (:meth:`guarded_step`); returns its statistics (``{}`` when no process had a sample)."""
        self.opt.zero_grad(set_to_none=True)
        c0 = time.process_time()
        stats = self.gradient(mb)
        if not stats:
            return {}
        self.beside(mb, stats, time.process_time() - c0)
        grads = [p for p in self.params if p.grad is not None]
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        stats["lr"] = self.scheduled_lr()
        if self.guarded_step(stats):
            self.after_step()
        return stats

    def scheduled_lr(self) -> float:
        """Set the learning rate of the coming update by ``optim.lr_schedule`` and ``optim.warmup_steps``
        (:mod:`jagg.trainers.lr_schedule`: each parameter group's ``initial_lr``, its learning rate at the start, times
        the factor of this update's index in the run) and return the first group's. ``constant`` without warm-up
        leaves the optimizer untouched."""
        o, g = self.cfg.optim, self.cfg.grpo
        if schedules_lr(o):
            per_iter = g.inner_epochs * g.updates_per_epoch
            k = self.iteration * per_iter + min(getattr(self, "_update_index", 0), per_iter - 1)
            factor = lr_factor(o.lr_schedule, o.warmup_steps, k, g.iterations * per_iter)
            for group in self.opt.param_groups:
                group.setdefault("initial_lr", group["lr"])
                group["lr"] = group["initial_lr"] * factor
            self._update_index = getattr(self, "_update_index", 0) + 1
        return float(self.opt.param_groups[0]["lr"])

    def guarded_step(self, stats: dict) -> bool:
        """Step unless ``stats["loss"]`` or ``stats["grad_norm"]`` is non-finite; sets ``stats["skipped"]``."""
        if not (np.isfinite(stats["loss"]) and np.isfinite(stats["grad_norm"])):
            self.opt.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.consecutive_skips += 1
            stats["skipped"] = 1
            return False
        self.opt.step()
        self.consecutive_skips = 0
        stats["skipped"] = 0
        return True

    # ------------------------------------------------------------------ the estimator audit

    def audit_due(self) -> bool:
        """Whether the coming iteration runs the estimator audit (``estimator.meter_every``)."""
        every = self.cfg.estimator.meter_every
        return bool(every) and (self.iteration + 1) % every == 0

    def audit_position(self) -> int:
        """Before which of its rollout's ``U = inner_epochs x updates_per_epoch`` updates the coming iteration's audit
        runs: the ``j``-th audit of the run (from 0) before update ``j mod U``, so the audits cycle through the
        on-policy first update and the off-policy ones after it (where ``interp``'s error shows)."""
        g = self.cfg.grpo
        return ((self.iteration + 1) // self.cfg.estimator.meter_every - 1) % (g.inner_epochs * g.updates_per_epoch)

    @torch.enable_grad()
    def audit(self, make_velocity: Callable[[list[int]], Callable], traj, adv, ref_v, prompt_groups,
              params: Sequence[torch.nn.Parameter], update: int = 0) -> tuple[float, float]:
        """The estimator audit (:func:`jagg.audit.audit_parts`) on whole prompt groups (``prompt_groups`` ``[B]``) of the
        batch, at least ``estimator.meter_samples`` samples and two prompt groups where the batch has them, picked at
        random with an RNG of its own, so a run with a fixed ``correction_p`` is the same with and without it.
        ``make_velocity(indices)`` gives the velocity callable of those samples; ``update`` is the rollout's update it
        runs before (0: on-policy; later ones off-policy, the parameters moved by the updates before it). Feeds the run's
        :class:`jagg.meter.Meter` (:attr:`meter`: error against noise, bias, predicted efficiency), logs an
        ``audit`` record (with a logger: on the main process of a :class:`GRPOTrainer`), prints each warning once per
        run, and returns its ``(seconds, CPU seconds)`` so that the caller can leave them out of the iteration's time."""
        c = self.cfg
        c0 = time.process_time()
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + self.iteration)
        ids = torch.unique(prompt_groups)
        chosen: list[int] = []
        for n, gi in enumerate(ids[torch.randperm(ids.numel(), generator=gen)]):
            chosen += torch.nonzero(prompt_groups == gi).flatten().tolist()
            if len(chosen) >= c.estimator.meter_samples and n >= 1:
                break
        sub = sorted(chosen)
        idx = torch.tensor(sub, device=traj.latents.device)
        g_sub = prompt_groups[torch.tensor(sub)]
        a, exact, est = audit_parts(make_velocity(sub), traj.select(idx), adv[idx], self.estimator, params,
                                    None if ref_v is None else ref_v[idx], g_sub, gen, split=g_sub,
                                    on_policy=update == 0)
        a["update"] = update
        if self.meter is None:
            self.meter = Meter([p.numel() for p in params], seed=c.seed)
        per_update = c.sample.batch_size / c.grpo.updates_per_epoch / c.sample.group_size
        last = self.logger.records("train")[-1:] if self.logger is not None else []
        share = last[0]["train_s"] / last[0]["iter_s"] if last and last[0].get("iter_s") else None
        a.update(self.meter.update(exact, est, a["rows_exact"], a["rows_estimator"], per_update, share))
        flags = [f for f in (audit_flag(a, self.estimator), meter_flag(a), clip_flag(a)) if f]
        if self.logger is not None:
            self.logger.log({"kind": "audit", "iteration": self.iteration + 1, "samples": len(sub), **a,
                             "flagged": int(bool(flags))})
        shown = getattr(self, "_flags_shown", set())
        for f in flags:
            key = f.split("(")[0]
            if key not in shown:
                shown.add(key)
                self._print(f"\niteration {self.iteration + 1}: {f}")
        self._flags_shown = shown
        return a["seconds"], time.process_time() - c0

    def _print(self, text: str) -> None:
        if self.main:
            print(text, flush=True)


class GRPOTrainer(GRPO):
    """The GRPO loop (:class:`GRPO`, module docstring) in the run directory ``cfg.log.output_dir``.

    ``Trainer(cfg)`` starts a new run and refuses a directory that holds one (``overwrite=True``: moves it aside
    first). ``Trainer(cfg, resume=True)`` continues the directory's run from its newest readable checkpoint; when the
    directory holds no run it starts one, unless ``require_checkpoint=True`` (``jagg train --resume``), which makes
    that an error. Neither ever starts over a run: checkpoints that are all unreadable are an error naming them.
    :meth:`run` is that and :meth:`train`, then the end-of-run lines (:meth:`report`): how ``jagg train`` starts
    either trainer.

    What a trainer provides besides :class:`GRPO`'s hooks: :meth:`save`, :meth:`load_state`, :meth:`rng_state` and
    :meth:`set_rng_state`; optionally :meth:`before_training` and :meth:`after_iteration` (evaluation),
    :meth:`stop_requested` (several processes), :meth:`report`, and the attributes :attr:`progress_label` and
    :attr:`evaluates`. :attr:`hints` says what its messages tell the user to do (``jagg train``'s flags; another
    command that trains, ``python -m lab quality``, gives its own); after :meth:`train`, :attr:`stopped` says whether a
    signal stopped it before ``grpo.iterations``.
    """

    progress_label = "GRPO"                              # the progress bar's label
    evaluates = False                                    # whether after_iteration returns evaluation records
    hints: RunHints = TRAIN                              # the words of its refusals and notes

    def __init__(self, cfg, resume: bool = False, overwrite: bool = False, require_checkpoint: bool = False):
        self._opening = dict(resume=resume, require_checkpoint=require_checkpoint, overwrite=overwrite)
        try:
            super().__init__(cfg)                        # GRPO's, with the run directory opened before setup()
            self._begin(cfg)
        except BaseException:
            self._abandon()
            raise

    def _begin(self, cfg) -> None:
        """After the model loaded: the checkpoint restored (a resumed run), ``run.json`` and the logger."""
        start, barrier = self._start, dist.barrier if self.world > 1 else None
        resumed_from = None
        if start.resumed is not None:
            state, path = start.resumed
            changed = self.load_state(state)
            check_resumable_schedule(state["config"], cfg)
            resumed_from = self.iteration
            self._print(f"resumed from {path} (iteration {self.iteration})")
            for line in changed:
                self._print(f"  {line}")
        if barrier is not None:
            barrier()
        if self.main and (start.resumed is None or read_run_file(self.out) is None):
            write_run_file(self.out, self.run_id, self.hints)   # an unwritable directory fails here, before training
        if self.main:                                    # the main process logs (to wandb too: log.wandb)
            tracker = WandbRun(cfg.log, self.run_id, self.out, to_dict(cfg)) if cfg.log.wandb else None
            self.logger = MetricsLogger(self.out, cfg.log.tensorboard, resume_iteration=resumed_from, wandb=tracker)

    def before_setup(self) -> None:
        """The run directory, before the model is loaded: its run lock first (a directory another run holds is
        refused with nothing read, moved or written), then every process decides from the same files (a run directory
        that cannot be used fails in seconds); the main process moves an old run aside first (--overwrite) and writes
        run.json only after all have decided (the barrier before the logger)."""
        cfg = self.cfg
        self.out = Path(cfg.log.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        if cfg.log.wandb:
            check_wandb_start(cfg.log)                   # before anything is written: one line naming the key
        agree = (lambda error: gather_objects([error])) if self.world > 1 else None
        self._start = open_run(self.out, **self._opening, main=self.main, agree=agree, log=self._print,
                               hints=self.hints)
        self.run_id = self._start.run_id
        self._stop = self.stopped = False

    def _abandon(self) -> None:
        """The constructor failed once the run lock was held (the model did not load, the checkpoint does not fit):
        a new run's files are removed (:func:`jagg.infra.rundir.discard_new_run`: the lock file, the directory made
        for it, a ``run.json``), a resumed run's are left as they were; the lock is released."""
        start = getattr(self, "_start", None)
        if start is None or start.lock is None:
            return
        if self.main and start.resumed is None:
            discard_new_run(self.out, start.before)
        start.lock.release(self.out, remove=True)

    @classmethod
    def run(cls, cfg, resume: bool = False, overwrite: bool = False, require_checkpoint: bool = False) -> list[dict]:
        """``jagg train``: the run of ``cfg`` in its run directory (``resume``, ``overwrite``, ``require_checkpoint``:
        as the constructor), trained to ``grpo.iterations``, then the end-of-run lines (:meth:`report`, on the main
        process). A process group this call set up (torchrun / accelerate) is destroyed at the end. Returns the
        metrics records (on the main process)."""
        owns_group = cls.multiprocess and not dist.is_initialized()
        try:
            trainer = cls(cfg, resume=resume, overwrite=overwrite, require_checkpoint=require_checkpoint)
            records = trainer.train()
        finally:
            if owns_group:
                end_process_group()
        if trainer.main:
            trainer.report(records)
        return records

    def report(self, records: list[dict]) -> None:
        """The end-of-run lines of :meth:`run`: where the outputs are (a trainer adds what its run achieved)."""
        print(f"outputs in {self.out}: {', '.join(self.shown_outputs()) or 'none'}")

    def shown_outputs(self) -> list[str]:
        """The run directory's outputs as :meth:`report` names them (:func:`jagg.infra.rundir.outputs`)."""
        return outputs(self.out)

    # ------------------------------------------------------------------ what each trainer provides

    @abstractmethod
    def save(self) -> Path | None:
        """Write a checkpoint of the current iteration (every process calls it); its path on the main process."""

    @abstractmethod
    def load_state(self, state: dict) -> list[str]:
        """Restore a checkpoint; return one line per config key that changed and may
        (:func:`~jagg.trainers.resume.check_resumable`)."""

    def loop_state(self) -> dict:
        """What every checkpoint keeps of the loop, in both trainers: the iterations done, their seconds and CPU
        seconds (across resumes), the skipped updates, the meter's measurements (None before the first measurement)
        and ``estimator.mode: auto``'s decision (None in another mode), so that a resumed run goes on as the run would
        have."""
        return {"iteration": self.iteration, "wall": self.wall, "cpu": self.cpu,
                "skipped_updates": self.skipped_updates,
                "meter": None if self.meter is None else self.meter.state_dict(), "estimator_decision": self.decision}

    def load_loop_state(self, state: dict) -> None:
        """Restore :meth:`loop_state` (a checkpoint without ``cpu``, from a diffusers run before it was kept: 0; without
        the meter: the meter of a run's start; an older checkpoint's ``correction_p``, the rate of the retired
        ``correction_p: auto``, is not read)."""
        self.iteration, self.wall, self.cpu = state["iteration"], state["wall"], state.get("cpu", 0.0)
        self.skipped_updates = state["skipped_updates"]
        self.meter = Meter.from_state(state["meter"]) if state.get("meter") is not None else None
        self.decision = state.get("estimator_decision")      # estimator.mode auto's (decide_estimator applies it)

    @abstractmethod
    def rng_state(self) -> dict:
        """Every RNG state of this process."""

    @abstractmethod
    def set_rng_state(self, rng: dict) -> None:
        """Restore :meth:`rng_state`."""

    def before_training(self) -> None:
        """Called once before the first iteration of :meth:`train` (e.g. evaluate the starting model)."""

    def after_iteration(self, done: bool) -> dict | None:
        """Called after each iteration is logged (``done``: the last one); an evaluation record, or None."""
        return None

    def skip_limit_error(self, limit: int) -> TrainingAborted | None:
        """The error to stop with after ``limit`` consecutive skipped updates (0 = never), else None."""
        if limit and self.consecutive_skips >= limit:
            return TrainingAborted(f"{limit} consecutive updates had a non-finite loss or gradient (see metrics.jsonl "
                                   "'skipped'); lower optim.lr")
        return None

    def empty_reason(self) -> str:
        """Why an iteration had nothing to learn from: every trained reward weight 0, or no reward spread."""
        weights = getattr(getattr(self.cfg, "reward", None), "weights", None)
        if weights and not any(weights.values()):
            return f"every reward weight is 0 (reward.weights {weights}), so every image scores 0"
        return ("no prompt group had any reward spread (every image of a prompt scored the same); check that the "
                "reward sees the image and that the sampling noise (eta) is neither too low nor too high")

    def empty_limit_error(self, limit: int) -> TrainingAborted | None:
        """After an iteration: count those in a row that had nothing to learn from (no prompt group with reward
        spread: no sample trained); at the first of the run print a warning naming the reason; return the error to
        stop with after ``limit`` in a row (``grpo.max_empty_iterations``, 0 = never), else None."""
        if not self.empty_iteration:
            self.consecutive_empty = 0
            return None
        self.consecutive_empty += 1
        why = self.empty_reason()
        if not self._empty_warned:
            self._empty_warned = True
            stops = f"; the run stops after {limit} such iterations in a row (grpo.max_empty_iterations)" if limit else ""
            if self.cfg.grpo.drop_zero_spread:
                what = "no sample was trained"
            else:                                        # trained, but with advantage 0: no gradient
                what = (f"every advantage was 0 (the {self.cfg.sample.batch_size} samples trained with "
                        "grpo.drop_zero_spread=false carried no signal)")
            self._print(f"\nwarning, iteration {self.iteration}: nothing to learn from: {what}: {why}{stops}")
        if limit and self.consecutive_empty >= limit:
            return TrainingAborted(f"{limit} iterations in a row had nothing to learn from: {why}; fix the config and "
                                   f"start a new run: {self.hints.other_dir}, or {self.hints.start_over}")
        return None

    def stop_requested(self) -> bool:
        """Whether to stop after this iteration (SIGINT/SIGTERM); a trainer with several processes makes them agree,
        so that every process stops at the same iteration."""
        return self._stop

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict]:
        """Run iterations up to ``grpo.iterations`` (logged, evaluated and checkpointed as configured); returns the
        metrics records (on the main process)."""
        c = self.cfg
        if self.iteration >= c.grpo.iterations:
            self._print(f"the run in {self.out} is at iteration {self.iteration} of grpo.iterations="
                        f"{c.grpo.iterations}: nothing to train ({how_to_continue(c)}, or "
                        f"{self.hints.start_over})")
        handlers = {}
        failed = False
        try:
            if self.cfg.estimator.mode == AUTO:       # before the first screen's evaluation, counted in the clocks, and
                self.decide_estimator()                 # before the handlers: a signal stops it at once (nothing trained)
            handlers = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            self.before_training()
            bar = tqdm(total=c.grpo.iterations, initial=self.iteration, disable=not (c.log.progress and self.main),
                       dynamic_ncols=True, desc=self.progress_label)
            last_eval = None
            while self.iteration < c.grpo.iterations:
                rec = self._logged_step()
                stop = self.stop_requested()
                done = self.iteration == c.grpo.iterations
                last_eval = self.after_iteration(done) or last_eval
                abort = (self.skip_limit_error(c.grpo.max_consecutive_skips)
                         or self.empty_limit_error(c.grpo.max_empty_iterations))
                path = None
                if (c.log.checkpoint_every and self.iteration % c.log.checkpoint_every == 0) or done or stop or abort:
                    path = self.save()
                bar.update(1)
                bar.set_postfix(self._progress(rec, last_eval))
                if abort is not None:
                    raise abort
                if stop:
                    self.stopped = True
                    self._print(f"saved {path}; {self.hints.continue_run}")
                    if self.main:                      # under a launcher: said again after its own report
                        say_after_launcher(f"jagg: stopped by a signal after iteration {self.iteration}, every "
                                           f"process saved: {path}; {self.hints.continue_run} (the same launch "
                                           "command)")
                    break
            bar.close()
        except Exception:
            failed = True
            raise
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.logger is not None:
                self.logger.close()
            discard = failed and self._untrained()
            if discard:
                self._discard()
            self._start.lock.release(self.out, remove=discard)  # held since before_setup: one run per directory
        return self.logger.records() if self.logger is not None else []

    def _untrained(self) -> bool:
        """Whether this is a new run that has not finished an iteration: nothing of it is worth keeping."""
        return self.iteration == 0 and self._start.resumed is None

    def _discard(self) -> None:
        """After a failure before the first iteration ended: remove what this new run wrote (the main process), so
        the same command starts again once the cause is fixed (:func:`jagg.infra.rundir.discard_new_run`)."""
        if self.main:
            removed = discard_new_run(self.out, self._start.before)
            what = f" ({', '.join(removed)})" if removed else ""
            print(f"\nthe run failed before its first iteration ended: nothing was trained, and what it wrote in "
                  f"{self.out}{what} was removed, so the same command starts a new run once the cause is fixed",
                  flush=True)

    def _logged_step(self) -> dict:
        """:meth:`step`, logged on the main process; a failure first saves what lets ``--resume`` retry it."""
        self._rng_at_start = self.rng_state()
        try:
            rec = self.step()
        except Exception:
            self._save_on_failure()
            raise
        if self.logger is not None:
            self.logger.log(rec)
        return rec

    def _progress(self, rec: dict, last_eval: dict | None) -> dict:
        """The progress bar's figures: the train reward, the last test reward (trainers that evaluate), the rows
        back-propagated and the iteration's seconds."""
        shown = {"reward": f"{rec['reward_mean']:.3f}"}
        if self.evaluates:
            shown["test"] = f"{last_eval['reward_mean']:.3f}" if last_eval else "-"
        return {**shown, "bwd": rec.get("backward_items", 0), "s_it": f"{rec['iter_s']:.2f}"}

    def _save_on_failure(self) -> None:
        """A failure before this iteration's first update (sampling, reward) left the weights untouched: in a
        single process, rewind the RNGs to the iteration's start and save, so ``--resume`` retries exactly
        this iteration."""
        if self._updating or self.world > 1 or self._untrained():     # a new run's first iteration: discarded
            return
        self.set_rng_state(self._rng_at_start)
        path = self.save()
        print(f"\nthe run failed in iteration {self.iteration + 1}; saved {path}: fix the cause and "
              f"{self.hints.continue_run}; a fix that changes a config key which a resumed run may not change (any "
              f"but {', '.join(RESUMABLE_CHANGES)}) needs a new run: {self.hints.start_over}")

    def _handle_signal(self, signum, frame):
        if self._stop:                                  # the launcher passes the terminal's Ctrl-C on: once is enough
            return
        self._stop = True
        deadline = (f" (the launcher kills the processes {shutdown_timeout()} s after a Ctrl-C: raise "
                    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT if an iteration and a checkpoint take longer)" if launched() else "")
        self._print(f"\nreceived signal {signum}: finishing this iteration, saving a checkpoint, exiting{deadline}")
