"""A tiny text-conditioned DiT for small RGB images in pixel space (no VAE).

Rectified-flow convention: x_sigma = (1 - sigma) x0 + sigma * noise, sigma = 1 is pure noise, and the
network predicts the velocity v = noise - x0.

Layout, top to bottom:
  - DiTConfig: the typed, validated configuration (to_dict / from_dict for checkpoints).
  - TextEncoder: token embedding + a small pre-LN transformer over the prompt. A learned "null" token is
    prepended to every prompt, so attention always has one valid key (the empty prompt is safe).
  - TinyDiT: patch embedding + learned positions, timestep embedding + pooled text -> adaLN conditioning,
    DiT blocks (adaLN-Zero self-attention, cross-attention to the text tokens, adaLN-Zero MLP),
    zero-initialised final layer, unpatchify.
  - save_pretrained / load_pretrained: one .safetensors file, config JSON in its metadata, atomic write.
  - cfg_velocity: classifier-free guidance with one batched forward of [cond; uncond].

Token id 0 is padding. A prompt ends at its first pad: every token after the first 0 is ignored.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..checks import parse_json

PAD_ID = 0
_META_KEY = "jagg_dit_config"


@dataclass
class DiTConfig:
    vocab_size: int  # token ids are in [0, vocab_size); id 0 is padding
    image_size: int = 32
    channels: int = 3
    patch_size: int = 4
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    max_text_len: int = 16
    text_dim: int = 64
    text_depth: int = 2
    text_heads: int = 4
    cfg_dropout: float = 0.1  # training-time probability of replacing the prompt by the empty prompt
    pos_init: str = "sincos"  # image position embedding init: "sincos" (2-D sin-cos, DiT) or "normal" (N(0, 0.02))

    def __post_init__(self):
        if self.pos_init not in ("sincos", "normal"):
            raise ValueError(f"DiTConfig.pos_init must be 'sincos' or 'normal', got {self.pos_init!r}")
        for f in fields(self):
            if f.name in ("cfg_dropout", "pos_init"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"DiTConfig.{f.name} must be a positive int, got {v!r}")
            setattr(self, f.name, int(v))                 # a numpy integer counts
        if self.vocab_size < 2:
            raise ValueError(f"DiTConfig.vocab_size must be >= 2 (id 0 is padding), got {self.vocab_size}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"DiTConfig.image_size ({self.image_size}) must be divisible by patch_size "
                f"({self.patch_size}); pick a patch_size that divides it"
            )
        if self.dim % self.heads:
            raise ValueError(f"DiTConfig.dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dim % 4:
            raise ValueError(f"DiTConfig.dim ({self.dim}) must be divisible by 4 (2-D sin-cos position embedding)")
        if self.text_dim % self.text_heads:
            raise ValueError(
                f"DiTConfig.text_dim ({self.text_dim}) must be divisible by text_heads ({self.text_heads})"
            )
        if not isinstance(self.cfg_dropout, (int, float)) or not (0.0 <= self.cfg_dropout < 1.0):
            raise ValueError(f"DiTConfig.cfg_dropout must be in [0, 1), got {self.cfg_dropout!r}")
        self.cfg_dropout = float(self.cfg_dropout)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DiTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"DiTConfig.from_dict: unknown keys {unknown}; the checkpoint was written by a different "
                f"version of jagg (known keys: {sorted(known)})"
            )
        return cls(**d)


# ----------------------------------------------------------------------------- building blocks


def sincos_2d(h: int, w: int, dim: int) -> Tensor:
    """2-D sin-cos position embedding [h*w, dim]: half the channels encode the row, half the column."""
    def axis(n: int, d: int) -> Tensor:
        freq = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d // 2))
        ang = torch.arange(n, dtype=torch.float64)[:, None] * freq[None]  # [n, d/2]
        return torch.cat([ang.sin(), ang.cos()], dim=1)  # [n, d]

    rows = axis(h, dim // 2)[:, None, :].expand(h, w, dim // 2)  # [h, w, dim/2]
    cols = axis(w, dim // 2)[None, :, :].expand(h, w, dim // 2)  # [h, w, dim/2]
    return torch.cat([rows, cols], dim=-1).reshape(h * w, dim).float()


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    # x [N, T, D], shift/scale [N, D]
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention; self-attention when `ctx` is None, else cross-attention to `ctx`."""

    def __init__(self, dim: int, heads: int, ctx_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(ctx_dim or dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, ctx: Tensor | None = None, ctx_mask: Tensor | None = None) -> Tensor:
        # x [N, T, D], ctx [N, S, Dc], ctx_mask [N, S] bool (True = attend)
        N, T, D = x.shape
        ctx = x if ctx is None else ctx
        S, H = ctx.shape[1], self.heads
        q = self.q(x).view(N, T, H, D // H).transpose(1, 2)  # [N, H, T, hd]
        k, v = self.kv(ctx).view(N, S, 2, H, D // H).permute(2, 0, 3, 1, 4)  # each [N, H, S, hd]
        mask = None if ctx_mask is None else ctx_mask[:, None, None, :]  # [N, 1, 1, S]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [N, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(N, T, D))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TextBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, mlp_ratio)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        h = h + self.attn(self.norm1(h), ctx_mask=mask)
        return h + self.mlp(self.norm2(h))


class TextEncoder(nn.Module):
    """Prompt tokens [N, L] -> (token features [N, 1 + L, text_dim], mask [N, 1 + L], pooled [N, text_dim]).

    Position 0 is a learned null token, always valid: the empty (all-pad) prompt reduces to it.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.max_len = cfg.max_text_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.text_dim)
        self.null = nn.Parameter(torch.zeros(1, 1, cfg.text_dim))
        self.pos = nn.Parameter(torch.zeros(1, 1 + cfg.max_text_len, cfg.text_dim))
        self.blocks = nn.ModuleList(TextBlock(cfg.text_dim, cfg.text_heads, cfg.mlp_ratio) for _ in range(cfg.text_depth))
        self.norm = nn.LayerNorm(cfg.text_dim)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        N, L = tokens.shape
        if L > self.max_len:
            raise ValueError(f"prompt has {L} tokens but max_text_len is {self.max_len}; truncate it or raise max_text_len")
        valid = torch.cumprod((tokens != PAD_ID).long(), dim=1).bool()  # [N, L], False from the first pad on
        mask = torch.cat([valid.new_ones(N, 1), valid], dim=1)  # [N, 1 + L]
        h = torch.cat([self.null.expand(N, -1, -1), self.tok(tokens)], dim=1)  # [N, 1 + L, Dt]
        h = h + self.pos[:, : 1 + L]
        for blk in self.blocks:
            h = blk(h, mask)
        h = self.norm(h)
        m = mask.to(h.dtype)[..., None]  # [N, 1 + L, 1]
        pooled = (h * m).sum(1) / m.sum(1)  # [N, Dt]; m.sum >= 1 (the null token)
        return h, mask, pooled


class TimestepEmbed(nn.Module):
    """sigma [N] in [0, 1] -> sinusoidal features of sigma * 1000 -> MLP -> [N, dim]."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, sigma: Tensor) -> Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=sigma.dtype, device=sigma.device) / half)
        args = (sigma * 1000.0)[:, None] * freqs[None]  # [N, half]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # [N, 2 * half]
        if self.dim % 2:
            emb = F.pad(emb, (0, 1))
        return self.mlp(emb)


class DiTBlock(nn.Module):
    """adaLN-Zero self-attention, plain cross-attention to the text tokens, adaLN-Zero MLP."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        D = cfg.dim
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(D, cfg.heads)
        self.norm2 = nn.LayerNorm(D, eps=1e-6)
        self.cross = Attention(D, cfg.heads, ctx_dim=cfg.text_dim)
        self.norm3 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(D, cfg.mlp_ratio)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x: Tensor, c: Tensor, ctx: Tensor, ctx_mask: Tensor) -> Tensor:
        # x [N, T, D], c [N, D], ctx [N, S, Dt], ctx_mask [N, S]
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c).chunk(6, dim=-1)  # each [N, D]
        x = x + g1[:, None] * self.attn(modulate(self.norm1(x), sh1, sc1))
        x = x + self.cross(self.norm2(x), ctx, ctx_mask)
        x = x + g2[:, None] * self.mlp(modulate(self.norm3(x), sh2, sc2))
        return x


# ----------------------------------------------------------------------------- the model


class TinyDiT(nn.Module):
    """Velocity network v_theta(x, sigma, tokens) for rectified flow in pixel space.

    forward(x [N, C, H, W] float, sigma [N] (or scalar) in [0, 1], tokens [N, L] long, L <= max_text_len)
        -> velocity [N, C, H, W] in x's dtype. Works in any float dtype (float64 for gradient checks).
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.config = cfg
        D, p, C = cfg.dim, cfg.patch_size, cfg.channels
        self.text = TextEncoder(cfg)
        self.patch_embed = nn.Linear(p * p * C, D)
        self.pos = nn.Parameter(torch.zeros(1, cfg.num_patches, D))
        self.t_embed = TimestepEmbed(D)
        self.text_pool = nn.Linear(cfg.text_dim, D)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))
        self.final = nn.Linear(D, p * p * C)
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for prm in (self.text.pos, self.text.null):
            nn.init.normal_(prm, std=0.02)
        if self.config.pos_init == "normal":
            nn.init.normal_(self.pos, std=0.02)
        else:
            with torch.no_grad():  # fixed-style 2-D sin-cos start (DiT/MAE), still learnable
                h = self.config.image_size // self.config.patch_size
                self.pos.copy_(sincos_2d(h, h, self.config.dim)[None])
        # adaLN-Zero: every gate/shift/scale starts at 0 (blocks start as identity on the attn/MLP paths),
        # and the output layer starts at 0, so the initial velocity is exactly 0.
        for lin in [blk.ada[-1] for blk in self.blocks] + [self.final_ada[-1], self.final]:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def patchify(self, x: Tensor) -> Tensor:
        N, C, H, W = x.shape
        p = self.config.patch_size
        x = x.reshape(N, C, H // p, p, W // p, p)  # [N, C, h, p, w, p]
        x = x.permute(0, 2, 4, 3, 5, 1)  # [N, h, w, p, p, C]
        return x.reshape(N, (H // p) * (W // p), p * p * C)  # [N, h*w, p*p*C]

    def unpatchify(self, x: Tensor) -> Tensor:
        cfg = self.config
        N, p, C = x.shape[0], cfg.patch_size, cfg.channels
        h = w = cfg.image_size // p
        x = x.reshape(N, h, w, p, p, C)  # [N, h, w, p, p, C]
        x = x.permute(0, 5, 1, 3, 2, 4)  # [N, C, h, p, w, p]
        return x.reshape(N, C, h * p, w * p)  # [N, C, H, W]

    def forward(self, x: Tensor, sigma: Tensor | float, tokens: Tensor) -> Tensor:
        cfg = self.config
        N, C, H, W = x.shape
        if (C, H, W) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"TinyDiT expects x of shape [N, {cfg.channels}, {cfg.image_size}, {cfg.image_size}], got {tuple(x.shape)}"
            )
        if tokens.shape[0] != N:
            raise ValueError(f"tokens has batch {tokens.shape[0]} but x has batch {N}; pass one prompt per image")
        sigma = torch.as_tensor(sigma, device=x.device).to(x.dtype)
        sigma = sigma.expand(N) if sigma.dim() == 0 else sigma  # [N]
        if sigma.shape != (N,):
            raise ValueError(f"sigma must be a scalar or of shape [{N}], got {tuple(sigma.shape)}")
        ctx, ctx_mask, pooled = self.text(tokens)  # [N, S, Dt], [N, S], [N, Dt]
        c = self.t_embed(sigma) + self.text_pool(pooled)  # [N, D]
        h = self.patch_embed(self.patchify(x)) + self.pos  # [N, T, D]
        for blk in self.blocks:
            h = blk(h, c, ctx, ctx_mask)
        shift, scale = self.final_ada(c).chunk(2, dim=-1)  # each [N, D]
        h = self.final(modulate(self.final_norm(h), shift, scale))  # [N, T, p*p*C]
        return self.unpatchify(h)


# ----------------------------------------------------------------------------- checkpoints


def save_pretrained(model: TinyDiT, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write weights (optionally cast to `dtype`) and the config to one .safetensors file, atomically
    (:func:`jagg.infra.atomic.atomic_write`)."""
    from safetensors.torch import save

    from ..infra.atomic import atomic_write

    sd = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {_META_KEY: json.dumps(model.config.to_dict()), "format": "pt"}
    atomic_write(path, lambda f: f.write(save(sd, metadata=meta)))


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> TinyDiT:
    """Load a TinyDiT written by save_pretrained (weights in their stored dtype unless `dtype` is given)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if _META_KEY not in meta:
        raise ValueError(f"{path} has no '{_META_KEY}' metadata; it was not written by jagg.shapes.dit.save_pretrained")
    cfg = DiTConfig.from_dict(parse_json(meta[_META_KEY], f"{path}: its '{_META_KEY}' metadata", "object",
                                         "write it again with jagg pretrain"))
    sd = load_file(path, device=str(device))
    model = TinyDiT(cfg)
    model.to(device=device, dtype=dtype if dtype is not None else next(iter(sd.values())).dtype)
    model.load_state_dict(sd, strict=True)
    return model


# ----------------------------------------------------------------------------- guidance


def cfg_velocity(
    model: nn.Module,
    x: Tensor,
    sigma: Tensor,
    tokens: Tensor,
    uncond_tokens: Tensor,
    guidance_scale: float,
    detach_uncond: bool = True,
) -> Tensor:
    """Classifier-free guidance v = v_u + w (v_c - v_u), from one batched forward of [cond; uncond].

    x [N, C, H, W], sigma [N] (or scalar), tokens [N, L], uncond_tokens [N, L'] or [1, L'] or [L']
    (usually all zeros: the empty prompt). With detach_uncond (Flow-GRPO's training setting) no gradient
    flows through v_u. guidance_scale == 1 skips the unconditional branch. Returns [N, C, H, W].
    """
    if guidance_scale == 1.0:
        return model(x, sigma, tokens)
    N = x.shape[0]
    if uncond_tokens.dim() == 1:
        uncond_tokens = uncond_tokens[None]
    uncond_tokens = uncond_tokens.to(tokens.device).expand(N, -1)
    L = max(tokens.shape[1], uncond_tokens.shape[1])  # pad both to a common length (pad = 0 is ignored)
    tok = torch.cat([F.pad(tokens, (0, L - tokens.shape[1])), F.pad(uncond_tokens, (0, L - uncond_tokens.shape[1]))])  # [2N, L]
    sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    sig = sigma.expand(N) if sigma.dim() == 0 else sigma
    v_c, v_u = model(torch.cat([x, x]), torch.cat([sig, sig]), tok).chunk(2)  # each [N, C, H, W]
    if detach_uncond:
        v_u = v_u.detach()
    return v_u + guidance_scale * (v_c - v_u)
