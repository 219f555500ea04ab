"""Knot layouts (groups, shared), alpha by sigma or index, and unbiased JAGG: exactness facts (float64)."""

from pathlib import Path

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg.knots import plan_update, shared_knots
from gradient_checks import assert_matches_golden, assert_on_scale, golden_case
from toy import AffineInSigma, LinearXSigma, Nonlinear, perturb, run, sampled_traj, traj_from_latents

TIGHT = dict(rtol=1e-10, atol=1e-13)
GOLDEN = Path(__file__).parent / "data" / "groups_golden.pt"
# the file's w4_route_half routed by the retired 'chord' score; routing by the one score left is pinned in test_estimator
GOLDEN_NAMES = ["w4_interp", "w3_fresh", "w5_first_exact", "exact"]
# the golden file records each case's config as written at 3fb7ec0, where exact_first_intervals was still called so
GOLDEN_KEYS = {"exact_first_groups": "exact_first_intervals"}


def _golden_config(case: dict) -> dict:
    """The case's config as written, with the default of its day: inner velocities ``interp`` (the default is now
    ``auto``, which runs ``fresh`` in a call not known to be on-policy, as this perturbed model's is not)."""
    return {"intermediate": "interp", **{GOLDEN_KEYS.get(k, k): v for k, v in case["config"].items()}}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_groups_reproduce_the_estimator_before_knots(name):
    """knots='groups' (the default) gives the gradient of the estimator as it was before knots existed, to rounding
    (golden file written by tests/data/make_groups_golden.py at commit 3fb7ec0; bit for bit only on that machine)."""
    case = torch.load(GOLDEN)[name]
    model, ref, traj, adv = golden_case()
    ref_v = jagg.reference_velocities(ref, traj) if case["config"].get("kl_beta") else None
    g, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, **_golden_config(case)), ref_velocities=ref_v,
                prompt_groups=[0, 0, 1, 1, 2, 2])
    assert_matches_golden(g, case["grad"])
    assert st.backward_items == case["backward_items"] and st.forward_nograd_items == case["forward_nograd_items"]
    assert_on_scale(st.loss, case["loss"], float(adv.abs().mean()), 1e-12, "loss")     # a near-cancelling sum


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_comparison_survives_another_cpus_rounding_and_catches_a_real_error(name):
    """The golden comparison passes with 1e-15 relative noise on the stored gradients (what regenerating them on
    another CPU changes: ~1e-18 absolute) and fails on a 1e-6 relative change of one entry (a wrong weight)."""
    golden = torch.load(GOLDEN)[name]["grad"]
    noise = torch.randn(golden.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert_matches_golden(golden * (1 + 1e-15 * noise), golden)
    assert_matches_golden(golden + 1e-15 * float(golden.abs().max()) * noise, golden)
    wrong = golden.clone()
    i = int(golden.abs().argmax())
    wrong[i] *= 1 + 1e-6
    with pytest.raises(AssertionError):
        assert_matches_golden(wrong, golden)
    with pytest.raises(AssertionError):
        assert_matches_golden(golden * (1 + 1e-9), golden)


def test_shared_knot_positions_and_counts():
    assert shared_knots(10, 4) == [0, 3, 6, 9]
    assert shared_knots(8, 4) == [0, 3, 6, 7]
    assert shared_knots(5, 2) == [0, 1, 2, 3, 4]
    for K in range(1, 20):
        for W in range(3, 9):
            assert len(shared_knots(K, W)) == (1 if K == 1 else 1 + -(-(K - 1) // (W - 1)))


@pytest.mark.parametrize("knots", ["groups", "shared"])
@pytest.mark.parametrize("intermediate", ["interp", "fresh"])
def test_knots_at_every_step_give_exact_bit_for_bit(knots, intermediate):
    """window 1 or 2 puts a knot at every trained step: the estimate is the exact gradient, bit for bit."""
    torch.manual_seed(1)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=9)
    perturb(model, 0.05)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    ge, se = run(model, traj, adv, EstimatorConfig(mode="exact", micro_batch=5, clip_range=0.05))
    for w in (1, 2):
        gj, sj = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=w, knots=knots, intermediate=intermediate,
                                                         micro_batch=5, clip_range=0.05))
        assert torch.equal(gj, ge)
        assert sj.backward_items == se.backward_items == 4 * 9


