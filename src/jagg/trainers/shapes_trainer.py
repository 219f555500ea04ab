"""The GRPO trainer of the embedded shapes world (its config: :mod:`jagg.trainers.shapes_config`), in three layers, as
the diffusers trainer (:mod:`jagg.trainers.diffusers_trainer`) is:

- :class:`ShapesSampler`: the rollouts of a config, what the trainer and every benchmark draw batches with: the
  TinyDiT (its trainable parameters marked), the prompts, the reward and the prompt and noise RNGs; it samples
  ``prompts_per_iter x group_size`` trajectories with the config's SDE (classifier-free guidance through
  :class:`jagg.shapes.guided_velocity.GuidedVelocity`) and rewards the images (by default the world's GenEval-like
  reward);
- :class:`ShapesGRPO`: the loop's hooks (:class:`jagg.trainers.loop.GRPO`) on a sampler: each update's gradient from
  :func:`jagg.policy_gradient` (the same function a user calls in their own loop), AdamW, an optional EMA of the
  weights; one iteration at a time, in memory (``python -m lab e2e``);
- :class:`ShapesTrainer`: that in a run directory (:class:`jagg.trainers.loop.GRPOTrainer`): checkpoints, resuming,
  and the evaluation on the world's test prompts every ``eval.every`` iterations.
"""

from __future__ import annotations

import copy
import random
import re
import time
from pathlib import Path

import numpy as np
import torch

from ..estimator import policy_gradient
from ..rewards.registry import get_reward
from ..schedule import flow_sigmas
from ..shapes import from_tensor, tokenizer
from ..shapes.evaluation import collapse_warnings, comparison_prompts, evaluate, generate, save_comparison
from ..shapes.guided_velocity import GuidedVelocity
from ..shapes.weights import load_model
from ..infra.checkpoint import save_checkpoint
from ..infra.config_loader import to_dict
from ..infra.metrics import plot_reward_curve, save_grid
from ..trajectory import sample_trajectories
from .ema import EMA
from .minibatches import cut_minibatches, minibatch_line
from .auto import AutoEstimator
from .loop import GRPO, GRPOTrainer
from .resume import check_resumable
from .rollout import Iteration, Minibatch, Rollout, RolloutInputs, rollout_inputs, update_summary
from .shapes_config import ShapesTrainConfig


def mark_trainable(model: torch.nn.Module, trainable: str) -> list[torch.nn.Parameter]:
    """Mark the parameters whose names ``trainable`` (``model.trainable``: ``all`` or a regular expression) matches
    trainable, the rest frozen; returns the trainable ones (an error when none)."""
    if trainable != "all":
        for name, p in model.named_parameters():
            p.requires_grad_(re.search(trainable, name) is not None)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"model.trainable {trainable!r} matches no parameter name")
    return params


class ShapesSampler:
    """The shapes world's rollouts of ``cfg``: the trainer's and every benchmark's, which never opens a run directory.

    Builds, with the config's seed and in this order: the TinyDiT of ``model.checkpoint`` with the parameters
    ``model.trainable`` matches trainable (:attr:`params`), the reward, the training prompts, the RNG of the noise and
    of the minibatch order (:attr:`gen`) and the RNG of the prompts (:attr:`np_rng`). :meth:`sample` draws and samples
    one iteration's batch, advancing them exactly as an iteration of the trainer does."""

    def __init__(self, cfg: ShapesTrainConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model.checkpoint, use_ema=True)
        m = self.model.config
        self.latent_shape, self.num_steps = (m.channels, m.image_size, m.image_size), cfg.sample.num_steps
        self.params = mark_trainable(self.model, cfg.model.trainable)
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]   # params' names, in order
        self.reward_fn = get_reward(cfg.reward.spec)
        self.prompts = cfg.sample.prompts()
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.np_rng = np.random.default_rng(cfg.seed)

    def draw(self, iteration: int = 0) -> RolloutInputs:
        """The prompts, initial noise, trained steps and SDE mask of iteration ``iteration`` (counted from 0; it decides
        a sliding SDE window: :func:`~jagg.trainers.rollout.rollout_inputs`)."""
        return rollout_inputs(self.cfg.sample, self.prompts, self.latent_shape, self.num_steps, self.np_rng,
                              self.gen, iteration)

    def rollout(self, draw: RolloutInputs) -> Rollout:
        """The trajectories of ``draw`` (SDE noise from :attr:`gen`); the conditioning is the prompt tokens ``[B, L]``."""
        c = self.cfg.sample
        tokens = tokenizer.encode(draw.prompts, max_len=self.model.config.max_text_len)
        traj = sample_trajectories(self.velocity(tokens), draw.noise, flow_sigmas(c.num_steps, c.shift), c.eta,
                                   draw.train_steps, draw.sde_mask, generator=self.gen, micro_batch=c.micro_batch,
                                   check_finite=False, sde_type=c.sde_type)
        return Rollout(draw.prompts, slice(0, len(draw.prompts)), traj, tokens)

    def sample(self, iteration: int = 0) -> Rollout:
        """The batch of iteration ``iteration``, drawn and sampled (:meth:`draw`, :meth:`rollout`)."""
        return self.rollout(self.draw(iteration))

    def decode(self, rollout: Rollout) -> np.ndarray:
        """The rollout's final images, uint8 ``[B, H, W, 3]``."""
        return from_tensor(rollout.traj.latents[:, -1])

    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        """The reward of the rollout's final images: ``(scores [B], info)``."""
        return self.reward_fn(self.decode(rollout), rollout.prompts, None)

    def velocity(self, tokens) -> GuidedVelocity:
        """The guided velocity callable of the samples whose prompt tokens ``[n, L]`` are given."""
        return GuidedVelocity(self.model, tokens, self.cfg.sample.guidance_scale)

    def zero_grad(self) -> None:
        """Clear the trainable parameters' ``.grad`` (before a gradient is accumulated into them)."""
        for p in self.params:
            p.grad = None


