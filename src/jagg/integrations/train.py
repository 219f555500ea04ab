"""``jagg train`` on a real diffusers model (SD3/SD3.5, FLUX.1): GRPO with the JAGG estimator, LoRA or full weights.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``) makes
``jagg train --config X.yaml`` run :class:`RealTrainer` instead of the TinyDiT trainer. One iteration:

1. pick ``prompts_per_iter`` prompts of ``sample.prompts_file`` and repeat each ``group_size`` times (the global
   batch of ``N`` trajectories); under torchrun / accelerate every rank takes its contiguous shard of it;
2. sample the shard with the Flow-GRPO SDE through :meth:`RealModel.velocity` (CFG, prompt embeddings),
   :func:`jagg.sample_trajectories`; decode with the VAE; score with the reward (registry name, weighted sum,
   ``module:function`` or an HTTP reward server);
3. gather the rewards of all ranks, group-relative advantages per prompt on the global batch
   (:func:`jagg.group_advantages`), drop zero-spread groups;
4. ``inner_epochs x updates_per_epoch`` AdamW updates whose gradients come from :func:`jagg.policy_gradient`
   (KL reference = the adapters switched off, or a frozen copy for full fine-tuning); with several ranks the
   local gradients are averaged once per update with :func:`jagg.training.distributed.all_reduce_gradients`, each rank's
   loss scaled by :func:`jagg.training.distributed.loss_scale` so the result is the gradient of the global minibatch.

Outputs in ``log.output_dir``: ``metrics.jsonl`` (+ TensorBoard), ``reward_curve.png``, ``samples/iter_<n>.png``
(a few rollout images at each checkpoint), ``checkpoints/ckpt_<n>.pt`` (trainable weights, optimizer, every RNG,
config; atomic, keep-last-N) and, with LoRA, ``checkpoints/adapter_<n>/pytorch_lora_weights.safetensors``, which
``StableDiffusion3Pipeline.load_lora_weights`` / ``FluxPipeline.load_lora_weights`` read.

Data parallelism replicates the model on every rank (LoRA on SD3.5 / FLUX fits one GPU); the model is not wrapped
in DDP: gradients accumulate locally and are all-reduced once per optimizer update, so ranks may hold different
numbers of samples after zero-spread groups are dropped. FSDP / DeepSpeed sharding are available through the
library API (docs/real_models.md), not through this trainer.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ..training import config_loader as configuration
from ..advantages import group_advantages, nonzero_spread_mask
from ..training.checkpoint import load_latest, save_checkpoint
from ..estimator_config import EstimatorConfig
from ..training.distributed import (all_reduce_gradients, gather, gather_objects, init_process_group_from_env, loss_scale,
                           shard)
from ..estimator import policy_gradient, reference_velocities
from ..training.metrics import MetricsLogger, plot_reward_curve, save_grid
from ..rewards.client import RewardClient
from ..rewards.registry import get_reward
from ..training.sections import (GRPOConfig, LogConfig, OptimConfig, RewardConfig, check_group_size,
                            check_sde_window, check_updates_divide_batch)
from ..training.core import TrainerCore, check_resumable
from ..trajectory import sample_trajectories, select_train_steps
from .diffusers_adapters import unwrap_model
from .pipeline import PipelineConfig, RealModel, load_model

# config keys that may differ between a checkpoint and its resumption, besides the TinyDiT trainer's
# (grpo.iterations, log.*, threads): where the model and rewards live, and settings with the same gradient
RESUMABLE_REAL = ("pipeline.path", "pipeline.device", "pipeline.prompt_cache", "pipeline.load_text_encoders",
                  "pipeline.gradient_checkpointing", "reward_server")
TRAINER_TAG = "jagg.integrations.train"


def _help(text: str) -> dict:
    return {"help": text}


def read_prompt_lines(path: str) -> list[str]:
    """The prompts of a text file, one per line (surrounding spaces and blank lines dropped)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"sample.prompts_file {path!r} does not exist or is not a file; give a text file with "
                                "one prompt per line (--set sample.prompts_file=prompts.txt)")
    try:
        prompts = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"sample.prompts_file {path!r} cannot be read as text: {e}") from None
    if not prompts:
        raise ValueError(f"sample.prompts_file {path!r} holds no prompt; put one prompt per line")
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class RealSampleConfig:
    """Rollouts of a real model. Steps, eta, shift and guidance are the model's and live in ``pipeline:``; the
    TinyDiT trainer's ``SampleConfig`` does not fit (its prompt file must parse in the shapes-world grammar)."""

    prompts_file: str | None = field(default=None, metadata=_help(
        "Required: text file of training prompts, one per line (blank lines skipped)."))
    prompts_per_iter: int = field(default=8, metadata=_help(
        "Distinct prompts per iteration, over all processes (Flow-GRPO: 48 on 32 GPUs)."))
    group_size: int = field(default=8, metadata=_help("Images per prompt (the GRPO group; Flow-GRPO: 24)."))
    shared_noise: bool = field(default=False, metadata=_help("Share the initial noise within a prompt's group."))
    timestep_fraction: float = field(default=1.0, metadata=_help(
        "Train the first fraction of the pipeline.num_steps steps (all steps are SDE steps)."))
    sde_window: list[int] | None = field(default=None, metadata=_help(
        "[start, end): only these steps are SDE steps and trained; the rest are ODE steps (Flow-GRPO-Fast)."))
    micro_batch: int = field(default=8, metadata=_help("Rows per transformer call while sampling."))

    def __post_init__(self):
        if self.prompts_file is None:
            raise ValueError("sample.prompts_file must be set: a text file with one training prompt per line "
                             "(in the YAML's sample: section or --set sample.prompts_file=prompts.txt)")
        self.prompts_file = str(self.prompts_file)
        read_prompt_lines(self.prompts_file)                       # fail at load, not mid-run
        for name in ("prompts_per_iter", "group_size", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"sample.{name} must be >= 1; got {getattr(self, name)}")
        check_group_size(self.group_size)
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"sample.timestep_fraction must be in (0, 1]; got {self.timestep_fraction}")
        if self.sde_window is not None and self.timestep_fraction != 1.0:
            raise ValueError("set either sample.timestep_fraction or sample.sde_window, not both")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_iter * self.group_size


