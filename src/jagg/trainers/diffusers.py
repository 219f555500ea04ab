"""``jagg train`` on a real diffusers model (SD3/SD3.5, FLUX.1, Qwen-Image): GRPO with JAGG, LoRA or full weights.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``; the config is
:class:`jagg.trainers.diffusers_config.DiffusersTrainConfig`) makes ``jagg train --config X.yaml`` run
:class:`DiffusersTrainer` instead of the shapes trainer. The loop is :class:`jagg.trainers.base.GRPOTrainer`'s; this
trainer fills its hooks and asks one object for everything model specific, the
:class:`jagg.integrations.policy.Policy` (prompts, sampler, velocity callable, KL reference, decoding, adapter
files); the rollouts (model, trainable weights, prompts, reward, sampling) are :class:`DiffusersSampler`'s, which
``jagg bench meter`` and ``jagg bench signal`` draw their batches with too. One iteration:

1. pick ``prompts_per_iter`` prompts of ``sample.prompts_file`` and repeat each ``group_size`` times (the global
   batch of ``N`` trajectories); under torchrun / accelerate every rank takes its contiguous shard of it;
2. sample the shard with the Flow-GRPO SDE through :meth:`Policy.velocity` (CFG, prompt embeddings) and
   :func:`jagg.sample_trajectories`, in pieces of ``sample.micro_batch`` trajectories at global positions, each
   with its own SDE noise seeded by (seed, iteration, position): a sample's rollout does not depend on the number
   of processes when every shard is a whole number of pieces; decode with the VAE; score with the reward
   (registry name, weighted sum, ``module:function`` or an HTTP reward server);
3. gather the rewards of all ranks, group-relative advantages per prompt on the global batch
   (:func:`jagg.group_advantages`), drop zero-spread prompt groups;
4. ``inner_epochs x updates_per_epoch`` AdamW updates whose gradients come from :func:`jagg.policy_gradient`
   (KL reference = the adapters switched off, or a frozen copy for full fine-tuning); with several ranks the
   local gradients are averaged once per update with :func:`jagg.infra.distributed.all_reduce_gradients`, each
   rank's loss scaled by :func:`jagg.infra.distributed.loss_scale` so the result is the gradient of the global
   minibatch.

Outputs in ``log.output_dir`` (one run per directory, :mod:`jagg.infra.rundir`; ``run.json`` holds the run id):
``metrics.jsonl`` (+ TensorBoard), ``reward_curve.png``, ``samples/iter_<n>.png``
(a few rollout images at each checkpoint; a video family's as an animated ``.gif`` grid), ``checkpoints/ckpt_<n>.pt`` (trainable weights, optimizer, every RNG,
config; atomic, keep-last-N) and, with LoRA, ``checkpoints/adapter_<n>/pytorch_lora_weights.safetensors``, which
``StableDiffusion3Pipeline.load_lora_weights`` / ``FluxPipeline.load_lora_weights`` read.

Data parallelism replicates the model on every rank (LoRA on SD3.5 / FLUX fits one GPU); the model is not wrapped
in DDP: gradients accumulate locally and are all-reduced once per optimizer update, so ranks may hold different
numbers of samples after zero-spread prompt groups are dropped. With one update per epoch (``grpo.updates_per_epoch: 1``)
two processes make the same update as one process on the same global batch (tested with ``accelerate launch``).
FSDP / DeepSpeed sharding are available through the library API (docs/real_models.md), not through this trainer.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..estimator import policy_gradient
from ..integrations.policy import Policy, load_model
from ..rewards.registry import get_reward
from ..trajectory import sample_trajectories
from ..infra import config_loader as configuration
from ..infra.checkpoint import prune_checkpoints, write_checkpoint
from ..infra.distributed import all_reduce_gradients, gather_objects, loss_scale, shard
from ..infra.metrics import plot_reward_curve, save_grid
from .auto import AutoEstimator
from .base import (RESUMABLE_CHANGES, Draw, GRPOTrainer, Iteration, Minibatch, Rollout, check_resumable,
                   draw_prompts_and_noise, update_summary)
from .diffusers_config import DiffusersTrainConfig

# config keys that may differ between a checkpoint and its resumption, besides the shapes trainer's
# (grpo.iterations, log.*, threads): where the model and rewards live, and settings with the same gradient
RESUMABLE_REAL = ("pipeline.path", "pipeline.device", "pipeline.prompt_cache", "pipeline.load_text_encoders",
                  "pipeline.gradient_checkpointing", "reward_server")
TRAINER_TAG = "jagg.trainers.diffusers"          # written into its checkpoints (a shapes run's carry none)


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def sampling_pieces(local: slice, size: int) -> list[slice]:
    """This rank's ``local`` slice of the global batch cut at the multiples of ``size`` (``sample.micro_batch``):
    the pieces sampled together, each with its own SDE noise seeded by its global start. When every shard is a
    multiple of ``size`` the pieces, and so the rollouts, are the same for any number of processes."""
    starts = sorted({local.start, *range(-(-local.start // size) * size, local.stop, size)})
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [local.stop])]


class DiffusersSampler:
    """The rollouts of a diffusers config: the trainer's and the benchmarks' (``jagg bench meter --config X.yaml``
    with a ``pipeline:`` section), which never opens a run directory; the interface of
    :class:`jagg.trainers.shapes.ShapesSampler`.

    Builds, in this order: the reward (the server's or the local one, a preference model on the pipeline's device in
    its dtype unless its spec says otherwise), the model of ``pipeline:`` with its trainable parameters
    (:attr:`named_params`, :attr:`params`; LoRA initialised from ``seed``), the RNG of the prompts (:attr:`np_rng`)
    and of the initial noise (:attr:`gen`). ``local``: this process's slice of the global batch (default: all of it,
    one process). :meth:`sample` draws and samples a batch; the SDE noise of each sampling piece is seeded by (seed,
    iteration, position), the iteration the trainer's, or the count of batches :meth:`sample` drew."""

    def __init__(self, cfg: DiffusersTrainConfig, local: slice | None = None):
        self.cfg = cfg
        self.local = slice(0, cfg.sample.batch_size) if local is None else local
        self.prompts = cfg.sample.prompt_lines                 # read (and checked) when the config was loaded
        self.reward_fn = get_reward(cfg.reward_server if cfg.reward_server is not None else cfg.reward.spec,
                                    {"device": cfg.pipeline.resolve_device(), "dtype": cfg.pipeline.dtype})
        torch.manual_seed(cfg.seed)                            # the same LoRA initialisation on every rank
        self.policy: Policy = load_model(cfg.pipeline)        # check_model_dir: clear errors for bad paths
        self.device = self.policy.device
        self.latent_shape, self.num_steps = self.policy.latent_shape, cfg.pipeline.num_steps
        self.policy.require_prompts(self.prompts, cfg.sample.prompts_file)
        self.named_params, self.params = self.policy.named_params, self.policy.params
        if not self.params:
            raise ValueError("the transformer has no trainable parameter (check pipeline.lora)")
        self.param_names = list(self.named_params)             # the names of params, in its order
        self.pieces = sampling_pieces(self.local, cfg.sample.micro_batch)
        # shared by all ranks: prompt choice and the initial noise of the global batch
        self.np_rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(_seed(cfg.seed, 1))
        self.last_images: np.ndarray | None = None             # the last scored rollout's decoded images
        self.sampled = 0                                       # batches sample() drew

    def draw(self, iteration: int = 0) -> Draw:
        """The prompts, initial noise, trained steps and SDE mask of iteration ``iteration`` (it decides a sliding SDE
        window: :func:`~jagg.trainers.base.draw_prompts_and_noise`)."""
        return draw_prompts_and_noise(self.cfg.sample, self.prompts, self.latent_shape, self.num_steps, self.np_rng,
                                      self.gen, iteration)

    def rollout(self, draw: Draw, iteration: int) -> Rollout:
        """This process's shard of ``draw``'s trajectories (the global batch's prompts, local trajectories), in pieces
        whose SDE noise is seeded by (seed, ``iteration``, global position), not by rank; the conditioning is the
        shard's prompts."""
        c, p = self.cfg.sample, self.cfg.pipeline
        prompts, noise = draw.prompts, draw.noise
        sigmas = self.policy.sigmas()
        parts = []
        for piece in self.pieces:
            gen = torch.Generator(device=self.device).manual_seed(_seed(self.cfg.seed, 2, iteration, piece.start))
            parts.append(sample_trajectories(self.policy.velocity(prompts[piece]), noise[piece].to(self.device),
                                             sigmas, p.eta, draw.train_steps, draw.sde_mask, generator=gen,
                                             micro_batch=c.micro_batch, check_finite=False, sde_type=c.sde_type))
        traj = parts[0]
        if len(parts) > 1:
            batched = ("latents", "log_probs", "velocities")
            traj = dataclasses.replace(parts[0], **{f: torch.cat([getattr(t, f) for t in parts]) for f in batched})
        return Rollout(prompts, self.local, traj, prompts[self.local])

    def sample(self, iteration: int = 0) -> Rollout:
        """A batch drawn at iteration ``iteration`` (:meth:`draw`) and sampled with the SDE noise of the count of
        batches drawn so far (each call's own)."""
        rollout = self.rollout(self.draw(iteration), self.sampled)
        self.sampled += 1
        return rollout

    def decode(self, rollout: Rollout) -> np.ndarray:
        """The rollout's final images (a video family's: videos), decoded by the VAE."""
        return self.policy.decode(rollout.traj.latents[:, -1])

    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        """The reward of the rollout's decoded final images (kept in :attr:`last_images`): ``(scores [n], info)``."""
        self.last_images = self.decode(rollout)
        return self.reward_fn(self.last_images, rollout.conditioning, None)

    def velocity(self, prompts):
        """The velocity callable of the samples whose prompts are given."""
        return self.policy.velocity(prompts)

    def reference(self, prompts):
        """The KL reference's velocity callable of those samples (the adapters off, or the frozen copy)."""
        return self.policy.reference(self.policy.velocity(prompts))

    def zero_grad(self) -> None:
        """Clear the trainable parameters' ``.grad``."""
        for p in self.params:
            p.grad = None