def _linear_case(knot_steps, T=10, B=3, seed=0):
    """A model linear in (x, sigma), all weights trainable, on latents that are piecewise affine in sigma with the
    pieces joining at ``knot_steps`` (so affine in sigma between every two neighbouring knots, ends included)."""
    torch.manual_seed(seed)
    model = LinearXSigma()
    sig = jagg.flow_sigmas(T, shift=3.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    S = (2, 3, 3)
    lat = torch.randn(B, T + 1, *S, generator=g, dtype=torch.float64)     # knots (and x_T) random
    for a, b in zip(knot_steps[:-1], knot_steps[1:]):
        al = ((sig[a : b + 1] - sig[a]) / (sig[b] - sig[a])).view(1, -1, *([1] * len(S)))
        lat[:, a : b + 1] = (1 - al) * lat[:, a : a + 1] + al * lat[:, b : b + 1]
    traj = traj_from_latents(model, lat, sig, 0.7)
    perturb(model, 0.05)
    return model, traj


@pytest.mark.parametrize("intermediate", ["fresh", "interp"])
def test_shared_knots_exact_when_latents_affine_between_knots(intermediate):
    """Linear model, latents affine in sigma between the shared knots 0, 3, 6, 9: the shared-knot gradient is exact
    to 1e-10 in float64, with 4 rows per sample instead of 10 (groups of 4 would need 6)."""
    model, traj = _linear_case([0, 3, 6, 9])
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.3))
    gj, st = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, knots="shared", intermediate=intermediate,
                                                     clip_range=0.3))
    assert torch.allclose(gj, ge, rtol=1e-10, atol=1e-12)
    assert st.backward_items == 3 * 4
    gg, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, knots="groups", intermediate=intermediate,
                                                    clip_range=0.3))
    assert not torch.allclose(gg, ge, rtol=1e-4, atol=1e-8)      # groups' knots (0,3,4,7,8,9) are other knots


@pytest.mark.parametrize("knots", ["groups", "shared"])
def test_affine_in_sigma_model_is_exact_for_every_layout(knots):
    """theta_0 + sigma theta_1: J is affine in sigma everywhere, so any knots give the exact gradient (fresh)."""
    torch.manual_seed(4)
    model = AffineInSigma()
    traj = sampled_traj(model, B=3, T=11)
    perturb(model, 0.1)
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.3))
    for w in (3, 4, 6):
        gj, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=w, knots=knots, intermediate="fresh",
                                                        clip_range=0.3))
        assert torch.allclose(gj, ge, **TIGHT)


@pytest.mark.parametrize("knots", ["shared"])
def test_micro_batch_splits_chains_without_changing_the_gradient(knots):
    """A chain of shared knots longer than micro_batch is split into overlapping pieces: same gradient, a few more
    rows (the duplicated boundary knots)."""
    torch.manual_seed(5)
    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=13)
    adv = torch.tensor([1.0, -0.4, 0.7], dtype=torch.float64)
    big, sb = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, knots=knots, micro_batch=64))
    for mb in (2, 3):
        small, ss = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", window=4, knots=knots, micro_batch=mb))
        assert torch.allclose(small, big, **TIGHT)
        assert ss.backward_items > sb.backward_items == 3 * 5


def test_routing_with_shared_knots_decomposes():
    """jagg_frac 0 is exact, 1 routes every interval; in between each (sample, interval) is exact or JAGG and the
    routed count is round(frac x eligible)."""
    torch.manual_seed(6)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=10)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    g0, s0 = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", knots="shared", jagg_frac=0.0))
    assert torch.equal(g0, ge) and s0.intervals_jagg == 0 and s0.intervals == 12
    _, s1 = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", knots="shared", jagg_frac=1.0))
    assert s1.intervals_jagg == 12 and s1.backward_items == 4 * 4
    _, sh = run(model, traj, adv, EstimatorConfig(correction_p=0.0, mode="jagg", knots="shared", jagg_frac=0.5))
    assert sh.intervals_jagg == 6 and sh.backward_items == 4 * 4 + 6 * 2