class ShapesGRPO(AutoEstimator, GRPO):
    """GRPO on the shapes world, one iteration at a time, in memory (:class:`~jagg.trainers.loop.GRPO`): the hooks
    on a :class:`ShapesSampler`, AdamW, the KL reference (``estimator.kl_beta > 0``), an optional EMA and the RNG of
    unbiased JAGG's picks."""

    cfg: ShapesTrainConfig

    def setup(self) -> None:
        cfg = self.cfg
        self.sampler = s = ShapesSampler(cfg)
        self.model, self.params = s.model, s.params
        # what GRPO.draw_batch draws from: the sampler's prompts and RNGs themselves (one stream, as ShapesSampler.draw)
        self.prompts, self.latent_shape, self.num_steps, self.np_rng, self.gen = (s.prompts, s.latent_shape,
                                                                                 s.num_steps, s.np_rng, s.gen)
        self.model_config = self.model.config.to_dict()
        self.ref_model = copy.deepcopy(self.model).requires_grad_(False) if cfg.estimator.kl_beta > 0 else None
        o = cfg.optim
        self.opt = o.optimizer(self.params)
        self.ema = EMA(dict(self.model.named_parameters()), o.ema_decay) if o.ema_decay > 0 else None
        # the estimator's random choices (the correction's picks, interval draws) draw from an RNG of their own, so
        # that runs of one seed with different estimators sample the same prompts and noise streams
        self.pick_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)

    def rollout(self, draw: RolloutInputs) -> Rollout:
        return self.sampler.rollout(draw)

    def score(self, rollout: Rollout) -> tuple[np.ndarray, dict]:
        return self.sampler.score(rollout)

    def velocity(self, tokens) -> GuidedVelocity:
        return self.sampler.velocity(tokens)

    def reference(self, tokens) -> GuidedVelocity:
        return GuidedVelocity(self.ref_model, tokens, self.cfg.sample.guidance_scale)

    def minibatches(self, prompt_groups: torch.Tensor) -> list[torch.Tensor]:
        cut = cut_minibatches(prompt_groups, self.cfg.grpo.updates_per_epoch, self.update_cut(), self.sampler.gen)
        return [mb for mb in cut if mb.numel()]

    def gradient(self, mb: Minibatch) -> dict:
        st = policy_gradient(self.velocity(mb.conditioning), mb.traj, mb.advantages, self.estimator,
                             ref_velocities=mb.ref_velocities, prompt_groups=mb.prompt_groups,
                             generator=self.pick_gen, on_policy=mb.on_policy).to_dict()
        return {**st, "samples": mb.size}

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def record(self, it: Iteration) -> dict:
        rec = {"kind": "train", "iteration": self.iteration, "reward_mean": float(it.scores.mean()),
               "reward_std": float(it.scores.std()), "trained_samples": it.trained, **it.times,
               "iter_cpu_s": it.cpu, "cpu_s": self.cpu}
        if "correct" in it.info:
            rec["accuracy"] = float(np.mean(it.info["correct"]))
        rec.update({"reward/" + k[len("scores/"):]: float(np.mean(v)) for k, v in it.info.items()
                    if k.startswith("scores/")})
        return {**rec, **update_summary(it.per_update), "skipped_total": self.skipped_updates}


