"""How the tests judge a gradient: against another to a relative tolerance (:func:`assert_rel`), JAGG with 2-step
groups against exact on a real model (:func:`assert_window_two_is_exact`), against a golden file written on another
machine (:func:`golden_case`, :func:`assert_matches_golden`), and the mean of random draws against its expectation
(:func:`assert_mean_is`)."""

from __future__ import annotations

import copy

import torch

import jagg
from toy import Nonlinear, flat_grad, perturb, sampled_traj


def assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    """``||a - b|| <= tol ||b||``: fp32 gradients summed in a different order agree to ~1e-6 relative."""
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def assert_window_two_is_exact(model, v, traj) -> None:
    """On-policy (``traj`` sampled by ``v``) every ratio is 1 and nothing clips, and JAGG with groups of 2 steps (every
    trained step a knot) gives exact's gradient of ``model``: the exactness test every diffusers family passes."""
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = []
    for cfg in (jagg.EstimatorConfig(mode="exact", micro_batch=4),
                jagg.EstimatorConfig(correction_p=0.0, mode="jagg", window=2, micro_batch=4)):
        model.zero_grad(set_to_none=True)
        stats = jagg.policy_gradient(v, traj, adv, cfg)
        assert abs(stats.ratio_mean - 1.0) < 1e-5 and stats.approx_kl < 1e-10 and stats.clip_frac == 0.0
        out.append(flat_grad(model))
    assert out[0].norm() > 0
    assert_rel(out[1], out[0])


def golden_case():
    """The float64 toy the golden files of tests/data were written on: a perturbed policy, its reference (the model
    before the perturbation), 6 trajectories of 11 steps and their advantages."""
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    ref = copy.deepcopy(model)
    traj = sampled_traj(model, B=6, T=11)
    perturb(model, 0.05)
    return model, ref, traj, torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)


def assert_matches_golden(g, golden):
    """A gradient against one stored on another machine: float64, within ``rtol=1e-12`` of each entry plus ``1e-12``
    of the largest (another CPU's BLAS rounds differently, by ~1e-18 on |g| ~ 5e-3: never compare bit for bit
    across machines). A wrong weight or a dropped term moves the gradient by far more
    (tests/test_knots.py checks that it catches one)."""
    assert g.dtype == golden.dtype == torch.float64 and g.shape == golden.shape
    torch.testing.assert_close(g, golden, rtol=1e-12, atol=1e-12 * float(golden.abs().max()))


def chi2(grads: torch.Tensor, target: torch.Tensor) -> float:
    """``|mean - target|^2`` over the squared standard error of the mean (summed over coordinates): about 1 (often
    less: few effective directions) when the draws ``[N, P]`` have expectation ``target``."""
    n = grads.shape[0]
    return float(((grads.mean(0) - target) ** 2).sum() / (grads.var(0).sum() / n))


def z_toward(grads: torch.Tensor, target: torch.Tensor, other: torch.Tensor) -> float:
    """How far the draws' mean lies from ``target`` along the direction to ``other``, in standard errors: within a
    few when the expectation is ``target``; large when it is ``other``."""
    u = (other - target) / (other - target).norm()
    proj = grads @ u
    return float((proj.mean() - target @ u) / (proj.std() / grads.shape[0] ** 0.5))


def assert_mean_is(grads: torch.Tensor, target: torch.Tensor, other: torch.Tensor) -> None:
    """The draws average to ``target`` (within 4 standard errors in total and along the way to ``other``), and not
    to ``other`` (more than 10 standard errors away along that direction)."""
    assert chi2(grads, target) < 4
    assert abs(z_toward(grads, target, other)) < 4
    assert abs(z_toward(grads, other, target)) > 10


def assert_on_scale(got: float, want: float, scale: float, tol: float, what: str = "") -> None:
    """A near-cancelling number (a GRPO loss: advantages that sum to zero per prompt group times ratios of about 1)
    against another on the scale of its terms: ``|got - want| <= tol * scale``. Never at a relative tolerance: the sum
    cancels to a residual of rounding, which another CPU (or another process count) rounds differently."""
    err = abs(float(got) - float(want))
    assert err <= tol * scale, f"{what}: |{got} - {want}| = {err:.2e} > {tol:.0e} x {scale:.3g} (the terms' scale)"


def assert_close_on_scale(got: torch.Tensor, want: torch.Tensor, tol: float, msg: str = "") -> None:
    """Two tensors whose entries may cancel to rounding (gradients: sums of advantage-weighted terms): within ``tol``
    of each entry plus ``tol`` of the largest entry, so an entry that cancels to ~0 is judged on the tensor's scale."""
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()), msg=msg or None)
