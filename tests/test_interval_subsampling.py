"""Interval subsampling (``interval_frac``, the JAGG authors' recipe): each sample trains a random ``m`` of its ``n``
intervals, weighted ``n / m``. Bit for bit the estimator before it at ``interval_frac=1``; in expectation the full
estimator (exact's gradient in mode exact, plain JAGG's without the correction, exact's with it), for every layout;
fewer rows; reproducible from the generator (float64 toys)."""

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg.knots import owners, plan_update
from gradient_checks import assert_matches_golden, assert_mean_is, assert_on_scale, golden_case
from toy import Nonlinear, perturb, run, sampled_traj

GOLDEN = Path(__file__).parent / "data" / "layouts_golden.pt"
# the file's shared_w3_fresh_route, adaptive_w4_interp and shared_w4_route_corrected used retired options (the 'chord'
# score, adaptive knots, correction_intervals)
LAYOUT_CASES = ["shared_w4_interp", "groups_w4_corrected", "shared_w4_corrected_mb2", "groups_w5_fresh_kl_corrected",
                "subsample_0.4"]
TIGHT = dict(rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_interval_frac_one_reproduces_every_layout_before_it(name):
    """interval_frac=1 (and no rates) gives every layout's gradient as the estimator gave it before these options
    existed: shared knots, the correction with its picks,
    chains split by micro_batch, subsampling (golden file written by tests/data/make_layouts_golden.py at f4a6ced)."""
    case = torch.load(GOLDEN)[name]
    model, ref, traj, adv = golden_case()
    ref_v = jagg.reference_velocities(ref, traj) if case["config"].get("kl_beta") else None
    cfg = EstimatorConfig(**{"intermediate": "interp", **case["config"]}, interval_frac=1.0,  # the default of its day
                          correction_probs=None)
    g, st = run(model, traj, adv, cfg, ref_velocities=ref_v, prompt_groups=[0, 0, 1, 1, 2, 2],
                generator=torch.Generator().manual_seed(3))
    assert_matches_golden(g, case["grad"])
    assert (st.backward_items, st.forward_nograd_items, st.intervals_corrected) == (
        case["backward_items"], case["forward_nograd_items"], case["intervals_corrected"])
    assert_on_scale(st.loss, case["loss"], float(adv.abs().mean()), 1e-12, "loss")     # a near-cancelling sum


def _case(B=3, T=12, seed=0):
    torch.manual_seed(seed)
    model = Nonlinear(batch=B)
    traj = sampled_traj(model, B=B, T=T)
    perturb(model, 0.05)
    adv = torch.linspace(-1.2, 1.5, B, dtype=torch.float64)
    return model, traj, adv


def test_a_fraction_that_draws_every_interval_is_the_full_estimator_bit_for_bit():
    """round(f n) = n draws nothing and weights 1: the same bits as interval_frac=1, and no random number used."""
    model, traj, adv = _case()
    for knots in ("groups", "shared"):
        base = dict(mode="jagg", window=4, knots=knots, correction_p=0.5, clip_range=0.05)
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        full, s1 = run(model, traj, adv, EstimatorConfig(**base), generator=g1)
        most, s2 = run(model, traj, adv, EstimatorConfig(**base, interval_frac=0.9), generator=g2)   # round(0.9 n) = n
        assert torch.equal(full, most) and s1.backward_items == s2.backward_items
        assert torch.equal(g1.get_state(), g2.get_state())
        assert s2.intervals_drawn == 3 * (3 if knots == "groups" else 4)            # groups 3 intervals, shared 4


def _all_draws(monkeypatch, B: int, n: int, m: int):
    """Make jagg.knots.draw return, call after call, every combination of m of n intervals per sample (each sample
    independently, as the draw is): the mean over them is the expectation over the draw, exactly."""
    combos = [torch.tensor([j in c for j in range(n)]) for c in itertools.combinations(range(n), m)]
    masks = [torch.stack(choice) for choice in itertools.product(combos, repeat=B)]
    it = iter(masks)
    monkeypatch.setattr(jagg.knots, "draw", lambda *args: next(it))
    return len(masks)


@pytest.mark.parametrize("knots, n", [("groups", 3), ("shared", 4)])
@pytest.mark.parametrize("mode", ["exact", "jagg"])
def test_the_mean_over_every_draw_is_the_full_estimator(monkeypatch, knots, n, mode):
    """Enumerating every draw of 2 of the n intervals per sample: the mean gradient is the full estimator's exactly
    (mode exact: the exact gradient; jagg: plain JAGG's full gradient, with routing too), so every term belongs to
    exactly one interval at weight n / m, shared knots included. A draw alone is not."""
    model, traj, adv = _case()
    extra = dict(jagg_frac=0.5) if mode == "jagg" and knots == "shared" else {}
    base = dict(mode=mode, window=4, knots=knots, correction_p=0.0, clip_range=0.05, **extra)
    full, _ = run(model, traj, adv, EstimatorConfig(**base))
    total = _all_draws(monkeypatch, 3, n, 2)
    grads = [run(model, traj, adv, EstimatorConfig(**base, interval_frac=2 / n))[0] for _ in range(total)]
    mean = torch.stack(grads).mean(0)
    assert torch.allclose(mean, full, **TIGHT)
    assert (grads[0] - full).norm() > 0.05 * full.norm()


def test_the_mean_over_every_draw_with_every_interval_corrected_is_exact(monkeypatch):
    """correction_p = 1 corrects every drawn interval: each draw is the exact gradient of the drawn intervals, and
    the mean over every draw is the exact gradient (groups and shared)."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    for knots, n in (("groups", 3), ("shared", 4)):
        total = _all_draws(monkeypatch, 3, n, 2)
        cfg = EstimatorConfig(mode="jagg", window=4, knots=knots, correction_p=1.0, interval_frac=2 / n,
                              clip_range=0.05)
        mean = torch.stack([run(model, traj, adv, cfg)[0] for _ in range(total)]).mean(0)
        assert torch.allclose(mean, exact, **TIGHT)


@pytest.mark.parametrize("knots", ["groups", "shared"])
def test_draws_from_the_generator_average_to_the_full_estimator(knots):
    """With the generator's own draws (and the correction's picks, with prompt groups): the mean over 300 draws is
    within a few standard errors of the full estimator: exact's gradient with the correction at p = 0.5, plain
    JAGG's without it; many standard errors from the other."""
    model, traj, adv = _case(B=4)
    groups = [0, 0, 1, 1]
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    base = dict(mode="jagg", window=4, knots=knots, clip_range=0.05)
    plain, _ = run(model, traj, adv, EstimatorConfig(**base, correction_p=0.0))
    gen = torch.Generator().manual_seed(0)
    for p, target, other in ((0.0, plain, exact), (0.5, exact, plain)):
        cfg = EstimatorConfig(**base, correction_p=p, interval_frac=0.5)
        grads = torch.stack([run(model, traj, adv, cfg, generator=gen, prompt_groups=groups)[0] for _ in range(300)])
        assert_mean_is(grads, target, other)