class ShapesTrainer(ShapesGRPO, GRPOTrainer):
    """``jagg train`` on the shapes world: :class:`ShapesGRPO` in a run directory
    (:class:`~jagg.trainers.loop.GRPOTrainer`: the run directory, resuming and the loop), TinyDiT in one process, with
    checkpoints and the evaluation on the test prompts."""

    evaluates = True

    # ------------------------------------------------------------------ state
    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(), "model_config": self.model_config,
            "optimizer": self.opt.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "config": to_dict(self.cfg), "run_id": self.run_id, "rng": self.rng_state(), **self.loop_state(),
        }

    def load_state(self, state: dict) -> list[str]:
        changed = check_resumable(state["config"], to_dict(self.cfg))
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.load_loop_state(state)
        self.set_rng_state(state["rng"])
        return changed

    def save(self) -> Path:
        return save_checkpoint(self._state(), self.ckpt_dir, self.iteration, self.cfg.log.keep_last)

    def rng_state(self) -> dict:
        return {"gen": self.sampler.gen.get_state(), "pick_gen": self.pick_gen.get_state(),
                "numpy": self.sampler.np_rng.bit_generator.state, "torch": torch.get_rng_state(),
                "python": random.getstate()}

    def set_rng_state(self, rng: dict) -> None:
        self.sampler.gen.set_state(rng["gen"])
        self.pick_gen.set_state(rng["pick_gen"])
        self.sampler.np_rng.bit_generator.state = rng["numpy"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])

    # ------------------------------------------------------------------ evaluation
    def eval_model(self):
        if self.ema is None:
            return self.model
        m = copy.deepcopy(self.model)
        self.ema.copy_to(list(m.parameters()))
        return m

    def evaluate(self) -> dict:
        e, s = self.cfg.eval, self.cfg.sample
        t0 = time.perf_counter()
        metrics, images, prompts, scores = evaluate(self.eval_model(), self.sampler.reward_fn, e.num_prompts,
                                                    e.images_per_prompt, e.num_steps, s.guidance_scale, e.seed,
                                                    s.shift, with_scores=True)
        n = min(e.grid_size, len(images))
        grid = self.out / "samples" / f"eval_{self.iteration:06d}.png"
        save_grid(images[:n], grid, prompts=prompts[:n], rewards=scores[:n])
        rec = {"kind": "eval", "iteration": self.iteration, "wall_s": self.wall, "eval_s": time.perf_counter() - t0,
               **metrics}
        self.logger.log(rec)
        self.logger.image("images/eval", grid, self.iteration)
        plot_reward_curve(self.logger.records(), self.out / "reward_curve.png",
                          f"GRPO ({self.cfg.estimator.mode}) on the shapes world")
        self.warn_collapse()
        return rec

    def warn_collapse(self) -> None:
        """Print each kind of :func:`~jagg.shapes.evaluation.collapse_warnings` once per run (a resumed run reads the
        evaluations it already logged)."""
        e = self.cfg.eval
        shown = getattr(self, "_collapse_shown", set())
        for text in collapse_warnings(self.logger.records("eval"), e.warn_drop, e.warn_empty, e.warn_background):
            kind = text.split(" rose ")[0].split(" fell ")[0]
            if kind not in shown:
                shown.add(kind)
                print(f"\nwarning, iteration {self.iteration}: {text}", flush=True)
        self._collapse_shown = shown

    def save_comparison(self) -> dict:
        """``samples/comparison.png``: the first ``eval.grid_size`` test prompts, one image each from the same
        evaluation noise, by the starting model (``model.checkpoint``) above the evaluated model of this iteration,
        captioned with score and each constraint's pass/fail. Returns the two sets' means."""
        e, s = self.cfg.eval, self.cfg.sample
        prompts = comparison_prompts(e.grid_size)
        before = generate(load_model(self.cfg.model.checkpoint, use_ema=True), prompts, e.num_steps, s.guidance_scale,
                          e.seed, s.shift)
        after = generate(self.eval_model(), prompts, e.num_steps, s.guidance_scale, e.seed, s.shift)
        path = self.out / "samples" / "comparison.png"
        means = save_comparison(before, after, prompts, path, ("iteration 0", f"iteration {self.iteration}"),
                                ncol=min(8, e.grid_size))
        self.logger.image("images/comparison", path, self.iteration)
        return means

    def before_training(self) -> None:
        g = self.cfg.grpo
        self._print(f"{g.inner_epochs * g.updates_per_epoch} updates per iteration on {minibatch_line(self.cfg)}")
        if self.iteration == 0 and self.cfg.eval.every:
            first = self.evaluate()
            print(f"iteration 0: test reward {first['reward_mean']:.3f}")

    def after_iteration(self, done: bool) -> dict | None:
        rec = self.evaluate() if self.cfg.eval.due(self.iteration, done) else None
        if done and self.cfg.eval.every:
            self.save_comparison()
        return rec

    def report(self, records: list[dict]) -> None:
        evals = [r for r in records if r["kind"] == "eval"]
        if len(evals) >= 2:
            a, b = evals[0], evals[-1]
            print(f"test reward: {a['reward_mean']:.3f} (iteration {a['iteration']}) -> {b['reward_mean']:.3f} "
                  f"(iteration {b['iteration']})")
            shown = [(k, label) for k, label in (("accuracy", "accuracy"), ("seen_reward", "seen pairs"),
                                                 ("held_out_reward", "held-out pairs"), ("empty_frac", "empty images"),
                                                 ("background_rms", "background")) if k in a and k in b]
            if shown:
                print("  " + ", ".join(f"{label} {a[k]:.3f} -> {b[k]:.3f}" for k, label in shown))
        super().report(records)