@dataclass
class RealLogConfig(LogConfig):
    """:class:`jagg.shapes.config.LogConfig` with its own default run directory."""

    output_dir: str = field(default="runs/real", metadata=_help(
        "Run directory: metrics, sample images, checkpoints and LoRA adapters."))
    sample_images: int = field(default=8, metadata=_help(
        "Rollout images saved as samples/iter_<n>.png at each checkpoint (0 = none)."))

    def __post_init__(self):
        super().__post_init__()
        if self.sample_images < 0:
            raise ValueError(f"log.sample_images must be >= 0; got {self.sample_images}")


@dataclass
class RealTrainConfig:
    """Everything one ``jagg train`` run on a diffusers model needs; saved into every checkpoint."""

    seed: int = field(default=0, metadata=_help("Seed of prompts, noise, LoRA initialisation and minibatches."))
    threads: int = field(default=0, metadata=_help("torch CPU threads (0 = torch's default)."))
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sample: RealSampleConfig = field(default_factory=RealSampleConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardConfig | None = field(default=None, metadata=_help(
        "Local reward, {name: <registry name | package.module:function>} or {weights: {name: w, ...}} "
        "(jagg.shapes.config.RewardConfig); the function takes (images uint8 [N,H,W,3], prompts, metadata). "
        "Set this or reward_server."))
    reward_server: RewardClient | None = field(default=None, metadata=_help(
        "HTTP reward server, jagg.rewards.server.RewardClient arguments {url, batch_size, timeout, retries, backoff, "
        "image_format, concurrency}. Set this or reward."))
    log: RealLogConfig = field(default_factory=RealLogConfig)

    def __post_init__(self):
        if isinstance(self.reward, dict):
            self.reward = configuration.from_dict(RewardConfig, self.reward, "reward")
        if isinstance(self.reward_server, dict):
            if "url" not in self.reward_server:
                raise ValueError("reward_server.url is required, e.g. http://127.0.0.1:8000 (start a server with "
                                 "python -m jagg.rewards.server --reward module:function)")
            self.reward_server = configuration.from_dict(RewardClient, self.reward_server, "reward_server")
        if (self.reward is None) == (self.reward_server is None):
            raise ValueError("set exactly one of reward (e.g. --set reward.name=jpeg_compressibility or "
                             "module:function) and reward_server (an HTTP reward server); "
                             + ("neither is set" if self.reward is None else
                                "both are set: drop one, e.g. --set reward_server=null"))
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0; got {self.threads}")
        if self.optim.ema_decay > 0:
            raise ValueError("optim.ema_decay is not supported by the real-model trainer; set it to 0")
        s, T = self.sample, self.pipeline.num_steps
        check_sde_window(s.sde_window, T, "pipeline.num_steps")
        if s.sde_window is None and int(T * s.timestep_fraction) < 1:
            raise ValueError(f"sample.timestep_fraction={s.timestep_fraction} of pipeline.num_steps={T} trains no "
                             "step; raise it")
        check_updates_divide_batch(s.batch_size, self.grpo.updates_per_epoch)
        if self.estimator.kl_beta > 0 and not self.pipeline.lora.enabled and not self.pipeline.keep_reference:
            raise ValueError("estimator.kl_beta > 0 with full fine-tuning (pipeline.lora.enabled: false) needs a "
                             "reference model: set pipeline.keep_reference: true, or estimator.kl_beta: 0")

    def reward_fn(self):
        """The checked reward callable ``(images, prompts, metadata) -> (scores [N], info)``."""
        if self.reward_server is not None:
            return get_reward(self.reward_server)
        return get_reward(self.reward.weights or self.reward.name)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RealTrainConfig:
    """A YAML with a ``pipeline:`` section plus ``--set key=value`` overrides -> :class:`RealTrainConfig`."""
    return configuration.load(RealTrainConfig, path, overrides)


def has_pipeline_section(path: str | Path | None) -> bool:
    """True when ``path`` is a readable YAML mapping with a top-level ``pipeline:`` key (a real-model config)."""
    import yaml

    if path is None or not Path(path).is_file():
        return False
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "pipeline" in data


# ----------------------------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------------------------


def _without(d: dict, dotted: tuple[str, ...]) -> dict:
    d = copy.deepcopy(d)
    for key in dotted:
        *head, last = key.split(".")
        node = d
        for k in head:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return d


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


class RealTrainer(TrainerCore):
    """GRPO with :func:`jagg.policy_gradient` on a diffusers SD3/FLUX model; ``RealTrainer(cfg, resume=True)``
    continues from the newest checkpoint of ``cfg.log.output_dir``. Launch with torchrun / accelerate for several
    processes (``WORLD_SIZE > 1``)."""

    def __init__(self, cfg: RealTrainConfig, resume: bool = False):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.rank, self.world = init_process_group_from_env()
        self.main = self.rank == 0
        self.out = Path(cfg.log.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        shard(cfg.sample.batch_size)                           # the global batch must split evenly over the ranks
        self.prompts = read_prompt_lines(cfg.sample.prompts_file)
        self.reward_fn = cfg.reward_fn()
        torch.manual_seed(cfg.seed)                            # the same LoRA initialisation on every rank
        self.model: RealModel = load_model(cfg.pipeline)      # check_model_dir: clear errors for bad paths
        self.device = self.model.device
        self._check_prompt_cache()
        base = unwrap_model(self.model.transformer)
        self.named_params = {n: p for n, p in base.named_parameters() if p.requires_grad}
        self.params = list(self.named_params.values())
        if not self.params:
            raise ValueError("the transformer has no trainable parameter (check pipeline.lora)")
        if self.world > 1:                                     # replicas start identical
            for p in self.params:
                dist.broadcast(p.data, 0)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        # shared by all ranks: prompt choice and the initial noise of the global batch; per rank: SDE noise
        # (a generator on the model's device) and the minibatch order
        self.np_rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(_seed(cfg.seed, 1))
        self.sde_gen = torch.Generator(device=self.device).manual_seed(_seed(cfg.seed, 2, self.rank))
        self.perm_gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, self.rank))
        self.iteration = 0
        self.wall = 0.0
        self.skipped_updates = 0
        self.consecutive_skips = 0
        self._stop = False
        self._images, self._prompts = None, None
        resumed_from = None
        if resume:
            found = load_latest(self.ckpt_dir)
            if found is None:
                self._print(f"no checkpoint in {self.ckpt_dir}; starting from scratch")
            else:
                self._load_state(found[0])
                resumed_from = self.iteration
                self._print(f"resumed from {found[1]} (iteration {self.iteration})")
        self.logger = (MetricsLogger(self.out, cfg.log.tensorboard, resume_iteration=resumed_from if resume else None)
                       if self.main else None)

    def _check_prompt_cache(self) -> None:
        """Without text encoders every training prompt and the negative prompt must be in the prompt cache."""
        pipe = self.model.pipe
        if pipe is not None and getattr(pipe, "text_encoder", None) is not None:
            return
        wanted = list(dict.fromkeys(self.prompts + ([self.model.config.negative_prompt]
                                                     if self.model.config.cfg_scale > 1 else [])))
        missing = [p for p in wanted if p not in self.model._cache]
        if missing:
            shown = ", ".join(repr(p) for p in missing[:5])
            raise ValueError(f"{len(missing)} prompt(s) of {self.cfg.sample.prompts_file} are not in the prompt-embedding "
                             f"cache {self.cfg.pipeline.prompt_cache} and the text encoders are not loaded ({shown}"
                             f"{', ...' if len(missing) > 5 else ''}): rebuild the cache from this prompts file (python "
                             "-m jagg.integrations.pipeline cache --config <yaml> --prompts <file> --out <cache>) or "
                             "set pipeline.load_text_encoders: true")

    # ------------------------------------------------------------------ state
    def _rng_state(self) -> dict:
        return {"numpy": self.np_rng.bit_generator.state, "gen": self.gen.get_state(),
                "sde_gen": self.sde_gen.get_state(), "perm_gen": self.perm_gen.get_state(),
                "torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def _set_rng_state(self, rng: dict, local: bool = True) -> None:
        self.np_rng.bit_generator.state = rng["numpy"]
        self.gen.set_state(rng["gen"])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if local:
            self.sde_gen.set_state(rng["sde_gen"])
            self.perm_gen.set_state(rng["perm_gen"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _state(self, rngs: list[dict]) -> dict:
        return {"trainer": TRAINER_TAG,
                "model": {n: p.detach().cpu().clone() for n, p in self.named_params.items()},
                "optimizer": self.opt.state_dict(), "iteration": self.iteration, "wall": self.wall,
                "skipped_updates": self.skipped_updates, "config": configuration.to_dict(self.cfg),
                "world_size": self.world, "rng": rngs}

    def _load_state(self, state: dict) -> None:
        if state.get("trainer") != TRAINER_TAG:
            raise ValueError(f"the checkpoints in {self.ckpt_dir} were not written by the real-model trainer (TinyDiT "
                             "run?); use another log.output_dir")
        allowed = RESUMABLE_REAL
        check_resumable(_without(state["config"], allowed), _without(configuration.to_dict(self.cfg), allowed))
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
                        "the per-process sampling noise is reseeded (the run continues, not bit-exactly)")
            self._set_rng_state(rngs[0], local=False)
            self.sde_gen.manual_seed(_seed(self.cfg.seed, 2, self.rank, self.iteration))
            self.perm_gen.manual_seed(_seed(self.cfg.seed, 3, self.rank, self.iteration))

    def save(self, rngs: list[dict] | None = None) -> Path | None:
        """Checkpoint (rank 0 writes; a collective: every rank must call it): LoRA adapter directory first, then
        ``ckpt_<n>.pt``, each written to a temporary name and renamed; the newest ``log.keep_last`` are kept."""
        rngs = rngs if rngs is not None else gather_objects([self._rng_state()])
        path = None
        if self.main:
            if self.cfg.pipeline.lora.enabled:
                self._save_adapter()
            path = save_checkpoint(self._state(rngs), self.ckpt_dir, self.iteration, self.cfg.log.keep_last)
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
        self.model.save_adapter(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        adapters = sorted(p for p in self.ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("adapter_"))
        for old in adapters[:-self.cfg.log.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    # ------------------------------------------------------------------ one iteration
    def _rollout(self):
        """Sample this rank's shard of the global batch; returns (global prompts, local embeddings, trajectory)."""
        c, p = self.cfg.sample, self.cfg.pipeline
        idx = self.np_rng.choice(len(self.prompts), size=c.prompts_per_iter,
                                 replace=len(self.prompts) < c.prompts_per_iter)
        prompts = [self.prompts[i] for i in idx for _ in range(c.group_size)]
        shape = self.model.latent_shape
        if c.shared_noise:
            noise = torch.randn(c.prompts_per_iter, *shape, generator=self.gen).repeat_interleave(c.group_size, 0)
        else:
            noise = torch.randn(c.batch_size, *shape, generator=self.gen)
        sl = shard(c.batch_size)
        for prompt in dict.fromkeys(prompts[sl]):    # text encoders embed new prompts one at a time: an embedding
            self.model.embeddings([prompt])          # must not depend on its batch (rounding), or --resume drifts
        emb = self.model.embeddings(prompts[sl])
        train_steps, sde_mask = select_train_steps(p.num_steps, c.timestep_fraction,
                                                   tuple(c.sde_window) if c.sde_window else None)
        traj = sample_trajectories(self.model.velocity(emb), noise[sl].to(self.device), self.model.sigmas(), p.eta,
                                   train_steps, sde_mask, generator=self.sde_gen, micro_batch=c.micro_batch)
        return prompts, emb, traj

    def _reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    @torch.enable_grad()
    def _update(self, traj, emb, adv, ref_v, groups) -> dict:
        """One optimizer update on this rank's minibatch (possibly empty); gradients averaged over the ranks."""
        c = self.cfg
        self.opt.zero_grad(set_to_none=True)
        n = 0 if traj is None else traj.batch_size
        n_global = int(self._reduce([n])[0])
        if n_global == 0:
            return {}
        names = ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl")
        counts = ("backward_items", "forward_grad_items", "forward_nograd_items", "groups", "groups_jagg")
        local = [0.0] * (len(names) + len(counts))
        if n:
            st = policy_gradient(self.model.velocity(emb), traj, adv, c.estimator, ref_velocities=ref_v,
                                 loss_scale=loss_scale(n, n_global, self.world), sample_groups=groups).to_dict()
            local = [n * st[k] for k in names] + [st[k] for k in counts]
        if self.world > 1:
            for p in self.params:                              # same buckets on every rank, even with no samples
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_gradients(self.params)
        tot = self._reduce(local)
        stats = {k: tot[i] / n_global for i, k in enumerate(names)}
        stats.update({k: int(tot[len(names) + i]) for i, k in enumerate(counts)})
        stats["jagg_frac_routed"] = stats["groups_jagg"] / stats["groups"] if stats["groups"] else 0.0
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
        prompts, emb, traj = self._rollout()
        sl = shard(len(prompts))
        local_prompts = prompts[sl]
        t1 = time.perf_counter()
        images = self.model.decode(traj.latents[:, -1])
        scores, _ = self.reward_fn(images, local_prompts, None)
        self._images, self._prompts = images, local_prompts
        rewards = gather(torch.as_tensor(scores, dtype=torch.float32, device=self.device)).cpu()  # global batch
        adv = group_advantages(rewards, prompts, c.grpo.global_std, c.grpo.adv_clip_max)[sl]
        keep = (nonzero_spread_mask(rewards, prompts) if c.grpo.drop_zero_spread
                else torch.ones(len(prompts), dtype=torch.bool))[sl]
        t2 = time.perf_counter()
        keep_idx = torch.nonzero(keep).flatten()
        self._updating = True
        per_update = []
        dev_idx = keep_idx.to(self.device)
        groups = (torch.arange(len(prompts)) // c.sample.group_size)[sl][keep_idx]   # [b] GRPO group per sample
        traj, emb, adv = traj.select(dev_idx), emb.select(dev_idx), adv[keep_idx].to(self.device)
        ref_v = None
        if c.estimator.kl_beta > 0 and keep_idx.numel():
            ref_v = reference_velocities(self.model.reference(self.model.velocity(emb)), traj, c.estimator.micro_batch)
        for _ in range(c.grpo.inner_epochs):
            perm = torch.randperm(keep_idx.numel(), generator=self.perm_gen)
            for mb in perm.tensor_split(c.grpo.updates_per_epoch):
                mb = mb.to(self.device)
                stats = self._update(traj.select(mb) if mb.numel() else None, emb.select(mb), adv[mb],
                                     None if ref_v is None else ref_v[mb], groups[mb.cpu()])
                if stats:
                    per_update.append(stats)
        t3 = time.perf_counter()
        self.iteration += 1
        self.wall += t3 - t0
        trained = int(self._reduce([keep_idx.numel()])[0])
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


def run(config_path: str, overrides: list[str] | None = None, resume: bool = False) -> int:
    """``jagg train --config <yaml with pipeline:>``: load, train, print where the outputs are. Returns 0."""
    cfg = load_config(config_path, overrides)
    owns_group = not dist.is_initialized()
    try:
        trainer = RealTrainer(cfg, resume=resume)
        records = trainer.train()
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    if trainer.main:
        train = [r for r in records if r.get("kind") == "train"]
        if train:
            print(f"train reward: {train[0]['reward_mean']:.4f} (iteration {train[0]['iteration']}) -> "
                  f"{train[-1]['reward_mean']:.4f} (iteration {train[-1]['iteration']})")
        extra = ", adapter_*/ (LoRA, diffusers load_lora_weights)" if cfg.pipeline.lora.enabled else ""
        print(f"outputs in {cfg.log.output_dir}: metrics.jsonl, reward_curve.png, samples/, "
              f"checkpoints/ (ckpt_*.pt{extra})")
    return 0
