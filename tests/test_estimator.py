"""Exactness and invariance of the gradient estimators (float64, tiny models)."""

import copy
import dataclasses
import math

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from gradient_checks import assert_on_scale
from toy import (AffineInSigma, LinearXSigma, Nonlinear, S, affine_latents, perturb, run, sampled_traj,
                 traj_from_latents)

TIGHT = dict(rtol=1e-9, atol=1e-12)


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def naive_loss(model, ref_model, traj, adv, clip, beta):
    """Flow-GRPO's loss written out independently: per-step Normal log-probs, PPO clip, KL; mean over steps."""
    B, sig = traj.batch_size, traj.sigmas
    total = 0.0
    for k in traj.train_steps.tolist():
        x, xn = traj.latents[:, k], traj.latents[:, k + 1]
        s, sn = float(sig[k]), float(sig[k + 1])
        std = traj.eta * math.sqrt(s / (1 - (float(sig[1]) if s == 1.0 else s)))
        dt = sn - s

        def mean_of(v):
            return x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt

        mean = mean_of(model(x, sig[k].expand(B), torch.arange(B)))
        lp = torch.distributions.Normal(mean, std * math.sqrt(-dt)).log_prob(xn).flatten(1).mean(1)
        r = torch.exp(lp - traj.log_probs[:, k])
        l = torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip)).mean()
        if beta:
            ref_mean = mean_of(ref_model(x, sig[k].expand(B), torch.arange(B)).detach())
            l = l + beta * (((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std**2)).mean()
        total = total + l
    return total / traj.train_steps.numel()


@pytest.mark.parametrize("micro_batch", [1, 3, 64])
def test_exact_equals_naive_flow_grpo_loss(micro_batch):
    torch.manual_seed(0)
    model = Nonlinear(batch=4)
    ref = copy.deepcopy(model)
    traj = sampled_traj(model, B=4, T=6)
    perturb(model, 0.05)  # off-policy: ratios != 1, some clipped
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    ref_v = jagg.reference_velocities(ref, traj, micro_batch=5)
    cfg = EstimatorConfig(mode="exact", micro_batch=micro_batch, clip_range=0.02, kl_beta=0.3)
    g, st = run(model, traj, adv, cfg, ref_velocities=ref_v)
    model.zero_grad()
    L = naive_loss(model, ref, traj, adv, 0.02, 0.3)
    L.backward()
    g_ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(g, g_ref, **TIGHT)
    assert_on_scale(st.loss, L.item(), float(adv.abs().mean()), 1e-9, "loss")
    assert 0 < st.clip_frac < 1 and st.kl > 0


def test_loss_scale_and_backward_context():
    model = Nonlinear(batch=2)
    traj = sampled_traj(model, B=2, T=4)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    calls = []

    import contextlib

    def ctx(last):
        calls.append(last)
        return contextlib.nullcontext()

    g1, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, micro_batch=2), backward_context=ctx)
    g2, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, micro_batch=2), loss_scale=0.25)
    assert torch.allclose(g2, 0.25 * g1, **TIGHT)
    assert calls == [False] * (st.backward_calls - 1) + [True]
    seen = []

    def engine_backward(loss):  # e.g. DeepSpeed's engine.backward
        assert loss.ndim == 0
        seen.append(loss)
        (2 * loss).backward()

    g3, st3 = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, micro_batch=2), backward_fn=engine_backward)
    assert len(seen) == st3.backward_calls and torch.allclose(g3, 2 * g1, **TIGHT)


@pytest.mark.parametrize("intermediate", ["fresh", "interp"])
def test_window_one_and_two_step_groups_are_exact(intermediate):
    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=8)
    perturb(model)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.2))
    for w in (1, 2):
        gj, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=w, intermediate=intermediate,
                                                       clip_range=0.2))
        assert torch.allclose(gj, ge, **TIGHT)
    # a trajectory trained on exactly two steps forms one 2-step group whatever the window
    traj.train_steps = torch.tensor([3, 4])
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.2))
    gj, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=8, intermediate=intermediate, clip_range=0.2))
    assert st.intervals == st.intervals_jagg == 0 and st.backward_items == 6  # 2-step groups run exact
    assert torch.allclose(gj, ge, **TIGHT)