def test_unbiased_jagg_is_exact_in_expectation_and_p1_is_exact():
    """correction_p = 1 corrects every interval: the exact gradient. At p = 0.5 the mean over many random picks
    converges to the exact gradient, while plain JAGG stays biased."""
    torch.manual_seed(7)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=8)
    perturb(model, 0.05)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    for knots in ("groups", "shared"):
        base = dict(mode="jagg", window=4, knots=knots, clip_range=0.05)
        g1, s1 = run(model, traj, adv, EstimatorConfig(**base, correction_p=1.0))
        assert torch.allclose(g1, ge, **TIGHT) and s1.intervals_corrected == s1.intervals_jagg > 0
        gj, _ = run(model, traj, adv, EstimatorConfig(correction_p=0.0, **base))
        gen = torch.Generator().manual_seed(0)
        runs = [run(model, traj, adv, EstimatorConfig(**base, correction_p=0.5), generator=gen) for _ in range(400)]
        mean = torch.stack([g for g, _ in runs]).mean(0)
        bias_plain, bias_unb = (gj - ge).norm() / ge.norm(), (mean - ge).norm() / ge.norm()
        assert bias_unb < 0.25 * bias_plain
        # the cost: p x the inner rows on average
        rows = sum(s.backward_items for _, s in runs) / len(runs)
        _, sj = run(model, traj, adv, EstimatorConfig(correction_p=0.0, **base))
        inner = 4 * 8 - sj.backward_items if knots == "shared" else 4 * 4
        assert rows == pytest.approx(sj.backward_items + 0.5 * inner, rel=0.1)


def test_correction_probs_limit_the_picks_to_the_noisiest():
    """What the retired correction_intervals=1 did: correction_probs [1, 0, 0] corrects only the first interval."""
    torch.manual_seed(8)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=12)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    cfg = EstimatorConfig(mode="jagg", window=4, correction_probs=[1.0, 0.0, 0.0])
    plan = plan_update(traj, cfg)
    corrected_steps = {t.step for b in plan.bundles for t in b.terms if not t.counted}
    assert corrected_steps == {1, 2} and plan.corrected == 4


def test_correction_picks_whole_grpo_groups():
    torch.manual_seed(9)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=8)
    cfg = EstimatorConfig(mode="jagg", window=4, correction_p=0.5)
    for seed in range(5):
        plan = plan_update(traj, cfg, torch.tensor([0, 0, 1, 1, 2, 2]), generator=torch.Generator().manual_seed(seed))
        picked = {(b.sample, t.step) for b in plan.bundles for t in b.terms if not t.counted}
        assert all((i ^ 1, k) in picked for i, k in picked)
        assert plan.corrected % 2 == 0


def test_only_steps_ranges_sum_to_the_full_gradient():
    torch.manual_seed(10)
    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=9)
    adv = torch.tensor([1.0, -0.4, 0.7], dtype=torch.float64)
    for cfg in (EstimatorConfig(mode="exact"), EstimatorConfig(correction_p=0.0, mode="jagg", knots="shared"),
                EstimatorConfig(correction_p=0.0, mode="jagg", window=4, intermediate="fresh")):
        full, _ = run(model, traj, adv, cfg)
        parts = [run(model, traj, adv, cfg, only_steps=r)[0] for r in ([0, 1, 2], [3, 4, 5], [6, 7, 8])]
        assert torch.allclose(sum(parts), full, **TIGHT)
    with pytest.raises(ValueError, match="only_steps"):
        run(model, traj, adv, EstimatorConfig(correction_p=0.0), only_steps=[42])