def test_exact_mode_draws_whole_step_ranges_and_rows_drop():
    """mode exact, interval_frac 0.5, step groups of 4 of 8 steps: each sample trains one whole step group (4 of its
    8 rows, each term at weight 2); JAGG's step groups cost 2 of 4 knot rows; shared knots (0, 3, 6, 9 of 10 steps)
    cost 3 or 4 knot rows for 2 of their 3 intervals, 3 when the two are neighbours (2 draws in 3)."""
    _, traj, _ = _case(B=8, T=8)
    gen = torch.Generator().manual_seed(2)
    plan = plan_update(traj, EstimatorConfig(mode="exact", window=4, interval_frac=0.5), generator=gen)
    per = {}
    for b in plan.bundles:
        assert len(b.rows) == 1 and b.terms[0].weights == [(0, 2.0)]
        per.setdefault(b.sample, []).append(b.rows[0])
    assert all(sorted(s) in ([0, 1, 2, 3], [4, 5, 6, 7]) for s in per.values()) and len(per) == 8
    assert len({tuple(sorted(s)) for s in per.values()}) == 2                   # fresh per sample
    assert plan.drawn == 8
    jg = plan_update(traj, EstimatorConfig(mode="jagg", window=4, interval_frac=0.5, correction_p=0.0), generator=gen)
    assert sum(len(b.rows) for b in jg.bundles) == 8 * 2 and jg.routed == jg.eligible == jg.drawn == 8
    rows, traj = [], _case(B=8, T=10)[1]
    for seed in range(40):
        sh = plan_update(traj, EstimatorConfig(mode="jagg", window=4, knots="shared", interval_frac=0.67,
                                               correction_p=0.0), generator=torch.Generator().manual_seed(seed))
        for i in range(8):
            mine = [b for b in sh.bundles if b.sample == i]
            rows.append(len({k for b in mine for k in b.rows}))
            terms = sorted(t.step for b in mine for t in b.terms)
            assert len(terms) == len(set(terms))                                # every term at most once
    assert set(rows) == {3, 4} and 3.0 < sum(rows) / len(rows) < 3.7           # 2/3 neighbours: 3.33 expected


