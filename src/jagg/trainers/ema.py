"""The exponential moving average of the trained weights that both trainers keep (``optim.ema_decay``): updated after
each optimizer step, saved in every checkpoint as ``"ema": {parameter name: tensor}`` (an entry of its own beside
``"model"``, so a sharded checkpoint can carry it the same way), resumed bit-identically, and swapped into the model
for evaluation (:meth:`EMA.applied`) or exported (:meth:`EMA.state_dict`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from ..infra.engine import placed_like


class EMA:
    """``ema <- decay * ema + (1 - decay) * weight`` for each of ``named`` (``{name: parameter}``), starting at the
    weights themselves; the averages keep each weight's device and dtype."""

    def __init__(self, named: dict[str, Tensor], decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"optim.ema_decay must be in (0, 1) for an EMA; got {decay!r}")
        self.decay = decay
        self.names = list(named)
        self.params = list(named.values())
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after an optimizer step."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - self.decay)

    def state_dict(self) -> dict[str, Tensor]:
        """The averages by parameter name, copies on the CPU (a checkpoint's ``"ema"`` entry)."""
        return {n: s.detach().cpu().clone() for n, s in zip(self.names, self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict` (exactly, whole averages into whole or sharded ones); a checkpoint whose names differ is a ValueError naming some."""
        if not isinstance(state, dict) or set(state) != set(self.names):
            got = set(state) if isinstance(state, dict) else set()
            diff = sorted(got ^ set(self.names))[:3]
            raise ValueError(f"the checkpoint's EMA weights do not match this model's trainable parameters (e.g. "
                             f"{diff}); was optim.ema_decay or the trained weights changed?")
        for n, s in zip(self.names, self.shadow):
            s.copy_(placed_like(state[n], s))              # a shard of it, when the weights are sharded

    @torch.no_grad()
    def copy_to(self, params: list[Tensor]) -> None:
        """Write the averages into ``params`` (the same parameters, in :attr:`names`' order, e.g. of a copy)."""
        for p, s in zip(params, self.shadow):
            p.copy_(s)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the parameters hold the averages (evaluation); their trained values come back after."""
        kept = [p.detach().clone() for p in self.params]
        self.copy_to(self.params)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)
