"""Held-out evaluation on the shapes world: deterministic ODE sampling with fixed seeds, the reward's metrics, and
the signs of reward hacking (:func:`image_health`): empty images, object counts against the asked ones, and a
dirty background."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .guided_velocity import GuidedVelocity
from ..schedule import flow_sigmas
from ..trajectory import sample_ode
from . import from_tensor, parse_prompt, test_prompts, tokenizer, uses_held_out
from .geneval import GenevalReward, segment
from .scene import BACKGROUND


@torch.no_grad()
def generate(model: nn.Module, prompts: list[str], num_steps: int, guidance_scale: float, seed: int,
             shift: float = 1.0, micro_batch: int = 64) -> np.ndarray:
    """One image per prompt by Euler sampling from noise seeded by ``seed`` -> uint8 ``[N, H, W, 3]``."""
    cfg = model.config
    tokens = tokenizer.encode(prompts, max_len=cfg.max_text_len)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(prompts), cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    x = sample_ode(GuidedVelocity(model, tokens, guidance_scale), noise, flow_sigmas(num_steps, shift), micro_batch)
    return from_tensor(x)


def _component_info(info: dict) -> dict:
    """A weighted sum of rewards files a component's info under ``<name>/<key>``: lift the GenEval-like keys
    (``correct``, ``constraints``, ``accuracy/...``) of the first component that has them to the top."""
    for key in info:
        if key.endswith("/correct"):
            prefix = key[: -len("correct")]
            return {k[len(prefix):]: v for k, v in info.items() if k.startswith(prefix)}
    return {}


def background_rms(images: np.ndarray, threshold: float = 90.0) -> np.ndarray:
    """How far each image's background is from the world's flat background colour: uint8 ``[N, H, W, 3]`` ->
    float ``[N]``, the RMS RGB distance to ``BACKGROUND`` over the pixels that are neither of an object colour (within
    ``threshold`` of a palette colour, as the detector segments) nor next to one (a 1-pixel border around objects is
    left out, where a blurry edge is not an artifact). 0 on rendered scenes; grid patterns, noise and haze raise
    it. An image without background pixels scores 0."""
    obj = segment(images, threshold) >= 0                                    # [N, H, W] object-coloured pixels
    near = obj.copy()                                                        # dilated by one pixel (4-neighbours)
    near[:, 1:] |= obj[:, :-1]
    near[:, :-1] |= obj[:, 1:]
    near[:, :, 1:] |= obj[:, :, :-1]
    near[:, :, :-1] |= obj[:, :, 1:]
    bg = ~near
    d2 = ((images.astype(np.float32) - np.asarray(BACKGROUND, np.float32)) ** 2).sum(-1)   # [N, H, W]
    n = bg.sum((1, 2))
    return np.sqrt(np.where(n > 0, (d2 * bg).sum((1, 2)) / np.maximum(n, 1), 0.0))


def image_health(images: np.ndarray, prompts: list[str], detector: GenevalReward | None = None) -> dict:
    """The signs of reward hacking in a batch, uint8 ``[N, H, W, 3]`` images of ``prompts`` ``[N]``, measured with
    the GenEval-like detector (whatever reward is trained):

      empty_frac       the fraction of images in which no object is detected;
      objects_mean     the mean number of detected objects, beside asked_mean, the mean number the prompts ask for;
      count_error      the mean |detected - asked| objects per image;
      background_rms   the mean of :func:`background_rms` (RGB units, 0-255 scale).
    """
    detector = detector or GenevalReward()
    if len(prompts) != len(images):
        raise ValueError(f"image_health: {len(images)} images but {len(prompts)} prompts")
    found = np.array([len(d) for d in detector.detect(images)], dtype=np.float64)
    asked = np.array([sum(o.count for o in parse_prompt(p).objects) for p in prompts], dtype=np.float64)
    return {"empty_frac": float((found == 0).mean()), "objects_mean": float(found.mean()),
            "asked_mean": float(asked.mean()), "count_error": float(np.abs(found - asked).mean()),
            "background_rms": float(background_rms(images, detector.color_threshold).mean())}


@torch.no_grad()
def evaluate(model: nn.Module, reward_fn, num_prompts: int = 0, images_per_prompt: int = 2, num_steps: int = 10,
             guidance_scale: float = 3.0, seed: int = 1234, shift: float = 1.0, with_scores: bool = False) -> tuple:
    """Reward of the test split (the first ``num_prompts``, 0 = all), ``images_per_prompt`` each.

    Returns ``(metrics, images uint8 [N, H, W, 3], prompts)``, and the per-image rewards ``[N]`` as a fourth item
    when ``with_scores`` (the trainer captions its sample grids with them); metrics hold ``reward_mean``, ``accuracy``,
    ``held_out_reward`` / ``held_out_accuracy`` (prompts using a held-out colour+shape pair) and ``seen_reward`` /
    ``seen_accuracy`` (the others), per-category accuracies (``accuracy/<category>``) and rewards
    (``score/<category>``) and, for rewards that report ``constraints`` (geneval), the pass rate of each constraint
    kind (``pass/shape``, ``pass/color``, ``pass/relation``, ``pass/no_extra``), for a weighted sum of rewards each
    component's unweighted mean (``reward/<name>``), and the signs of reward hacking of :func:`image_health`
    (``empty_frac``, ``objects_mean``, ``asked_mean``, ``count_error``, ``background_rms``).
    """
    prompts = test_prompts()
    prompts = prompts[:num_prompts] if num_prompts else prompts
    batch = [p for p in prompts for _ in range(images_per_prompt)]
    images = generate(model, batch, num_steps, guidance_scale, seed, shift)
    scores, info = reward_fn(images, batch, None)
    info = {**info, **_component_info(info)}
    scores = np.asarray(scores)
    held = np.array([uses_held_out(p) for p in batch])
    correct = np.asarray(info["correct"], dtype=bool) if "correct" in info else None
    metrics = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std())}
    if correct is not None:
        metrics["accuracy"] = float(correct.mean())
    for part, mask in (("held_out", held), ("seen", ~held)):
        if mask.any():
            metrics[f"{part}_reward"] = float(scores[mask].mean())
            if correct is not None:
                metrics[f"{part}_accuracy"] = float(correct[mask].mean())
    metrics.update({k: v for k, v in info.items() if k.startswith("accuracy/")})
    if "category" in info:
        category = np.asarray(info["category"])
        metrics.update({f"score/{c}": float(scores[category == c].mean()) for c in dict.fromkeys(info["category"])})
    for k, v in info.items():      # a weighted sum of rewards: each component's mean, reported separately
        if k.startswith("scores/"):
            metrics["reward/" + k[len("scores/"):]] = float(np.mean(v))
    if "constraints" in info:      # GenEval-like rewards: pass rate per constraint kind ("shape:circle" -> shape)
        passed: dict[str, list[bool]] = {}
        for c in info["constraints"]:
            for k, v in c.items():
                passed.setdefault("pass/" + k.split(":")[0], []).append(bool(v))
        metrics.update({k: float(np.mean(v)) for k, v in passed.items()})
    metrics.update(image_health(images, batch))
    return (metrics, images, batch, scores) if with_scores else (metrics, images, batch)


def comparison_prompts(n: int) -> list[str]:
    """The first ``n`` test prompts (the split is interleaved by category, so any prefix covers every category)."""
    return test_prompts()[:n]


def save_comparison(before: np.ndarray, after: np.ndarray, prompts: list[str], path, labels: tuple[str, str],
                    ncol: int = 8) -> dict:
    """The same prompts and noise before and after training, side by side, as one captioned PNG (and its ``.txt``).

    ``before`` and ``after``: uint8 ``[N, H, W, 3]`` images of ``prompts`` ``[N]``. Rows come in pairs, ``labels[0]``
    above ``labels[1]``, ``ncol`` prompts per pair; each image is captioned with its prompt, its GenEval-like score, whether
    it is fully correct, and each constraint passed (``+``) or failed (``-``). Returns both sets' mean score and
    accuracy (``before_score``, ``after_score``, ``before_accuracy``, ``after_accuracy``)."""
    from ..infra.metrics import save_grid

    before, after = np.asarray(before), np.asarray(after)
    if before.shape != after.shape or len(before) != len(prompts):
        raise ValueError(f"save_comparison: before {list(before.shape)}, after {list(after.shape)} and {len(prompts)} "
                         "prompts must match")
    ncol = min(ncol, len(prompts))
    if ncol < 1 or len(prompts) % ncol:
        raise ValueError(f"save_comparison: {len(prompts)} prompts do not fill rows of ncol={ncol}")
    reward = GenevalReward()
    captions, out = [], {}
    for key, label, images in zip(("before", "after"), labels, (before, after)):
        scores, info = reward(images, prompts)
        out[f"{key}_score"], out[f"{key}_accuracy"] = float(scores.mean()), float(np.mean(info["correct"]))
        captions.append([[f"{label}: {s:.2f}" + (" correct" if ok else ""),
                          " ".join(("+" if v else "-") + k for k, v in c.items())]
                         for s, ok, c in zip(scores, info["correct"], info["constraints"])])
    rows, texts, notes = [], [], []
    for start in range(0, len(prompts), ncol):                  # a row of `before`, then the same prompts `after`
        block = range(start, min(start + ncol, len(prompts)))
        for images, caps in zip((before, after), captions):
            rows += [images[i] for i in block]
            texts += [prompts[i] for i in block]
            notes += [caps[i] for i in block]
    save_grid(np.stack(rows), path, ncol=ncol, prompts=texts, notes=notes)
    return out


def collapse_warnings(evals: list[dict], drop: float, empty_rise: float, background_rise: float) -> list[str]:
    """Plain warnings about the latest of ``evals`` (the run's evaluation records, oldest first; the first is the
    starting model's), one per sign that fires:

    - the held-out reward (``reward_mean``) fell more than ``drop`` below its best so far;
    - the fraction of empty images rose more than ``empty_rise`` above the first evaluation's;
    - the background measure (``background_rms``) rose more than ``background_rise`` above the first evaluation's.

    A margin of 0 turns its check off. The trainer prints each kind once per run."""
    if len(evals) < 2:
        return []
    first, last = evals[0], evals[-1]
    out = []
    best = max(evals[:-1], key=lambda r: r["reward_mean"])
    if drop and last["reward_mean"] < best["reward_mean"] - drop:
        out.append(f"the held-out reward fell to {last['reward_mean']:.3f}, more than {drop} below its best "
                   f"{best['reward_mean']:.3f} (iteration {best['iteration']}): training may be collapsing; the "
                   f"checkpoints keep the better model")
    for key, margin, what in (("empty_frac", empty_rise, "the fraction of images with no object"),
                              ("background_rms", background_rise, "the background measure (background_rms)")):
        if margin and key in first and last[key] > first[key] + margin:
            out.append(f"{what} rose from {first[key]:.3f} to {last[key]:.3f} (more than {margin}): the model may be "
                       "gaming the reward instead of following the prompts; look at the sample grids")
    return out
