import math

import pytest
import torch

import jagg
from jagg.schedule import check_sigmas
from jagg.sde import sde_mean, sde_std


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