def _affine_in_sigma_case(window):
    torch.manual_seed(1)
    model = AffineInSigma()
    return model, sampled_traj(model, B=3, T=16, shift=3.0)


def _linear_case(window):
    torch.manual_seed(2)
    model = LinearXSigma()
    sig = jagg.flow_sigmas(16, shift=3.0, dtype=torch.float64)
    return model, traj_from_latents(model, affine_latents(3, sig, window), sig, 0.7)


@pytest.mark.parametrize("case", [_affine_in_sigma_case, _linear_case], ids=["theta0+sigma*theta1", "linear"])
@pytest.mark.parametrize("window", [3, 4, 8])
@pytest.mark.parametrize("intermediate", ["fresh", "interp"])
def test_jagg_exact_when_jacobian_affine_in_sigma(case, window, intermediate):
    model, traj = case(window)
    ref = copy.deepcopy(model)
    ref_v = jagg.reference_velocities(ref, traj)
    perturb(model, 0.1)  # off-policy, so interp is not trivially exact and ratios are not 1
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    kw = dict(clip_range=0.05, kl_beta=0.1, micro_batch=4)
    ge, se = run(model, traj, adv, EstimatorConfig(mode="exact", **kw), ref_velocities=ref_v)
    gj, sj = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=window, intermediate=intermediate, **kw),
                 ref_velocities=ref_v)
    assert ge.abs().max() > 1e-3
    assert torch.allclose(gj, ge, **TIGHT)
    assert_on_scale(sj.loss, se.loss, float(adv.abs().mean()), 1e-9, "loss")
    assert sj.backward_items < se.backward_items


def test_index_based_alpha_would_fail():
    """The affine case pins alpha by sigma: the index-based alpha (alpha='index') on the shifted schedule breaks it."""
    model, traj = _affine_in_sigma_case(4)
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    gs, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, intermediate="fresh"))
    gj, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, intermediate="fresh", alpha="index"))
    assert torch.allclose(gs, ge, **TIGHT)
    assert not torch.allclose(gj, ge, rtol=1e-4, atol=1e-8)


def test_jagg_is_an_approximation_on_a_nonlinear_network(capsys):
    torch.manual_seed(3)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=16)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    for w in (4, 8):
        gj, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=w))
        c = cos(gj, ge)
        print(f"nonlinear MLP, window {w}: cosine(jagg, exact) = {c:.4f}")
        assert not torch.allclose(gj, ge, rtol=1e-3, atol=1e-6)
        assert 0.3 < c < 1 - 1e-6


def test_interp_equals_fresh_on_policy_and_differs_after_a_step():
    torch.manual_seed(4)
    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=12)
    adv = torch.tensor([1.0, -1.0, 0.7], dtype=torch.float64)
    cfg = dict(mode="jagg", window=4, clip_range=0.2)
    gf, sf = run(model, traj, adv, EstimatorConfig(correction_p=0.0, intermediate="fresh", **cfg))
    gi, si = run(model, traj, adv, EstimatorConfig(correction_p=0.0, intermediate="interp", **cfg))
    assert torch.allclose(gi, gf, rtol=1e-7, atol=1e-12)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.zero_grad()
    for p, gp in zip(model.parameters(), torch.split(gf, [p.numel() for p in model.parameters()])):
        p.grad = gp.view_as(p).clone()
    opt.step()
    gf, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, intermediate="fresh", **cfg))
    gi, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, intermediate="interp", **cfg))
    assert not torch.allclose(gi, gf, rtol=1e-5, atol=1e-10)
    assert cos(gi, gf) > 0.9


