"""``inner_clip``: how PPO's clip treats a JAGG interval's inner terms. ``step`` clips each term as exact does;
``none`` keeps them unclipped; ``group`` takes one decision per prompt group and inner step from the group's
advantage-weighted ratio. The knots' terms, every ratio and the KL stay exact's; exact mode and 2-step groups are
untouched; on-policy (nothing clipped) every variant is today's estimator. The off-policy cases are checked against
a loss written out term by term with the group decisions computed here, on a model whose parameter-Jacobian is affine
in sigma (JAGG is exact there), so a dropped, double-counted or wrongly decided term shows."""

import copy
import dataclasses

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg.knots import intervals_of
from jagg.sde import group_clip, step_moments, step_loss
from toy import AffineInSigma, Nonlinear, perturb, run, sampled_traj

TIGHT = dict(rtol=1e-9, atol=1e-12)
GROUPS = [0, 0, 0, 1, 1, 1]                                              # two prompt groups of three
ADV = torch.tensor([1.2, -0.4, -0.8, 0.9, 0.6, -1.5], dtype=torch.float64)   # zero-sum in each


def _case(model_cls, scale=0.1):
    """A rollout of 6 samples over 11 trained steps, then the model moved as an optimizer step would; the KL
    reference is the sampling model."""
    torch.manual_seed(0)
    model = model_cls() if model_cls is AffineInSigma else model_cls(batch=6)
    traj = sampled_traj(model, B=6, T=11)
    ref_v = jagg.reference_velocities(copy.deepcopy(model), traj)
    perturb(model, scale)
    return model, traj, ref_v


def _inner_steps(traj, window=4):
    return [k for iv in intervals_of(traj.train_steps.tolist(), "groups", window) for k in iv[1:-1]]


