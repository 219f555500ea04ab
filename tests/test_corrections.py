"""The cheaper unbiased corrections beside ``correction_p``'s whole-interval one: one random inner step
(``correction="step"``), per-interval rates (``correction_rates``, :func:`jagg.knots.budget_rates`) and the control
variate (``control_variate``, :class:`jagg.CorrectionState`). Each: the mean of many draws is exact, rate 1 is exact
where it applies, the same generator gives the same bits (float64 toys)."""

import copy
import math

import pytest
import torch

import jagg
from jagg import CorrectionState, EstimatorConfig
from jagg.knots import budget_rates
from test_bench import bench_ckpt, efficiency_sets  # noqa: F401  (the tiny random TinyDiT fixture)
from test_interval_subsampling import assert_mean_is
from toy import Nonlinear, perturb, run, sampled_traj

TIGHT = dict(rtol=1e-10, atol=1e-13)


def _case(B=4, T=12, seed=0, adv=None):
    torch.manual_seed(seed)
    model = Nonlinear(batch=B)
    traj = sampled_traj(model, B=B, T=T)
    perturb(model, 0.05)
    adv = torch.linspace(-1.2, 1.5, B, dtype=torch.float64) if adv is None else adv
    return model, traj, adv


def _base(**kw):
    return {"mode": "jagg", "window": 4, "clip_range": 0.05, **kw}


def _draws(model, traj, adv, cfg, n, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([run(model, traj, adv, cfg, generator=gen, **kw)[0] for _ in range(n)])


# ----------------------------------------------------------------------------- one random inner step


@pytest.mark.parametrize("knots", ["groups", "shared"])
def test_step_correction_with_one_inner_step_at_rate_one_is_exact(knots):
    """W = 3: an interval's one inner step is the whole interval, so correction='step' at p = 1 is exact."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    g, st = run(model, traj, adv, EstimatorConfig(**_base(window=3, knots=knots, correction="step", correction_p=1.0)),
                generator=torch.Generator().manual_seed(0))
    assert torch.allclose(g, exact, **TIGHT) and st.intervals_corrected == st.intervals_jagg > 0


@pytest.mark.parametrize("p", [1.0, 0.5])
def test_step_correction_is_exact_in_expectation(p):
    """W = 4 (two inner steps): one draw is not exact, the mean of 300 is; a corrected interval runs one row."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    plain, sp = run(model, traj, adv, EstimatorConfig(**_base(correction_p=0.0)))
    cfg = EstimatorConfig(**_base(correction="step", correction_p=p))
    g1, st = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(g1, exact, rtol=1e-4, atol=1e-8)
    assert st.backward_items == sp.backward_items + st.intervals_corrected          # one row per correction
    assert_mean_is(_draws(model, traj, adv, cfg, 300, prompt_groups=[0, 0, 1, 1]), exact, plain)


def test_step_correction_takes_one_step_per_unit():
    """With prompt groups a picked unit's samples all correct the same inner step (their shared error keeps
    cancelling in their zero-sum advantages); different units and draws take different steps."""
    from jagg.knots import plan_update

    _, traj, _ = _case(B=8)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    cfg = EstimatorConfig(**_base(correction="step", correction_p=1.0))
    seen = set()
    for seed in range(6):
        plan = plan_update(traj, cfg, groups, generator=torch.Generator().manual_seed(seed))
        fixed = {}                                          # (sample, step group) -> the corrected step (own row)
        for b in plan.bundles:
            for t in b.terms:
                if b.rows == [t.step] and t.weights[0][1] == 2.0:
                    fixed[(b.sample, t.step // 4)] = t.step
        assert len(fixed) == 8 * 3
        assert all(fixed[(i, j)] == fixed[(i ^ 1, j)] for i, j in fixed)
        seen |= {tuple(fixed[(i, j)] for i in range(0, 8, 2)) for j in range(3)}
    assert len(seen) > 3


def _inner_errors(model, traj, adv, window=4):
    """``d[u][j]``: per sample u and step group j, the inner steps' errors (exact - interpolated term) as vectors:
    each sample's advantage alone (the others' 0), each inner step alone (``only_steps``)."""
    B, K = traj.batch_size, traj.train_steps.numel()
    groups = [list(range(a, min(a + window, K))) for a in range(0, K, window)]
    out = []
    for u in range(B):
        a = torch.zeros_like(adv)
        a[u] = adv[u]
        out.append([[run(model, traj, a, EstimatorConfig(mode="exact", clip_range=0.05), only_steps=[k])[0]
                     - run(model, traj, a, EstimatorConfig(**_base(correction_p=0.0)), only_steps=[k])[0]
                     for k in iv[1:-1]] for iv in groups if len(iv) > 2])
    return out


def test_step_correction_has_the_variance_design_gives():
    """At q = 1 (every interval corrected, only the step is random) E|g - exact|^2 = sum over units of
    |I| sum_k |d_k|^2 - |D|^2 (docs/design.md §3.5), against 400 draws."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    d = _inner_errors(model, traj, adv)
    predicted = sum(len(ks) * sum(float(x @ x) for x in ks) - float(sum(ks) @ sum(ks)) for unit in d for ks in unit)
    grads = _draws(model, traj, adv, EstimatorConfig(**_base(correction="step", correction_p=1.0)), 400)
    measured = float(((grads - exact) ** 2).sum(1).mean())
    assert measured == pytest.approx(predicted, rel=0.15)


# ----------------------------------------------------------------------------- per-interval rates


def test_rates_of_one_everywhere_are_exact_and_a_zero_rate_leaves_plain_jagg_there():
    """correction_rates [1, 1, 1] (three step groups of 4) is exact; [0.5, 0, 1] corrects the first and the last step
    group and leaves the middle one plain: its mean over draws is exact on steps 0-3 and 8-11, plain JAGG on 4-7."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    g1, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_rates=[1.0, 1.0, 1.0])),
                generator=torch.Generator().manual_seed(0))
    assert torch.allclose(g1, exact, **TIGHT)
    middle = list(range(4, 8))
    ex_mid, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05), only_steps=middle)
    plain_mid, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_p=0.0)), only_steps=middle)
    target = exact - ex_mid + plain_mid
    cfg = EstimatorConfig(**_base(correction_rates=[0.5, 0.0, 1.0]))
    grads = _draws(model, traj, adv, cfg, 300)
    assert_mean_is(grads, target, exact)
    st = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(3))[1]
    assert st.intervals_corrected == 2 + 4                                 # half of the first group's, all the last's