def test_config_rejects_bad_knot_options():
    for kw, msg in ((dict(knots="uniform"), "knots must be one of"), (dict(alpha="time"), "alpha must be one of"),
                    (dict(correction_p=1.5), "correction_p"), (dict(exact_first_intervals=-1), "exact_first_intervals"),
                    (dict(meter_every=-2), "meter_every"), (dict(meter_samples=1), "meter_samples")):
        with pytest.raises(ValueError, match=msg):
            EstimatorConfig(**kw)


def test_audit_compares_per_step_range_and_restores_grads():
    """audit_gradient: cosine 1 where JAGG is exact; on a nonlinear net the totals are the two estimators' full
    gradients; the parameters' .grad are left untouched."""
    torch.manual_seed(11)
    model = AffineInSigma()
    traj = sampled_traj(model, B=3, T=9)
    perturb(model, 0.1)
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = EstimatorConfig(correction_p=0.0, mode="jagg", window=4, knots="shared", intermediate="fresh", clip_range=0.3)
    a = jagg.audit_gradient(model, traj, adv, cfg, params)
    assert all(a[k] == pytest.approx(1.0, abs=1e-12) for k in ("cos", "cos_noisy", "cos_middle", "cos_clean"))
    assert a["rel_err"] < 1e-10 and a["rows"] > 0 and a["seconds"] > 0

    model = Nonlinear(batch=3)
    traj = sampled_traj(model, B=3, T=9)
    params = list(model.parameters())
    marker = [torch.full_like(p, 7.0) for p in params]
    for p, m in zip(params, marker):
        p.grad = m.clone()
    cfg = EstimatorConfig(correction_p=0.0, mode="jagg", window=4)
    a = jagg.audit_gradient(model, traj, adv, cfg, params)
    assert all(torch.equal(p.grad, m) for p, m in zip(params, marker))
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact"))
    gj, _ = run(model, traj, adv, cfg)
    assert a["cos"] == pytest.approx(torch.nn.functional.cosine_similarity(gj, ge, dim=0).item(), abs=1e-9)
    assert a["cos"] < 1 - 1e-6


def test_trainer_audit_logs_per_range_cosines_and_changes_nothing(tmp_path, tiny_ckpt):
    """estimator.meter_every=1: an `audit` record per iteration (cosines total and per third, rows, seconds) in
    metrics.jsonl; the trained weights are those of the same run without the audit."""
    import json

    from tiny_runs import tiny_train_args
    from jagg.cli import main
    from jagg.shapes.weights import load_model

    extra = ("estimator.window=3", "sample.num_steps=6", "eval.every=0", "estimator.meter_samples=2")
    for name, audit in (("plain", "0"), ("audited", "1")):
        assert main(tiny_train_args(tiny_ckpt, tmp_path / name, 2, *extra, f"estimator.meter_every={audit}")) == 0
    recs = [json.loads(l) for l in (tmp_path / "audited" / "metrics.jsonl").read_text().splitlines()]
    audits = [r for r in recs if r["kind"] == "audit"]
    assert [r["iteration"] for r in audits] == [1, 2]
    assert all({"cos", "cos_noisy", "cos_middle", "cos_clean", "rel_err", "rows", "seconds", "flagged"} <= set(r)
               for r in audits)
    a = load_model(str(tmp_path / "plain"), use_ema=False).state_dict()
    b = load_model(str(tmp_path / "audited"), use_ema=False).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_audit_flags_a_biased_estimator_far_from_exact():
    from jagg.audit import audit_flag

    low = {"cos": 0.9, "cos_noisy": 0.52, "cos_middle": 0.91, "cos_clean": 1.0}
    msg = audit_flag(low, EstimatorConfig(correction_p=0.0, mode="jagg"))
    assert msg and "noisy 0.52" in msg and "correction_p" in msg
    assert audit_flag(low, EstimatorConfig(mode="jagg", correction_p=0.25)) is None     # unbiased: noise, not bias
    assert audit_flag(low, EstimatorConfig(mode="exact")) is None
    assert audit_flag({"cos": 0.99, "cos_noisy": 0.95}, EstimatorConfig(correction_p=0.0, mode="jagg")) is None
