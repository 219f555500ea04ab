"""The GRPO trainer for the embedded shapes world.

One iteration: sample ``prompts_per_iter x group_size`` trajectories with the Flow-GRPO SDE, reward the
images, compute group-relative advantages, then ``inner_epochs x updates_per_epoch`` AdamW updates whose
gradients come from :func:`jagg.policy_gradient` (the same function a user calls in their own loop).
"""

from __future__ import annotations

import copy
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..advantages import group_advantages, nonzero_spread_mask
from ..training.checkpoint import save_checkpoint
from ..training.rundir import open_run, read_run_file, write_run_file
from .weights import load_model
from ..training.config_loader import to_dict
from ..training.core import TrainerCore, check_resumable
from ..estimator import policy_gradient, reference_velocities
from .evaluation import evaluate
from ..training.metrics import MetricsLogger, plot_reward_curve, save_grid
from .velocity import GuidedVelocity
from ..rewards.registry import get_reward
from ..schedule import flow_sigmas
from .config import TrainConfig
from ..trajectory import sample_trajectories, select_train_steps
from . import from_tensor, tokenizer

class Trainer(TrainerCore):
    """Runs ``jagg train`` in the run directory ``cfg.log.output_dir`` (:mod:`jagg.training.rundir`).

    ``Trainer(cfg)`` starts a new run and refuses a directory that holds one (``overwrite=True``: moves it aside
    first). ``Trainer(cfg, resume=True)`` continues the directory's run from its newest readable checkpoint; when the
    directory holds no run it starts one, unless ``require_checkpoint=True`` (``jagg train --resume``), which makes
    that an error. Neither ever starts over a run: checkpoints that are all unreadable are an error naming them."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, overwrite: bool = False,
                 require_checkpoint: bool = False):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.log.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        start = open_run(self.out, resume=resume, require_checkpoint=require_checkpoint, overwrite=overwrite)
        self.run_id = start.run_id
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model.checkpoint, use_ema=True)
        self.model_config = self.model.config.to_dict()
        self.ref_model = copy.deepcopy(self.model).requires_grad_(False) if cfg.estimator.kl_beta > 0 else None
        if cfg.model.trainable != "all":
            for name, p in self.model.named_parameters():
                p.requires_grad_(re.search(cfg.model.trainable, name) is not None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"model.trainable {cfg.model.trainable!r} matches no parameter name")
        o = cfg.optim
        self.opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.ema = [p.detach().clone() for p in self.model.parameters()] if o.ema_decay > 0 else None
        self.reward_fn = get_reward(cfg.reward.weights or cfg.reward.name)
        self.prompts = cfg.sample.prompts()
        self.gen = torch.Generator().manual_seed(cfg.seed)
        # the unbiased correction's picks draw from an RNG of their own, so that runs of one seed with different
        # estimators sample the same prompts and noise streams
        self.pick_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
        self.np_rng = np.random.default_rng(cfg.seed)
        self.iteration = 0
        self.wall = 0.0                      # seconds spent in iterations (not eval), across resumes
        self.cpu = 0.0                       # the same in CPU seconds of this process (robust to a busy machine)
        self.skipped_updates = 0
        self.consecutive_skips = 0
        self._stop = False
        resumed_from = None
        if start.resumed is not None:
            state, path = start.resumed
            changed = self._load_state(state)
            resumed_from = self.iteration
            print(f"resumed from {path} (iteration {self.iteration})")
            for line in changed:
                print(f"  {line}")
        if start.resumed is None or read_run_file(self.out) is None:
            write_run_file(self.out, self.run_id)        # an unwritable directory fails here, before any training
        self.logger = MetricsLogger(self.out, cfg.log.tensorboard, resume_iteration=resumed_from)

    # ------------------------------------------------------------------ state
    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(), "model_config": self.model_config,
            "optimizer": self.opt.state_dict(),
            "ema": None if self.ema is None else {k: e.clone() for (k, _), e in zip(self.model.named_parameters(), self.ema)},
            "iteration": self.iteration, "wall": self.wall, "cpu": self.cpu, "skipped_updates": self.skipped_updates,
            "config": to_dict(self.cfg), "run_id": self.run_id,
            "rng": self._rng_state(),
        }

    def _load_state(self, state: dict) -> list[str]:
        """Restore ``state``; returns one line per config key that changed and may (e.g. ``grpo.iterations``)."""
        changed = check_resumable(state["config"], to_dict(self.cfg))
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.ema is not None:
            named = dict(self.model.named_parameters())
            self.ema = [state["ema"][k].clone() for k in named]
        self.iteration, self.wall, self.cpu = state["iteration"], state["wall"], state.get("cpu", 0.0)
        self.skipped_updates = state["skipped_updates"]
        self._set_rng_state(state["rng"])
        return changed

    def save(self) -> Path:
        return save_checkpoint(self._state(), self.ckpt_dir, self.iteration, self.cfg.log.keep_last)

    # ------------------------------------------------------------------ one iteration
    def sample_batch(self):
        """Sample one iteration's batch: ``(prompts [B], tokens [B, L], Trajectory)`` (advances the RNGs)."""
        c = self.cfg.sample
        idx = self.np_rng.choice(len(self.prompts), size=c.prompts_per_iter, replace=len(self.prompts) < c.prompts_per_iter)
        prompts = [self.prompts[i] for i in idx for _ in range(c.group_size)]
        tokens = tokenizer.encode(prompts, max_len=self.model.config.max_text_len)
        shape = (self.model.config.channels, self.model.config.image_size, self.model.config.image_size)
        if c.shared_noise:
            noise = torch.randn(c.prompts_per_iter, *shape, generator=self.gen).repeat_interleave(c.group_size, 0)
        else:
            noise = torch.randn(c.batch_size, *shape, generator=self.gen)
        train_steps, sde_mask = select_train_steps(
            c.num_steps, c.timestep_fraction, tuple(c.sde_window) if c.sde_window else None)
        traj = sample_trajectories(GuidedVelocity(self.model, tokens, c.guidance_scale), noise,
                                   flow_sigmas(c.num_steps, c.shift), c.eta, train_steps, sde_mask,
                                   generator=self.gen, micro_batch=c.micro_batch, check_finite=False,
                                   sde_type=c.sde_type)
        return prompts, tokens, traj

    @torch.enable_grad()
    def _update(self, traj, tokens, adv, ref_v, groups) -> dict:
        """One optimizer update on a minibatch; returns its statistics."""
        c = self.cfg
        self.opt.zero_grad(set_to_none=True)
        vf = GuidedVelocity(self.model, tokens, c.sample.guidance_scale)
        stats = policy_gradient(vf, traj, adv, c.estimator, ref_velocities=ref_v, prompt_groups=groups,
                                generator=self.pick_gen).to_dict()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, c.optim.max_grad_norm if c.optim.max_grad_norm > 0 else float("inf"))
        stats["grad_norm"] = float(norm)
        if self.guarded_step(stats) and self.ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.model.parameters()], 1 - c.optim.ema_decay)
        return stats

    def _rng_state(self) -> dict:
        return {"gen": self.gen.get_state(), "pick_gen": self.pick_gen.get_state(), "numpy": self.np_rng.bit_generator.state,
                "torch": torch.get_rng_state(), "python": random.getstate()}

    def _set_rng_state(self, rng: dict) -> None:
        self.gen.set_state(rng["gen"])
        if "pick_gen" in rng:                                  # checkpoints before unbiased JAGG have none
            self.pick_gen.set_state(rng["pick_gen"])
        self.np_rng.bit_generator.state = rng["numpy"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])

    def step(self) -> dict:
        """One GRPO iteration: sample, reward, advantages, updates. Returns the metrics record."""
        c = self.cfg
        self._rng_at_start, self._updating = self._rng_state(), False
        t0, c0 = time.perf_counter(), time.process_time()
        prompts, tokens, traj = self.sample_batch()
        t1 = time.perf_counter()
        images = from_tensor(traj.latents[:, -1])
        scores, info = self.reward_fn(images, prompts, None)
        rewards = torch.as_tensor(scores, dtype=torch.float32)
        adv = group_advantages(rewards, prompts, c.grpo.global_std, c.grpo.adv_clip_max)
        keep = nonzero_spread_mask(rewards, prompts) if c.grpo.drop_zero_spread else torch.ones(len(prompts), dtype=torch.bool)
        t2 = time.perf_counter()
        keep_idx = torch.nonzero(keep).flatten()
        per_update, audit_s, audit_cpu = [], 0.0, 0.0
        self._updating = True
        if keep_idx.numel():
            groups = torch.arange(len(prompts)) // c.sample.group_size   # [B] GRPO group of each sample
            traj, tokens, adv, groups = traj.select(keep_idx), tokens[keep_idx], adv[keep_idx], groups[keep_idx]
            ref_v = None
            if self.ref_model is not None:
                ref_v = reference_velocities(GuidedVelocity(self.ref_model, tokens, c.sample.guidance_scale), traj,
                                             c.estimator.micro_batch)
            if self.audit_due():
                audit_s, audit_cpu = self.audit(
                    lambda sub: GuidedVelocity(self.model, tokens[sub], c.sample.guidance_scale), traj, adv, ref_v,
                    groups, [p for p in self.model.parameters() if p.requires_grad])
            for _ in range(c.grpo.inner_epochs):
                perm = torch.randperm(keep_idx.numel(), generator=self.gen)
                for mb in perm.tensor_split(c.grpo.updates_per_epoch):
                    if mb.numel():
                        per_update.append(self._update(traj.select(mb), tokens[mb], adv[mb],
                                                       None if ref_v is None else ref_v[mb], groups[mb]))
        t3 = time.perf_counter() - audit_s                 # the audit is a diagnostic: not the iteration's cost
        cpu = time.process_time() - c0 - audit_cpu
        self.iteration += 1
        self.wall += t3 - t0
        self.cpu += cpu
        rec = {"kind": "train", "iteration": self.iteration, "reward_mean": float(scores.mean()),
               "reward_std": float(scores.std()), "trained_samples": int(keep_idx.numel()),
               "sample_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2, "iter_s": t3 - t0, "wall_s": self.wall,
               "iter_cpu_s": cpu, "cpu_s": self.cpu}
        if "correct" in info:
            rec["accuracy"] = float(np.mean(info["correct"]))
        rec.update({"reward/" + k[len("scores/"):]: float(np.mean(v)) for k, v in info.items() if k.startswith("scores/")})
        if per_update:
            for k in ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl", "grad_norm", "jagg_frac_routed"):
                rec[k] = float(np.mean([s[k] for s in per_update]))
            for k in ("backward_items", "forward_grad_items", "forward_nograd_items", "skipped"):
                rec[k] = int(sum(s[k] for s in per_update))
        rec["skipped_total"] = self.skipped_updates
        return rec

    # ------------------------------------------------------------------ evaluation and the loop
    def eval_model(self):
        if self.ema is None:
            return self.model
        m = copy.deepcopy(self.model)
        with torch.no_grad():
            for p, e in zip(m.parameters(), self.ema):
                p.copy_(e)
        return m

    def evaluate(self) -> dict:
        e, s = self.cfg.eval, self.cfg.sample
        t0 = time.perf_counter()
        metrics, images, prompts, scores = evaluate(self.eval_model(), self.reward_fn, e.num_prompts,
                                                    e.images_per_prompt, e.num_steps, s.guidance_scale, e.seed,
                                                    s.shift, with_scores=True)
        n = min(e.grid_size, len(images))
        save_grid(images[:n], self.out / "samples" / f"eval_{self.iteration:06d}.png", prompts=prompts[:n],
                  rewards=scores[:n])
        rec = {"kind": "eval", "iteration": self.iteration, "wall_s": self.wall, "eval_s": time.perf_counter() - t0,
               **metrics}
        self.logger.log(rec)
        plot_reward_curve(self.logger.records(), self.out / "reward_curve.png",
                          f"GRPO ({self.cfg.estimator.mode}) on the shapes world")
        return rec

    def train(self) -> list[dict]:
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if self.iteration >= c.grpo.iterations:
            print(f"the run in {self.out} is at iteration {self.iteration} of grpo.iterations={c.grpo.iterations}: "
                  "nothing to train (raise grpo.iterations to continue it, or --overwrite to start over)")
        handlers = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.iteration == 0 and c.eval.every:
                first = self.evaluate()
                print(f"iteration 0: test reward {first['reward_mean']:.3f}")
            bar = tqdm(total=c.grpo.iterations, initial=self.iteration, disable=not c.log.progress,
                       dynamic_ncols=True, desc="GRPO")
            last_eval = None
            while self.iteration < c.grpo.iterations and not self._stop:
                try:
                    rec = self.step()
                except Exception:
                    self._save_on_failure()
                    raise
                self.logger.log(rec)
                done = self.iteration == c.grpo.iterations
                if c.eval.every and (self.iteration % c.eval.every == 0 or done):
                    last_eval = self.evaluate()
                if (c.log.checkpoint_every and self.iteration % c.log.checkpoint_every == 0) or done:
                    self.save()
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", test=f"{last_eval['reward_mean']:.3f}" if last_eval else "-",
                                bwd=rec.get("backward_items", 0), s_it=f"{rec['iter_s']:.2f}")
                abort = self.skip_limit_error(c.grpo.max_consecutive_skips)
                if abort is not None:
                    self.save()
                    raise abort
            bar.close()
            if self._stop:
                path = self.save()
                print(f"saved {path}; continue with --resume")
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.logger.close()
        return self.logger.records()