@pytest.mark.parametrize("window", [2, 4, 8])
@pytest.mark.parametrize("intermediate", ["fresh", "interp"])
def test_counts_match_cost_model(window, intermediate):
    model = Nonlinear(batch=4)
    B, T = 4, 16
    traj = sampled_traj(model, B=B, T=T)
    adv = torch.ones(B, dtype=torch.float64)
    _, se = run(model, traj, adv, EstimatorConfig(mode="exact", micro_batch=4))
    _, sj = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=window, intermediate=intermediate,
                                                  micro_batch=4))
    n_groups = T // window
    assert se.backward_items == se.forward_grad_items == B * T
    assert se.forward_nograd_items == 0 and se.backward_calls == B * T // 4
    assert sj.backward_items == sj.forward_grad_items == 2 * B * n_groups
    assert sj.forward_nograd_items == (B * n_groups * (window - 2) if intermediate == "fresh" else 0)
    eligible = B * n_groups if window > 2 else 0
    assert sj.intervals == sj.intervals_jagg == eligible and sj.jagg_frac_routed == (1.0 if window > 2 else 0.0)


def test_on_policy_ratio_is_one():
    torch.manual_seed(5)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=10)
    for mode in ("exact", "jagg"):
        _, st = run(model, traj, torch.randn(4, dtype=torch.float64), EstimatorConfig(correction_p=0.0, mode=mode, window=4))
        assert st.ratio_mean == pytest.approx(1.0, abs=1e-9)
        assert st.clip_frac == 0.0 and st.approx_kl < 1e-18


def test_fp32_rollout_ratio_is_one_within_tolerance():
    torch.manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Linear(19, 32), torch.nn.GELU(), torch.nn.Linear(32, 18))
    vf = lambda x, s, i: net(torch.cat([x.flatten(1), s[:, None]], 1)).view(-1, *S)
    traj = jagg.sample_trajectories(vf, torch.randn(6, *S), jagg.flow_sigmas(8, 3.0), 0.7, micro_batch=4)
    st = jagg.policy_gradient(vf, traj, torch.randn(6), EstimatorConfig(correction_p=0.0, mode="jagg", micro_batch=6, clip_range=1e-4))
    assert abs(st.ratio_mean - 1) < 1e-4 and st.clip_frac < 0.05


def test_routing_fraction_zero_is_exact_and_one_routes_all():
    torch.manual_seed(7)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=12)
    adv = torch.randn(4, dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    g0, s0 = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, jagg_frac=0.0))
    assert torch.allclose(g0, ge, **TIGHT) and s0.intervals_jagg == 0 and s0.backward_items == 4 * 12
    _, s1 = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, jagg_frac=1.0))
    assert s1.intervals_jagg == s1.intervals == 12 and s1.backward_items == 2 * 12


def test_routing_mid_fraction_picks_most_linear_groups():
    from jagg.knots import plan_update
    from jagg.knots import step_groups
    from jagg.routing import linearity_scores

    torch.manual_seed(8)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=12)
    cfg = EstimatorConfig(correction_p=0.0, mode="jagg", window=4, jagg_frac=0.5)
    plan = plan_update(traj, cfg)
    assert plan.eligible == 12 and plan.routed == 6
    intervals = step_groups(list(range(12)), 4)
    scores = linearity_scores(traj.velocities, intervals)
    routed = {(b.sample, b.rows[0] // 4) for b in plan.bundles if b.jagg}
    thresh = torch.sort(scores.flatten(), descending=True).values[5]
    assert all(scores[i, g] >= thresh for i, g in routed)
    assert all(scores[i, g] <= thresh for i in range(4) for g in range(3) if (i, g) not in routed)
    _, st = run(model, traj, torch.randn(4, dtype=torch.float64), cfg)
    assert st.backward_items == 6 * 2 + 6 * 4


def test_score_ranks_a_linear_group_above_a_curved_one():
    from jagg.routing import linearity_scores

    sig = jagg.flow_sigmas(8, dtype=torch.float64)
    v = torch.zeros(1, 8, 3, dtype=torch.float64)
    v[0, :4] = sig[:4, None] * torch.tensor([1.0, 2.0, 3.0])                 # linear in sigma
    v[0, 4:] = torch.stack([torch.tensor([1.0, 0, 0]), torch.tensor([0, 1.0, 0]),
                            torch.tensor([-1.0, 0, 0]), torch.tensor([0, -1.0, 0])])  # a curve
    s = linearity_scores(v, [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1]])
    assert s[0, 0] == pytest.approx(1.0) and s[0, 0] > s[0, 1] and s[0, 2] == torch.inf    # 2 steps: exact


def test_exact_first_and_last_groups():
    model = Nonlinear(batch=2)
    traj = sampled_traj(model, B=2, T=16)
    adv = torch.randn(2, dtype=torch.float64)
    _, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, exact_first_intervals=1, exact_last_intervals=1))
    assert st.intervals_jagg == 2 * 2 and st.backward_items == 2 * (4 + 4 + 2 + 2)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    gj, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, exact_first_intervals=4))
    assert torch.allclose(gj, ge, **TIGHT)


