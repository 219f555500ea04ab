"""Rectified-flow pretraining of a velocity model (e.g. jagg.shapes.dit.TinyDiT) from an abstract data source.

Per step: draw x0 and prompt tokens from `sample_batch`, sigma (logit-normal or uniform), noise;
x_sigma = (1 - sigma) x0 + sigma * noise, target v = noise - x0, MSE loss. Prompts are replaced by the
empty prompt (all pad ids 0) with probability `model.config.cfg_dropout` (so classifier-free guidance
works later). AdamW, linear warmup then cosine decay, grad-norm clipping, optional EMA of the weights.
Deterministic under `seed`: the data source gets its own seeded torch.Generator, and sigma / noise /
dropout come from a second one.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

SampleBatch = Callable[[torch.Generator, int], "tuple[Tensor, Tensor]"]  # (gen, n) -> (x0 [n,C,H,W] in [-1,1], tokens [n,L])


@dataclass
class PretrainConfig:
    steps: int = field(default=10000, metadata={"help": 'Optimizer steps.'})
    batch_size: int = field(default=64, metadata={"help": 'Rendered images per step.'})
    lr: float = field(default=1e-3, metadata={"help": 'Peak AdamW learning rate.'})
    min_lr_ratio: float = field(default=0.1, metadata={"help": 'Cosine decay ends at lr * min_lr_ratio.'})
    weight_decay: float = field(default=0.01, metadata={"help": 'AdamW weight decay (matrices and embeddings only).'})
    betas: tuple[float, float] = field(default=(0.9, 0.99), metadata={"help": 'AdamW betas.'})
    warmup: int = field(default=100, metadata={"help": 'Linear warm-up steps.'})
    grad_clip: float = field(default=1.0, metadata={"help": 'Max global gradient norm (0 = off).'})
    seed: int = field(default=0, metadata={"help": 'Seed of data, noise, sigmas and initialisation.'})
    log_every: int = field(default=50, metadata={"help": 'Print the mean loss every N steps.'})
    sigma_sampling: str = field(default="logit_normal", metadata={"help": "'logit_normal' (SD3) or 'uniform' sigma sampling."})
    logit_mean: float = field(default=0.0, metadata={"help": 'Mean of the logit-normal sigma distribution.'})
    logit_std: float = field(default=1.0, metadata={"help": 'Std of the logit-normal sigma distribution.'})
    ema_decay: float | None = field(default=0.999, metadata={"help": 'EMA decay of the returned weights (None = off).'})
    cfg_dropout: float | None = field(default=None, metadata={"help": "Probability of the empty prompt (None = the model's cfg_dropout)."})

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"PretrainConfig.{name} must be a positive int, got {v!r}")
            setattr(self, name, int(v))                   # a numpy integer counts
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, numbers.Integral) or self.warmup < 0:
            raise ValueError(f"PretrainConfig.warmup must be an int >= 0, got {self.warmup!r}")
        self.warmup = int(self.warmup)
        if not self.lr > 0:
            raise ValueError(f"PretrainConfig.lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"PretrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"PretrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"PretrainConfig.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.sigma_sampling not in ("logit_normal", "uniform"):
            raise ValueError(f"PretrainConfig.sigma_sampling must be 'logit_normal' or 'uniform', got {self.sigma_sampling!r}")
        if self.logit_std <= 0:
            raise ValueError(f"PretrainConfig.logit_std must be > 0, got {self.logit_std}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"PretrainConfig.ema_decay must be in (0, 1) or None to disable EMA, got {self.ema_decay}")
        if self.cfg_dropout is not None and not 0.0 <= self.cfg_dropout < 1.0:
            raise ValueError(f"PretrainConfig.cfg_dropout must be in [0, 1) or None (use the model's), got {self.cfg_dropout}")


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup - 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def sample_sigma(gen: torch.Generator, n: int, cfg: PretrainConfig) -> Tensor:
    """[n] sigmas in (0, 1), float32 on CPU."""
    if cfg.sigma_sampling == "uniform":
        return torch.rand(n, generator=gen)
    return torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(n, generator=gen))


def pretrain(
    model: nn.Module,
    sample_batch: SampleBatch,
    cfg: PretrainConfig,
    log: Callable[[dict], None] | None = None,
    snapshot: Callable[[int, nn.Module], None] | None = None,
    snapshot_every: int = 0,
) -> nn.Module:
    """Train `model(x [N,C,H,W], sigma [N], tokens [N,L]) -> v [N,C,H,W]` in place with the rectified-flow loss.

    `sample_batch(gen, n)` returns (x0 [n, C, H, W] in [-1, 1], tokens [n, L] long, pad id 0).
    `log`, if given, receives {"step", "loss" (mean over the last log_every steps), "lr", "grad_norm",
    "sec_per_step"} every `log_every` steps and at the last step. `snapshot`, if given, receives
    (step, weights) every `snapshot_every` steps before the last: the EMA copy when cfg.ema_decay is set,
    else the model. Returns the model (holding the EMA weights when cfg.ema_decay is set).
    """
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    p_drop = cfg.cfg_dropout if cfg.cfg_dropout is not None else getattr(getattr(model, "config", None), "cfg_dropout", 0.0)

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas,
    )
    ema = copy.deepcopy(model).requires_grad_(False) if cfg.ema_decay is not None else None

    data_gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    model.train()
    loss_sum, t0 = torch.zeros((), device=device), time.perf_counter()
    for step in range(cfg.steps):
        x0, tokens = sample_batch(data_gen, cfg.batch_size)
        n = x0.shape[0]
        sigma = sample_sigma(noise_gen, n, cfg)  # [n]
        noise = torch.randn(x0.shape, generator=noise_gen)  # [n, C, H, W]
        drop = torch.rand(n, generator=noise_gen) < p_drop  # [n]
        x0, sigma, noise = (t.to(device=device, dtype=dtype) for t in (x0, sigma, noise))
        tokens = tokens.to(device).masked_fill(drop.to(device)[:, None], 0)  # empty prompt where dropped

        s = sigma[:, None, None, None]
        x_sigma = (1 - s) * x0 + s * noise
        loss = F.mse_loss(model(x_sigma, sigma, tokens), noise - x0)

        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        opt.step()
        if ema is not None:
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1.0 - cfg.ema_decay)
                for be, bm in zip(ema.buffers(), model.buffers()):
                    be.copy_(bm)
        loss_sum += loss.detach()

        k = (step + 1) % cfg.log_every or cfg.log_every  # steps since the last log
        if log is not None and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
            dt = time.perf_counter() - t0
            log({"step": step + 1, "loss": loss_sum.item() / k, "lr": lr_at(step, cfg),
                 "grad_norm": float(gn), "sec_per_step": dt / k})
            loss_sum.zero_()
            t0 = time.perf_counter()
        if snapshot is not None and snapshot_every > 0 and (step + 1) % snapshot_every == 0 and step + 1 < cfg.steps:
            snapshot(step + 1, ema if ema is not None else model)
    if ema is not None:
        model.load_state_dict(ema.state_dict())
    model.eval()
    return model