def _items(model, traj, ref_v):
    """Per (sample, trained step), with grad: the ratio ``r`` and the KL ``[B, K]``, written out per step."""
    B, sig = traj.batch_size, traj.sigmas
    ratios, kls = [], []
    for k in traj.train_steps.tolist():
        s, sn = sig[k].expand(B), sig[k + 1].expand(B)
        x, xn = traj.latents[:, k], traj.latents[:, k + 1]
        mean, step_std, std = step_moments(x, model(x, s, torch.arange(B)), s, sn, float(sig[1]), traj.eta)
        lp = jagg.sde.gaussian_log_prob(xn, mean, step_std)
        ratios.append(torch.exp(lp - traj.log_probs[:, k]))
        ref_mean = step_moments(x, ref_v[:, k], s, sn, float(sig[1]), traj.eta)[0]
        kls.append(((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std**2))
    return torch.stack(ratios, 1), torch.stack(kls, 1)


def _hand_gradient(model, traj, ref_v, eps, beta, keep, drop):
    """The gradient of the loss written out: PPO's clipped term where neither ``keep`` nor ``drop`` ``[B, K]`` says
    otherwise, the unclipped ``-A r`` where ``keep``, no policy term where ``drop``; the KL everywhere; the mean over
    samples and trained steps."""
    model.zero_grad(set_to_none=True)
    r, kl = _items(model, traj, ref_v)
    A = ADV[:, None]
    ppo = torch.maximum(-A * r, -A * r.clamp(1 - eps, 1 + eps))
    policy = torch.where(drop, torch.zeros_like(r), torch.where(keep, -A * r, ppo))
    (policy + beta * kl).mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def _ratios(model, traj, ref_v):
    with torch.no_grad():
        return _items(model, traj, ref_v)[0]


def _group_gains(r, inner):
    """``{(group, step): sum A (r - 1) / sum |A|}`` over the prompt groups ``GROUPS`` at the inner steps."""
    out = {}
    for k in inner:
        for g in set(GROUPS):
            idx = [i for i in range(6) if GROUPS[i] == g]
            gain = sum(float(ADV[i]) * (float(r[i, k]) - 1) for i in idx)
            out[g, k] = gain / sum(abs(float(ADV[i])) for i in idx)
    return out


def _hand_group_drops(model, traj, ref_v, eps, inner):
    """``[B, K]`` bool: the inner items whose prompt group's advantage-weighted ratio exceeds ``1 + eps`` at that
    step, computed here from the ratios of :func:`_items`; and PPO's own per-item drops at the same items."""
    r = _ratios(model, traj, ref_v)
    gains = _group_gains(r, inner)
    drop, ppo = torch.zeros_like(r, dtype=torch.bool), torch.zeros_like(r, dtype=torch.bool)
    for (g, k), gain in gains.items():
        for i in (i for i in range(6) if GROUPS[i] == g):
            drop[i, k] = gain > eps
            ppo[i, k] = float(ADV[i]) * (float(r[i, k]) - 1) > eps * abs(float(ADV[i]))
    return drop, ppo


def _group_eps(model, traj, ref_v, inner) -> float:
    """A clip range that splits the (group, inner step) decisions: just below the median of the positive gains."""
    positive = sorted(x for x in _group_gains(_ratios(model, traj, ref_v), inner).values() if x > 0)
    return positive[len(positive) // 2] * 0.999


def _mask(traj, steps):
    out = torch.zeros(traj.batch_size, traj.train_steps.numel(), dtype=torch.bool)
    out[:, steps] = True
    return out


@pytest.mark.parametrize("micro_batch", [2, 16])
@pytest.mark.parametrize("intermediate", ["auto", "fresh"])
def test_group_clip_off_policy_is_the_hand_written_loss(micro_batch, intermediate):
    """Off-policy, on a model where JAGG is exact: ``group`` gives the gradient of the loss written out with the group
    decisions computed here (inner terms of a dropped (prompt group, step) without policy term, the others unclipped;
    the knots PPO-clipped; the KL everywhere), whether a group's samples share a chunk or not; the decisions are mixed
    and differ from PPO's per-item ones, and today's ``step`` gives another gradient. Ratios (the clip fraction) and
    the KL are exact's."""
    model, traj, ref_v = _case(AffineInSigma)
    inner = _inner_steps(traj)
    eps, beta = _group_eps(model, traj, ref_v, inner), 0.3
    drop, ppo = _hand_group_drops(model, traj, ref_v, eps, inner)
    assert 0 < int(drop.sum()) < 6 * len(inner) and bool((drop != ppo)[:, inner].any())   # the test has teeth
    keep = _mask(traj, inner) & ~drop
    expected = _hand_gradient(model, traj, ref_v, eps, beta, keep, drop)
    cfg = EstimatorConfig(mode="jagg", window=4, intermediate=intermediate, inner_clip="group", clip_range=eps,
                          kl_beta=beta, micro_batch=micro_batch)
    g, st = run(model, traj, ADV, cfg, ref_velocities=ref_v, prompt_groups=GROUPS, on_policy=False)
    torch.testing.assert_close(g, expected, **TIGHT)
    g_step, st_step = run(model, traj, ADV, dataclasses.replace(cfg, inner_clip="step"), ref_velocities=ref_v,
                          prompt_groups=GROUPS, on_policy=False)
    assert (g - g_step).norm() > 1e-3 * g.norm()
    g_exact, st_exact = run(model, traj, ADV, cfg.exact(), ref_velocities=ref_v, on_policy=False)
    torch.testing.assert_close(g_step, g_exact, **TIGHT)                      # JAGG is exact on this model
    assert st.clip_frac == st_step.clip_frac == st_exact.clip_frac and st.kl == pytest.approx(st_exact.kl, rel=1e-12)
    knots_dropped = int(_knot_drops(model, traj, ref_v, eps, inner).sum())
    assert st.dropped_frac == pytest.approx((int(drop.sum()) + knots_dropped) / drop.numel(), abs=1e-12)


def _knot_drops(model, traj, ref_v, eps, inner):
    """``[B, K]`` PPO's own drops at the knots (every step not in ``inner``)."""
    r = _ratios(model, traj, ref_v)
    out = ADV[:, None] * (r - 1) > eps * ADV.abs()[:, None]
    out[:, inner] = False
    return out


def test_no_inner_clip_off_policy_is_the_hand_written_loss():
    """``none``: every inner term unclipped, the knots PPO-clipped, on the same model and clip range as above."""
    model, traj, ref_v = _case(AffineInSigma)
    inner = _inner_steps(traj)
    eps = _group_eps(model, traj, ref_v, inner)
    none = torch.zeros(6, traj.train_steps.numel(), dtype=torch.bool)
    expected = _hand_gradient(model, traj, ref_v, eps, 0.3, _mask(traj, inner), none)
    cfg = EstimatorConfig(mode="jagg", window=4, inner_clip="none", clip_range=eps, kl_beta=0.3, micro_batch=2)
    g, st = run(model, traj, ADV, cfg, ref_velocities=ref_v, prompt_groups=GROUPS, on_policy=False)
    torch.testing.assert_close(g, expected, **TIGHT)
    assert st.dropped_frac == pytest.approx(int(_knot_drops(model, traj, ref_v, eps, inner).sum()) / none.numel())


def test_corrected_inner_steps_share_their_groups_decision():
    """Unbiased JAGG with every unit corrected (``correction_p`` 1) runs each inner step's own row at weight 1 and its
    interpolated copy at 0: with ``group`` its gradient is the hand-written loss's with exact Jacobians, on a
    nonlinear model. An own row clipped by PPO's rule instead of its group's decision would not match."""
    model, traj, ref_v = _case(Nonlinear)
    inner = _inner_steps(traj)
    eps = _group_eps(model, traj, ref_v, inner)
    drop, ppo = _hand_group_drops(model, traj, ref_v, eps, inner)
    assert bool((drop != ppo)[:, inner].any())
    expected = _hand_gradient(model, traj, ref_v, eps, 0.0, _mask(traj, inner) & ~drop, drop)
    cfg = EstimatorConfig(mode="jagg", window=4, correction_p=1.0, inner_clip="group", clip_range=eps, micro_batch=3)
    g, st = run(model, traj, ADV, cfg, prompt_groups=GROUPS, on_policy=False, generator=torch.Generator().manual_seed(0))
    assert st.intervals_corrected == st.intervals_jagg > 0
    torch.testing.assert_close(g, expected, **TIGHT)


@pytest.mark.parametrize("inner_clip", ["none", "group"])
@pytest.mark.parametrize("intermediate", ["auto", "interp", "fresh"])
def test_on_policy_every_variant_is_todays(inner_clip, intermediate):
    """On-policy nothing is clipped (every ratio is 1 to rounding): every variant is today's estimator, gradient and
    statistics, on a nonlinear model with micro-batches that split the prompt groups."""
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=11)
    base = EstimatorConfig(mode="jagg", window=4, intermediate=intermediate, micro_batch=3)
    g0, st0 = run(model, traj, ADV, base, prompt_groups=GROUPS, on_policy=True)
    g, st = run(model, traj, ADV, dataclasses.replace(base, inner_clip=inner_clip), prompt_groups=GROUPS,
                on_policy=True)
    assert st0.clip_frac == 0 and st0.intervals_jagg > 0
    torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-15)
    assert st.to_dict() == st0.to_dict()


