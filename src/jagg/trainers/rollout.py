"""An iteration's rollout, from its draw to its record: the data both trainers and the benches pass along, and the
one pipeline that makes a batch of it.

- :class:`RolloutInputs`: what an iteration's rollout starts from (prompts, initial noise, trained steps, SDE mask),
  drawn by :func:`rollout_inputs`;
- :class:`Rollout`: what the trainer's sampler made of it (prompts, this process's trajectories and conditioning);
- :class:`Batch`: the rollout rewarded, with its group-relative advantages and the samples kept to train, made by
  :func:`rollout_batch`, the one rollout pipeline of the trainers and the benches;
- :class:`Minibatch`: the samples of one optimizer update (:func:`take` picks a minibatch's rows of anything
  per-sample);
- :class:`Iteration`: an iteration's outcome, for the trainer's record (:func:`update_summary` sums its updates).

The loop that runs them is :mod:`jagg.trainers.loop`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..advantages import group_advantages, nonzero_spread_mask
from ..infra.distributed import gather
from ..trajectory import Trajectory


@dataclass
class RolloutInputs:
    """What an iteration's rollout starts from, drawn at random (:func:`rollout_inputs`): the prompts, prompt group after
    prompt group; the initial noise ``[N, *S]``; the trained steps ``[K]`` and the SDE mask ``[T]``; each sample's
    position in the prompt list it was drawn from ``[N]`` (its metadata's, for the reward)."""

    prompts: list[str]
    noise: Tensor
    train_steps: Tensor
    sde_mask: Tensor
    indices: list[int] | None = None


def rollout_inputs(c, prompts: Sequence[str], latent_shape: tuple[int, ...], num_steps: int,
                   np_rng: np.random.Generator, gen: torch.Generator, iteration: int = 0) -> RolloutInputs:
    """The global batch of iteration ``iteration`` (counted from 0) by the ``sample:`` section ``c``:
    ``c.prompts_per_iter`` of ``prompts`` drawn with ``np_rng``, each repeated ``c.group_size`` times (its prompt
    group); the initial noise ``[N, *latent_shape]`` from ``gen`` (shared within a prompt group with
    ``c.shared_noise``); and the trained steps and SDE mask of ``num_steps`` sampling steps in that iteration (its SDE
    window: :meth:`jagg.trainers.sections.SampleBatch.sde_steps`)."""
    idx = np_rng.choice(len(prompts), size=c.prompts_per_iter, replace=len(prompts) < c.prompts_per_iter)
    batch = [prompts[i] for i in idx for _ in range(c.group_size)]
    if c.shared_noise:
        noise = torch.randn(c.prompts_per_iter, *latent_shape, generator=gen).repeat_interleave(c.group_size, 0)
    else:
        noise = torch.randn(len(batch), *latent_shape, generator=gen)
    train_steps, sde_mask = c.sde_steps(num_steps, iteration)
    return RolloutInputs(batch, noise, train_steps, sde_mask, [int(i) for i in idx for _ in range(c.group_size)])


@dataclass
class Rollout:
    """What the trainer's :meth:`~jagg.trainers.loop.GRPO.rollout` sampled in one iteration.

    Attributes:
        prompts: the global batch's prompts, prompt group after prompt group (``sample.group_size`` each).
        local: this process's samples of the global batch (all of them in a single process).
        traj: this process's trajectories.
        conditioning: per local sample, what the trainer's :meth:`~jagg.trainers.loop.GRPO.velocity` needs (the shapes trainer:
            prompt tokens ``[n, L]``; the diffusers trainer: the prompts).
        metadata: per local sample, its prompt's metadata for the reward (a ``.jsonl`` prompt set's objects), or None.
    """

    prompts: list[str]
    local: slice
    traj: Trajectory
    conditioning: Any
    metadata: list | None = None


@dataclass
class Batch:
    """One iteration's batch, ready to train (:func:`rollout_batch`).

    Attributes:
        rollout: what was sampled (:class:`Rollout`); scores, info: this process's rewards ``[n]`` and the reward's info.
        rewards: the global batch's rewards ``[N]``.
        advantages: this process's samples' group-relative advantages ``[n]`` (all of them, kept or not).
        keep: ``[n]`` bool, the samples trained: those of prompt groups with a reward spread when
            ``grpo.drop_zero_spread`` (else all).
        spread: whether some prompt group of the global batch has a reward spread (else nothing to learn).
        prompt_groups: ``[n]`` the prompt group of each of this process's samples.
        times: ``sample_s`` and ``reward_s`` (seconds).
    """

    rollout: Rollout
    scores: np.ndarray
    info: dict
    rewards: Tensor
    advantages: Tensor
    keep: Tensor
    spread: bool
    prompt_groups: Tensor
    times: dict

    @property
    def keep_idx(self) -> Tensor:
        """The kept samples' positions ``[k]`` among this process's."""
        return torch.nonzero(self.keep).flatten()


def rollout_batch(sample: Callable[[], Rollout], score: Callable[[Rollout], tuple], cfg,
                  device: torch.device = torch.device("cpu")) -> Batch:
    """The one rollout pipeline of the trainers and the benchmarks: ``sample()`` this process's share of the batch,
    ``score`` it, gather the global batch's rewards, compute the group-relative advantages per prompt group
    (``cfg.grpo``), mark the prompt groups without reward spread to drop (``grpo.drop_zero_spread``), and each sample's
    prompt group (``cfg.sample.group_size``)."""
    t0 = time.perf_counter()
    rollout = sample()
    t1 = time.perf_counter()
    scores, info = score(rollout)
    rewards = gather(torch.as_tensor(scores, dtype=torch.float32, device=device)).cpu()    # the global batch
    prompts, g = rollout.prompts, cfg.grpo
    adv = group_advantages(rewards, prompts, g.global_std, g.adv_clip_max)[rollout.local]
    spread = nonzero_spread_mask(rewards, prompts)          # [N] samples of prompt groups with reward spread
    keep = (spread if g.drop_zero_spread else torch.ones(len(prompts), dtype=torch.bool))[rollout.local]
    prompt_groups = (torch.arange(len(prompts)) // cfg.sample.group_size)[rollout.local]
    return Batch(rollout, scores, info, rewards, adv, keep, bool(spread.any()), prompt_groups,
                 {"sample_s": t1 - t0, "reward_s": time.perf_counter() - t1})


@dataclass
class Minibatch:
    """The samples of one optimizer update on this process (possibly none, with several processes)."""

    traj: Trajectory | None
    conditioning: Any
    advantages: Tensor
    ref_velocities: Tensor | None
    prompt_groups: Tensor                    # [n] prompt group of each sample
    size: int
    position: int = 0                        # the update's place in its rollout's updates (0: on-policy)

    @property
    def on_policy(self) -> bool:
        """Whether this is the rollout's first update: at the parameters it was sampled with."""
        return self.position == 0


def take(items, index) -> Any:
    """``items`` at ``index`` (a tensor, or a list or tensor of positions): a tensor is indexed, a list picked from."""
    if isinstance(items, Tensor):
        return items[index.to(items.device) if isinstance(index, Tensor) else index]
    return [items[i] for i in (index.tolist() if isinstance(index, Tensor) else index)]


@dataclass
class Iteration:
    """One iteration's outcome, for :meth:`~jagg.trainers.loop.GRPO.record`: the rollout, this process's scores and the reward's
    info, the global batch's rewards, this process's trained (kept) samples, the updates' statistics, the phases'
    seconds (``sample_s``, ``reward_s``, ``train_s``, ``iter_s``, ``wall_s``) and the iteration's CPU seconds."""

    rollout: Rollout
    scores: np.ndarray
    info: dict
    rewards: Tensor
    trained: int
    per_update: list[dict]
    times: dict = field(default_factory=dict)
    cpu: float = 0.0


def update_summary(per_update: list[dict]) -> dict:
    """The mean statistics and the summed counts of an iteration's updates (empty without updates)."""
    if not per_update:
        return {}
    rec = {k: float(np.mean([s[k] for s in per_update]))
           for k in ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl", "grad_norm", "jagg_frac_routed")}
    rec.update({k: int(sum(s[k] for s in per_update))
                for k in ("backward_items", "forward_grad_items", "forward_nograd_items", "skipped")})
    if "lr" in per_update[0]:                             # the learning rate in use (optim.lr_schedule)
        rec["lr"] = float(np.mean([s["lr"] for s in per_update]))
    return rec