@pytest.mark.parametrize("kw,msg", [
    (dict(window=0), "window"), (dict(jagg_frac=1.5), "jagg_frac"), (dict(jagg_frac=-0.1), "jagg_frac"),
    (dict(mode="fast"), "mode"), (dict(intermediate="lerp"), "intermediate"),
    (dict(micro_batch=1), "micro_batch"), (dict(clip_range=0), "clip_range"), (dict(kl_beta=-1), "kl_beta"),
    (dict(clip_range=float("nan")), "clip_range must be a finite number"), (dict(kl_beta=float("inf")), "kl_beta"),
    (dict(jagg_frac="0.5"), "jagg_frac must be a finite number"), (dict(window=True), "window"),
])
def test_bad_config_raises(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EstimatorConfig(correction_p=0.0, **kw)


def test_bad_trajectories_raise():
    model = Nonlinear(batch=2)
    traj = sampled_traj(model, B=2, T=4)
    adv = torch.ones(2, dtype=torch.float64)
    cfg = EstimatorConfig(correction_p=0.0)
    bad = copy.copy(traj)
    bad.velocities = traj.velocities[:, :3]
    with pytest.raises(ValueError, match="velocities must have shape"):
        jagg.policy_gradient(model, bad, adv, cfg)
    bad = copy.copy(traj)
    bad.log_probs = traj.log_probs[:1]
    with pytest.raises(ValueError, match="log_probs"):
        jagg.policy_gradient(model, bad, adv, cfg)
    bad = copy.copy(traj)
    bad.sigmas = traj.sigmas.flip(0)
    with pytest.raises(ValueError, match="strictly decreasing"):
        jagg.policy_gradient(model, bad, adv, cfg)
    bad = copy.copy(traj)
    bad.train_steps = torch.tensor([0, 7])
    with pytest.raises(ValueError, match="train_steps"):
        jagg.policy_gradient(model, bad, adv, cfg)
    with pytest.raises(ValueError, match="advantages"):
        jagg.policy_gradient(model, traj, torch.ones(3), cfg)
    with pytest.raises(ValueError, match="ref_velocities"):
        jagg.policy_gradient(model, traj, adv, EstimatorConfig(correction_p=0.0, kl_beta=0.1))


@pytest.mark.parametrize("kw,err,msg", [
    (dict(velocity_fn=None), TypeError, "velocity_fn must be callable"),
    (dict(traj={"latents": 0}), TypeError, "traj must be a jagg.Trajectory"),
    (dict(config={"mode": "jagg"}), TypeError, "config must be a jagg.EstimatorConfig"),
    (dict(generator=5), TypeError, "generator must be a torch.Generator"),
    (dict(loss_scale=float("nan")), ValueError, "loss_scale must be a finite number"),
])
def test_bad_call_arguments_raise_before_any_work(kw, err, msg):
    model = Nonlinear(batch=2)
    args = dict(velocity_fn=model, traj=sampled_traj(model, B=2, T=4), advantages=torch.ones(2, dtype=torch.float64),
                config=EstimatorConfig())
    extra = {k: kw.pop(k) for k in ("generator", "loss_scale") if k in kw}
    args.update(kw)
    with pytest.raises(err, match=msg):
        jagg.policy_gradient(**args, **extra)
    assert all(p.grad is None for p in model.parameters())
    if "loss_scale" not in extra:
        with pytest.raises(err, match=msg):
            jagg.audit_gradient(**args, params=list(model.parameters()), **extra)


def test_sampling_records_no_graph():
    traj = sampled_traj(Nonlinear(batch=2), B=2, T=4)
    assert not (traj.latents.requires_grad or traj.velocities.requires_grad or traj.log_probs.requires_grad)


def _nan_below_half(x, sigma, index):
    v = -x.clone()
    if float(sigma[0]) < 0.6:
        v[index == 1] = float("nan")                  # sample 1 goes bad at sigma 0.5: step 2 of 4
    return v


@pytest.mark.parametrize("kw,err,msg", [
    (dict(noise=torch.randn(3)), ValueError, r"noise must have shape \[B, \*S\]"),
    (dict(noise=[[0.0, 1.0]]), TypeError, "noise must be a torch.Tensor"),
    (dict(noise=torch.full((2, 3), float("inf"))), ValueError, "noise contains NaN or infinity"),
    (dict(eta=float("nan")), ValueError, "eta must be a finite number > 0"),
    (dict(eta=0.0), ValueError, "eta must be a finite number > 0"),
    (dict(velocity=_nan_below_half), ValueError, r"non-finite at step 2.*samples \[1\]"),
])
def test_bad_sampling_inputs_raise(kw, err, msg):
    args = dict(velocity=lambda x, s, i: -x, noise=torch.randn(2, 3), eta=0.7)
    args.update(kw)
    with pytest.raises(err, match=msg):
        jagg.sample_trajectories(args["velocity"], args["noise"], jagg.flow_sigmas(4), eta=args["eta"])
    with pytest.raises(ValueError, match="shift must be a finite number"):
        jagg.flow_sigmas(4, shift=float("nan"))


def test_routing_whole_grpo_groups():
    """With prompt_groups, a prompt group's samples are routed together, by their mean score, and the gradient is
    the exact gradient of the unrouted groups plus the JAGG gradient of the routed ones."""
    from jagg.knots import plan_update
    from jagg.knots import route, step_groups
    from jagg.routing import linearity_scores

    torch.manual_seed(9)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=8)
    members = torch.tensor([0, 0, 1, 1, 2, 2])                   # three GRPO groups of two samples
    cfg = EstimatorConfig(correction_p=0.0, mode="jagg", window=4, jagg_frac=0.5)
    plan = plan_update(traj, cfg, members)
    routed = {(b.sample, b.rows[0] // 4) for b in plan.bundles if b.jagg}
    assert plan.eligible == 12 and plan.routed == 6                           # round(0.5 * 6 units) = 3 units x 2 samples
    for i, g in routed:
        assert (i ^ 1, g) in routed                                # the partner sample is routed alike
    intervals = step_groups(list(range(8)), 4)
    scores = linearity_scores(traj.velocities, intervals)
    unit = scores.view(3, 2, 2).mean(1)                           # [GRPO group, step group]
    expect = {(2 * u + k, g) for u, g in torch.nonzero(route(unit, 0.5, torch.ones(2, dtype=torch.bool)))
              .tolist() for k in (0, 1)}
    assert routed == {(int(i), int(g)) for i, g in expect}
    # the gradient decomposes: per (sample, step group), exact or JAGG
    adv = torch.randn(6, dtype=torch.float64)
    g_mixed, _ = run(model, traj, adv, cfg, prompt_groups=members)
    total = torch.zeros_like(g_mixed)
    for i in range(6):                                             # sample i alone: the others' advantages 0
        only = torch.zeros(6, dtype=torch.float64)
        only[i] = adv[i]
        for g in range(2):
            part = dataclasses.replace(traj, train_steps=torch.arange(4 * g, 4 * g + 4))
            mode = dict(mode="jagg", window=4) if (i, g) in routed else dict(mode="exact")
            gi, _ = run(model, part, only, EstimatorConfig(correction_p=0.0, **mode))
            total += gi * 4 / 8                                    # the loss averages over the K trained steps
    assert torch.allclose(g_mixed, total, **TIGHT)
    prompts = ["a", "a", "b", "b", "c", "c"]                      # any hashables work as group labels
    assert torch.equal(route(scores, 0.5, torch.ones(2, dtype=torch.bool), prompts),
                       route(scores, 0.5, torch.ones(2, dtype=torch.bool), members))
    with pytest.raises(ValueError, match="prompt_groups"):
        route(scores, 0.5, torch.ones(2, dtype=torch.bool), torch.zeros(5))


def test_bad_inputs_name_the_culprit():
    """Non-finite advantages name the sample; a broadcasting velocity names the function and both shapes, in
    policy_gradient and in sample_trajectories; advantages may be any array-like."""
    import numpy as np

    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=4)
    cfg = EstimatorConfig(correction_p=0.0, mode="jagg", window=4)
    with pytest.raises(ValueError, match="sample 1 has nan"):
        run(model, traj, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64), cfg)
    with pytest.raises(ValueError, match="sample 2 has inf"):
        run(model, traj, [1.0, 0.0, float("inf")], cfg)
    g_list, _ = run(model, traj, [1.0, -0.5, 0.2], cfg)
    g_np, _ = run(model, traj, np.array([1.0, -0.5, 0.2]), cfg)
    g_t, _ = run(model, traj, torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64), cfg)
    assert torch.equal(g_list, g_t) and torch.equal(g_np, g_t)
    with pytest.raises(TypeError, match=r"advantages \(one per sample, 3\) must be a tensor or an array-like"):
        run(model, traj, ["a", "b", "c"], cfg)

    def flat(x, sigma, idx):                     # [N, 1, 1, 1]: broadcasts silently over [N, 2, 3, 3]
        return model(x, sigma, idx).mean((1, 2, 3), keepdim=True)

    with pytest.raises(ValueError, match=r"flat.*\(3, 1, 1, 1\).*\(3, 2, 3, 3\)"):
        jagg.policy_gradient(flat, traj, [1.0, -0.5, 0.2], EstimatorConfig(mode="exact", micro_batch=3))
    with pytest.raises(ValueError, match=r"flat.*\(3, 1, 1, 1\).*\(3, 2, 3, 3\)"):
        jagg.sample_trajectories(flat, torch.randn(3, *S, dtype=torch.float64),
                                 jagg.flow_sigmas(4, dtype=torch.float64), 0.7)


def test_exact_last_intervals_counts_only_intervals_jagg_could_take():
    """Step groups of 3, 3, 3 and 1 steps: exact_last_intervals=1 makes the third interval exact (the 1-step one is exact
    anyway); micro_batch=1 is fine where no interval has inner steps (window 2)."""
    from jagg.knots import plan_update

    model = Nonlinear(batch=2)
    traj = sampled_traj(model, B=2, T=10)
    plan = plan_update(traj, EstimatorConfig(correction_p=0.0, mode="jagg", window=3, exact_last_intervals=1))
    jagg_steps = {b.rows[0] for b in plan.bundles if b.jagg}
    assert jagg_steps == {0, 3} and plan.eligible == 4 and plan.routed == 4
    ge, _ = run(model, traj, [1.0, -1.0], EstimatorConfig(mode="exact"))
    g2, _ = run(model, traj, [1.0, -1.0], EstimatorConfig(correction_p=0.0, mode="jagg", window=2, micro_batch=1))
    assert torch.allclose(g2, ge, **TIGHT)


def test_gradient_stats_documents_every_field():
    import dataclasses

    doc = jagg.GradientStats.__doc__
    assert all(f"{f.name}:" in doc for f in dataclasses.fields(jagg.GradientStats))
