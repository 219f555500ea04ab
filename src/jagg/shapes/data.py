"""Rendered (image, prompt) pairs of the shapes world, as a data source for rectified-flow pretraining."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import render_prompts, to_tensor, tokenizer, train_prompts


class WorldBatches:
    """``(gen, n) -> (x0 [n, 3, H, W] in [-1, 1], tokens [n, L])`` over the train prompts.

    Only the train split is used, so the held-out colour+shape pairs stay unseen. Deterministic given ``gen``.
    """

    def __init__(self, image_size: int = 32, max_len: int = 16, prompts: list[str] | None = None):
        self.prompts = prompts or train_prompts()
        self.image_size, self.max_len = image_size, max_len

    def __call__(self, gen: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.prompts), (n,), generator=gen).tolist()
        rng = np.random.default_rng(int(torch.randint(2**31 - 1, (1,), generator=gen)))
        prompts = [self.prompts[i] for i in idx]
        images, _ = render_prompts(prompts, rng, size=self.image_size)
        return to_tensor(images), tokenizer.encode(prompts, max_len=self.max_len)
