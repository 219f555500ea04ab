"""``jagg train`` on a real diffusers model (SD3/SD3.5, FLUX.1, Qwen-Image, Wan 2.1, FLUX.2): GRPO with JAGG, LoRA or
full weights.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``; the config is
:class:`jagg.trainers.diffusers_config.DiffusersTrainConfig`) makes ``jagg train --config X.yaml`` run
:class:`DiffusersTrainer` instead of the shapes trainer. It is built as the shapes trainer
(:mod:`jagg.trainers.shapes_trainer`) is, in three layers, each asking one object for everything model specific, the
:class:`jagg.integrations.policy.Policy` (prompts, sampler, velocity callable, KL reference, decoding, adapter files):

- :class:`DiffusersSampler`: the rollouts of a config (model, trainable weights, prompts, reward, sampling), what the
  trainer draws its batches with and ``jagg bench meter`` and ``python -m lab signal`` too;
- :class:`DiffusersGRPO`: the loop's hooks (:class:`jagg.trainers.loop.GRPO`) on a sampler: the engine of several
  processes, each update's gradient from :func:`jagg.policy_gradient`, AdamW, an optional EMA; one iteration at a
  time, in memory;
- :class:`DiffusersTrainer`: that in a run directory (:class:`jagg.trainers.loop.GRPOTrainer`): the first screen,
  checkpoints and their exported weights, resuming, the final export and the evaluation on the test set.

Before the model loads (and before the run directory is touched) :func:`jagg.trainers.load_checks.check_before_loading`
checks the model directory against the config, the starting adapter and the reward server; the first screen is a
header of what runs (:mod:`jagg.trainers.run_header`). One iteration:

1. pick ``prompts_per_iter`` prompts of ``sample.prompts_file`` (a ``.txt``, or a ``.jsonl`` with each prompt's
   metadata) and repeat each ``group_size`` times (the global batch of ``N`` trajectories); under torchrun /
   accelerate every rank takes its contiguous shard of it;
2. sample the shard with the Flow-GRPO SDE through :meth:`Policy.velocity` (CFG, prompt embeddings) and
   :func:`jagg.sample_trajectories` on :meth:`Policy.sigmas` (the family's pipeline grid, ``pipeline.sigma_grid``),
   in pieces of ``sample.micro_batch`` trajectories at global positions, each with its own SDE noise seeded by (seed,
   iteration, position): a sample's rollout does not depend on the number of processes when every shard is a whole
   number of pieces; decode with the VAE; score with the reward (registry name, weighted sum, ``module:function`` or
   an HTTP reward server), given each sample's prompt metadata;
3. gather the rewards of all ranks, group-relative advantages per prompt on the global batch
   (:func:`jagg.group_advantages`), drop zero-spread prompt groups;
4. ``inner_epochs x updates_per_epoch`` AdamW updates whose gradients come from :func:`jagg.policy_gradient`
   (KL reference = the adapters switched off, or a frozen copy for full fine-tuning), each followed by the EMA's
   update (``optim.ema_decay``, :class:`jagg.trainers.ema.EMA`); with several ranks each rank's loss is scaled by
   :func:`jagg.infra.distributed.loss_scale` and the engine averages the gradients, so the result is the gradient of
   the global minibatch.

Every ``eval.every`` iterations (and before the first and after the last) the test set is evaluated
(:func:`jagg.trainers.diffusers_eval.evaluate_policy`: the ODE at ``pipeline.eval_num_steps``, fixed noise, the EMA's
weights). Outputs in ``log.output_dir`` (one run per directory, :mod:`jagg.infra.rundir`; ``run.json`` holds the run
id): ``metrics.jsonl`` (``train`` and ``eval`` records, + TensorBoard with the grids), ``reward_curve.png``,
``samples/iter_<n>.png`` (a few rollout images at each checkpoint) and ``samples/eval_<n>.png`` (test images), each
captioned with prompt and reward (a video family's as an animated ``.gif`` grid), ``checkpoints/ckpt_<n>.pt``
(trainable weights, their EMA, optimizer, every RNG, config; atomic, keep-last-N; under FSDP the weights, the EMA and
the optimizer are shards in ``ckpt_<n>.dcp/``) and beside each its export (:mod:`jagg.trainers.weights_export`,
gathered under FSDP): with LoRA ``adapter_<n>/``, which ``<Pipeline>.load_lora_weights`` and
``PeftModel.from_pretrained`` read, with full fine-tuning ``transformer_<n>/`` (``save_pretrained``), the EMA's in
``ema/``; at the end of the run the final weights, gathered once: ``final/adapter/`` (LoRA) or ``final/transformer/``
(full fine-tuning), the EMA's in ``final/ema/``.

Several processes (torchrun, ``accelerate launch``) train on an engine (:mod:`jagg.infra.engine`, chosen from
``distributed:`` and the accelerate config, :mod:`jagg.infra.launch`): DDP replicates the transformer (LoRA, or a model
that fits one GPU) and all-reduces each update's gradient once; FSDP2 shards it per transformer block (parameters,
gradients, AdamW state, the frozen KL reference) for full fine-tuning of a model that does not fit one GPU. Ranks may
hold different numbers of samples after zero-spread prompt groups are dropped: the engine keeps them in step. With one
update per epoch (``grpo.updates_per_epoch: 1``) two processes make the same update as one process on the same global
batch (tested with ``accelerate launch`` and torchrun, DDP and FSDP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..estimator import policy_gradient
from ..integrations.model_dir import ModelFiles
from ..integrations.policy import Policy, load_model
from ..rewards.registry import get_reward
from ..trajectory import sample_trajectories
from ..infra import config_loader as configuration
from ..infra.checkpoint import prune_checkpoints, shard_names, write_checkpoint, write_shards
from ..infra.distributed import gather_objects, loss_scale, shard
from ..infra.engine import EngineSettings, make_engine, resolve_engine
from ..infra.launch import LaunchSettings, read_launch
from ..infra.metrics import plot_reward_curve, save_grid
from .auto import AutoEstimator
from .loop import GRPO, GRPOTrainer
from .resume import RESUMABLE_CHANGES, check_resumable
from .rollout import Iteration, Minibatch, Rollout, RolloutInputs, rollout_inputs, update_summary
from .diffusers_config import TRAINER_TAG, DiffusersTrainConfig
from .diffusers_eval import evaluate_policy
from .ema import EMA
from .minibatches import GROUPS, check_groups_fit, cut_minibatches
from .load_checks import check_before_loading
from .run_header import header, loading_note, quiet_loading
from .weights_export import export_weights, prune_exports, write_weights

# config keys that may differ between a checkpoint and its resumption, besides the shapes trainer's
# (grpo.iterations, log.*, threads): where the model and rewards live, and settings with the same gradient (how the
# processes share the model: a checkpoint of FSDP shards or of whole weights reads into any engine, resharded)
RESUMABLE_REAL = ("pipeline.path", "pipeline.device", "pipeline.prompt_cache", "pipeline.load_text_encoders",
                  "pipeline.gradient_checkpointing", "reward_server", "distributed.")


def grid_suffix(images: np.ndarray) -> str:
    """A sample grid's file type: ``gif`` for videos ``[N, F, H, W, 3]`` (an animated grid), else ``png``."""
    return "gif" if images.ndim == 5 else "png"


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def sampling_pieces(local: slice, size: int) -> list[slice]:
    """This rank's ``local`` slice of the global batch cut at the multiples of ``size`` (``sample.micro_batch``):
    the pieces sampled together, each with its own SDE noise seeded by its global start. When every shard is a
    multiple of ``size`` the pieces, and so the rollouts, are the same for any number of processes."""
    starts = sorted({local.start, *range(-(-local.start // size) * size, local.stop, size)})
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [local.stop])]


def engine_for(cfg: DiffusersTrainConfig, launch: LaunchSettings, world: int) -> EngineSettings:
    """The engine of ``cfg`` under the launcher's settings with ``world`` processes
    (:func:`jagg.infra.engine.resolve_engine`, which applies the launcher's settings to ``cfg.pipeline``), refusing
    what the trainer cannot run with it: the estimator audit (``estimator.meter_every`` of a fixed estimator) under
    FSDP, measured on the main process's whole gradient (``estimator.mode: auto`` gathers the sharded gradients whole
    on every process)."""
    settings = resolve_engine(cfg, launch, world)
    if settings.strategy == "fsdp" and cfg.estimator.meter_every and cfg.estimator.mode != "auto":
        raise ValueError("estimator.meter_every > 0 audits the estimator on the main process's whole gradient, which "
                         "FSDP shards across the processes: set estimator.meter_every: 0 and measure with jagg bench "
                         "meter --config (one process), or train with distributed.strategy: ddp")
    return settings


class DiffusersSampler:
    """The rollouts of a diffusers config: the trainer's and the benchmarks' (``jagg bench meter --config X.yaml``
    with a ``pipeline:`` section), which never opens a run directory; the interface of
    :class:`jagg.trainers.shapes_trainer.ShapesSampler`.

    Builds, in this order: the reward (the server's or the local one, a preference model on the pipeline's device in
    its dtype unless its spec says otherwise), the model of ``pipeline:`` with its trainable parameters
    (:attr:`named_params`, :attr:`params`; LoRA initialised from ``seed``), the RNG of the prompts (:attr:`np_rng`)
    and of the initial noise (:attr:`gen`). ``local``: this process's slice of the global batch (default: all of it,
    one process). :meth:`sample` draws and samples a batch; the SDE noise of each sampling piece is seeded by (seed,
    iteration, position), the iteration the trainer's, or the count of batches :meth:`sample` drew. ``place``: as
    :func:`jagg.integrations.policy.load_model`'s (False: a sharding engine places the transformer); ``checked``: what
    :func:`jagg.trainers.load_checks.check_before_loading` returned when the caller ran it (else it runs here)."""

    def __init__(self, cfg: DiffusersTrainConfig, local: slice | None = None, checked: ModelFiles | None = None,
                 place: bool = True):
        if checked is None:                                    # before anything loads (jagg train: before_setup)
            checked = check_before_loading(cfg)
        self.cfg = cfg
        self.local = slice(0, cfg.sample.batch_size) if local is None else local
        self.prompts = cfg.sample.prompt_lines                 # read (and checked) when the config was loaded
        self.reward_fn = get_reward(cfg.reward_server if cfg.reward_server is not None else cfg.reward.spec,
                                    {"device": cfg.pipeline.resolve_device(), "dtype": cfg.pipeline.dtype})
        torch.manual_seed(cfg.seed)                            # the same LoRA initialisation on every rank
        self.policy: Policy = load_model(cfg.pipeline, place, checked)
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

    def draw(self, iteration: int = 0) -> RolloutInputs:
        """The prompts, initial noise, trained steps and SDE mask of iteration ``iteration`` (it decides a sliding SDE
        window: :func:`~jagg.trainers.rollout.rollout_inputs`)."""
        return rollout_inputs(self.cfg.sample, self.prompts, self.latent_shape, self.num_steps, self.np_rng,
                              self.gen, iteration)

    def rollout(self, draw: RolloutInputs, iteration: int) -> Rollout:
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
        metadata = self.cfg.sample.prompt_set.take(draw.indices[self.local])[1] if draw.indices else None
        return Rollout(prompts, self.local, traj, prompts[self.local], metadata)

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
        return self.reward_fn(self.last_images, rollout.conditioning, rollout.metadata)

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


class DiffusersGRPO(AutoEstimator, GRPO):
    """GRPO with :func:`jagg.policy_gradient` on a diffusers SD3/FLUX/Qwen-Image/Wan/FLUX.2 model, one iteration at a
    time, in memory (:class:`~jagg.trainers.loop.GRPO`): the hooks on a :class:`DiffusersSampler`, the engine, AdamW,
    the KL reference, an optional EMA and the RNGs of the minibatch order and of unbiased JAGG's picks. Launch with
    torchrun / accelerate for several processes (``WORLD_SIZE > 1``): the engine (:mod:`jagg.infra.engine`: DDP or
    FSDP2) comes from ``distributed:`` and the launcher's settings (:mod:`jagg.infra.launch`)."""

    cfg: DiffusersTrainConfig
    multiprocess = True

    def before_setup(self) -> None:
        """What can be checked before the model loads (and, in a :class:`DiffusersTrainer`, before the run directory
        is used): the model directory against the config, the starting adapter, the reward server
        (:func:`jagg.trainers.load_checks.check_before_loading`), then the launcher's settings and the engine
        (:func:`engine_for`)."""
        self.model_files = check_before_loading(self.cfg)
        if self.cfg.grpo.minibatches == GROUPS:               # a prompt group never straddles two processes
            check_groups_fit(self.cfg.sample.prompts_per_iter, self.cfg.grpo.updates_per_epoch, self.world)
        self.engine_settings = engine_for(self.cfg, read_launch(), self.world)
        super().before_setup()

    def setup(self) -> None:
        cfg = self.cfg
        self.engine = make_engine(self.engine_settings, self.rank, self.world, cfg.pipeline.resolve_device())
        for line in self.engine_settings.notes:
            self._print(line)
        # this rank's slice (the batch must split evenly); the model, prompts, reward and rollout RNGs: the sampler's
        with quiet_loading() as held:
            self.sampler = s = DiffusersSampler(cfg, shard(cfg.sample.batch_size), checked=self.model_files,
                                                place=self.engine.places_model)
        self.loading_messages = held                           # what the loading said, held back (run_header)
        self.engine.wrap(s.policy)                # DDP: replicas start equal (rank 0's); FSDP: sharded
        s.named_params, s.params = s.policy.named_params, s.policy.params
        self.local, self.prompts, self.reward_fn, self.policy, self.device = (s.local, s.prompts, s.reward_fn,
                                                                              s.policy, s.device)
        self.latent_shape, self.num_steps, self.named_params, self.params = (s.latent_shape, s.num_steps,
                                                                             s.named_params, s.params)
        self.pieces, self.np_rng, self.gen = s.pieces, s.np_rng, s.gen
        o = cfg.optim
        self.opt = o.optimizer(self.params)
        # per rank: the minibatch order and unbiased JAGG's picks (the sampler's: prompts, noise, SDE noise)
        self.perm_gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, self.rank))
        self.pick_gen = torch.Generator().manual_seed(_seed(cfg.seed, 4, self.rank))   # unbiased JAGG's picks
        self.ema = EMA(self.named_params, o.ema_decay) if o.ema_decay > 0 else None   # after each optimizer step

    # ------------------------------------------------------------------ one iteration
    def rollout(self, draw: RolloutInputs) -> Rollout:
        """Sample this rank's shard of the global batch (:meth:`DiffusersSampler.rollout`, SDE noise of this
        iteration), in a region of the engine (its pieces may differ in number between ranks)."""
        with self.engine.region():
            return self.sampler.rollout(draw, self.iteration)

    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        return self.sampler.score(rollout)

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def velocity(self, prompts):
        return self.sampler.velocity(prompts)

    def reference(self, prompts):
        return self.sampler.reference(prompts)

    def reference_rows(self, cond, traj, n: int):
        """The KL reference velocities of the kept samples, in a region of the engine: every rank calls it, with
        its own number of samples (possibly none)."""
        with self.engine.region():
            return super().reference_rows(cond, traj, n)

    def audit(self, *args, **kwargs):
        """The estimator audit of the main process's samples (:meth:`GRPO.audit`), its gradients not synchronised."""
        with self.engine.local():
            return super().audit(*args, **kwargs)

    def minibatches(self, prompt_groups: torch.Tensor) -> list[torch.Tensor]:
        """Shuffled samples from this process's generator; whole prompt groups from one global cut of every
        process's kept groups, drawn by (seed, iteration, epoch) alike on every process: each update's global minibatch
        is the same for any process count."""
        U, cut = self.cfg.grpo.updates_per_epoch, self.update_cut()
        if cut != GROUPS:
            return [mb.sort().values for mb in cut_minibatches(prompt_groups, U, cut, self.perm_gen)]  # sets, in order
        if getattr(self, "_cut_iteration", None) != self.iteration:
            self._cut_iteration, self._cut_epoch = self.iteration, 0
        self._cut_epoch += 1
        gen = torch.Generator().manual_seed(_seed(self.cfg.seed, 5, self.iteration, self._cut_epoch))
        kept = sorted(set(gather_objects(prompt_groups.unique().tolist())))           # every process's groups
        return cut_minibatches(prompt_groups, U, cut, gen, torch.tensor(kept, dtype=prompt_groups.dtype))

    def gradient(self, mb: Minibatch) -> dict:
        """This rank's gradient of its part of the minibatch (possibly empty), averaged over the ranks by the engine
        (each rank's loss scaled by :func:`jagg.infra.distributed.loss_scale`), and the statistics of the whole
        minibatch (``samples``: its size over the processes)."""
        n = mb.size
        n_global = int(self._sum([n])[0])
        if n_global == 0:
            return {}
        names = ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl")
        counts = ("backward_items", "forward_grad_items", "forward_nograd_items", "intervals", "intervals_jagg")
        local = [0.0] * (len(names) + len(counts))
        with self.engine.update() as backward_context:
            if n:
                st = policy_gradient(self.velocity(mb.conditioning), mb.traj, mb.advantages, self.estimator,
                                     ref_velocities=mb.ref_velocities, loss_scale=loss_scale(n, n_global, self.world),
                                     backward_context=backward_context, prompt_groups=mb.prompt_groups,
                                     generator=self.pick_gen, on_policy=mb.on_policy)
                local = [n * getattr(st, k) for k in names] + [getattr(st, k) for k in counts]
        tot = self._sum(local)
        stats = {k: tot[i] / n_global for i, k in enumerate(names)}
        stats.update({k: int(tot[len(names) + i]) for i, k in enumerate(counts)})
        stats["jagg_frac_routed"] = stats["intervals_jagg"] / stats["intervals"] if stats["intervals"] else 0.0
        stats["samples"] = n_global
        return stats

    def _sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (float64; a collective with several processes)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

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