@pytest.mark.parametrize("inner_clip", ["none", "group"])
def test_exact_mode_and_two_step_groups_are_untouched(inner_clip):
    """Exact mode and JAGG with window 2 have no inner terms: ``inner_clip`` changes nothing, bit for bit, off-policy
    where PPO clips."""
    model, traj, ref_v = _case(Nonlinear)
    for cfg in (EstimatorConfig(mode="exact", clip_range=1e-3), EstimatorConfig(mode="jagg", window=2, clip_range=1e-3)):
        g0, st0 = run(model, traj, ADV, cfg, prompt_groups=GROUPS, on_policy=False)
        g, st = run(model, traj, ADV, dataclasses.replace(cfg, inner_clip=inner_clip), prompt_groups=GROUPS,
                    on_policy=False)
        assert st0.clip_frac > 0 and torch.equal(g, g0) and st.to_dict() == st0.to_dict()


def test_group_without_prompt_groups_is_step():
    """Without ``prompt_groups`` each sample is its own group, and the group rule is PPO's: ``group`` = ``step``."""
    model, traj, ref_v = _case(Nonlinear)
    eps = _group_eps(model, traj, ref_v, _inner_steps(traj))
    cfg = EstimatorConfig(mode="jagg", window=4, clip_range=eps, micro_batch=4)
    g0, st0 = run(model, traj, ADV, cfg, on_policy=False)
    g, st = run(model, traj, ADV, dataclasses.replace(cfg, inner_clip="group"), on_policy=False)
    assert st0.dropped_frac > 0
    torch.testing.assert_close(g, g0, **TIGHT)
    assert st.dropped_frac == st0.dropped_frac and st.forward_nograd_items == st0.forward_nograd_items


