"""``jagg train`` on a real diffusers model (SD3/SD3.5, FLUX.1): GRPO with the JAGG estimator, LoRA or full weights.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``; the config is
:class:`jagg.integrations.train_config.RealTrainConfig`) makes ``jagg train --config X.yaml`` run
:class:`RealTrainer` instead of the TinyDiT trainer. The trainer asks one object for everything model specific, the
:class:`jagg.integrations.policy.Policy` (prompts, sampler, velocity callable, KL reference, decoding, adapter
files). One iteration:

1. pick ``prompts_per_iter`` prompts of ``sample.prompts_file`` and repeat each ``group_size`` times (the global
   batch of ``N`` trajectories); under torchrun / accelerate every rank takes its contiguous shard of it;
2. sample the shard with the Flow-GRPO SDE through :meth:`Policy.velocity` (CFG, prompt embeddings) and
   :func:`jagg.sample_trajectories`, in pieces of ``sample.micro_batch`` trajectories at global positions, each
   with its own SDE noise seeded by (seed, iteration, position): a sample's rollout does not depend on the number
   of processes when every shard is a whole number of pieces; decode with the VAE; score with the reward
   (registry name, weighted sum, ``module:function`` or an HTTP reward server);
3. gather the rewards of all ranks, group-relative advantages per prompt on the global batch
   (:func:`jagg.group_advantages`), drop zero-spread groups;
4. ``inner_epochs x updates_per_epoch`` AdamW updates whose gradients come from :func:`jagg.policy_gradient`
   (KL reference = the adapters switched off, or a frozen copy for full fine-tuning); with several ranks the
   local gradients are averaged once per update with :func:`jagg.training.distributed.all_reduce_gradients`, each
   rank's loss scaled by :func:`jagg.training.distributed.loss_scale` so the result is the gradient of the global
   minibatch.

Outputs in ``log.output_dir`` (one run per directory, :mod:`jagg.training.rundir`; ``run.json`` holds the run id):
``metrics.jsonl`` (+ TensorBoard), ``reward_curve.png``, ``samples/iter_<n>.png``
(a few rollout images at each checkpoint), ``checkpoints/ckpt_<n>.pt`` (trainable weights, optimizer, every RNG,
config; atomic, keep-last-N) and, with LoRA, ``checkpoints/adapter_<n>/pytorch_lora_weights.safetensors``, which
``StableDiffusion3Pipeline.load_lora_weights`` / ``FluxPipeline.load_lora_weights`` read.

Data parallelism replicates the model on every rank (LoRA on SD3.5 / FLUX fits one GPU); the model is not wrapped
in DDP: gradients accumulate locally and are all-reduced once per optimizer update, so ranks may hold different
numbers of samples after zero-spread groups are dropped. With one update per epoch (``grpo.updates_per_epoch: 1``)
two processes make the same update as one process on the same global batch (tested with ``accelerate launch``).
FSDP / DeepSpeed sharding are available through the library API (docs/real_models.md), not through this trainer.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ..advantages import group_advantages, nonzero_spread_mask
from ..estimator import policy_gradient, reference_velocities
from ..trajectory import Trajectory, sample_trajectories, select_train_steps
from ..training import config_loader as configuration
from ..training.checkpoint import prune_checkpoints, write_checkpoint
from ..training.core import RESUMABLE_CHANGES, TrainerCore, check_resumable
from ..training.rundir import open_run, outputs, read_run_file, write_run_file
from ..training.distributed import (all_reduce_gradients, gather, gather_objects, init_process_group_from_env,
                                    loss_scale, shard)
from ..training.metrics import MetricsLogger, plot_reward_curve, save_grid
from .policy import Policy, load_model
from .train_config import RealTrainConfig, load_config, read_prompt_lines

# config keys that may differ between a checkpoint and its resumption, besides the TinyDiT trainer's
# (grpo.iterations, log.*, threads): where the model and rewards live, and settings with the same gradient
RESUMABLE_REAL = ("pipeline.path", "pipeline.device", "pipeline.prompt_cache", "pipeline.load_text_encoders",
                  "pipeline.gradient_checkpointing", "reward_server")
TRAINER_TAG = "jagg.integrations.train"          # written into checkpoints; the module was called so before


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def sampling_pieces(local: slice, size: int) -> list[slice]:
    """This rank's ``local`` slice of the global batch cut at the multiples of ``size`` (``sample.micro_batch``):
    the pieces sampled together, each with its own SDE noise seeded by its global start. When every shard is a
    multiple of ``size`` the pieces, and so the rollouts, are the same for any number of processes."""
    starts = sorted({local.start, *range(-(-local.start // size) * size, local.stop, size)})
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [local.stop])]


class RealTrainer(TrainerCore):
    """GRPO with :func:`jagg.policy_gradient` on a diffusers SD3/FLUX model, in the run directory
    ``cfg.log.output_dir``: ``resume``, ``overwrite`` and ``require_checkpoint`` as for the TinyDiT trainer
    (:class:`jagg.shapes.trainer.Trainer`, :mod:`jagg.training.rundir`). Launch with torchrun / accelerate for
    several processes (``WORLD_SIZE > 1``)."""

    def __init__(self, cfg: RealTrainConfig, resume: bool = False, overwrite: bool = False,
                 require_checkpoint: bool = False):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.rank, self.world = init_process_group_from_env()
        self.main = self.rank == 0
        self.out = Path(cfg.log.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        barrier = dist.barrier if self.world > 1 else None
        # every process decides from the same files, before the model is loaded (a run directory that cannot be used
        # fails in seconds, not after minutes of loading weights); the main process moves an old run aside first
        # (--overwrite) and writes run.json only after all have decided (the barrier before the logger)
        start = open_run(self.out, resume=resume, require_checkpoint=require_checkpoint, overwrite=overwrite,
                         main=self.main, barrier=barrier, log=self._print)
        self.run_id = start.run_id
        self.local = shard(cfg.sample.batch_size)              # this rank's slice; the batch must split evenly
        self.prompts = read_prompt_lines(cfg.sample.prompts_file)
        self.reward_fn = cfg.reward_fn()
        torch.manual_seed(cfg.seed)                            # the same LoRA initialisation on every rank
        self.policy: Policy = load_model(cfg.pipeline)        # check_model_dir: clear errors for bad paths
        self.device = self.policy.device
        self.policy.require_prompts(self.prompts, cfg.sample.prompts_file)
        self.named_params, self.params = self.policy.named_params, self.policy.params
        if not self.params:
            raise ValueError("the transformer has no trainable parameter (check pipeline.lora)")
        self.pieces = sampling_pieces(self.local, cfg.sample.micro_batch)
        if self.world > 1:                                     # replicas start identical
            for p in self.params:
                dist.broadcast(p.data, 0)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        # shared by all ranks: prompt choice and the initial noise of the global batch; per sampling piece: the SDE
        # noise (seeded by iteration and position, see _rollout); per rank: the minibatch order
        self.np_rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(_seed(cfg.seed, 1))
        self.perm_gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, self.rank))
        self.pick_gen = torch.Generator().manual_seed(_seed(cfg.seed, 4, self.rank))   # unbiased JAGG's picks
        self.iteration = 0
        self.wall = 0.0
        self.skipped_updates = 0
        self.consecutive_skips = 0
        self._stop = False
        self._images, self._prompts = None, None
        resumed_from = None
        if start.resumed is not None:
            state, path = start.resumed
            changed = self._load_state(state)
            resumed_from = self.iteration
            self._print(f"resumed from {path} (iteration {self.iteration})")
            for line in changed:
                self._print(f"  {line}")
        if barrier is not None:
            barrier()
        if self.main and (start.resumed is None or read_run_file(self.out) is None):
            write_run_file(self.out, self.run_id)
        self.logger = (MetricsLogger(self.out, cfg.log.tensorboard, resume_iteration=resumed_from)
                       if self.main else None)

    # ------------------------------------------------------------------ state
    def _rng_state(self) -> dict:
        return {"numpy": self.np_rng.bit_generator.state, "gen": self.gen.get_state(),
                "perm_gen": self.perm_gen.get_state(), "pick_gen": self.pick_gen.get_state(),
                "torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def _set_rng_state(self, rng: dict, local: bool = True) -> None:
        self.np_rng.bit_generator.state = rng["numpy"]
        self.gen.set_state(rng["gen"])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if local:
            self.perm_gen.set_state(rng["perm_gen"])
            if "pick_gen" in rng:                             # checkpoints before unbiased JAGG have none
                self.pick_gen.set_state(rng["pick_gen"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _state(self, rngs: list[dict]) -> dict:
        return {"trainer": TRAINER_TAG,
                "model": {n: p.detach().cpu().clone() for n, p in self.named_params.items()},
                "optimizer": self.opt.state_dict(), "iteration": self.iteration, "wall": self.wall,
                "skipped_updates": self.skipped_updates, "config": configuration.to_dict(self.cfg),
                "run_id": self.run_id, "world_size": self.world, "rng": rngs}

    def _load_state(self, state: dict) -> list[str]:
        """Restore ``state``; returns one line per config key that changed and may (``RESUMABLE_REAL`` and the
        TinyDiT trainer's ``RESUMABLE_CHANGES``)."""
        if state.get("trainer") != TRAINER_TAG:
            raise ValueError(f"the checkpoints in {self.ckpt_dir} were not written by the real-model trainer (TinyDiT "
                             "run?); use another log.output_dir")
        changed = check_resumable(state["config"], configuration.to_dict(self.cfg),
                                  RESUMABLE_CHANGES + RESUMABLE_REAL)
        saved = state["model"]
        if set(saved) != set(self.named_params):
            diff = sorted(set(saved) ^ set(self.named_params))[:3]
            raise ValueError(f"the checkpoint's trainable parameters differ from this model's (e.g. {diff}); was "
                             "pipeline.lora changed?")
        with torch.no_grad():
            for n, p in self.named_params.items():
                p.copy_(saved[n].to(p.device, p.dtype))
        self.opt.load_state_dict(state["optimizer"])
        self.iteration, self.wall = state["iteration"], state["wall"]
        self.skipped_updates = state["skipped_updates"]
        rngs = state["rng"]
        if len(rngs) == self.world:
            self._set_rng_state(rngs[self.rank])
        else:
            self._print(f"warning: the checkpoint was written by {len(rngs)} process(es), this run has {self.world}: "
                        "the per-process minibatch order is reseeded (the run continues, not bit-exactly)")
            self._set_rng_state(rngs[0], local=False)
            self.perm_gen.manual_seed(_seed(self.cfg.seed, 3, self.rank, self.iteration))
        return changed

    def save(self, rngs: list[dict] | None = None) -> Path | None:
        """Checkpoint (rank 0 writes; a collective: every rank must call it): LoRA adapter directory first, then
        ``ckpt_<n>.pt``, each written to a temporary name and renamed; the newest ``log.keep_last`` are kept."""
        rngs = rngs if rngs is not None else gather_objects([self._rng_state()])
        path = None
        if self.main:
            if self.cfg.pipeline.lora.enabled:
                self._save_adapter()
            path = write_checkpoint(self._state(rngs), self.ckpt_dir, self.iteration)
            for old in prune_checkpoints(self.ckpt_dir, self.cfg.log.keep_last, self.run_id, keep=path):
                # this run's adapter of a pruned checkpoint goes with it; other adapter directories stay
                shutil.rmtree(self.ckpt_dir / old.name.replace("ckpt_", "adapter_").removesuffix(".pt"),
                              ignore_errors=True)
            if self._images is not None and self.cfg.log.sample_images:
                n = min(self.cfg.log.sample_images, len(self._images))
                save_grid(self._images[:n], self.out / "samples" / f"iter_{self.iteration:06d}.png", ncol=min(n, 4),
                          scale=1, prompts=self._prompts[:n])
            plot_reward_curve(self.logger.records(), self.out / "reward_curve.png",
                              f"GRPO ({self.cfg.estimator.mode}) on {self.cfg.pipeline.family}")
        if self.world > 1:
            dist.barrier()
        return path

    def _save_adapter(self) -> Path:
        final = self.ckpt_dir / f"adapter_{self.iteration:06d}"
        tmp = self.ckpt_dir / f".adapter_{self.iteration:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.policy.save_adapter(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    # ------------------------------------------------------------------ one iteration
    def _rollout(self) -> tuple[list[str], Trajectory]:
        """Sample this rank's shard of the global batch; returns (the global batch's prompts, local trajectories)."""
        c, p = self.cfg.sample, self.cfg.pipeline
        idx = self.np_rng.choice(len(self.prompts), size=c.prompts_per_iter,
                                 replace=len(self.prompts) < c.prompts_per_iter)
        prompts = [self.prompts[i] for i in idx for _ in range(c.group_size)]
        shape = self.policy.latent_shape
        if c.shared_noise:
            noise = torch.randn(c.prompts_per_iter, *shape, generator=self.gen).repeat_interleave(c.group_size, 0)
        else:
            noise = torch.randn(len(prompts), *shape, generator=self.gen)
        train_steps, sde_mask = select_train_steps(p.num_steps, c.timestep_fraction,
                                                   tuple(c.sde_window) if c.sde_window else None)
        sigmas = self.policy.sigmas()
        parts = []
        for piece in self.pieces:                # SDE noise by (seed, iteration, global position), not by rank
            gen = torch.Generator(device=self.device).manual_seed(_seed(self.cfg.seed, 2, self.iteration, piece.start))
            parts.append(sample_trajectories(self.policy.velocity(prompts[piece]), noise[piece].to(self.device),
                                             sigmas, p.eta, train_steps, sde_mask, generator=gen,
                                             micro_batch=c.micro_batch, check_finite=False, sde_type=c.sde_type))
        if len(parts) == 1:
            return prompts, parts[0]
        batched = ("latents", "log_probs", "velocities")
        return prompts, dataclasses.replace(parts[0], **{f: torch.cat([getattr(t, f) for t in parts]) for f in batched})

    def _reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    @torch.enable_grad()
    def _update(self, traj, prompts, adv, ref_v, groups) -> dict:
        """One optimizer update on this rank's minibatch (possibly empty); gradients averaged over the ranks."""
        c = self.cfg
        self.opt.zero_grad(set_to_none=True)
        n = len(prompts)
        n_global = int(self._reduce([n])[0])
        if n_global == 0:
            return {}
        names = ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl")
        counts = ("backward_items", "forward_grad_items", "forward_nograd_items", "intervals", "intervals_jagg")
        local = [0.0] * (len(names) + len(counts))
        if n:
            st = policy_gradient(self.policy.velocity(prompts), traj, adv, c.estimator, ref_velocities=ref_v,
                                 loss_scale=loss_scale(n, n_global, self.world), prompt_groups=groups,
                                 generator=self.pick_gen)
            local = [n * getattr(st, k) for k in names] + [getattr(st, k) for k in counts]
        if self.world > 1:
            for p in self.params:                              # same buckets on every rank, even with no samples
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_gradients(self.params)
        tot = self._reduce(local)
        stats = {k: tot[i] / n_global for i, k in enumerate(names)}
        stats.update({k: int(tot[len(names) + i]) for i, k in enumerate(counts)})
        stats["jagg_frac_routed"] = stats["intervals_jagg"] / stats["intervals"] if stats["intervals"] else 0.0
        grads = [p for p in self.params if p.grad is not None]
        max_norm = c.optim.max_grad_norm if c.optim.max_grad_norm > 0 else float("inf")
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        self.guarded_step(stats)
        return stats

    def step(self) -> dict:
        """One GRPO iteration: sample, reward, advantages, updates. Returns the metrics record."""
        c = self.cfg
        self._rng_at_start, self._updating = self._rng_state(), False
        t0 = time.perf_counter()
        prompts, traj = self._rollout()
        local_prompts = prompts[self.local]
        t1 = time.perf_counter()
        images = self.policy.decode(traj.latents[:, -1])
        scores, _ = self.reward_fn(images, local_prompts, None)
        self._images, self._prompts = images, local_prompts
        rewards = gather(torch.as_tensor(scores, dtype=torch.float32, device=self.device)).cpu()  # global batch
        adv = group_advantages(rewards, prompts, c.grpo.global_std, c.grpo.adv_clip_max)[self.local]
        keep = (nonzero_spread_mask(rewards, prompts) if c.grpo.drop_zero_spread
                else torch.ones(len(prompts), dtype=torch.bool))[self.local]
        t2 = time.perf_counter()
        keep_idx = torch.nonzero(keep).flatten()
        self._updating = True
        per_update = []
        groups = (torch.arange(len(prompts)) // c.sample.group_size)[self.local][keep_idx]   # GRPO group per sample
        kept = [local_prompts[i] for i in keep_idx.tolist()]
        adv = adv[keep_idx].to(self.device)
        if not bool(keep.all()):
            traj = traj.select(keep_idx.to(self.device))
        ref_v = None
        if c.estimator.kl_beta > 0 and kept:
            ref_fn = self.policy.reference(self.policy.velocity(kept))
            ref_v = reference_velocities(ref_fn, traj, c.estimator.micro_batch)
        audit_s = 0.0
        if self.main and kept and self.audit_due():           # the main process audits its own samples
            audit_s, _ = self.audit(lambda sub: self.policy.velocity([kept[i] for i in sub]), traj, adv, ref_v,
                                    groups, self.params)
        for _ in range(c.grpo.inner_epochs):
            perm = torch.randperm(len(kept), generator=self.perm_gen)
            for mb in perm.tensor_split(c.grpo.updates_per_epoch):
                mb = mb.sort().values              # a minibatch is a set: accumulate it in the batch's order
                rows = mb.tolist()
                whole = len(rows) == len(kept)     # one update per epoch: no copy of the trajectories
                mb = mb.to(self.device)
                stats = self._update(traj if whole else traj.select(mb) if rows else None, [kept[i] for i in rows],
                                     adv[mb], None if ref_v is None else ref_v[mb], groups[mb.cpu()])
                if stats:
                    per_update.append(stats)
        t3 = time.perf_counter() - audit_s                 # the audit is a diagnostic: not the iteration's cost
        self.iteration += 1
        self.wall += t3 - t0
        trained = int(self._reduce([len(kept)])[0])
        rec = {"kind": "train", "iteration": self.iteration, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std(unbiased=False)), "samples": len(prompts), "trained_samples": trained,
               "processes": self.world, "sample_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2,
               "iter_s": t3 - t0, "wall_s": self.wall}
        if per_update:
            for k in ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl", "grad_norm", "jagg_frac_routed"):
                rec[k] = float(np.mean([s[k] for s in per_update]))
            for k in ("backward_items", "forward_grad_items", "forward_nograd_items", "skipped"):
                rec[k] = int(sum(s[k] for s in per_update))
        rec["updates"] = len(per_update)
        rec["skipped_total"] = self.skipped_updates
        return rec

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        c = self.cfg
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        if self.iteration >= c.grpo.iterations:
            self._print(f"the run in {self.out} is at iteration {self.iteration} of grpo.iterations="
                        f"{c.grpo.iterations}: nothing to train (raise grpo.iterations to continue it, or --overwrite "
                        "to start over)")
        handlers = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            bar = tqdm(total=c.grpo.iterations, initial=self.iteration, disable=not (c.log.progress and self.main),
                       dynamic_ncols=True, desc=f"GRPO {c.pipeline.family}")
            while self.iteration < c.grpo.iterations:
                try:
                    rec = self.step()
                except Exception:
                    self._save_on_failure()
                    raise
                if self.main:
                    self.logger.log(rec)
                stop = bool(self._reduce([float(self._stop)])[0])  # every rank stops at the same iteration
                done = self.iteration == c.grpo.iterations
                abort = self.skip_limit_error(c.grpo.max_consecutive_skips)
                if (c.log.checkpoint_every and self.iteration % c.log.checkpoint_every == 0) or done or stop or abort:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", bwd=rec.get("backward_items", 0),
                                s_it=f"{rec['iter_s']:.2f}")
                if abort is not None:
                    raise abort
                if stop:
                    self._print(f"saved iteration {self.iteration}; continue with --resume")
                    break
            bar.close()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.logger is not None:
                self.logger.close()
        return self.logger.records() if self.logger is not None else []


