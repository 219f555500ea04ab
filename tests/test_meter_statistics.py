"""The meter's statistics (jagg.meter) and its predicted range (jagg.verdict), on synthetic gradients with known
noise, error and bias: the error-to-noise and bias-to-noise ratios and their standard errors, their extrapolation to
another batch, the bias against the signal, the per-update and per-job range of the rate (SGD's model to Adam's) or
'unknown', Adam's square root of an unbiased error checked on torch's Adam (globally and per tensor), the running
meter over audits of prompt groups and its state, and each prompt group's own gradient (jagg.audit.audit_parts)."""

import json
import math

import numpy as np
import pytest
import torch

from jagg import EstimatorConfig
from jagg.audit import audit_parts
from jagg.meter import (Meter, adam_efficiency, adam_tensor_factor, error_noise_stats, extrapolate,
                        predicted_efficiency, tensor_weights)
from toy import Nonlinear, perturb, run, sampled_traj


def _synthetic(n=40, draws=3, P=4000, noise=1.0, bias=0.0, err=0.5, seed=0):
    """``n`` batches: exact = mu + N(0, noise/P I) (so V_b = noise), estimates = exact + b + N(0, err/P I) per draw,
    with |b|^2 = bias (so E|e|^2 = bias + err)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(P, generator=g, dtype=torch.float64) * 0.01
    b = torch.randn(P, generator=g, dtype=torch.float64)
    b = b / b.norm() * math.sqrt(bias)
    exact = mu + torch.randn(n, P, generator=g, dtype=torch.float64) * math.sqrt(noise / P)
    est = [x + b + torch.randn(draws, P, generator=g, dtype=torch.float64) * math.sqrt(err / P) for x in exact]
    return exact, est


def test_error_noise_stats_recover_known_noise_error_and_bias():
    exact, est = _synthetic(bias=0.04, err=0.5)
    st = error_noise_stats(exact, est)
    assert st["noise"] == pytest.approx(1.0, rel=0.1)
    assert st["error_to_noise"] == pytest.approx(0.54, rel=0.1)
    assert st["bias_to_noise"] == pytest.approx(0.04, abs=3 * st["bias_to_noise_se"] + 0.005)
    assert st["bias_to_noise"] > 3 * st["bias_to_noise_se"]                      # a real bias is significant
    unbiased = error_noise_stats(*_synthetic(bias=0.0, err=0.5, seed=1))
    assert abs(unbiased["bias_to_noise"]) < 3 * unbiased["bias_to_noise_se"] + 1e-3  # no bias: zero within its SE
    same = error_noise_stats(exact, [x[None] for x in exact])                       # the exact estimator itself
    assert same["error_to_noise"] == 0 and same["bias_to_noise"] == 0 and same["same_batch_cosine"] == pytest.approx(1)
    with pytest.raises(ValueError, match="n >= 3"):
        error_noise_stats(exact[:2], est[:2])


def test_extrapolation_and_efficiency_formula():
    st = {"noise": 1.0, "bias_sq": 0.01, "error_sq": 0.21}
    at = extrapolate(st, batch=32, target=128)             # V_b / 4; the unbiased error / 4; the bias stays
    assert at["bias_to_noise"] == pytest.approx(0.04)
    assert at["error_to_noise"] == pytest.approx((0.01 + 0.2 / 4) / 0.25)
    assert extrapolate(st, 32, 32)["error_to_noise"] == pytest.approx(0.21)
    assert predicted_efficiency(2.0, 1.0) == pytest.approx(1.0)               # twice as cheap, twice the variance
    assert predicted_efficiency(1.0, 0.0) == 1.0 and math.isnan(predicted_efficiency(1.0, math.nan))  # not measured


def test_bias_against_the_signal():
    """A bias of -0.5 times the true gradient: bias^2 / signal^2 = 0.25 and the bias points against the signal."""
    g = torch.Generator().manual_seed(3)
    n, P = 30, 4000
    mu = torch.randn(P, generator=g, dtype=torch.float64) * 0.02               # |mu|^2 = 1.6, noise V_b = 1
    exact = mu + torch.randn(n, P, generator=g, dtype=torch.float64) / math.sqrt(P)
    est = [x - 0.5 * mu + torch.randn(2, P, generator=g, dtype=torch.float64) * math.sqrt(0.1 / P) for x in exact]
    st = error_noise_stats(exact, est)
    assert st["signal_sq"] == pytest.approx(float(mu @ mu), rel=0.1)
    assert st["bias_to_signal"] == pytest.approx(0.25, rel=0.15)
    assert st["bias_signal_cos"] == pytest.approx(-1.0, abs=0.1)


def test_the_meter_gives_a_range_or_says_unknown():
    """The prediction spans SGD's model at the error's upper end (+ 2 SE) to Adam's at its lower end (- 2 SE),
    per update and times the iteration ratio, and is 'unknown' where no model holds: a significant repeating error,
    or a range wider than MAX_RANGE (an error the batches do not resolve)."""
    from jagg.verdict import MAX_RANGE, prediction

    rec = {"error_to_noise": 0.5, "error_to_noise_se": 0.1, "iter_ratio": 1.2, "bias_z": 0.3, "update": 0}
    out = prediction(rec)
    assert out["rate_lo"] == pytest.approx(1 / 1.7)                       # SGD at 0.5 + 2 x 0.1
    assert out["rate_hi"] == pytest.approx(1 / math.sqrt(1.3))            # Adam at 0.5 - 2 x 0.1
    assert out["time_rate_lo"] == pytest.approx(1.2 / 1.7) and out["time_rate_hi"] == pytest.approx(1.2 / math.sqrt(1.3))
    assert out["prediction"] == "range" and out["prediction_range"] == "0.59-0.88"
    exact = prediction({**rec, "error_to_noise": 0.0, "error_to_noise_se": 0.0})
    assert (exact["rate_lo"], exact["rate_hi"], exact["prediction_range"]) == (1.0, 1.0, "1.00-1.00")
    wide = prediction({**rec, "error_to_noise_se": 0.5})                  # the lower end of the error clamps at 0
    assert wide["rate_hi"] == 1.0 and wide["rate_lo"] == pytest.approx(1 / 2.5)
    assert wide["rate_hi"] - wide["rate_lo"] > MAX_RANGE and wide["prediction_range"] == "unknown"
    assert wide["prediction"].startswith("unknown: the error is not resolved")
    assert prediction({**rec, "bias_z": 2.5})["prediction_range"] == "unknown"
    assert prediction({**rec, "bias_z": 2.5})["prediction"].startswith("unknown: a significant repeating error")
    assert prediction({**rec, "bias_z": math.nan}) == out                 # an unknown SE of the bias: the range
    assert prediction({**rec, "update": 1}) == out                         # off-policy: the same model
    big = prediction({**rec, "error_to_noise": 3.0, "error_to_noise_se": 0.0})   # the models' spread alone: 0.25
    assert (big["rate_lo"], big["rate_hi"], big["prediction"]) == (0.25, 0.5, "range")


def test_job_prediction_is_the_mean_of_the_positions_ranges():
    """A job of U updates per iteration learns at the mean of its updates' rates: the job's range is the mean of
    the positions' ranges (rate and times the iteration ratio), and 'unknown' where any position's is."""
    from jagg.verdict import job_prediction, prediction

    def rec(name, err, se=0.0, z=0.0):
        return {"estimator": name, "error_to_noise": err, "error_to_noise_se": se, "iter_ratio": 1.5, "bias_z": z}

    u0 = [rec("exact", 0.0), rec("a", 0.5, 0.1), rec("b", 0.2)]
    u1 = [rec("exact", 0.0), rec("a", 1.5, 0.1), rec("b", 0.2, 0.0, 3.0)]
    job = {r["estimator"]: r for r in job_prediction([u0, u1])}
    p0, p1 = prediction(u0[1]), prediction(u1[1])
    assert job["a"]["rate_lo"] == pytest.approx((p0["rate_lo"] + p1["rate_lo"]) / 2)
    assert job["a"]["rate_hi"] == pytest.approx((1 / math.sqrt(1.3) + 1 / math.sqrt(2.3)) / 2)
    assert job["a"]["time_rate_hi"] == pytest.approx(1.5 * job["a"]["rate_hi"])
    assert job["a"]["prediction"] == "range" and job["a"]["unknown_at"] == []
    assert job["a"]["prediction_range"] == f"{job['a']['rate_lo']:.2f}-{job['a']['rate_hi']:.2f}"
    assert job["a"]["positions"] == f"{p0['prediction_range']} {p1['prediction_range']}" and job["a"]["updates"] == 2
    assert job["b"]["prediction_range"] == "unknown" and job["b"]["unknown_at"] == [1]      # a repeating error at 1
    assert job["b"]["prediction"].startswith("unknown: a significant repeating error")
    assert job["exact"]["prediction_range"] == "1.00-1.00" and all(r["kind"] == "job" for r in job.values())
    assert job_prediction([u0])[1]["prediction_range"] == p0["prediction_range"]      # one update per iteration
    with pytest.raises(ValueError, match="update 1 measured the estimators"):
        job_prediction([u0, u1[:2]])
    with pytest.raises(ValueError, match="no update positions"):
        job_prediction([])


@pytest.mark.parametrize("error_to_noise", [1.0, 3.0])
def test_adam_pays_the_square_root_of_an_unbiased_error(error_to_noise):
    """The model behind adam_efficiency: Adam on a noise-dominated gradient (signal s_j = 0.1 of the noise's std in
    every coordinate) gains along the signal in proportion to 1 / sqrt(1 + E|e|^2 / V_b) when an unbiased error of
    E|e|^2 is added, not 1 / (1 + E|e|^2 / V_b) as plain SGD's variance model says."""
    from jagg.meter import adam_efficiency

    def gain(extra: float) -> float:
        g = torch.Generator().manual_seed(0)
        P, s = 1000, torch.full((1000,), 0.1, dtype=torch.float64)
        theta = torch.zeros(P, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([theta], lr=1e-3)
        for _ in range(2000):
            theta.grad = -(s + torch.randn(P, generator=g, dtype=torch.float64) * math.sqrt(1 + extra))
            opt.step()
        return float(s @ theta.detach())

    ratio = gain(error_to_noise) / gain(0.0)
    assert ratio == pytest.approx(adam_efficiency(1.0, error_to_noise), rel=0.03)
    assert abs(ratio - predicted_efficiency(1.0, error_to_noise)) > 0.15
    assert adam_efficiency(2.0, 3.0) == pytest.approx(1.0)


def _adam_gain(signal: torch.Tensor, extra: torch.Tensor, steps: int, seed: int) -> float:
    """Adam's progress along ``signal`` after ``steps`` noisy steps: gradient ``-(s + N(0, 1 + extra))`` per
    coordinate (unit noise, ``extra`` the error's variance), measured as ``s . theta``."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.zeros(signal.numel(), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=1e-3)
    scale = torch.sqrt(1 + extra)
    for _ in range(steps):
        theta.grad = -(signal + torch.randn(signal.numel(), generator=g, dtype=torch.float64) * scale)
        opt.step()
    return float(signal @ theta.detach())


@pytest.mark.parametrize("where, s_big, s_small, rel", [("signal sits with the error", 0.01, 0.1, 0.08),
                                                          ("every coordinate the same signal-to-noise", 0.05, 0.05,
                                                           0.02)])
def test_adam_pays_per_tensor_where_the_error_sits(where, s_big, s_small, rel):
    """Two parameter tensors of 1,800 and 200 coordinates, unit noise in each; an unbiased error of 10x the noise sits
    in the small tensor only, so E|e|^2 / V_b = 1 overall and the global model says 1 / sqrt(2) = 0.71. Adam pays per
    coordinate: where the small tensor also carries most of the signal (weights by the signal: 0.92 of Adam's progress
    there) the per-tensor model says 0.08 + 0.92 / sqrt(11) = 0.36, lower than the global one; where every coordinate
    has the same signal-to-noise ratio (weights by the noise: 0.1) it says 0.9 + 0.1 / sqrt(11) = 0.93, higher. Torch's
    Adam agrees with the per-tensor model in both and with the global one in neither."""
    n_big, n_small = 1800, 200
    signal = torch.cat([torch.full((n_big,), s_big), torch.full((n_small,), s_small)]).double()
    extra = torch.cat([torch.zeros(n_big), torch.full((n_small,), 10.0)]).double()
    measured = np.mean([_adam_gain(signal, extra, 1500, seed) / _adam_gain(signal, torch.zeros_like(extra), 1500, seed)
                        for seed in range(4)])
    by_signal = s_big != s_small
    sq = [n_big * s_big ** 2, n_small * s_small ** 2] if by_signal else None
    w = tensor_weights([n_big, n_small], [n_big, n_small], sq)          # V_t = n_t (unit noise per coordinate)
    assert w == pytest.approx([0.0826, 0.9174] if by_signal else [0.9, 0.1], abs=1e-4)
    per_tensor = adam_tensor_factor([0.0, 10.0], w)
    assert per_tensor == pytest.approx(0.359 if by_signal else 0.930, abs=2e-3)
    glob = adam_efficiency(1.0, 1.0)
    assert (per_tensor < glob - 0.3) if by_signal else (per_tensor > glob + 0.2)
    assert measured == pytest.approx(per_tensor, rel=rel)
    assert abs(measured - glob) > 0.2
    assert adam_tensor_factor([1.0, 1.0], w) == pytest.approx(glob)     # one ratio everywhere: the global model


def _two_tensor_batches(n=30, big=3000, small=300, signal_small=0.0, err_small=0.5, seed=0):
    """``n`` batches of a 2-tensor gradient: exact = mu + N(0, 1/P) per coordinate (V_b = 1 over P = big + small), a
    draw = exact + an unbiased error of ``err_small`` in the small tensor only; ``signal_small``: |mu|^2 there."""
    g = torch.Generator().manual_seed(seed)
    P = big + small
    mu = torch.zeros(P, dtype=torch.float64)
    if signal_small:
        m = torch.randn(small, generator=g, dtype=torch.float64)
        mu[big:] = m / m.norm() * math.sqrt(signal_small)
    exact = mu + torch.randn(n, P, generator=g, dtype=torch.float64) / math.sqrt(P)
    err = torch.zeros(P, dtype=torch.float64)
    err[big:] = math.sqrt(err_small / small)
    est = [x + torch.randn(2, P, generator=g, dtype=torch.float64) * err for x in exact]
    return exact, est, [big, small]


def test_error_noise_stats_per_tensor():
    """The error sits in the small tensor (0.5 of the whole noise, 5x that tensor's own): per tensor E_t/V_t is 0 and
    ~5. Without a measurable signal the tensors are weighted by their noise, sqrt(n_t V_t) (0.91 / 0.09), and the
    per-tensor prediction is above the global one; with a strong signal in the small tensor the weights follow the
    signal and the prediction falls below it."""
    exact, est, sizes = _two_tensor_batches()
    st = error_noise_stats(exact, est, sizes)
    big, small = st["tensors"]
    assert [big["numel"], small["numel"]] == sizes
    assert big["error_to_noise"] == 0 and small["error_to_noise"] == pytest.approx(5.0, rel=0.1)
    assert big["noise"] + small["noise"] == pytest.approx(st["noise"], rel=1e-9)
    assert st["tensor_weighting"] == "noise"
    assert [big["weight"], small["weight"]] == pytest.approx(list(tensor_weights([big["noise"], small["noise"]], sizes)))
    assert small["weight"] == pytest.approx(0.0909, abs=0.01)
    assert st["adam_tensor_factor"] == pytest.approx(adam_tensor_factor([0.0, small["error_to_noise"]],
                                                                        [big["weight"], small["weight"]]))
    assert st["adam_tensor_factor"] > 1 / math.sqrt(1 + st["error_to_noise"]) + 0.1
    at = extrapolate(st, 32, 128)                      # 4x the batch: both the noise and this unbiased error / 4
    assert at["adam_tensor_factor"] == pytest.approx(st["adam_tensor_factor"], rel=0.02)
    one = error_noise_stats(exact, est)                # no sizes: one tensor, the global model
    assert one["adam_tensor_factor"] == pytest.approx(1 / math.sqrt(1 + one["error_to_noise"]))

    exact, est, sizes = _two_tensor_batches(signal_small=0.5, seed=1)
    st = error_noise_stats(exact, est, sizes)
    assert st["tensor_weighting"] == "signal" and st["tensors"][1]["weight"] > 0.9
    assert st["adam_tensor_factor"] < 1 / math.sqrt(1 + st["error_to_noise"]) - 0.1
    with pytest.raises(ValueError, match="tensor sizes"):
        error_noise_stats(exact, est, [10, 20])


def test_audit_meter_recovers_noise_error_and_bias_from_group_gradients():
    """Synthetic audits of 4 groups each: group gradients mu + N(0, 1/P) (so var_j = 1), errors b + N(0, 0.5/P),
    |b|^2 = 0.05; 8 groups per update. Expected: V_b = 1/8, E|e|^2 = 0.05 + 0.5/8, bias^2/V_b = 0.4."""
    from jagg.meter import Meter, meter_flag

    g = torch.Generator().manual_seed(0)
    P = 20000
    mu = torch.randn(P, generator=g, dtype=torch.float64) * 0.01
    b = torch.randn(P, generator=g, dtype=torch.float64)
    b = b / b.norm() * math.sqrt(0.05)
    meter = Meter(sketch_dim=4096, seed=1)
    for _ in range(40):
        exact = mu + torch.randn(4, P, generator=g, dtype=torch.float64) / math.sqrt(P)
        est = exact + b + torch.randn(4, P, generator=g, dtype=torch.float64) * math.sqrt(0.5 / P)
        r = meter.update(exact, est, rows_exact=80, rows_estimator=40, prompt_groups_per_update=8, train_share=0.5)
    assert r["audits"] == 40
    assert r["error_to_noise"] == pytest.approx((0.05 + 0.5 / 8) / (1 / 8), rel=0.15)
    assert r["bias_to_noise"] == pytest.approx(0.4, abs=0.12) and r["bias_to_noise"] > 3 * r["bias_to_noise_se"]
    assert r["predicted_efficiency"] == pytest.approx(2 / (1 + r["error_to_noise"]))
    assert r["predicted_time_efficiency"] == pytest.approx(1.5 / (1 + r["error_to_noise"]))   # (1 - f) + f * 2
    assert r["predicted_adam_efficiency"] == pytest.approx(2 / math.sqrt(1 + r["error_to_noise"]))
    assert r["predicted_adam_time_efficiency"] == pytest.approx(1.5 / math.sqrt(1 + r["error_to_noise"]))
    assert "repeats from batch to batch" in meter_flag(r)
    # an unbiased, cheap estimator: no flag
    meter = Meter(seed=2)
    for _ in range(10):
        exact = mu + torch.randn(4, P, generator=g, dtype=torch.float64) / math.sqrt(P)
        r = meter.update(exact, exact + torch.randn(4, P, generator=g, dtype=torch.float64) * math.sqrt(0.05 / P),
                         80, 40, 8)
    assert abs(r["bias_to_noise"]) < 3 * r["bias_to_noise_se"] + 0.02 and r["predicted_efficiency"] > 1.5
    assert meter_flag(r) is None and math.isnan(r["predicted_time_efficiency"])
    one = Meter().update(mu[None], mu[None], 8, 4, 8)            # one group: no spread, no estimate yet
    assert math.isnan(one["error_to_noise"]) and meter_flag(one) is None


def _audits(meter, n, err, seed=0, P=20000, groups=4):
    """``n`` synthetic audits of ``groups`` prompt groups: gradients mu + N(0, 1/P), errors N(0, err/P); 8 prompt
    groups per update, 80 exact rows and 40 of the estimator per audit."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(P, generator=g, dtype=torch.float64) * 0.01
    for _ in range(n):
        exact = mu + torch.randn(groups, P, generator=g, dtype=torch.float64) / math.sqrt(P)
        r = meter.update(exact, exact + torch.randn(groups, P, generator=g, dtype=torch.float64) * math.sqrt(err / P),
                         80, 40, 8)
    return r


def test_the_meter_state_round_trips():
    """The next audit after :meth:`Meter.from_state` gives the same numbers as the meter it was saved from; a
    state saved while ``correction_p: auto`` existed (a third row count) reads the same."""
    meter = Meter(sizes=[15000, 5000], seed=3)
    _audits(meter, 3, 0.1)
    again = Meter.from_state(meter.state_dict())
    old = meter.state_dict()
    old["rows"] = [*old["rows"], 120]                                  # auto's inner rows, unused now
    older = Meter.from_state(old)
    a, b, c = (_audits(m, 1, 0.1, seed=9) for m in (meter, again, older))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) == json.dumps(c, sort_keys=True)
    assert a["rows_ratio"] == 2.0 and "correction_p" not in a


def test_audit_parts_gives_each_prompt_group_its_own_gradient():
    """audit_parts(split=...): each part's gradient is that of its own samples, each at its own conditioning (the
    whole batch's gradient with the other samples' advantages set to 0, times B / n), and the parts weighted by their
    shares sum to the whole batch's gradient."""
    torch.manual_seed(3)
    model = Nonlinear(batch=6)                       # a conditioning vector per sample
    traj = sampled_traj(model, B=6, T=6)
    perturb(model, 0.05)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    params = list(model.parameters())
    for mode in ("exact", "jagg"):
        cfg = EstimatorConfig(mode=mode, window=3, correction_p=0.0, clip_range=0.05)
        _, exact, est = audit_parts(model, traj, adv, cfg, params, prompt_groups=groups, split=groups)
        parts = exact if mode == "exact" else est
        whole, _ = run(model, traj, adv, cfg, prompt_groups=groups)
        assert torch.allclose(parts.mean(0), whole, rtol=1e-10, atol=1e-14)
        for j in range(3):
            only = torch.where(groups == j, adv, torch.zeros_like(adv))
            g, _ = run(model, traj, only, cfg, prompt_groups=groups)
            assert torch.allclose(parts[j], g * 3, rtol=1e-10, atol=1e-14), (mode, j)
