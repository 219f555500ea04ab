import math

import pytest
import torch

import jagg
from jagg.sde import sde_mean, sde_std
from jagg.checks import check_sigmas


def test_flow_sigmas_match_sd3_schedule():
    s = jagg.flow_sigmas(4, shift=1.0, dtype=torch.float64)
    assert torch.allclose(s, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    s3 = jagg.flow_sigmas(4, shift=3.0, dtype=torch.float64)
    t = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    assert torch.allclose(s3, 3 * t / (1 + 2 * t))
    assert s3[0] == 1 and s3[-1] == 0
    gaps = s3[:-1] - s3[1:]
    assert gaps.max() / gaps.min() > 2  # non-uniform


@pytest.mark.parametrize("bad", [[1.0, 1.0, 0.0], [0.0, 0.5, 1.0], [1.5, 0.5, 0.0], [1.0]])
def test_check_sigmas_rejects_bad_schedules(bad):
    with pytest.raises(ValueError, match="sigmas"):
        check_sigmas(torch.tensor(bad))


def test_std_replaces_sigma_one_by_sigma_1():
    sig = torch.tensor([1.0, 0.8])
    std = sde_std(sig, sigma_one=0.8, eta=0.7)
    assert torch.allclose(std[0], 0.7 * torch.sqrt(torch.tensor(1.0 / 0.2)))
    assert torch.allclose(std[1], 0.7 * torch.sqrt(torch.tensor(0.8 / 0.2)))


def test_sde_step_log_prob_is_gaussian_density():
    torch.manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randn(3, 2, 4, 4, dtype=torch.float64)
    s, sn = torch.full((3,), 0.6, dtype=torch.float64), torch.full((3,), 0.45, dtype=torch.float64)
    xn, lp, mean, std = jagg.sde_step(x, v, s, sn, sigma_one=0.9, eta=0.7, reduction="sum")
    step_std = std * math.sqrt(0.15)
    ref = torch.distributions.Normal(mean, step_std.view(-1, 1, 1, 1)).log_prob(xn).flatten(1).sum(1)
    assert torch.allclose(lp, ref, atol=1e-10)
    _, lpm, _, _ = jagg.sde_step(x, v, s, sn, 0.9, 0.7, noise=(xn - mean) / step_std.view(-1, 1, 1, 1))
    assert torch.allclose(lpm, ref / 32, atol=1e-10)  # mean over the 32 latent dims


def test_sde_mean_formula_and_affine_in_v():
    x, v = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    s, sn = torch.tensor([0.7, 0.3], dtype=torch.float64), torch.tensor([0.5, 0.1], dtype=torch.float64)
    std = sde_std(s, 0.9, 0.5)
    dt = (sn - s)[:, None]
    sc, sd = s[:, None], std[:, None]
    expect = x * (1 + sd**2 / (2 * sc) * dt) + v * (1 + sd**2 * (1 - sc) / (2 * sc)) * dt
    assert torch.allclose(sde_mean(x, v, s, sn, std), expect)
    m0, m1, m2 = (sde_mean(x, a * v, s, sn, std) for a in (0.0, 1.0, 2.0))
    assert torch.allclose(m2 - m1, m1 - m0)


def test_bf16_velocity_computes_in_fp32():
    x = torch.randn(2, 8)
    v = torch.randn(2, 8).bfloat16()
    xn, lp, mean, _ = jagg.sde_step(x, v, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4]), 0.9, 0.7)
    assert xn.dtype == lp.dtype == mean.dtype == torch.float32
    assert jagg.euler_step(x, v, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4])).dtype == torch.float32


def test_euler_step():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    out = jagg.euler_step(x, v, torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25]))
    assert torch.allclose(out, x - 0.25 * v)


def test_select_train_steps():
    ts, mask = jagg.select_train_steps(10, timestep_fraction=0.6)
    assert ts.tolist() == list(range(6)) and mask.all()
    ts, mask = jagg.select_train_steps(10, sde_window=(2, 5))
    assert ts.tolist() == [2, 3, 4] and mask.tolist() == [False] * 2 + [True] * 3 + [False] * 5
    with pytest.raises(ValueError, match="sde_window"):
        jagg.select_train_steps(10, sde_window=(5, 12))
    with pytest.raises(ValueError, match="timestep_fraction"):
        jagg.select_train_steps(10, timestep_fraction=0.0)