def test_group_clip_gradients_of_disjoint_step_ranges_sum_to_the_whole():
    """The decisions are per (prompt group, step), so ``only_steps`` ranges sum to the full gradient."""
    model, traj, ref_v = _case(Nonlinear)
    eps = _group_eps(model, traj, ref_v, _inner_steps(traj))
    cfg = EstimatorConfig(mode="jagg", window=4, inner_clip="group", clip_range=eps, micro_batch=3)
    kw = dict(prompt_groups=GROUPS, on_policy=False)
    whole = run(model, traj, ADV, cfg, **kw)[0]
    parts = run(model, traj, ADV, cfg, only_steps=range(0, 5), **kw)[0] + run(model, traj, ADV, cfg,
                                                                               only_steps=range(5, 11), **kw)[0]
    torch.testing.assert_close(parts, whole, **TIGHT)


def test_group_clip_rule():
    """One item per group is PPO's rule (the gradient of the clipped term is zero exactly where it drops); a group is
    dropped or kept whole, by its advantage-weighted ratio."""
    torch.manual_seed(0)
    ratio = (1 + 0.02 * torch.randn(200, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(200, dtype=torch.float64)
    drop = group_clip(ratio.detach(), adv, torch.arange(200), 0.01)
    torch.maximum(-adv * ratio, -adv * ratio.clamp(0.99, 1.01)).sum().backward()
    assert 20 < int(drop.sum()) < 180 and torch.equal(drop, ratio.grad == 0)
    r = torch.tensor([1.03, 1.0, 0.99, 1.0, 1.0, 1.05], dtype=torch.float64)
    a = torch.tensor([1.0, -0.5, -0.5, 2.0, -1.0, -1.0], dtype=torch.float64)
    # group 0: gain 0.03 + 0 + 0.005 = 0.035 against eps * sum|A| = 0.04 (kept; PPO alone would drop item 0) or
    # 0.034 (dropped); group 1: gain -0.05, kept
    assert not group_clip(r, a, torch.tensor([0, 0, 0, 1, 1, 1]), 0.02).any()
    assert group_clip(r, a, torch.tensor([0, 0, 0, 1, 1, 1]), 0.017).tolist() == [True] * 3 + [False] * 3


def test_step_loss_clip_decisions():
    """``clip_decision`` per item: PPO's own, kept unclipped (``-A r`` and its gradient) or dropped (the same value,
    no policy gradient); the KL term keeps its gradient either way."""
    torch.manual_seed(1)
    n, S = 3, (2, 3)
    v = torch.randn(n, *S, dtype=torch.float64, requires_grad=True)
    x, xn = torch.randn(n, *S, dtype=torch.float64), torch.randn(n, *S, dtype=torch.float64)
    sig, sn = torch.full((n,), 0.8, dtype=torch.float64), torch.full((n,), 0.6, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    args = (x, xn, sig, sn, 0.9, 0.7, torch.full((n,), -2.0, dtype=torch.float64), adv, 1e-3, 0.5,
            torch.zeros(n, *S, dtype=torch.float64))
    own = step_loss(v, *args)
    out = step_loss(v, *args, clip_decision=torch.tensor([-1, 0, 1], dtype=torch.int8))
    assert out.loss[0].item() == own.loss[0].item()
    assert out.loss[1].item() == pytest.approx((-adv[1] * out.ratio[1] + 0.5 * out.kl[1]).item(), rel=1e-12)
    assert out.loss[2].item() == pytest.approx((-adv[2] * out.ratio[2] + 0.5 * out.kl[2]).item(), rel=1e-12)
    assert out.dropped.tolist() == [bool(own.dropped[0]), False, True]
    no_policy = step_loss(v, *args[:7], torch.zeros(n, dtype=torch.float64), *args[8:])      # A = 0: the KL alone
    unclipped = step_loss(v, *args[:8], 1e9, *args[9:])                                   # PPO never clipping
    for item, reference in ((2, no_policy), (1, unclipped)):
        (g,) = torch.autograd.grad(out.loss[item], v, retain_graph=True)
        (g_ref,) = torch.autograd.grad(reference.loss[item], v, retain_graph=True)
        assert g_ref.abs().sum() > 0
        torch.testing.assert_close(g, g_ref, **TIGHT)


def test_bad_inner_clip_is_refused():
    with pytest.raises(ValueError, match="inner_clip must be one of"):
        EstimatorConfig(inner_clip="groups")
