"""Evaluation of a real model on a test prompt set, as Flow-GRPO evaluates (the trainer's ``eval:`` section,
``jagg eval`` and ``jagg sample`` on a real-model run).

The test prompts are sampled with the deterministic ODE (Euler) sampler at ``pipeline.eval_num_steps`` on the run's
sigma grid (:meth:`jagg.integrations.Policy.sigmas`), the run's guidance, and a fixed initial noise per test image:
image ``i`` starts from row ``i`` of one noise tensor drawn from ``eval.seed``, so an evaluation does not depend on
the number of processes or on when it runs. With several processes each one samples and scores a contiguous share of
the test images (the shares padded to one length, so that every process runs as many transformer calls); the scores
are gathered. The metrics are the reward's mean and standard deviation, each component of a weighted sum of rewards
(``reward/<name>``) and, for GenEval-like rewards that report ``correct``, the accuracy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..infra.distributed import gather_objects
from ..trajectory import sample_ode


@dataclass
class Evaluation:
    """One evaluation: ``metrics``; the first ``grid`` images (uint8 ``[g, H, W, 3]``, videos ``[g, F, H, W, 3]``),
    their prompts and rewards (every process holds them); ``seconds``."""

    metrics: dict
    images: np.ndarray
    prompts: list[str]
    scores: np.ndarray
    seconds: float


def eval_noise(n: int, latent_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial noise ``[n, *latent_shape]`` of ``n`` test images: row ``i`` is image ``i``'s at every evaluation."""
    return torch.randn(n, *latent_shape, generator=torch.Generator().manual_seed(seed))


def share(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """This process's positions of ``n`` test images, padded to ``ceil(n / world)`` with the last position (every
    process makes as many calls), and how many of them are its own (the rest are dropped)."""
    per = math.ceil(n / world)
    own = list(range(rank * per, min((rank + 1) * per, n)))
    return own + [n - 1] * (per - len(own)), len(own)


@torch.no_grad()
def sample_images(policy, prompts: list[str], noise: torch.Tensor, num_steps: int, micro_batch: int) -> np.ndarray:
    """ODE samples of ``prompts`` from ``noise`` ``[n, *S]`` at ``num_steps`` steps on the policy's sigma grid, decoded:
    uint8 ``[n, H, W, 3]`` (a video family: ``[n, F, H, W, 3]``)."""
    x = sample_ode(policy.velocity(prompts), noise.to(policy.device), policy.sigmas(num_steps), micro_batch)
    return policy.decode(x)


def eval_metrics(scores: np.ndarray, info: dict) -> dict:
    """The metrics of an evaluation's ``scores`` ``[n]`` and the reward's gathered per-image ``info`` lists: the mean
    and standard deviation, each weighted-sum component's mean (``reward/<name>``), GenEval's accuracy."""
    metrics = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std()), "images": int(len(scores))}
    for key, values in info.items():
        if key.startswith("scores/"):
            metrics["reward/" + key[len("scores/"):]] = float(np.mean(values))
        elif key == "correct":
            metrics["accuracy"] = float(np.mean(values))
    return metrics


def per_image(info: dict, n: int) -> dict:
    """The entries of a reward's ``info`` that hold one number per image (``n``), as lists of floats."""
    out = {}
    for key, value in info.items():
        v = value.detach().cpu().numpy() if hasattr(value, "detach") else value
        if isinstance(v, (list, np.ndarray)) and len(v) == n and np.asarray(v).dtype.kind in "biuf":
            out[key] = np.asarray(v, dtype=np.float64).ravel().tolist()
    return out


def evaluate_policy(policy, reward_fn, prompts: list[str], metadata: list | None, num_steps: int, seed: int,
                    micro_batch: int, grid: int, rank: int = 0, world: int = 1) -> Evaluation:
    """Sample and score the test images of ``prompts`` (``metadata``: each one's, for the reward, or None) on this
    process's share (:func:`share`), gather the scores of every process, and keep the first ``grid`` images (module
    docstring). Every process gets the whole :class:`Evaluation`."""
    t0 = time.perf_counter()
    n = len(prompts)
    noise = eval_noise(n, policy.latent_shape, seed)
    positions, own = share(n, rank, world)
    images = sample_images(policy, [prompts[i] for i in positions], noise[positions], num_steps, micro_batch)[:own]
    mine = positions[:own]
    scores, info = reward_fn(images, [prompts[i] for i in mine],
                             None if metadata is None else [metadata[i] for i in mine]) if own else (np.zeros(0), {})
    # every process's (scores, per-image info, its images among the first `grid`), in process order
    parts = gather_objects([(np.asarray(scores, dtype=np.float64), per_image(info, own),
                             [(i, im) for i, im in zip(mine, images) if i < grid])])
    all_scores = np.concatenate([p[0] for p in parts])
    scored = [p[1] for p in parts if len(p[0])]                       # the info of processes that scored images
    gathered = {k: [x for p in scored for x in p[k]] for k in scored[0] if all(k in p for p in scored)}
    shown = sorted((pair for p in parts for pair in p[2]), key=lambda pair: pair[0])
    shown_images = np.stack([im for _, im in shown]) if shown else np.zeros((0,), np.uint8)
    return Evaluation(eval_metrics(all_scores, gathered), shown_images, [prompts[i] for i, _ in shown],
                      all_scores[:len(shown)], time.perf_counter() - t0)
