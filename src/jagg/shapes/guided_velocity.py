"""The TinyDiT as a jagg velocity callable, with classifier-free guidance."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .dit import cfg_velocity


class GuidedVelocity:
    """``(x [N,C,H,W], sigma [N], sample_index [N]) -> v [N,C,H,W]`` for a batch of prompts.

    ``v = v_u + w (v_c - v_u)``. With grad enabled (training) the unconditional branch runs under
    ``no_grad``, so the backward pass covers the conditional rows only and the gradient is ``w`` times the
    conditional branch's. That is this TinyDiT task's own choice (half the backward rows), not Flow-GRPO's: its
    SD3 trainer (``train.cfg = True``) sends both branches through the network with grad, as the real-model
    adapters do by default (:class:`jagg.integrations.VelocityConfig`, ``detach_uncond``). Without grad
    (sampling) both branches go through the network as one batch.

    Args:
        model: the TinyDiT ``(x, sigma, tokens) -> v``.
        tokens: ``[B, L]`` prompt tokens of the B trajectories; ``sample_index`` selects rows.
        guidance_scale: ``w``; 1 disables guidance.
    """

    def __init__(self, model: nn.Module, tokens: Tensor, guidance_scale: float):
        self.model, self.tokens, self.w = model, tokens, float(guidance_scale)

    def __call__(self, x: Tensor, sigma: Tensor, sample_index: Tensor) -> Tensor:
        tok = self.tokens[sample_index]
        if self.w == 1.0:
            return self.model(x, sigma, tok)
        if not torch.is_grad_enabled():
            return cfg_velocity(self.model, x, sigma, tok, torch.zeros_like(tok), self.w)
        with torch.no_grad():
            v_u = self.model(x, sigma, torch.zeros_like(tok))
        v_c = self.model(x, sigma, tok)
        return v_u + self.w * (v_c - v_u)