def test_sde_window_rollout_uses_euler_outside_window():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    vf = lambda x, s, i: lin(x)
    ts, mask = jagg.select_train_steps(6, sde_window=(1, 3))
    sig = jagg.flow_sigmas(6)
    traj = jagg.sample_trajectories(vf, torch.randn(3, 4), sig, 0.7, ts, mask, torch.Generator().manual_seed(0))
    for k in (0, 3, 4, 5):  # deterministic steps
        expect = jagg.euler_step(traj.latents[:, k], traj.velocities[:, k], sig[k].expand(3), sig[k + 1].expand(3))
        assert torch.allclose(traj.latents[:, k + 1], expect)
        assert (traj.log_probs[:, k] == 0).all()
    assert traj.train_steps.tolist() == [1, 2]
    assert not torch.allclose(traj.latents[:, 2], jagg.euler_step(traj.latents[:, 1], traj.velocities[:, 1],
                                                                   sig[1].expand(3), sig[2].expand(3)))


# ----------------------------------------------------------------------------- SDE types


def _independent_moments(sde_type, x, v, s, sn, eta, sigma_one):
    """Mean and step std of each SDE type written out as its source writes it (scalars s, sn; float64)."""
    dt = sn - s
    if sde_type == "flow_grpo":        # Flow-GRPO: std_t = eta sqrt(s / (1 - s)), the marginal-preserving SDE
        std = eta * math.sqrt(s / (1 - (sigma_one if s == 1 else s)))
        return x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt, std * math.sqrt(-dt)
    if sde_type == "dance":            # DanceGRPO: Euler step plus the score term, constant noise eta sqrt(-dt)
        x0_hat = x - s * v
        score = -(x - x0_hat * (1 - s)) / s**2
        return x + dt * v + (-0.5 * eta**2 * score) * dt, eta * math.sqrt(-dt)
    std = sn * math.sin(eta * math.pi / 2)   # CPS: re-noise the predicted x0 to sn, keeping the coefficients
    x0_hat, x1_hat = x - s * v, x + (1 - s) * v
    return x0_hat * (1 - sn) + x1_hat * math.sqrt(sn**2 - std**2), std


