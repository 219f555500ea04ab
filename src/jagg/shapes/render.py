"""Rasterise shapes-world scenes (the conversions between uint8 pixels and model space are :mod:`jagg.rewards.images`).

Pixels are painted when their centre falls inside a shape (no anti-aliasing), so colours stay exactly on
the palette and shapes stay crisp. Shapes, with half-extent r around the centre:
    circle    disc of radius r
    square    axis-aligned, side 2r
    triangle  upright isosceles: apex at the top centre, base along the bottom edge (fills half its box)
"""

from __future__ import annotations

import numpy as np

from .scene import BACKGROUND, COLORS, PromptSpec, Scene, sample_scene


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "triangle":
        return (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2)
    raise ValueError(f"cannot render shape {shape!r}")


def render(scene: Scene, size: int = 32) -> np.ndarray:
    """Render one scene -> uint8 [size, size, 3]. Sizes below 32 may make nearby objects touch."""
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    c = (np.arange(size) + 0.5) / size
    for obj in scene.objects:
        mask = _shape_mask(obj.shape, c[None, :] - obj.center[0], c[:, None] - obj.center[1], obj.size / 2)
        img[mask] = COLORS[obj.color]
    return img


def render_batch(scenes: list[Scene], size: int = 32) -> np.ndarray:
    """Render scenes -> uint8 [N, size, size, 3]."""
    return np.stack([render(s, size) for s in scenes]) if scenes else np.zeros((0, size, size, 3), np.uint8)


def render_prompts(prompts: list[str | PromptSpec], rng: np.random.Generator | int | None = None,
                   size: int = 32, allow_held_out: bool = False) -> tuple[np.ndarray, list[Scene]]:
    """Ground truth for prompts: one random scene each -> (uint8 [N, size, size, 3], scenes)."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    scenes = [sample_scene(p, rng, allow_held_out=allow_held_out) for p in prompts]
    return render_batch(scenes, size), scenes