def run(config_path: str, overrides: list[str] | None = None, resume: bool = False, overwrite: bool = False,
        require_checkpoint: bool = False) -> int:
    """``jagg train --config <yaml with pipeline:>``: load, train, print where the outputs are. Returns 0.
    ``resume``, ``overwrite`` and ``require_checkpoint``: as :class:`RealTrainer`."""
    cfg = load_config(config_path, overrides)
    owns_group = not dist.is_initialized()
    try:
        trainer = RealTrainer(cfg, resume=resume, overwrite=overwrite, require_checkpoint=require_checkpoint)
        records = trainer.train()
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    if trainer.main:
        train = [r for r in records if r.get("kind") == "train"]
        if train:
            print(f"train reward: {train[0]['reward_mean']:.4f} (iteration {train[0]['iteration']}) -> "
                  f"{train[-1]['reward_mean']:.4f} (iteration {train[-1]['iteration']})")
        extra = " (ckpt_*.pt, adapter_*/: LoRA, diffusers load_lora_weights)" if cfg.pipeline.lora.enabled else ""
        shown = [o + extra if o == "checkpoints/" else o for o in outputs(Path(cfg.log.output_dir))]
        print(f"outputs in {cfg.log.output_dir}: {', '.join(shown) or 'none'}")
    return 0
