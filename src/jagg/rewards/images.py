"""Images as rewards take them and as models produce them: uint8 pixels ``[N, H, W, 3]`` and float tensors
``[N, 3, H, W]`` in [-1, 1] (model space), and the conversions between the two. No task and no model inside: the
rewards, their wire format and the shapes world (:mod:`jagg.shapes`) all convert here."""

from __future__ import annotations

import numpy as np
import torch


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


def to_unit_float(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """What :func:`to_uint8` accepts -> float32 ``[N, 3, H, W]`` in [0, 1]: uint8 pixels divided by 255, a float
    tensor in [-1, 1] mapped by ``(x + 1) / 2`` and clamped, on its own device and without quantising it (the input
    of the preference models' torch preprocessing, :mod:`jagg.rewards.preference`)."""
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"a float image tensor must be [N, 3, H, W] in [-1, 1]; got shape {tuple(images.shape)}")
        return ((images.detach().float() + 1.0) / 2.0).clamp(0.0, 1.0)
    return torch.tensor(to_uint8(images)).permute(0, 3, 1, 2).float().div(255.0)