class DiffusersTrainer(DiffusersGRPO, GRPOTrainer):
    """``jagg train`` on a diffusers model: :class:`DiffusersGRPO` in a run directory
    (:class:`~jagg.trainers.loop.GRPOTrainer`: the run directory, ``resume``, ``overwrite``, ``require_checkpoint``
    and the loop), with the first screen, checkpoints (whole or FSDP shards) with their exported weights, the sample
    grids, the final export and the evaluation on the test set."""

    def setup(self) -> None:
        cfg = self.cfg
        self.progress_label = f"GRPO {cfg.pipeline.family}"
        super().setup()
        if cfg.eval.enabled:                                   # the test prompts too, before anything runs
            self.policy.require_prompts(cfg.eval.prompts()[0], cfg.eval.test_set.path)
        self.evaluates = cfg.eval.enabled
        self._images, self._prompts, self._scores = None, None, None
        if self.main:                                          # the first screen: what runs
            lines = header(cfg, self.policy, self.out, self.run_id, self._start.resumed is not None, self.world,
                           self.engine.name)
            print("\n".join(lines + [note for note in [loading_note(self.loading_messages)] if note]), flush=True)

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

    def state_entries(self) -> dict[str, dict[str, torch.Tensor]]:
        """State besides the model and the optimizer that is keyed like the trainable parameters (name -> {parameter
        name: tensor}): the EMA's averages (``"ema"``), saved and restored with the weights, as shards under FSDP."""
        return {} if self.ema is None else {"ema": dict(zip(self.ema.names, self.ema.shadow))}

    def _state(self, rngs: list[dict], shards: str | None = None) -> dict:
        """The checkpoint's state: with ``shards`` (the shard directory's name, FSDP) the model, optimizer and
        :meth:`state_entries` live there, else here, whole."""
        if shards is None:
            model = {n: p.detach().cpu().clone() for n, p in self.named_params.items()}
            weights = {"model": model, "optimizer": self.opt.state_dict(),
                       **{k: {n: t.detach().cpu().clone() for n, t in e.items()}
                          for k, e in self.state_entries().items()}}
        else:
            weights = {"model": shards, "optimizer": shards}
        return {"trainer": TRAINER_TAG, **weights, "config": configuration.to_dict(self.cfg),
                "engine": {"strategy": self.engine.name, "processes": self.world,
                           "param_dtype": self.engine_settings.param_dtype},
                "run_id": self.run_id, "world_size": self.world, "rng": rngs, **self.loop_state()}

    def load_state(self, state: dict) -> list[str]:
        """Restore ``state``; returns one line per config key that changed and may (``RESUMABLE_REAL`` and the
        shapes trainer's ``RESUMABLE_CHANGES``)."""
        if state.get("trainer") != TRAINER_TAG:
            raise ValueError(f"the checkpoints in {self.ckpt_dir} were not written by the diffusers trainer (a shapes "
                             "run?); use another log.output_dir")
        changed = check_resumable(state["config"], configuration.to_dict(self.cfg), RESUMABLE_CHANGES + RESUMABLE_REAL)
        was, now = state.get("engine", {}).get("param_dtype"), self.engine_settings.param_dtype
        if was != now:                                 # FSDP's compute dtype comes from the launcher, not the config
            changed.append(f"FSDP mixed precision (the accelerate config's mixed_precision): {was or 'no'} in the "
                           f"checkpoint, {now or 'no'} now")
        saved = state["model"]
        buffers = {n for n, _ in self.policy.bare.named_buffers()}          # shards carry the buffers too
        names = shard_names(self.ckpt_dir / saved) - buffers if isinstance(saved, str) else set(saved)
        if names != set(self.named_params):
            diff = sorted(names ^ set(self.named_params))[:3]
            raise ValueError(f"the checkpoint's trainable parameters differ from this model's (e.g. {diff}); was "
                             "pipeline.lora changed?")
        if isinstance(saved, str):                     # FSDP's shards, read into any layout (resharded)
            try:
                self.engine.load_shards(self.policy.bare, self.opt, self.state_entries(), self.ckpt_dir / saved)
            except Exception as e:                     # damaged beyond what check_shards sees
                raise ValueError(f"the shard directory {self.ckpt_dir / saved} cannot be read ({type(e).__name__}: "
                                 f"{str(e)[:300]}); move it and its .pt out of {self.ckpt_dir} to resume from the "
                                 "checkpoint before it") from None
        else:                                          # whole weights, each process taking its part (sharded)
            if self.ema is not None:
                self.ema.load_state_dict(state.get("ema"))
            self.engine.load_whole(self.named_params, self.opt, saved, state["optimizer"])
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
        """Checkpoint (a collective: every rank must call it): the weights gathered under FSDP, then (FSDP) the shard
        directory ``ckpt_<n>.dcp/`` written by every rank, then on rank 0 the exported weights (adapter or transformer
        directory, :func:`jagg.trainers.weights_export.export_weights`) and ``ckpt_<n>.pt``; each written under a
        temporary name and renamed, so ``ckpt_<n>.pt`` exists only when all it names is complete. The newest
        ``log.keep_last`` are kept, with their exports and shards."""
        rngs = rngs if rngs is not None else gather_objects([self.rng_state()])
        weights = self._gathered()
        shards = None
        if self.engine.sharded:
            shards = write_shards(lambda d: self.engine.save_shards(self.policy.bare, self.opt, self.state_entries(),
                                                                    d),
                                  self.ckpt_dir, self.iteration, self.main, self._barrier, self.run_id)
        path = None
        if self.main:
            export_weights(self.policy, self.ckpt_dir, self.iteration, *weights)   # adapter_<n>/ or transformer_<n>/
            path = write_checkpoint(self._state(rngs, shards), self.ckpt_dir, self.iteration)
            # this run's exports and shards of a pruned checkpoint go with it; other directories stay
            prune_exports(self.ckpt_dir, prune_checkpoints(self.ckpt_dir, self.cfg.log.keep_last, self.run_id,
                                                           keep=path))
            if self._images is not None and self.cfg.log.sample_images:
                n = min(self.cfg.log.sample_images, len(self._images))
                grid = self.out / "samples" / f"iter_{self.iteration:06d}.{grid_suffix(self._images)}"
                save_grid(self._images[:n], grid, ncol=min(n, 4), scale=1, prompts=self._prompts[:n],
                          rewards=self._scores[:n])
                self.logger.image("images/rollouts", grid, self.iteration)
            plot_reward_curve(self.logger.records(), self.out / "reward_curve.png",
                              f"GRPO ({self.cfg.estimator.mode}) on {self.cfg.pipeline.family}")
        self._barrier()
        return path

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _gathered(self) -> tuple[dict | None, dict | None]:
        """The weights to export and the EMA's, gathered whole on the main process (a collective under FSDP: the
        trainable weights with LoRA, all of them with full fine-tuning); the weights are None where the model holds
        them whole (it is read directly), the EMA's None without an EMA."""
        lora = self.cfg.pipeline.lora.enabled
        weights = self.engine.full_state_dict(self.policy.bare, trainable_only=lora) if self.engine.sharded else None
        ema = None if self.ema is None else self.engine.full_tensors(self.state_entries()["ema"])
        return weights, ema

    def train(self) -> list[dict]:
        """:meth:`GRPOTrainer.train`, then, when this call trained the run to ``grpo.iterations``, the final export
        (:meth:`export`)."""
        start = self.iteration
        records = super().train()
        if start < self.cfg.grpo.iterations <= self.iteration and not self.stopped:
            self.export()
        return records

    def export(self) -> Path | None:
        """The trained weights, gathered once, in the format users load, to ``final/`` (replacing this run's earlier
        export when it is complete): ``final/adapter/`` (LoRA, what ``<Pipeline>.load_lora_weights`` and
        ``PeftModel.from_pretrained`` read) or ``final/transformer/`` (full fine-tuning, ``save_pretrained``:
        ``<Transformer>.from_pretrained`` reads it, in the trained weights' dtype), the EMA's in its ``ema/``. A
        collective under FSDP. Returns the directory on the main process."""
        lora = self.cfg.pipeline.lora.enabled
        weights, ema = self._gathered()
        path = None
        if self.main:
            kind = "adapter" if lora else "transformer"
            path = write_weights(self.policy, self.out / "final" / kind, weights, ema)
            self._print(f"exported the final weights to {path}")
        self._barrier()
        return path

    # ------------------------------------------------------------------ one iteration
    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        scores, info = super().score(rollout)
        # the samples saved at a checkpoint, captioned with their rewards
        self._images, self._prompts, self._scores = self.sampler.last_images, rollout.conditioning, scores
        return scores, info

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Evaluate on the test set (:func:`jagg.trainers.diffusers_eval.evaluate_policy`, the EMA's weights when the
        run keeps one), log an ``eval`` record, write ``samples/eval_<n>.png`` (videos: ``.gif``) captioned with each
        image's prompt and reward, to TensorBoard and wandb too; returns the record."""
        c = self.cfg
        prompts, metadata = c.eval.prompts()
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext(), self.engine.region():
            ev = evaluate_policy(self.policy, self.reward_fn, prompts, metadata, c.pipeline.eval_num_steps,
                                 c.eval.seed, c.sample.micro_batch, c.eval.grid_size, self.rank, self.world)
        rec = {"kind": "eval", "iteration": self.iteration, "wall_s": self.wall, "eval_s": ev.seconds,
               "ema": self.ema is not None, **ev.metrics}
        if self.main:
            self.logger.log(rec)
            grid = self.out / "samples" / f"eval_{self.iteration:06d}.{grid_suffix(ev.images)}"
            save_grid(ev.images, grid, ncol=min(len(ev.images), 4), scale=1, prompts=ev.prompts, rewards=ev.scores)
            self.logger.image("images/eval", grid, self.iteration)
            plot_reward_curve(self.logger.records(), self.out / "reward_curve.png",
                              f"GRPO ({c.estimator.mode}) on {c.pipeline.family}")
        return rec

    def before_training(self) -> None:
        if self.iteration == 0 and self.evaluates:
            self._print(f"iteration 0: test reward {self.evaluate()['reward_mean']:.4f}")

    def after_iteration(self, done: bool) -> dict | None:
        return self.evaluate() if self.cfg.eval.due(self.iteration, done) else None

    def stop_requested(self) -> bool:
        return bool(self._sum([float(self._stop)])[0])                 # every process stops at the same iteration

    def report(self, records: list[dict]) -> None:
        for kind in ("train", "eval"):
            rows = [r for r in records if r.get("kind") == kind]
            if rows:
                print(f"{'train' if kind == 'train' else 'test'} reward: {rows[0]['reward_mean']:.4f} (iteration "
                      f"{rows[0]['iteration']}) -> {rows[-1]['reward_mean']:.4f} (iteration {rows[-1]['iteration']})")
        super().report(records)

    def shown_outputs(self) -> list[str]:
        lora = self.cfg.pipeline.lora.enabled
        extra = (" (ckpt_*.pt; adapter_*/: LoRA for load_lora_weights and PeftModel.from_pretrained" if lora else
                 " (ckpt_*.pt; transformer_*/: save_pretrained") + (", EMA in ema/)" if self.ema is not None else ")")
        return [o + extra if o == "checkpoints/" else o for o in super().shown_outputs()]