class DiffusersTrainer(AutoEstimator, GRPOTrainer):
    """GRPO with :func:`jagg.policy_gradient` on a diffusers SD3/FLUX/Qwen-Image model (:class:`~jagg.trainers.base.GRPOTrainer`:
    the run directory, ``resume``, ``overwrite``, ``require_checkpoint`` and the loop). Launch with torchrun /
    accelerate for several processes (``WORLD_SIZE > 1``)."""

    cfg: DiffusersTrainConfig
    multiprocess = True

    def setup(self) -> None:
        cfg = self.cfg
        self.progress_label = f"GRPO {cfg.pipeline.family}"
        # this rank's slice (the batch must split evenly); the model, prompts, reward and rollout RNGs: the sampler's
        self.sampler = s = DiffusersSampler(cfg, shard(cfg.sample.batch_size))
        self.local, self.prompts, self.reward_fn, self.policy, self.device = (s.local, s.prompts, s.reward_fn,
                                                                              s.policy, s.device)
        self.latent_shape, self.num_steps, self.named_params, self.params = (s.latent_shape, s.num_steps,
                                                                             s.named_params, s.params)
        self.pieces, self.np_rng, self.gen = s.pieces, s.np_rng, s.gen
        if self.world > 1:                                     # replicas start identical
            for p in self.params:
                dist.broadcast(p.data, 0)
        o = cfg.optim
        self.opt = o.optimizer(self.params)
        # per rank: the minibatch order and unbiased JAGG's picks (the sampler's: prompts, noise, SDE noise)
        self.perm_gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, self.rank))
        self.pick_gen = torch.Generator().manual_seed(_seed(cfg.seed, 4, self.rank))   # unbiased JAGG's picks
        self._images, self._prompts = None, None

    # ------------------------------------------------------------------ state
    def rng_state(self) -> dict:
        return {"numpy": self.np_rng.bit_generator.state, "gen": self.gen.get_state(),
                "perm_gen": self.perm_gen.get_state(), "pick_gen": self.pick_gen.get_state(),
                "torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def set_rng_state(self, rng: dict, local: bool = True) -> None:
        self.np_rng.bit_generator.state = rng["numpy"]
        self.gen.set_state(rng["gen"])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if local:
            self.perm_gen.set_state(rng["perm_gen"])
            self.pick_gen.set_state(rng["pick_gen"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _state(self, rngs: list[dict]) -> dict:
        return {"trainer": TRAINER_TAG,
                "model": {n: p.detach().cpu().clone() for n, p in self.named_params.items()},
                "optimizer": self.opt.state_dict(), "config": configuration.to_dict(self.cfg),
                "run_id": self.run_id, "world_size": self.world, "rng": rngs, **self.loop_state()}

    def load_state(self, state: dict) -> list[str]:
        """Restore ``state``; returns one line per config key that changed and may (``RESUMABLE_REAL`` and the
        shapes trainer's ``RESUMABLE_CHANGES``)."""
        if state.get("trainer") != TRAINER_TAG:
            raise ValueError(f"the checkpoints in {self.ckpt_dir} were not written by the diffusers trainer (a shapes "
                             "run?); use another log.output_dir")
        changed = check_resumable(state["config"], configuration.to_dict(self.cfg), RESUMABLE_CHANGES + RESUMABLE_REAL)
        saved = state["model"]
        if set(saved) != set(self.named_params):
            diff = sorted(set(saved) ^ set(self.named_params))[:3]
            raise ValueError(f"the checkpoint's trainable parameters differ from this model's (e.g. {diff}); was "
                             "pipeline.lora changed?")
        with torch.no_grad():
            for n, p in self.named_params.items():
                p.copy_(saved[n].to(p.device, p.dtype))
        self.opt.load_state_dict(state["optimizer"])
        self.load_loop_state(state)
        rngs = state["rng"]
        if len(rngs) == self.world:
            self.set_rng_state(rngs[self.rank])
        else:
            self._print(f"warning: the checkpoint was written by {len(rngs)} process(es), this run has {self.world}: "
                        "the per-process minibatch order is reseeded (the run continues, not bit-exactly)")
            self.set_rng_state(rngs[0], local=False)
            self.perm_gen.manual_seed(_seed(self.cfg.seed, 3, self.rank, self.iteration))
        return changed

    def save(self, rngs: list[dict] | None = None) -> Path | None:
        """Checkpoint (rank 0 writes; a collective: every rank must call it): LoRA adapter directory first, then
        ``ckpt_<n>.pt``, each written to a temporary name and renamed; the newest ``log.keep_last`` are kept."""
        rngs = rngs if rngs is not None else gather_objects([self.rng_state()])
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
                suffix = "gif" if self._images.ndim == 5 else "png"            # videos (Wan): an animated grid
                grid = self.out / "samples" / f"iter_{self.iteration:06d}.{suffix}"
                save_grid(self._images[:n], grid, ncol=min(n, 4), scale=1, prompts=self._prompts[:n])
                self.logger.image("images/rollouts", grid, self.iteration)
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
    def rollout(self, draw: Draw) -> Rollout:
        """Sample this rank's shard of the global batch (:meth:`DiffusersSampler.rollout`, SDE noise of this
        iteration)."""
        return self.sampler.rollout(draw, self.iteration)

    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        scores, info = self.sampler.score(rollout)
        self._images, self._prompts = self.sampler.last_images, rollout.conditioning   # the samples saved at a checkpoint
        return scores, info

    def velocity(self, prompts):
        return self.sampler.velocity(prompts)

    def reference(self, prompts):
        return self.sampler.reference(prompts)

    def minibatches(self, n: int) -> list[torch.Tensor]:
        perm = torch.randperm(n, generator=self.perm_gen)
        return [mb.sort().values for mb in perm.tensor_split(self.cfg.grpo.updates_per_epoch)]   # sets, in order

    def gradient(self, mb: Minibatch) -> dict:
        """This rank's gradient of its part of the minibatch (possibly empty), averaged over the ranks, and the
        statistics of the whole minibatch."""
        n = mb.size
        n_global = int(self._sum([n])[0])
        if n_global == 0:
            return {}
        names = ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl")
        counts = ("backward_items", "forward_grad_items", "forward_nograd_items", "intervals", "intervals_jagg")
        local = [0.0] * (len(names) + len(counts))
        if n:
            st = policy_gradient(self.velocity(mb.conditioning), mb.traj, mb.advantages, self.estimator,
                                 ref_velocities=mb.ref_velocities, loss_scale=loss_scale(n, n_global, self.world),
                                 prompt_groups=mb.prompt_groups, generator=self.pick_gen, on_policy=mb.on_policy)
            local = [n * getattr(st, k) for k in names] + [getattr(st, k) for k in counts]
        if self.world > 1:
            for p in self.params:                              # same buckets on every rank, even with no samples
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_gradients(self.params)
        tot = self._sum(local)
        stats = {k: tot[i] / n_global for i, k in enumerate(names)}
        stats.update({k: int(tot[len(names) + i]) for i, k in enumerate(counts)})
        stats["jagg_frac_routed"] = stats["intervals_jagg"] / stats["intervals"] if stats["intervals"] else 0.0
        return stats

    def _sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (float64; a collective with several processes)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def stop_requested(self) -> bool:
        return bool(self._sum([float(self._stop)])[0])                 # every process stops at the same iteration

    def report(self, records: list[dict]) -> None:
        train = [r for r in records if r.get("kind") == "train"]
        if train:
            print(f"train reward: {train[0]['reward_mean']:.4f} (iteration {train[0]['iteration']}) -> "
                  f"{train[-1]['reward_mean']:.4f} (iteration {train[-1]['iteration']})")
        super().report(records)

    def shown_outputs(self) -> list[str]:
        extra = " (ckpt_*.pt, adapter_*/: LoRA, diffusers load_lora_weights)" if self.cfg.pipeline.lora.enabled else ""
        return [o + extra if o == "checkpoints/" else o for o in super().shown_outputs()]

    def record(self, it: Iteration) -> dict:
        rewards = it.rewards
        rec = {"kind": "train", "iteration": self.iteration, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std(unbiased=False)), "samples": len(it.rollout.prompts),
               "trained_samples": int(self._sum([it.trained])[0]), "processes": self.world, **it.times,
               "iter_cpu_s": it.cpu, "cpu_s": self.cpu}                  # this process's CPU seconds
        # a weighted sum's components (info["scores/<name>"] of this process's samples), averaged over the processes
        parts = {k[len("scores/"):]: np.asarray(v, dtype=np.float64) for k, v in it.info.items()
                 if k.startswith("scores/")}
        if parts:
            sums = self._sum([float(v.sum()) for v in parts.values()] + [float(len(it.rollout.conditioning))])
            rec.update({f"reward/{name}": total / sums[-1] for name, total in zip(parts, sums)})
        return {**rec, **update_summary(it.per_update), "updates": len(it.per_update),
                "skipped_total": self.skipped_updates}