def test_ownership_of_shared_knots():
    """Intervals sharing knots own (a, b], the first one [a, b]; step groups own their steps."""
    shared = [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7]]
    assert owners(shared, shared=True) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 2}
    assert owners([[0, 1, 2], [3, 4, 5]], shared=False) == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}


def test_a_drawn_interval_keeps_both_knot_rows_when_its_start_knot_is_not_trained():
    """Shared knots, the second of three intervals drawn alone: its rows are both its knots (3 and 6); the start
    knot's own term belongs to the undrawn first interval and is not trained; its end knot's is, at weight 3."""
    _, traj, _ = _case(B=1, T=8)
    cfg = EstimatorConfig(mode="jagg", window=4, knots="shared", interval_frac=0.34, correction_p=0.0)
    for seed in range(30):
        plan = plan_update(traj, cfg, generator=torch.Generator().manual_seed(seed))
        (b,) = plan.bundles
        if b.rows == [3, 6]:
            assert [t.step for t in b.terms] == [4, 5, 6]
            assert b.terms[-1].weights == [(1, 3.0)]
            return
    raise AssertionError("the middle interval was never drawn alone")


def test_routing_and_the_correction_count_drawn_intervals_only():
    model, traj, adv = _case(B=4)
    gen = torch.Generator().manual_seed(5)
    cfg = EstimatorConfig(mode="jagg", window=4, correction_p=1.0, interval_frac=0.34)     # 1 of 3 step groups
    _, st = run(model, traj, adv, cfg, generator=gen)
    assert (st.intervals_drawn, st.intervals, st.intervals_jagg, st.intervals_corrected) == (4, 4, 4, 4)
    assert st.backward_items == 4 * 4                                                  # 2 knots + 2 inner rows
    _, half = run(model, traj, adv, EstimatorConfig(mode="jagg", window=4, jagg_frac=0.5, correction_p=0.0,
                                                    interval_frac=0.67), generator=gen)
    assert half.intervals_drawn == 8 and half.intervals == 8 and half.intervals_jagg <= 6


def test_the_same_generator_gives_the_same_bits():
    model, traj, adv = _case(B=4)
    for knots in ("groups", "shared"):
        cfg = EstimatorConfig(mode="jagg", window=4, knots=knots, correction_p=0.5, interval_frac=0.5)
        a, _ = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(9))
        b, _ = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(9))
        c, _ = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(10))
        assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), "half"])
def test_interval_frac_is_validated(bad):
    with pytest.raises(ValueError, match="interval_frac"):
        EstimatorConfig(interval_frac=bad)


def test_interval_frac_is_refused_with_subsample():
    with pytest.raises(ValueError, match="interval_frac < 1 needs mode"):
        EstimatorConfig(mode="subsample", interval_frac=0.5)


def test_a_prompt_groups_samples_draw_the_same_intervals_so_their_terms_still_cancel():
    """With prompt_groups, the samples of a prompt group train the same intervals. Two identical samples with
    opposite advantages then cancel in every draw, as in the full estimator (GRPO's zero-sum advantages cancel the
    error a prompt group's samples share; drawn per sample, JAGG's per-sample error, ~10x the group's in the main job,
    did not cancel). Without prompt_groups each sample draws for itself."""
    model, traj, _ = _case(B=2)
    with torch.no_grad():
        model.cond[1] = model.cond[0]
    twins = traj.select(torch.tensor([0, 0]))
    opposite = torch.tensor([1.0, -1.0], dtype=torch.float64)
    cfg = EstimatorConfig(mode="jagg", window=4, knots="groups", interval_frac=0.5, clip_range=1e6,   # no clipping
                          correction_p=0.25)                    # the correction's picks are a prompt group's too
    full, _ = run(model, twins, opposite, dataclasses.replace(cfg, interval_frac=1.0), prompt_groups=[0, 0])
    one, _ = run(model, twins, torch.tensor([1.0, 0.0], dtype=torch.float64), cfg, prompt_groups=[0, 0],
                 generator=torch.Generator().manual_seed(0))
    assert one.norm() > 0 and full.norm() <= 1e-9 * one.norm()
    for seed in range(6):
        g, st = run(model, twins, opposite, cfg, prompt_groups=[0, 0], generator=torch.Generator().manual_seed(seed))
        assert g.norm() <= 1e-9 * one.norm() and st.backward_items > 0
    apart = [run(model, twins, opposite, cfg, generator=torch.Generator().manual_seed(seed))[0].norm()
             for seed in range(6)]
    assert max(apart) > 1e-3 * one.norm()
