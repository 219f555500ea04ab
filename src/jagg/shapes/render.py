"""Rasterise shapes-world scenes, and convert images between uint8 pixels and model space.

Pixels are painted when their centre falls inside a shape (no anti-aliasing), so colours stay exactly on
the palette and shapes stay crisp. Shapes, with half-extent r around the centre:
    circle    disc of radius r
    square    axis-aligned, side 2r
    triangle  upright isosceles: apex at the top centre, base along the bottom edge (fills half its box)
"""

from __future__ import annotations

import numpy as np
import torch

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


def to_tensor(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W] in [-1, 1]."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"to_tensor expects uint8 images [N, H, W, 3], got {x.dtype} {tuple(x.shape)}")
    return x.permute(0, 3, 1, 2).float().div(127.5).sub(1.0).contiguous()


def from_tensor(x: torch.Tensor) -> np.ndarray:
    """float [N, 3, H, W] in [-1, 1] (values outside are clamped) -> uint8 [N, H, W, 3]."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"from_tensor expects a float tensor [N, 3, H, W] in [-1, 1], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    x = ((x.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 1).numpy()


def to_uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Accept uint8 [N, H, W, 3] (numpy or torch) or a float tensor [N, 3, H, W] in [-1, 1] (model space);
    return uint8 numpy [N, H, W, 3]. This is what every reward takes."""
    if isinstance(images, torch.Tensor):
        if images.is_floating_point():
            return from_tensor(images)
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [N, H, W, 3] or a float tensor [N, 3, H, W] in [-1, 1], got "
                         f"{images.dtype} {images.shape}")
    return images