def test_rates_must_fit_the_layout_and_be_probabilities():
    model, traj, adv = _case()
    with pytest.raises(ValueError, match="correction_rates has 2 rates.*3 intervals"):
        run(model, traj, adv, EstimatorConfig(**_base(correction_rates=[0.5, 0.5])))
    for bad, match in (([1.5], r"correction_rates\[0\]"), ([], "non-empty"), ("0.5", "non-empty"),
                       ([0.2, float("nan")], r"correction_rates\[1\]")):
        with pytest.raises(ValueError, match=match):
            EstimatorConfig(correction_rates=bad)
    with pytest.raises(ValueError, match="correction must be one of"):
        EstimatorConfig(correction="half")
    # exact mode ignores rates laid out for JAGG's intervals (K single steps there)
    run(model, traj, adv, EstimatorConfig(mode="exact", correction_rates=[0.5, 0.5]))


def test_budget_rates_minimise_the_variance_at_the_budget():
    D, r = [4.0, 1.0, 0.0], [2.0, 2.0, 2.0]
    p = budget_rates(D, r, 2.0)
    assert p == pytest.approx([2 / 3, 1 / 3, 0.0]) and sum(a * b for a, b in zip(p, r)) == pytest.approx(2.0)
    cost = lambda q: sum((1 / x - 1) * d for x, d in zip(q, D) if d > 0)
    grid = [(x, (2.0 - 2 * x) / 2) for x in (i / 1000 for i in range(1, 1000)) if 0 < (2.0 - 2 * x) / 2 <= 1]
    best = min(grid, key=lambda q: cost(q))
    assert cost(p) <= cost(best) + 1e-9 and p[0] == pytest.approx(best[0], abs=2e-3)
    assert budget_rates([100.0, 1.0], [1.0, 1.0], 1.5) == pytest.approx([1.0, 0.5])       # capped, budget passed on
    assert budget_rates([3.0, 1.0], [2.0, 1.0], 10.0) == [1.0, 1.0]
    assert budget_rates([0.0, 0.0], [2.0, 2.0], 1.0) == [0.0, 0.0]
    assert budget_rates([2.0, -0.1], [2.0, 0.0], 1.0) == pytest.approx([0.5, 0.0])
    for args, match in ((([1.0], [1.0, 2.0], 1.0), "one error per interval"), (([1.0], [-1.0], 1.0), ">= 0"),
                        (([math.nan], [1.0], 1.0), "finite")):
        with pytest.raises(ValueError, match=match):
            budget_rates(*args)


