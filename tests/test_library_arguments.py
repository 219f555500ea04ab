"""The library's public functions check their arguments as the command line does: a bad argument (an empty batch, a
value of the wrong kind, one passed in the wrong position, a tensor of the wrong shape) is a ValueError or TypeError
naming the argument, before any work, never a raw exception from deep inside; a result that cannot be computed is an
error or an explicit undefined (None), never NaN passed off as a number; numpy scalars count as the numbers they
hold."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg import knots, meter
from jagg.verdict import position_failure, prediction, rate_range, verdict
from toy import S, Nonlinear, sampled_traj

CFG = EstimatorConfig(window=3, micro_batch=4)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=6)
    return model, traj, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)


def _no_grad(model) -> bool:
    return all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("args,kw,err,culprit", [
    (([], []), {}, ValueError, "rewards is empty"),
    (([1.0, 2.0], 5), {}, TypeError, "prompt_ids must be a sequence"),
    (([1.0, 2.0], [0]), {}, ValueError, "prompt_ids has 1 prompt ids but rewards has 2"),
    (([1.0, 2.0], [[0], [1]]), {}, TypeError, "prompt_ids must hold hashable ids"),
    (([1.0, 2.0], [0, 0], 5.0), {}, TypeError, "global_std must be True or False"),      # adv_clip_max in its place
    (([1.0, 2.0], [0, 0]), dict(eps=-2.5), ValueError, "eps must be a finite number > 0"),
    (([1.0, 2.0], [0, 0]), dict(eps=0.0), ValueError, "eps must be a finite number > 0"),
    (([1.0, 2.0], [0, 0]), dict(eps=math.nan), ValueError, "eps must be a finite number > 0"),
    (([1.0, math.nan], [0, 0]), {}, ValueError, "rewards contain NaN"),
    (([1.0, 2.0], [0, 0]), dict(adv_clip_max=1e40), ValueError, "adv_clip_max: 1e\\+40 overflows float32"),
    (([1.0, 2.0], [0, 0]), dict(eps=1e-45), ValueError, "eps: 1e-45 underflows float32"),
])
def test_group_advantages_names_the_bad_argument(args, kw, err, culprit):
    with pytest.raises(err, match=culprit):
        jagg.group_advantages(*args, **kw)


def test_group_advantages_never_flips_or_divides_by_zero():
    """eps is a floor on the std: > 0 keeps the signs (eps = -2.5 flipped every one) and a flat group finite."""
    adv = jagg.group_advantages([1.0, 2.0, 3.0, 3.0], [0, 0, 1, 1], eps=1e-8)
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0


def test_nonzero_spread_mask_checks_the_same_batch():
    with pytest.raises(ValueError, match="rewards is empty"):
        jagg.nonzero_spread_mask([], [])
    with pytest.raises(ValueError, match="tol must be a finite number >= 0"):
        jagg.nonzero_spread_mask([1.0, 2.0], [0, 0], tol=-1)


# ----------------------------------------------------------------------------- policy_gradient, audit_gradient


def _empty(traj):
    return traj.select(torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("change,err,culprit", [
    (lambda m, t, a: dict(traj=_empty(t), advantages=a[:0]), ValueError, "holds no sample"),
    (lambda m, t, a: dict(advantages=a[:3]), ValueError, r"advantages must have shape \[B\] = \[4\]"),
    (lambda m, t, a: dict(ref_velocities=[0, 1, 2, 3]), TypeError, "ref_velocities must be a torch.Tensor"),
    (lambda m, t, a: dict(ref_velocities=t.velocities[:, :2]), ValueError, "ref_velocities must have shape"),
    (lambda m, t, a: dict(prompt_groups=[0, 0, 1]), ValueError, r"prompt_groups must have one prompt group per "
                                                                r"sample, \[B\] = \[4\]; got 3"),
    (lambda m, t, a: dict(prompt_groups=7), TypeError, "prompt_groups must be None or"),
    (lambda m, t, a: dict(only_steps=[]), ValueError, "only_steps is empty"),
    (lambda m, t, a: dict(backward_fn=3), TypeError, "backward_fn must be callable"),
    (lambda m, t, a: dict(config=EstimatorConfig(window=40)), ValueError,
     r"window=40 is more than the 6 trained steps .*lower window to at most 6"),
    (lambda m, t, a: dict(config=EstimatorConfig(window=3, correction_probs=[0.5])), ValueError,
     "correction_probs has 1 rate, but the layout has 2 intervals"),
    (lambda m, t, a: dict(traj=dict(vars(t), latents=t.latents.tolist())), TypeError, "traj must be a jagg.Trajectory"),
])
def test_policy_gradient_names_the_bad_argument_before_any_work(change, err, culprit, setup):
    model, traj, adv = setup
    args = dict(velocity_fn=model, traj=traj, advantages=adv, config=CFG)
    args.update(change(model, traj, adv))
    with pytest.raises(err, match=culprit):
        jagg.policy_gradient(**args)
    assert _no_grad(model)


def test_a_trajectory_field_that_is_no_tensor_is_named(setup):
    model, traj, adv = setup
    bad = copy.copy(traj)
    bad.latents = traj.latents.tolist()
    with pytest.raises(TypeError, match="Trajectory.latents must be a torch.Tensor"):
        jagg.policy_gradient(model, bad, adv, CFG)


def test_arguments_in_the_wrong_position_are_named(setup):
    """policy_gradient(velocity, traj, adv, config, prompt_groups) puts the prompt groups in ref_velocities' place:
    with kl_beta 0 they were ignored, or failed deep inside; now named."""
    model, traj, adv = setup
    with pytest.raises(TypeError, match="ref_velocities must be a torch.Tensor"):
        jagg.policy_gradient(model, traj, adv, CFG, [0, 0, 1, 1])
    with pytest.raises(TypeError, match="config must be a jagg.EstimatorConfig"):
        jagg.policy_gradient(model, traj, CFG, adv)
    with pytest.raises(ValueError, match="params must be a non-empty sequence of parameters"):
        jagg.audit_gradient(model, traj, adv, CFG, traj.velocities)           # ref_velocities in params' place
    assert _no_grad(model)


@pytest.mark.parametrize("change,err,culprit", [
    (lambda m, t, a: dict(prompt_groups=[0, 1]), ValueError, r"prompt_groups must have one prompt group per sample"),
    (lambda m, t, a: dict(traj=_empty(t), advantages=a[:0]), ValueError, "holds no sample"),
    (lambda m, t, a: dict(ref_velocities=t.velocities[:1]), ValueError, "ref_velocities must have shape"),
    (lambda m, t, a: dict(params=[]), ValueError, "params must be a non-empty sequence"),
    (lambda m, t, a: dict(params=next(m.parameters())), ValueError, "params must be a non-empty sequence"),
    (lambda m, t, a: dict(parts=np.int64(0)), ValueError, "parts .* must be an integer >= 1"),
    (lambda m, t, a: dict(params=[torch.zeros(3, requires_grad=True)]), ValueError,
     "velocity_fn does not use any of these 1 parameters"),
])
def test_audit_gradient_names_the_bad_argument(change, err, culprit, setup):
    model, traj, adv = setup
    args = dict(velocity_fn=model, traj=traj, advantages=adv, config=CFG, params=list(model.parameters()))
    args.update(change(model, traj, adv))
    with pytest.raises(err, match=culprit):
        jagg.audit_gradient(**args)
    assert _no_grad(model) or "does not use" in culprit      # (that one is found by the first backward)


def test_an_audit_whose_gradient_is_zero_reports_undefined_not_nan(setup):
    """All advantages 0 (grpo.drop_zero_spread=false): every gradient is 0 and no cosine can be computed; the audit
    says undefined (None: null in JSON, no TensorBoard point) instead of NaN, and warns of nothing."""
    from jagg.audit import audit_flag

    model, traj, adv = setup
    a = jagg.audit_gradient(model, traj, torch.zeros(4), CFG, list(model.parameters()))
    assert a["cos"] is None and a["rel_err"] is None and a["cos_noisy"] is None
    assert audit_flag(a, CFG) is None
    assert "NaN" not in json.dumps(a)
    b = jagg.audit_gradient(model, traj, adv, CFG, list(model.parameters()), generator=torch.Generator())
    assert 0.5 < b["cos"] <= 1 and all(isinstance(b[k], float) for k in ("cos_noisy", "cos_middle", "cos_clean"))


def test_reference_velocities_checks_its_arguments(setup):
    model, traj, adv = setup
    with pytest.raises(TypeError, match="ref_fn must be callable"):
        jagg.reference_velocities(traj, model)
    with pytest.raises(ValueError, match="micro_batch must be an integer >= 1"):
        jagg.reference_velocities(model, traj, micro_batch=0)
    ref = jagg.reference_velocities(model, traj, micro_batch=np.int64(3))
    assert ref.shape == traj.velocities.shape


# ----------------------------------------------------------------------------- sampling, schedules, SDE steps


@pytest.mark.parametrize("call,err,culprit", [
    (lambda m, n, s: jagg.sample_trajectories(n, m, s, 0.7), TypeError, "velocity_fn must be callable"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, [1.0, 0.5, 0.0], 0.7), TypeError, "sigmas must be a torch.Tensor"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, s, 0.7, micro_batch=0), ValueError,
     "micro_batch must be an integer >= 1"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, s, 0.7, sde_mask=torch.ones(2, dtype=torch.bool)), ValueError,
     r"sde_mask must be a bool tensor \[T\] = \[4\]"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, s, 0.7, train_steps=[0, 1]), ValueError,
     "train_steps must be a non-empty 1-D integer tensor"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, s, 0.7, None, None, None, None, "mean", 2.0), TypeError,
     "check_finite must be True or False"),
    (lambda m, n, s: jagg.sample_ode(m, n, s, micro_batch=-1), ValueError, "micro_batch must be an integer >= 1"),
    (lambda m, n, s: jagg.flow_sigmas(4, dtype=torch.int64), TypeError, "dtype must be a floating torch.dtype"),
    (lambda m, n, s: jagg.shift_sigmas([0.5], 3.0), TypeError, "sigmas must be a torch.Tensor"),
    (lambda m, n, s: jagg.select_train_steps("10"), ValueError, "num_steps must be an integer >= 1"),
    (lambda m, n, s: jagg.select_train_steps(10, 1.0, 4), TypeError, "sde_window must be None or"),
    (lambda m, n, s: jagg.select_train_steps(10, (0, 8)), ValueError, "timestep_fraction must be a number in"),
    (lambda m, n, s: jagg.sample_trajectories(m, n, s, 1e40), ValueError, "eta: 1e\\+40 overflows float32"),
    (lambda m, n, s: jagg.gaussian_log_prob(n, n, s[:3]), ValueError, r"step_std must have one value per item"),
    (lambda m, n, s: jagg.step_loss(n, n, n, s[0].expand(2), s[1].expand(2), 0.9, 0.7, [0.0, 0.0],
                                    torch.zeros(2), 0.1), ValueError, r"old_log_prob must be a tensor \[n\] = \[2\]"),
    (lambda m, n, s: jagg.sde_step(n, n[:1], s[:1], s[1:2], 0.9, 0.7), ValueError, "v must have the shape of x"),
    (lambda m, n, s: jagg.sde_step(n, n, s[0].expand(2), s[1].expand(2), 0.9, 0.0), ValueError,
     "eta must be a finite number > 0"),
    (lambda m, n, s: jagg.sde_step(n, n, s[0].expand(2), s[1].expand(2), 1.5, 0.7), ValueError,
     r"sigma_one must be the schedule's sigma_1, a number in \[0, 1\)"),
    (lambda m, n, s: jagg.sde_step(n, n, 0.9, 0.8, 0.9, 0.7), TypeError, "sigma must be a torch.Tensor"),
    (lambda m, n, s: jagg.euler_step(n, n, s[:3], s[1:4]), ValueError, r"sigma must have one value per item"),
    (lambda m, n, s: jagg.gaussian_log_prob(n[:1], n, s[:2]), ValueError, "x_next must have the shape of mean"),
    (lambda m, n, s: jagg.step_loss(n, n, n, s[0].expand(2), s[1].expand(2), 0.9, 0.7, torch.zeros(2),
                                    torch.zeros(2), clip_range=0.0), ValueError, "clip_range must be a finite number > 0"),
])
def test_sampling_and_step_functions_name_the_bad_argument(call, err, culprit):
    model = Nonlinear(batch=2)
    noise = torch.randn(2, *S, dtype=torch.float64)
    with pytest.raises(err, match=culprit):
        call(model, noise, jagg.flow_sigmas(4, dtype=torch.float64))


def test_numpy_scalars_count_as_the_numbers_they_hold(setup):
    """np.int64(4) was refused ("must be an integer; got np.int64(4)"): counts from numpy code are accepted and
    stored as Python numbers (so a config still writes as JSON)."""
    from jagg.infra.config_loader import from_dict
    from jagg.trainers.shapes_config import ShapesTrainConfig

    model, traj, adv = setup
    cfg = EstimatorConfig(window=np.int64(3), micro_batch=np.int32(4), jagg_frac=np.float32(1.0))
    assert type(cfg.window) is int and json.loads(json.dumps(cfg.to_dict()))["window"] == 3
    assert jagg.flow_sigmas(np.int64(4)).numel() == 5
    assert jagg.select_train_steps(np.int64(10), sde_window=(np.int64(0), np.int64(8)))[0].tolist() == list(range(8))
    assert jagg.sliding_sde_window(np.int64(3), (0, 8), np.int64(4)) == (3, 7)
    assert all(type(v) is int for v in jagg.sliding_sde_window(np.int64(3), (0, 8), np.int64(4)))
    jagg.policy_gradient(model, traj, adv.numpy(), cfg)
    train = from_dict(ShapesTrainConfig, {"sample": {"num_steps": np.int64(12)}, "grpo": {"iterations": np.int64(3)}})
    assert type(train.sample.num_steps) is int and train.grpo.iterations == 3


# ----------------------------------------------------------------------------- jagg.knots, jagg.meter


@pytest.mark.parametrize("call,err,culprit", [
    (lambda: knots.step_groups([0, 1, 2], 0), ValueError, "window must be an integer >= 1"),
    (lambda: knots.intervals_of([0, 1, 2], "grouped", 2), ValueError, "knots must be one of"),
    (lambda: knots.intervals_of([], "groups", 2), ValueError, "steps must be a non-empty sequence of integer steps"),
    (lambda: knots.intervals_of(None, "groups", 2), TypeError, "steps must be a non-empty sequence of integer steps"),
    (lambda: knots.step_groups({"a": 1}, 2), TypeError, "train_steps must be a non-empty sequence"),
    (lambda: knots.check_layout({"window": 4}, 8), TypeError, "config must be a jagg.EstimatorConfig"),
    (lambda: knots.check_layout(CFG, "8"), ValueError, r"K \(the trained steps\) must be an integer >= 1"),
    (lambda: meter.tensor_weights(["x"], [3]), TypeError, "noise must be a tensor or an array-like of numbers"),
    (lambda: meter.error_noise_stats(torch.zeros(3, 5), None), TypeError, "estimates must be a sequence"),
    (lambda: meter.meter_flag([1, 2]), TypeError, "result must be the dict of Meter.update"),
    (lambda: knots.interval_alphas(jagg.flow_sigmas(4), [], "sigma"), ValueError, "interval must be a non-empty"),
    (lambda: knots.interval_alphas(jagg.flow_sigmas(4), torch.zeros(3), "sigma"), TypeError, "interval must be a"),
    (lambda: knots.interval_alphas(jagg.flow_sigmas(4), [3, 9], "sigma"), ValueError, r"steps in \[0, 4\]"),
    (lambda: knots.shared_knots(0, 4), ValueError, "num_steps must be an integer >= 1"),
    (lambda: knots.budget_probs(1.0, [1.0], 1.0), TypeError, "errors must be a sequence"),
    (lambda: knots.plan_update({"latents": 0}, CFG), TypeError, "traj must be a jagg.Trajectory"),
    (lambda: meter.predicted_efficiency(0.0, 0.1), ValueError, "work_ratio must be a finite number > 0"),
    (lambda: meter.adam_efficiency(2.0, "0.1"), TypeError, "error_to_noise must be a number"),
    (lambda: meter.tensor_weights([1.0, 2.0], [3]), ValueError, "noise, numel .* of one length"),
    (lambda: meter.adam_tensor_factor([0.1], [0.5, 0.5]), ValueError, "error_to_noise and weights"),
    (lambda: meter.jackknife_se([1.0]), ValueError, "n >= 2 leave-one-out values"),
    (lambda: meter.extrapolate({"noise": 1.0}, 4, 8), ValueError, "has no 'bias_sq'"),
    (lambda: meter.extrapolate({"noise": 1.0, "bias_sq": 0.0, "error_sq": 1.0}, 0, 8), ValueError,
     "batch must be a finite number > 0"),
    (lambda: meter.error_noise_stats(torch.zeros(4, 5), [torch.zeros(1, 5)] * 3), ValueError,
     "one .* estimate tensor per batch"),
    (lambda: meter.error_noise_stats(torch.zeros(3, 5), [torch.zeros(1, 4)] * 3), ValueError,
     r"estimates\[0\] must be a tensor \[draws >= 1, P = 5\]"),
    (lambda: meter.Meter([2, 3]).update(torch.zeros(2, 4), torch.zeros(2, 4), 1, 1, 2.0), ValueError,
     r"exact and estimate must both be \[m, P = 5\]"),
    (lambda: meter.Meter().update(torch.zeros(2, 4), torch.zeros(2, 4), 1, 1, 0.0), ValueError,
     "prompt_groups_per_update must be a finite number > 0"),
])
def test_knots_and_meter_name_the_bad_argument(call, err, culprit):
    with pytest.raises(err, match=culprit):
        call()


def test_a_refused_meter_update_leaves_the_meter_as_it_was():
    m = meter.Meter()
    with pytest.raises(ValueError):
        m.update(torch.zeros(2, 4), torch.zeros(3, 4), 1, 1, 2.0)
    assert m.audits == 0 and m.rows == [0, 0]


# ----------------------------------------------------------------------------- NaN, infinity, out of the domain

NAN, INF = math.nan, math.inf


def _verdict_record(**change):
    return {"estimator": "a", "update": 0, "error_to_noise": 0.02, "error_to_noise_se": 0.005, "iter_ratio": 1.6,
            "bias_z": 0.0, "projected_iter_ratio": 1.4, **change}


@pytest.mark.parametrize("call,culprit", [
    # jagg.verdict: a candidate recommended on an infinite ratio or a negative SE ("projected inf-inf")
    (lambda: verdict([_verdict_record(iter_ratio=INF)], 1), "'a'.*iter_ratio"),
    (lambda: verdict([_verdict_record(iter_ratio=NAN)], 1), "'a'.*iter_ratio"),
    (lambda: verdict([_verdict_record(iter_ratio=-1.6)], 1), "iter_ratio must be a finite number > 0"),
    (lambda: verdict([_verdict_record(error_to_noise_se=-0.5)], 1), "error_to_noise_se must be a finite number >= 0"),
    (lambda: verdict([_verdict_record(error_to_noise=-0.5)], 1), "error_to_noise must be a finite number >= 0"),
    (lambda: verdict([_verdict_record(error_to_noise=INF)], 1), "'error_to_noise' must be"),
    (lambda: verdict([_verdict_record(projected_iter_ratio=INF)], 1), "'projected_iter_ratio' must be"),
    (lambda: verdict([_verdict_record(bias_z=INF)], 1), "'bias_z' must be"),
    (lambda: verdict([_verdict_record()], 1, margin=NAN), "margin must be a finite number >= 0"),
    (lambda: verdict([_verdict_record()], 1.5), "updates must be an integer >= 1"),
    (lambda: rate_range(NAN, 0.1), "error_to_noise must be a finite number >= 0"),
    (lambda: rate_range(0.1, -0.1), "se must be a finite number >= 0"),
    (lambda: position_failure(_verdict_record(iter_ratio=INF)), "iter_ratio"),
    (lambda: prediction(_verdict_record(error_to_noise_se=-1.0)), "error_to_noise_se"),
    # jagg.meter: NaN, infinity or an impossible rate for NaN or negative inputs
    (lambda: meter.predicted_efficiency(NAN, 0.1), "work_ratio must be a finite number > 0"),
    (lambda: meter.predicted_efficiency(INF, 0.1), "work_ratio must be a finite number > 0"),
    (lambda: meter.adam_efficiency(1.0, -0.5), "error_to_noise must be a finite number >= 0"),
    (lambda: meter.adam_efficiency(1.0, INF), "error_to_noise must be a finite number >= 0"),
    (lambda: meter.adam_tensor_factor([0.1, 0.1], [1.0, 1.0]), "weights must sum to 1"),
    (lambda: meter.adam_tensor_factor([0.1, NAN], [0.5, 0.5]), r"error_to_noise\[1\] must be a finite number >= 0"),
    (lambda: meter.adam_tensor_factor([0.1, -0.9], [0.5, 0.5]), r"error_to_noise\[1\]"),
    (lambda: meter.adam_tensor_factor([0.1, 0.1], [1.5, -0.5]), r"weights\[1\] must be a finite number >= 0"),
    (lambda: meter.tensor_weights([1.0, NAN], [3, 4]), r"noise\[1\] must be a finite number >= 0"),
    (lambda: meter.tensor_weights([1.0, -1.0], [3, 4]), r"noise\[1\]"),
    (lambda: meter.tensor_weights([1.0, 1.0], [3, 0]), r"numel\[1\] must be an integer >= 1"),
    (lambda: meter.tensor_weights([1.0, 1.0], [3, 4], [1.0, INF]), r"signal\[1\] must be a finite number"),
    (lambda: meter.jackknife_se([1.0, NAN, 2.0]), r"leave_one_out\[1\] must be a finite number"),
    (lambda: meter.extrapolate({"noise": -1.0, "bias_sq": 0.0, "error_sq": 1.0}, 4, 8), r"\['noise'\] must be"),
    (lambda: meter.extrapolate({"noise": 1.0, "bias_sq": 0.0, "error_sq": 1.0, "tensors": [{"noise": 1.0,
                                "bias_sq": 0.0, "error_sq": -1.0, "weight": 1.0}]}, 4, 8),
     r"stats\['tensors'\]\[0\]\['error_sq'\] must be a finite number >= 0"),
    (lambda: meter.error_noise_stats(torch.full((3, 5), NAN), [torch.zeros(1, 5)] * 3), "exact must be finite"),
    (lambda: meter.error_noise_stats(torch.zeros(3, 5), [torch.zeros(1, 5), torch.full((1, 5), INF),
                                                           torch.zeros(1, 5)]), r"estimates\[1\] must be finite"),
    (lambda: meter.Meter().update(torch.zeros(2, 4), torch.full((2, 4), NAN), 1, 1, 2.0), "estimate must be finite"),
    (lambda: meter.Meter([3, -1]), r"sizes\[1\] must be an integer >= 1"),
    (lambda: meter.Meter(sketch_dim=0), "sketch_dim must be an integer >= 1"),
    (lambda: meter.meter_flag({"audits": 5}, min_audits=NAN), "min_audits must be an integer >= 0"),
    # jagg.knots: NaN alphas for equal or NaN sigmas; unsorted, duplicate or negative steps
    (lambda: knots.interval_alphas(torch.tensor([1.0, 0.5, 0.5, 0.0]), [1, 2], "sigma"), "strictly monotone"),
    (lambda: knots.interval_alphas(torch.tensor([1.0, NAN, 0.5, 0.0]), [0, 1, 2], "sigma"), "must be finite"),
    (lambda: knots.interval_alphas(jagg.flow_sigmas(4), [2, 1], "sigma"), r"interval\[1\] = 1 does not follow 2"),
    (lambda: knots.step_groups([0, 2, 1], 2), r"train_steps\[2\] = 1 does not follow 2"),
    (lambda: knots.step_groups([0, 1, 1], 2), r"train_steps\[2\] = 1 does not follow 1"),
    (lambda: knots.step_groups([-1, 0, 1], 2), r"train_steps\[0\] = -1 is negative"),
    (lambda: knots.intervals_of([3, 2, 1], "shared", 3), r"steps\[1\] = 2 does not follow 3"),
    (lambda: knots.drawn_count(4, NAN), r"frac must be a finite number in \(0, 1\]"),
    (lambda: knots.drawn_count(4, 1.5), r"frac must be a finite number in \(0, 1\]"),
    (lambda: knots.draw(2, 4, 0, None), "m must be an integer >= 1"),
    (lambda: knots.route(torch.zeros(2, 3), NAN, torch.ones(3, dtype=torch.bool)), "jagg_frac must be a finite"),
    (lambda: knots.route(torch.full((2, 3), NAN), 0.5, torch.ones(3, dtype=torch.bool)), "without NaN"),
])
def test_nan_infinity_and_out_of_domain_inputs_are_refused_by_name(call, culprit):
    """Every public function of jagg.verdict, jagg.meter and jagg.knots refuses NaN, infinity and values outside its
    domain, naming the argument (or the record's field), instead of returning NaN, inf, an impossible rate (1.91 from
    weights that do not sum to 1) or a recommendation on an infinite ratio."""
    with pytest.raises((ValueError, TypeError), match=culprit):
        call()


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_reference_velocities_never_reach_the_gradient(setup, bad):
    model, traj, adv = setup
    ref = traj.velocities.clone()
    ref[1, 2].view(-1)[0] = bad
    with pytest.raises(ValueError, match="ref_velocities must be finite where the rollout's velocities are; 1 of"):
        jagg.policy_gradient(model, traj, adv, EstimatorConfig(window=3, micro_batch=4, kl_beta=0.1),
                             ref_velocities=ref)
    assert _no_grad(model)


def test_what_the_meter_has_not_measured_stays_an_explicit_unknown():
    """NaN where the meter measured nothing (no noise to compare the error with) is its documented 'not measured': the
    verdict says unknown and trains exact; it is never a recommendation."""
    v = verdict([_verdict_record(error_to_noise=NAN, error_to_noise_se=NAN)], 1)
    assert v["estimator"] == "exact" and "unknown" in v["reason"]
    assert verdict([_verdict_record()], 1)["estimator"] == "a"
