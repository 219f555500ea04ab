"""Tiny stand-in velocity models and trajectories for the estimator tests (float64)."""

from __future__ import annotations

import torch
from torch import nn

import jagg
from jagg.sde import step_loss

S = (2, 3, 3)          # latent shape
D = 18


class AffineInSigma(nn.Module):
    """``v = frozen_mlp(x) + theta_0 + sigma * theta_1``: the parameter-Jacobian is affine in sigma."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(D, 32), nn.Tanh(), nn.Linear(32, D)).double().requires_grad_(False)
        self.theta0 = nn.Parameter(0.1 * torch.randn(D, dtype=torch.float64))
        self.theta1 = nn.Parameter(0.1 * torch.randn(D, dtype=torch.float64))

    def forward(self, x, sigma, idx):
        h = self.frozen(x.flatten(1).double())
        return (h + self.theta0 + sigma.double()[:, None] * self.theta1).view(-1, *S)


class LinearXSigma(nn.Module):
    """``v = W x + sigma u + c`` with every weight trainable."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D).double()
        self.u = nn.Parameter(0.1 * torch.randn(D, dtype=torch.float64))

    def forward(self, x, sigma, idx):
        return (self.lin(x.flatten(1).double()) + sigma.double()[:, None] * self.u).view(-1, *S)


class Nonlinear(nn.Module):
    """A generic MLP in (x, sigma) with a per-sample conditioning vector."""

    def __init__(self, batch: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D + 1 + 4, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                                 nn.Linear(48, D)).double()
        self.register_buffer("cond", torch.randn(batch, 4, dtype=torch.float64))

    def forward(self, x, sigma, idx):
        h = torch.cat([x.flatten(1).double(), sigma.double()[:, None], self.cond[idx]], 1)
        return self.net(h).view(-1, *S)


def sampled_traj(model, B=4, T=12, shift=3.0, eta=0.7, seed=0, **kw):
    """Sample a float64 trajectory from ``model`` on a non-uniform (shifted) schedule."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(B, *S, generator=g, dtype=torch.float64)
    sig = jagg.flow_sigmas(T, shift=shift, dtype=torch.float64)
    return jagg.sample_trajectories(model, noise, sig, eta, generator=g, **kw)


@torch.no_grad()
def traj_from_latents(model, latents, sig, eta, train_steps=None):
    """A Trajectory over given latents ``[B, T+1, *S]`` with log-probs/velocities from ``model``."""
    B, T = latents.shape[0], sig.numel() - 1
    vs, lps = [], []
    for k in range(T):
        v = model(latents[:, k], sig[k].expand(B), torch.arange(B))
        lp = step_loss(v, latents[:, k], latents[:, k + 1], sig[k].expand(B), sig[k + 1].expand(B), float(sig[1]),
                       eta, torch.zeros(B), torch.zeros(B), 1.0).log_prob
        vs.append(v)
        lps.append(lp)
    ts = torch.arange(T) if train_steps is None else train_steps
    return jagg.Trajectory(latents, sig, torch.stack(lps, 1), torch.stack(vs, 1), ts, eta)


def affine_latents(B, sig, window, seed=0):
    """Latents ``[B, T+1, *S]`` that are affine in sigma inside each group of ``window`` steps."""
    g = torch.Generator().manual_seed(seed)
    T = sig.numel() - 1
    out = torch.empty(B, T + 1, *S, dtype=torch.float64)
    for start in range(0, T + 1, window):
        P = torch.randn(B, 1, *S, generator=g, dtype=torch.float64)
        Q = torch.randn(B, 1, *S, generator=g, dtype=torch.float64)
        s = sig[start : start + window].double().view(1, -1, *([1] * len(S)))
        out[:, start : start + window] = P + s * Q
    return out


def flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters() if p.requires_grad])


def run(model, traj, adv, cfg, **kw):
    model.zero_grad(set_to_none=True)
    stats = jagg.policy_gradient(model, traj, adv, cfg, **kw)
    return flat_grad(model), stats


def perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