# ----------------------------------------------------------------------------- the control variate


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_control_variate_needs_its_state():
    model, traj, adv = _case()
    with pytest.raises(ValueError, match="correction_state=jagg.CorrectionState"):
        run(model, traj, adv, EstimatorConfig(**_base(control_variate=0.5)))
    with pytest.raises(ValueError, match="only with config.control_variate > 0"):
        run(model, traj, adv, EstimatorConfig(**_base()), correction_state=CorrectionState(_params(model)))
    with pytest.raises(TypeError, match="CorrectionState"):
        run(model, traj, adv, EstimatorConfig(**_base(control_variate=0.5)), correction_state={})
    with pytest.raises(ValueError, match="needs a correction"):
        EstimatorConfig(control_variate=0.5, correction_p=0.0)
    with pytest.raises(ValueError, match="control_variate must be in"):
        EstimatorConfig(control_variate=1.5)


def test_rate_one_is_exact_and_measures_the_mean_correction():
    """p = 1: every interval corrected, the control variate cancels (c + (D - c)): exact. Its measurement is each
    step group's mean correction over the samples, in units of one term's weight: (exact - plain JAGG) on that step
    group's inner steps, divided by B x term weight."""
    model, traj, adv = _case()
    B, K = 4, 12
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    state = CorrectionState(_params(model))
    cfg = EstimatorConfig(**_base(correction_p=1.0, control_variate=1.0))
    for _ in range(2):                                    # the second call adds the first one's means, and cancels them
        g, st = run(model, traj, adv, cfg, correction_state=state, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(g, exact, **TIGHT)
    assert st.backward_items == 4 * (6 + 2 * 3 + 6)      # knots, the picked groups' knots again, the inner rows
    tw = 1.0 / (B * K)
    for j, iv in enumerate((range(1, 3), range(5, 7), range(9, 11))):
        ex, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05), only_steps=list(iv))
        pl, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_p=0.0)), only_steps=list(iv))
        c = torch.cat([t.flatten() for t in state.mean(j)])
        assert torch.allclose(c * tw * B, ex - pl, **TIGHT)
    assert state.counts == {0: 2, 1: 2, 2: 2}


