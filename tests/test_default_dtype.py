"""The library under ``torch.set_default_dtype(torch.float64)`` (common in exactness work and scientific code).

Every public entry point, with model, trajectory and advantages in float32 and in float64, must give a finite result,
and the same result as under the usual float32 default: nothing in the library may take its dtype from the default.
Each test restores the default dtype (the ``default_dtype`` fixture), whatever happens inside it.
"""

import pytest
import torch
from torch import nn

import jagg
from jagg import EstimatorConfig
from gradient_checks import assert_close_on_scale

S = (2, 3, 3)
D = 18
B = 6
GROUPS = [0, 0, 1, 1, 2, 2]


@pytest.fixture
def default_dtype():
    """Yields a setter of the default dtype; the original default comes back after the test."""
    saved = torch.get_default_dtype()
    try:
        yield torch.set_default_dtype
    finally:
        torch.set_default_dtype(saved)


class Tiny(nn.Module):
    """An MLP in (x, sigma, per-sample conditioning) whose parameters have an explicit dtype."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shapes = [(48, D + 1 + 4), (48,), (D, 48), (D,)]
        self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(0.3 * torch.randn(s, generator=g, dtype=torch.float64)
                                                           .to(dtype)) for s in shapes)
        self.register_buffer("cond", torch.randn(B, 4, generator=g, dtype=torch.float64).to(dtype))
        self.dtype = dtype

    def forward(self, x, sigma, idx):
        h = torch.cat([x.flatten(1).to(self.dtype), sigma.to(self.dtype)[:, None], self.cond[idx]], 1)
        return (torch.tanh(h @ self.w1.T + self.b1) @ self.w2.T + self.b2).view(-1, *S)


def _setup(dtype, T=11):
    """Model (perturbed off-policy), reference model, a sampled trajectory and advantages, all in ``dtype``."""
    ref = Tiny(dtype)
    model = Tiny(dtype)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(B, *S, generator=g, dtype=torch.float64).to(dtype)
    sig = jagg.flow_sigmas(T, shift=3.0, dtype=dtype)
    traj = jagg.sample_trajectories(model, noise, sig, 0.7, generator=g)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    adv = torch.linspace(-1.5, 1.5, B, dtype=torch.float64).to(dtype)
    return model, ref, traj, adv


def _grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# every option combination that takes its own code path in planning or execution
CASES = {
    "unbiased": dict(correction_p=0.25),                                      # unbiased JAGG, groups of 4
    "exact": dict(mode="exact"),
    "plain_interp": dict(correction_p=0.0),
    "plain_fresh": dict(correction_p=0.0, intermediate="fresh"),
    "alpha_index": dict(alpha="index", correction_p=0.25),
    "shared": dict(knots="shared", correction_p=0.25),
    "shared_corrected_micro3": dict(knots="shared", correction_p=0.5, micro_batch=3),
    "shared_fresh_plain": dict(knots="shared", intermediate="fresh", correction_p=0.0),
    "route_half_cosine": dict(jagg_frac=0.5, correction_p=0.25),
    "route_third_plain": dict(jagg_frac=0.3, correction_p=0.0),
    "correction_probs": dict(correction_probs=[0.5, 0.0, 1.0]),
    "correction_p1": dict(correction_p=1.0),
    "exact_first_last": dict(exact_first_intervals=1, exact_last_intervals=1, window=3, correction_p=0.25),
    "kl": dict(kl_beta=0.2, correction_p=0.25),
    "window8": dict(window=8, correction_p=0.25),
    "subsample": dict(mode="subsample", subsample_frac=0.4),
}


def _policy_gradient(dtype, kw, groups, only_steps=None):
    model, ref, traj, adv = _setup(dtype)
    cfg = EstimatorConfig(**{"micro_batch": 4, "clip_range": 0.05, **kw})
    ref_v = jagg.reference_velocities(ref, traj) if cfg.kl_beta else None
    model.zero_grad(set_to_none=True)
    st = jagg.policy_gradient(model, traj, adv, cfg, ref_velocities=ref_v, prompt_groups=groups,
                              generator=torch.Generator().manual_seed(5), only_steps=only_steps)
    return _grad(model), st


@pytest.mark.parametrize("groups", [GROUPS, None], ids=["prompt_groups", "per_sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_gradient_under_a_float64_default(default_dtype, case, dtype, groups):
    g32, st32 = _policy_gradient(dtype, CASES[case], groups)          # the usual float32 default
    default_dtype(torch.float64)
    g64, st64 = _policy_gradient(dtype, CASES[case], groups)
    assert g64.dtype == dtype
    assert bool(torch.isfinite(g64).all()) and float(g64.norm()) > 0
    assert st64.backward_items == st32.backward_items and st64.intervals_corrected == st32.intervals_corrected
    assert_close_on_scale(g64, g32, 1e-5 if dtype == torch.float32 else 1e-12)       # entries may cancel to ~0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_only_steps_under_a_float64_default(default_dtype, dtype):
    default_dtype(torch.float64)
    unbiased = CASES["unbiased"]
    full, _ = _policy_gradient(dtype, unbiased, GROUPS)
    parts = [_policy_gradient(dtype, unbiased, GROUPS, only_steps=r)[0] for r in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10])]
    assert all(bool(torch.isfinite(p).all()) for p in parts)
    assert_close_on_scale(sum(parts), full, 1e-4 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sampling_and_advantages_under_a_float64_default(default_dtype, dtype):
    _, _, t32, _ = _setup(dtype)
    r32 = jagg.group_advantages([0.1, 0.5, 0.2, 0.9, 0.4, 0.4], GROUPS)
    default_dtype(torch.float64)
    _, _, t64, _ = _setup(dtype)
    r64 = jagg.group_advantages([0.1, 0.5, 0.2, 0.9, 0.4, 0.4], GROUPS)
    for name in ("latents", "velocities", "log_probs", "sigmas"):
        a, b = getattr(t64, name), getattr(t32, name)
        assert a.dtype == dtype and bool(torch.isfinite(a).all()), name
        assert_close_on_scale(a, b, 1e-5 if dtype == torch.float32 else 1e-12, name)
    assert r64.dtype == r32.dtype and bool(torch.isfinite(r64).all())
    torch.testing.assert_close(r64, r32, rtol=0, atol=0)
    # tensors and numpy rewards in float64 too
    r_t = jagg.group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9, 0.4, 0.4], dtype=torch.float64), GROUPS)
    assert bool(torch.isfinite(r_t).all()) and r_t.abs().max() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", ["unbiased", "plain_interp", "shared", "shared_fresh_plain", "route_half_cosine",
                                  "exact"])
def test_audit_gradient_under_a_float64_default(default_dtype, dtype, case):
    def audit():
        model, _, traj, adv = _setup(dtype)
        cfg = EstimatorConfig(**{"micro_batch": 4, "clip_range": 0.05, **CASES[case]})
        return jagg.audit_gradient(model, traj, adv, cfg, list(model.parameters()), prompt_groups=GROUPS,
                                   generator=torch.Generator().manual_seed(3))
    a32 = audit()
    default_dtype(torch.float64)
    a64 = audit()
    for key in ("cos", "rel_err", "cos_noisy", "cos_middle", "cos_clean"):
        assert a64[key] == a64[key], key                                           # not NaN
        assert a64[key] == pytest.approx(a32[key], rel=1e-4 if dtype == torch.float32 else 1e-10, abs=1e-6), key
    if case == "exact":
        assert a64["cos"] == pytest.approx(1.0, abs=1e-6) and a64["rel_err"] < 1e-5