@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("s,sn", [(1.0, 0.8), (0.6, 0.45), (0.2, 0.05)])
def test_sde_types_log_prob_against_an_independent_formula(sde_type, s, sn):
    torch.manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randn(3, 2, 4, 4, dtype=torch.float64)
    eta = 0.6
    S, SN = torch.full((3,), s, dtype=torch.float64), torch.full((3,), sn, dtype=torch.float64)
    xn, lp, mean, std = jagg.sde_step(x, v, S, SN, 0.8, eta, reduction="sum", sde_type=sde_type)
    mean_ref, step_std = _independent_moments(sde_type, x, v, s, sn, eta, 0.8)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(std, torch.full((3,), step_std / math.sqrt(s - sn), dtype=torch.float64))
    ref = torch.distributions.Normal(mean_ref, step_std).log_prob(xn).flatten(1).sum(1)
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-10)
    # the sample's spread is the step std: x_next - mean over many draws
    eps = (xn - mean) / step_std
    assert abs(float(eps.std()) - 1) < 0.25
    # the step_loss head uses the same log-prob: on-policy ratio 1, and its log_prob equals sde_step's (mean reduction)
    out = jagg.step_loss(v, x, xn, S, SN, 0.8, eta, lp / 32, torch.ones(3), 0.1, reduction="mean", sde_type=sde_type)
    torch.testing.assert_close(out.log_prob, lp / 32, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.ratio, torch.ones(3, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_sde_types_differ_and_are_affine_in_v():
    x, v = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    s, sn = torch.tensor([0.7, 0.3], dtype=torch.float64), torch.tensor([0.5, 0.1], dtype=torch.float64)
    means = {}
    for t in ("flow_grpo", "dance", "cps"):
        m0, m1, m2 = (jagg.sde_step(x, a * v, s, sn, 0.9, 0.5, noise=torch.zeros_like(x), sde_type=t)[2]
                      for a in (0.0, 1.0, 2.0))
        torch.testing.assert_close(m2 - m1, m1 - m0)        # JAGG's signal g = dl/dv needs only this
        means[t] = m1
    assert not torch.allclose(means["flow_grpo"], means["dance"]) and not torch.allclose(means["dance"], means["cps"])


def test_sde_type_validation():
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    s, sn = torch.tensor([0.5, 0.5]), torch.tensor([0.0, 0.0])
    with pytest.raises(ValueError, match="sde_type must be one of"):
        jagg.sde_step(x, v, s, sn, 0.9, 0.7, sde_type="ddim")
    with pytest.raises(ValueError, match="cps.*0 < eta <= 1"):
        jagg.sde_step(x, v, s, torch.tensor([0.4, 0.4]), 0.9, 1.5, sde_type="cps")
    with pytest.raises(ValueError, match="ODE step"):
        jagg.sde_step(x, v, s, sn, 0.9, 0.7, sde_type="cps")
    vf = lambda x, s, i: x * 0.1
    sig = jagg.flow_sigmas(6)
    with pytest.raises(ValueError, match="ODE step"):                    # every step SDE: the last goes to 0
        jagg.sample_trajectories(vf, torch.randn(2, 4), sig, 0.7, sde_type="cps")
    ts, mask = jagg.select_train_steps(6, sde_window=(0, 5))
    traj = jagg.sample_trajectories(vf, torch.randn(2, 4), sig, 0.7, ts, mask, sde_type="cps")
    assert traj.sde_type == "cps" and traj.select(torch.tensor([1])).sde_type == "cps"
    with pytest.raises(ValueError, match="sde_type must be one of"):
        jagg.sample_trajectories(vf, torch.randn(2, 4), sig, 0.7, sde_type="sde")


@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance", "cps"])
def test_rollout_log_probs_follow_the_sde_type(sde_type):
    """A rollout's stored log-probs are the Gaussian densities of its own steps under its SDE type."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    vf = lambda x, s, i: lin(x)
    ts, mask = jagg.select_train_steps(6, sde_window=(0, 5))
    sig = jagg.flow_sigmas(6, shift=3.0, dtype=torch.float64)
    traj = jagg.sample_trajectories(vf, torch.randn(3, 4, dtype=torch.float64), sig, 0.5, ts, mask,
                                    torch.Generator().manual_seed(0), sde_type=sde_type)
    for k in ts.tolist():
        x, xn = traj.latents[:, k], traj.latents[:, k + 1]
        mean, step_std = _independent_moments(sde_type, x, traj.velocities[:, k], float(sig[k]), float(sig[k + 1]), 0.5,
                                              float(sig[1]))
        ref = torch.distributions.Normal(mean, step_std).log_prob(xn).mean(1)
        torch.testing.assert_close(traj.log_probs[:, k], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance", "cps"])
def test_policy_gradient_under_each_sde_type(sde_type):
    """exact = the backward of a written-out loss (independent log-probs, PPO clip, KL) under that SDE; JAGG is exact
    on a model whose parameter-Jacobian is affine in sigma, whatever the SDE (the interpolation is of J alone)."""
    import copy

    from toy import AffineInSigma, Nonlinear, S, perturb, run

    torch.manual_seed(0)
    model = Nonlinear(batch=4)
    ref_model = copy.deepcopy(model)
    ts, mask = jagg.select_train_steps(7, sde_window=(0, 6))
    sig = jagg.flow_sigmas(7, shift=3.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    traj = jagg.sample_trajectories(model, torch.randn(4, *S, generator=g, dtype=torch.float64), sig, 0.6, ts, mask, g,
                                    sde_type=sde_type)
    perturb(model, 0.05)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    clip, beta = 0.02, 0.3
    ref_v = jagg.reference_velocities(ref_model, traj)
    got, _ = run(model, traj, adv, jagg.EstimatorConfig(mode="exact", micro_batch=3, clip_range=clip, kl_beta=beta),
                 ref_velocities=ref_v)
    model.zero_grad()
    total = 0.0
    for k in ts.tolist():
        x, xn, s, sn = traj.latents[:, k], traj.latents[:, k + 1], float(sig[k]), float(sig[k + 1])
        mean, step_std = _independent_moments(sde_type, x, model(x, sig[k].expand(4), torch.arange(4)), s, sn, 0.6,
                                              float(sig[1]))
        ref_mean, _ = _independent_moments(sde_type, x, ref_v[:, k], s, sn, 0.6, float(sig[1]))
        lp = torch.distributions.Normal(mean, step_std).log_prob(xn).flatten(1).mean(1)
        r = torch.exp(lp - traj.log_probs[:, k])
        kl = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * step_std**2 / (s - sn))
        total = total + (torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip)) + beta * kl).mean()
    (total / ts.numel()).backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    affine = AffineInSigma()
    traj = jagg.sample_trajectories(affine, torch.randn(4, *S, generator=g, dtype=torch.float64), sig, 0.6, ts, mask, g,
                                    sde_type=sde_type)
    perturb(affine, 0.05)
    ge, _ = run(affine, traj, adv, jagg.EstimatorConfig(mode="exact", clip_range=0.05))
    gj, _ = run(affine, traj, adv, jagg.EstimatorConfig(window=4, correction_p=0.0, intermediate="fresh",
                                                        clip_range=0.05))
    torch.testing.assert_close(gj, ge, rtol=1e-9, atol=1e-12)