def _random_means(state, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    for j in range(3):
        state.update(j, [scale * torch.randn(p.shape, generator=g, dtype=torch.float64) for p in state.params], 1.0)
    return copy.deepcopy(state.state_dict())


def test_control_variate_is_unbiased_for_any_fixed_means():
    """With means c_j fixed before each draw (here random, of the corrections' size, restored before every draw):
    the mean of 300 draws at p = 0.5 is exact."""
    model, traj, adv = _case()
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    plain, _ = run(model, traj, adv, EstimatorConfig(**_base(correction_p=0.0)))
    state = CorrectionState(_params(model))
    P = sum(p.numel() for p in state.params)             # c_j about one sample-interval's correction: |e| / 12 each
    saved = _random_means(state, scale=float((exact - plain).norm()) * 48 / math.sqrt(12 * P))
    cfg = EstimatorConfig(**_base(correction_p=0.5, control_variate=0.5))
    gen, grads = torch.Generator().manual_seed(0), []
    for _ in range(300):
        state.load_state_dict(saved)
        grads.append(run(model, traj, adv, cfg, correction_state=state, generator=gen)[0])
    assert_mean_is(torch.stack(grads), exact, plain)


def _paired_errors(model, traj, adv, draws=200):
    """Squared errors to exact at p = 0.5 with the control variate at c_j = each step group's mean correction (learned
    at p = 1) and without it, draw by draw on the same picks (the same generator seeds)."""
    exact, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    state = CorrectionState(_params(model))
    run(model, traj, adv, EstimatorConfig(**_base(correction_p=1.0, control_variate=1.0)), correction_state=state)
    saved = copy.deepcopy(state.state_dict())
    errs = {"cv": 0.0, "plain": 0.0}
    for seed in range(draws):
        state.load_state_dict(saved)
        for key, kw in (("cv", dict(correction_state=state, control_variate=0.5)), ("plain", {})):
            cfg = EstimatorConfig(**_base(correction_p=0.5, control_variate=kw.pop("control_variate", 0.0)))
            g, _ = run(model, traj, adv, cfg, generator=torch.Generator().manual_seed(seed), **kw)
            errs[key] += float(((g - exact) ** 2).sum())
    return errs


def test_control_variate_at_the_true_means_lowers_the_variance():
    """c_j = each step group's mean correction: at p = 0.5 the squared error to exact falls below the correction's
    without the control variate, on the same picks. The picks take an exact count, which already removes the batch's
    overall mean correction: what the means remove is the part in which the step groups differ. With samples whose
    corrections are all alike (one trajectory and advantage four times), that is all of it: the error vanishes."""
    model, traj, adv = _case(adv=torch.tensor([1.5, 1.0, 0.8, 1.2], dtype=torch.float64))
    errs = _paired_errors(model, traj, adv)
    assert errs["cv"] < 0.95 * errs["plain"]
    with torch.no_grad():
        model.cond.copy_(model.cond[:1].expand_as(model.cond))
    same = traj.select(torch.zeros(4, dtype=torch.long))
    errs = _paired_errors(model, same, torch.ones(4, dtype=torch.float64), draws=20)
    assert errs["cv"] < 1e-12 * errs["plain"] and errs["plain"] > 0


def test_control_variate_same_bits_and_only_steps():
    """Same generator and state: the same bits; only_steps ranges sum to the full gradient (a mean belongs to its
    interval's first inner step) and leave the state unchanged."""
    model, traj, adv = _case()
    state = CorrectionState(_params(model))
    saved = _random_means(state, scale=1e-3)
    cfg = EstimatorConfig(**_base(correction_p=0.5, control_variate=0.5, knots="shared"))
    state.load_state_dict(saved)
    a, _ = run(model, traj, adv, cfg, correction_state=state, generator=torch.Generator().manual_seed(4))
    state.load_state_dict(saved)
    b, _ = run(model, traj, adv, cfg, correction_state=state, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    parts = []
    for steps in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
        state.load_state_dict(saved)
        parts.append(run(model, traj, adv, cfg, correction_state=state, generator=torch.Generator().manual_seed(4),
                         only_steps=steps)[0])
        assert state.counts == {0: 1, 1: 1, 2: 1}
    assert torch.allclose(sum(parts), a, **TIGHT)


def test_correction_state_running_mean_and_checkpoint():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    state = CorrectionState([p])
    for x in (1.0, 2.0, 3.0, 10.0):
        state.update(0, [torch.full((3,), x, dtype=torch.float64)], 0.5)
    # plain mean of the first two (1/t >= 0.5), then weight 0.5: 1.5 -> 2.25 -> 6.125
    assert torch.allclose(state.mean(0)[0], torch.full((3,), 6.125, dtype=torch.float64))
    again = CorrectionState([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])
    again.load_state_dict(state.state_dict())
    assert torch.equal(again.mean(0)[0], state.mean(0)[0]) and again.counts == {0: 4}
    with pytest.raises(ValueError, match="do not fit"):
        CorrectionState([torch.nn.Parameter(torch.ones(4))]).load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="requires_grad"):
        CorrectionState([torch.ones(3)])


# ----------------------------------------------------------------------------- in the trainers


def test_trainer_keeps_the_control_variate_across_a_resume(tmp_path, tiny_ckpt):
    """estimator.control_variate: the run's CorrectionState is in every checkpoint, the audit reads it, and a resumed
    run continues as if never stopped (same weights, same rewards); the step correction and interval subsampling
    train too."""
    from conftest import tiny_train_args
    from test_train import _params, _records
    from jagg.cli import main

    extra = ("estimator.window=4", "estimator.correction_p=0.5", "estimator.control_variate=0.5",
             "reward.name=jpeg_compressibility", "estimator.audit_every=1", "estimator.audit_samples=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_train_args(tiny_ckpt, straight, 4, *extra)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 2, *extra)) == 0
    saved = torch.load(sorted((split / "checkpoints").glob("ckpt_*.pt"))[-1], weights_only=False)
    assert saved["correction_state"]["counts"] and 0 in saved["correction_state"]["means"]
    assert main(tiny_train_args(tiny_ckpt, split, 4, *extra) + ["--resume"]) == 0
    p1, p2 = _params(straight), _params(split)
    assert all(torch.allclose(p1[k], p2[k], rtol=1e-5, atol=1e-7) for k in p1)
    assert [r["reward_mean"] for r in _records(straight) if r["kind"] == "train"] == \
        [r["reward_mean"] for r in _records(split) if r["kind"] == "train"]
    assert len([r for r in _records(straight) if r["kind"] == "audit"]) == 4
    for name, sets in (("step", ("estimator.correction=step",)),
                       ("frac", ("estimator.window=3", "estimator.correction_p=0", "estimator.interval_frac=0.5"))):
        out = tmp_path / name
        assert main(tiny_train_args(tiny_ckpt, out, 2, "estimator.window=4", "estimator.correction_p=0.5", *sets)) == 0
        train = [r for r in _records(out) if r["kind"] == "train"]
        assert len(train) == 2 and all(r["backward_items"] > 0 for r in train)
        if name == "frac":                       # step groups 0-2 and 3: one of the two per sample, 1 or 2 rows
            assert all(4 <= r["backward_items"] <= 8 for r in train)


# ----------------------------------------------------------------------------- in jagg bench efficiency


def test_estimator_specs_take_lists_and_budget_rates():
    from jagg.bench.efficiency import parse_estimator, spec_items, wants_budget_rates

    assert spec_items("correction_rates=[0.4,0.1],window=5") == ["correction_rates=[0.4,0.1]", "window=5"]
    name, est = parse_estimator("r:correction_rates=[0.4, 0.1],window=5", EstimatorConfig())
    assert name == "r" and est.correction_rates == [0.4, 0.1] and est.window == 5
    assert wants_budget_rates("r:correction_rates=by_interval,correction=step")
    assert not wants_budget_rates("r:correction_rates=[0.5]") and not wants_budget_rates("config")
    assert parse_estimator("r:correction_rates=by_interval", EstimatorConfig())[1].correction_rates is None
    assert parse_estimator("plain", EstimatorConfig(control_variate=0.5, correction_rates=[0.2]))[1].corrects is False


def test_bench_efficiency_measures_the_new_estimators(tmp_path, bench_ckpt, capsys):
    """The step correction, budget rates from the per-interval error (a pilot of its own), a control variate warmed up
    on batches of its own, and interval subsampling, through `jagg bench efficiency` on the tiny checkpoint."""
    import json

    from jagg.cli import main

    out = tmp_path / "eff.json"
    sets = efficiency_sets(bench_ckpt)
    args = ["bench", "efficiency", "--batches", "3", "--draws", "2", "--warmup", "1", "--estimator", "st:correction=step",
            "--estimator", "rates:correction_rates=by_interval", "--estimator", "cv:control_variate=0.5",
            "--estimator", "half:interval_frac=0.5", "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["estimator"]: r for r in json.loads(out.read_text())}
    assert list(recs) == ["exact", "st", "rates", "cv", "half"]
    # 8 steps, step groups of 4: 4 knot rows; step: + 0.25 x 1 row per group; cv: + 0.25 x (2 + 2) per group
    assert recs["st"]["rows_per_sample"] == pytest.approx(4 + 0.25 * 2 * 1)
    assert recs["cv"]["rows_per_sample"] == pytest.approx(4 + 0.25 * 2 * 4)
    assert 2 <= recs["half"]["rows_per_sample"] <= 3           # one group's 2 knots, + 2 inner rows if corrected
    rates = recs["rates"]["estimator_config"]["correction_rates"]
    assert len(rates) == 2 and sum(rates) * 2 == pytest.approx(0.25 * 4, abs=1e-3)      # the uniform rate's rows
    assert "rates: correction_rates" in capsys.readouterr().out
    assert all(math.isfinite(r["error_to_noise"]) for r in recs.values())
