"""The efficiency meter of #26: Adam's per-tensor model (checked on torch's Adam), ``correction_p: auto`` (the rate
formula, the meter's choice, the trainer's log and resume), the projected time of a named cost structure, and the
audit's per-prompt-group gradients."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import tiny_train_args
from jagg import EstimatorConfig
from jagg.audit import (AUTO_BIAS_BOUND, AUTO_P_MIN, AUTO_START_P, AuditMeter, adam_efficiency, adam_tensor_factor,
                        audit_parts, choose_correction_p, corrected_efficiency, error_noise_stats, extrapolate,
                        optimal_correction_p, tensor_weights)
from jagg.bench.projection import PRESETS, CostStructure, gpu_bench_b_over_f, parse_cost, resolve
from jagg.cli import main
from toy import Nonlinear, perturb, run, sampled_traj

# ----------------------------------------------------------------------------- Adam's per-tensor model


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


# ----------------------------------------------------------------------------- correction_p: auto


def test_the_correction_rate_formula_on_hand_made_numbers():
    """p* = sqrt(c0 D / (c1 (V_b - D))), the maximum of SGD's efficiency over p, clipped to [p_min, 1]; 0 only where
    plain JAGG's repeating error is measured and small and plain JAGG is predicted at least as efficient."""
    assert optimal_correction_p(4, 4, 0.1, 1.0) == pytest.approx(1 / 3)
    assert optimal_correction_p(12, 4, 0.1, 1.0) == pytest.approx(math.sqrt(12 * 0.1 / (4 * 0.9)))   # a rollout in c0
    grid = np.linspace(0.01, 1, 991)
    eff = [corrected_efficiency(p, 4, 4, 8, 0.1, 1.0, 0.1) for p in grid]
    assert grid[int(np.argmax(eff))] == pytest.approx(1 / 3, abs=2e-3)
    assert corrected_efficiency(1.0, 4, 4, 8, 0.1, 1.0, 0.1) == pytest.approx(1.0)      # p = 1 is exact
    assert corrected_efficiency(0.25, 4, 4, 8, 0.1, 1.0, 0.1) == pytest.approx(8 / 5 / 1.3)
    assert corrected_efficiency(0.0, 4, 4, 8, 0.1, 1.0, 0.12) == pytest.approx(2 / 1.12)
    assert optimal_correction_p(4, 4, 1e-6, 1.0) == AUTO_P_MIN                        # clipped below
    assert optimal_correction_p(40, 4, 0.5, 1.0) == 1.0                                # clipped above
    assert optimal_correction_p(4, 4, 1.5, 1.0) == 1.0                                 # the error is the noise's
    assert math.isnan(optimal_correction_p(4, 4, math.nan, 1.0)) and math.isnan(optimal_correction_p(4, 4, 0.1, 0.0))
    args = (4, 4, 8, 0.1, 1.0, 0.1)                    # c0, c1, c_exact, D, V_b, plain JAGG's E|e|^2
    assert choose_correction_p(*args, 0.0, 1e-5) == 0.0                                # no repeating error: plain
    assert choose_correction_p(*args, 3e-5, 1e-5) == pytest.approx(1 / 3)             # z = 3: corrected
    assert choose_correction_p(*args, 1e-5, AUTO_BIAS_BOUND) == pytest.approx(1 / 3)  # not shown small
    assert choose_correction_p(*args, math.nan, math.nan) == pytest.approx(1 / 3)     # not known yet
    assert choose_correction_p(4, 4, 8, 0.1, 1.0, 5.0, 0.0, 1e-5) == pytest.approx(1 / 3)   # plain predicted worse
    assert choose_correction_p(4, 0, 8, 0.1, 1.0, 0.1, math.nan, math.nan) == 0.0     # nothing to correct
    assert math.isnan(choose_correction_p(4, 4, 8, 0.1, math.nan, 0.1, 0.0, 1e-5))


def _audits(meter, n, err, bias=0.0, seed=0, P=20000, groups=4, **kw):
    """``n`` synthetic audits of ``groups`` prompt groups: gradients mu + N(0, 1/P) (var_j = 1), errors b + N(0,
    err/P) with |b|^2 = ``bias``; 8 prompt groups per update, 80 exact rows, 40 plain and 40 inner ones per audit."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(P, generator=g, dtype=torch.float64) * 0.01
    b = torch.randn(P, generator=g, dtype=torch.float64)
    b = b / b.norm() * math.sqrt(bias)
    for _ in range(n):
        exact = mu + torch.randn(groups, P, generator=g, dtype=torch.float64) / math.sqrt(P)
        est = exact + b + torch.randn(groups, P, generator=g, dtype=torch.float64) * math.sqrt(err / P)
        r = meter.update(exact, est, 80, 40, 8, rows_inner=40, **kw)
    return r


def test_the_meter_chooses_the_rate_from_its_audits():
    """correction_p auto in the meter: D / V_b = (err / 8) / (1 / 8) = err; p* from the audits' rows (40 plain, 40
    inner) and, with the training phase's share of the iteration, the rest of the iteration counted as rows; the
    predictions describe the estimator at the chosen rate; plain JAGG once its error is known to be tiny and to not
    repeat; the state round-trips."""
    meter = AuditMeter(sizes=[15000, 5000], seed=3)
    r = _audits(meter, 3, 0.1)
    assert r["correction_error_to_noise"] == pytest.approx(0.1, rel=0.1)
    D = r["correction_error_to_noise"]
    assert r["correction_p"] == pytest.approx(math.sqrt(D / (1 - D)))                 # c0 = c1 = 40 x 3
    p = r["correction_p"]
    assert r["error_to_noise"] == pytest.approx((1 / p - 1) * D)
    assert r["rows_ratio"] == pytest.approx(80 / (40 + 40 * p))
    assert r["predicted_efficiency"] == pytest.approx(r["rows_ratio"] / (1 + r["error_to_noise"]))
    assert r["predicted_adam_tensor_efficiency"] == pytest.approx(r["predicted_adam_efficiency"], rel=0.02)
    assert math.isnan(r["predicted_time_efficiency"])
    # half the iteration outside training, measured at the rate in use (0.25): the rate stays the rows' (a run's
    # choices do not hang on its timings), the time prediction counts the rest of the iteration as 200 more rows
    meter = AuditMeter(seed=3)
    r = _audits(meter, 4, 0.1, train_share=0.5, current_p=AUTO_START_P)
    D = r["correction_error_to_noise"]
    p = r["correction_p"]
    assert p == pytest.approx(optimal_correction_p(160, 160, D, 1.0))
    other = 0.5 / 0.5 * (160 + AUTO_START_P * 160)
    assert r["predicted_time_efficiency"] == pytest.approx((other + 320) / (other + 160 + 160 * p)
                                                           / (1 + (1 / p - 1) * D))
    # an error far below the noise, measured not to repeat: plain JAGG
    meter = AuditMeter(seed=4)
    r = _audits(meter, 3, 1e-6)
    assert r["correction_p"] == AUTO_P_MIN and r["audits"] == 3                     # not known yet: corrected
    r = _audits(meter, 2, 1e-6, seed=5)
    assert r["bias_to_noise"] + 2 * r["bias_to_noise_se"] < AUTO_BIAS_BOUND and r["correction_p"] == 0.0
    assert r["error_to_noise"] == pytest.approx(r["plain_error_to_noise"]) and r["rows_ratio"] == 2.0
    # a repeating error: corrected, however small the rest
    meter = AuditMeter(seed=6)
    r = _audits(meter, 8, 1e-6, bias=0.01)
    assert r["bias_z"] > 3 and r["correction_p"] > 0
    # the state round-trips: the next audit gives the same numbers
    meter = AuditMeter(sizes=[15000, 5000], seed=3)
    _audits(meter, 3, 0.1)
    again = AuditMeter.from_state(meter.state_dict())
    a, b = _audits(meter, 1, 0.1, seed=9), _audits(again, 1, 0.1, seed=9)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_auto_is_a_setting_of_the_trainers_not_of_the_library_call():
    cfg = EstimatorConfig(correction_p="auto")
    assert cfg.correction_p == "auto"
    for kw, msg in ((dict(correction_p="auto", correction_rates=[0.5]), "correction_rates=None"),
                    (dict(correction_p="sometimes"), "or 'auto'"), (dict(correction_p=float("nan")), "or 'auto'")):
        with pytest.raises(ValueError, match=msg):
            EstimatorConfig(**kw)
    assert EstimatorConfig(mode="exact", correction_p="auto").correction_p == "auto"   # no rate matters there
    model = Nonlinear(batch=2)
    traj = sampled_traj(model, B=2, T=4)
    with pytest.raises(ValueError, match="pass correction_p in \\[0, 1\\]"):
        run(model, traj, torch.tensor([1.0, -1.0], dtype=torch.float64), cfg)
    from jagg.training import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig

    loaded = configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=auto", "estimator.audit_every=2"])
    assert loaded.estimator.correction_p == "auto"
    with pytest.raises(ValueError, match="estimator.correction_p 'auto' needs estimator.audit_every > 0"):
        configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=auto"])   # the trainers' meter chooses
    assert configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=0.5"]).estimator.correction_p == 0.5


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


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_logs_the_rate_and_a_resume_continues_with_it(tmp_path, tiny_ckpt):
    """correction_p auto: every train record logs the rate its updates used, every audit record the meter's running
    error, bias z and predictions (global and per tensor) and the rate it chose; a run stopped after 2 iterations and
    resumed to 4 ends with the same weights, rates and audits as one that ran 4 (the rate and the meter are in the
    checkpoint)."""
    from jagg.training.checkpoint import load_latest

    extra = ("estimator.mode=jagg", "estimator.window=4", "estimator.correction_p=auto", "estimator.audit_every=1",
             "eval.every=0", "sample.prompts_per_iter=3", "reward.name=reward_plugins:brightness")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_train_args(tiny_ckpt, straight, 4, *extra)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 2, *extra)) == 0
    state, _ = load_latest(split / "checkpoints")
    assert state["meter"]["audits"] == 2 and 0 <= state["correction_p"] <= 1
    assert main(tiny_train_args(tiny_ckpt, split, 4, *extra) + ["--resume"]) == 0
    recs = _records(straight)
    train = [r for r in recs if r["kind"] == "train"]
    audits = [r for r in recs if r["kind"] == "audit"]
    assert len(train) == 4 and len(audits) == 4
    for t, a in zip(train, audits):
        assert t["correction_p"] == a["correction_p"]          # the audit comes first in an iteration
        assert a["correction_p"] == 0 or AUTO_P_MIN <= a["correction_p"] <= 1
        for key in ("error_to_noise", "plain_error_to_noise", "correction_error_to_noise", "bias_to_noise",
                    "predicted_efficiency", "predicted_adam_efficiency", "predicted_adam_tensor_efficiency"):
            assert math.isfinite(a[key]), key
        assert "bias_z" in a
    assert math.isfinite(audits[-1]["bias_z"]) and math.isfinite(audits[-1]["predicted_adam_tensor_time_efficiency"])
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s") and "time_eff" not in k
                         and k not in ("seconds", "correction_p")} for r in rs if r["kind"] != "eval"]
    other = _records(split)
    assert [r["correction_p"] for r in other if r["kind"] == "train"] == [r["correction_p"] for r in train]
    assert strip(other) == strip(recs)
    a, b = load_latest(straight / "checkpoints")[0], load_latest(split / "checkpoints")[0]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# ----------------------------------------------------------------------------- projected time


def test_the_projected_iteration_ratio_on_hand_made_numbers():
    """Per sample, in forwards of one branch: rollout T x cfg; a training row cfg_train (1 + B/F) + (cfg - cfg_train);
    a no-grad row cfg."""
    c = CostStructure("x", B_F=2.0, cfg_rollout=2, cfg_train=2, rollout_steps=10, train_steps=10)
    assert c.iteration_ratio(1.0) == 1.0
    assert c.iteration_ratio(0.5) == pytest.approx((20 + 60) / (20 + 30))
    assert c.iteration_ratio(0.5, 0.5) == pytest.approx(80 / (20 + 30 + 10))
    detached = CostStructure("y", B_F=2.0, cfg_rollout=2, cfg_train=1, rollout_steps=10, train_steps=8)
    assert detached.iteration_ratio(0.5) == pytest.approx((20 + 8 * 4) / (20 + 8 * 2))
    sd35 = PRESETS["flow_grpo_sd35"]
    assert (sd35.B_F, sd35.cfg_rollout, sd35.cfg_train, sd35.rollout_steps, sd35.train_steps) == (1.0, 2, 2, 10, 9)
    assert sd35.iteration_ratio(5 / 8) == pytest.approx((20 + 9 * 4) / (20 + 9 * 4 * 5 / 8))
    for kw, msg in ((dict(B_F=0.0), "B_F"), (dict(cfg_train=3), "cfg_train"), (dict(train_steps=11), "train_steps"),
                    (dict(rollout_steps=0), "rollout_steps")):
        with pytest.raises(ValueError, match=msg):
            CostStructure(**{**dict(name="x", B_F=2.0, cfg_rollout=2, cfg_train=2, rollout_steps=10, train_steps=10),
                             **kw})


def test_cost_structures_from_the_command_line_and_a_gpu_bench_json(tmp_path):
    job = CostStructure("custom", B_F=2.0, cfg_rollout=1, cfg_train=1, rollout_steps=10, train_steps=8)
    assert parse_cost("flow_grpo_sd35", job) is PRESETS["flow_grpo_sd35"]
    changed = parse_cost("flow_grpo_sd35:B_F=2,train_steps=10", job)
    assert changed.B_F == 2.0 and changed.train_steps == 10 and changed.name == "flow_grpo_sd35 (changed)"
    custom = parse_cost("B_F=1.5,cfg_rollout=2", job)
    assert (custom.B_F, custom.cfg_rollout, custom.rollout_steps, custom.train_steps) == (1.5, 2, 10, 8)
    for spec, msg in (("sd99", "unknown cost structure"), ("B_F=1,foo=2", "KEY=VALUE"), ("B_F=x", "not a number"),
                      ("flow_grpo_sd35:train_steps=1.5", "not an integer")):
        with pytest.raises(ValueError, match=msg):
            parse_cost(spec, job)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"config": {"lora": False, "dtype": "bf16"}, "env": {"device": "NVIDIA H200"},
                                "costs": [{"model": "sd35m", "resolution": 512, "b_over_f": 1.8},
                                          {"model": "flux", "resolution": 1024, "b_over_f": 2.1}]}))
    b_f, where = gpu_bench_b_over_f(path, "sd35m", 512)
    assert b_f == 1.8 and "full fine-tuning" in where and "NVIDIA H200" in where
    cost, line = resolve("flow_grpo_sd35", job, str(path))
    assert cost.B_F == 1.8 and "B/F 1.8" in line and "gpu_bench.py" in line
    with pytest.raises(ValueError, match="no B/F of qwen_image at 720 px .*sd35m at 512"):
        resolve("jagg_authors_qwen_image", job, str(path))
    with pytest.raises(ValueError, match="names its model"):
        resolve("B_F=1", job, str(path))
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="no 'costs' records"):
        gpu_bench_b_over_f(tmp_path / "old.json", "sd35m", 512)


def test_bench_quality_sets_the_meter_and_the_projection_beside_the_measurement():
    """Synthetic runs (tests/test_efficiency.py): a variant that learns at half exact's speed per update with half
    its rows; its runs' last audits predicted 0.6 per update; the projection multiplies the measured 0.5 by the
    structure's iteration ratio for half the rows."""
    from jagg.bench.quality import compare
    from test_efficiency import _run

    runs = []
    for s in (0, 1, 2):
        runs.append({**_run("exact", s, 1.0, 2.0), "meter": None, "correction_p": None})
        slow = _run("slow", s, 0.5, 1.0)
        slow["meter"] = {"audits": 10, "rows_ratio": 2.0, "predicted_efficiency": 1.0, "predicted_adam_efficiency": 1.2,
                         "predicted_adam_tensor_efficiency": 1.1, "predicted_adam_time_efficiency": 1.3 + 0.1 * s,
                         "bias_z": 0.5}
        runs.append({**slow, "correction_p": 0.3})
    cost = PRESETS["flow_grpo_sd35_full"]
    out = {r["variant"]: r for r in compare(runs, ["exact", "slow"], [0, 1, 2], "cpu", "test", cost)}
    slow = out["slow"]
    assert slow["efficiency_to_lower_final"] == pytest.approx(0.5)
    assert (slow["meter_efficiency"], slow["meter_adam_efficiency"], slow["meter_adam_tensor_efficiency"]) == \
        pytest.approx((0.5, 0.6, 0.55))
    assert slow["meter_adam_time_efficiency"] == pytest.approx(1.4) and slow["meter_bias_z"] == 0.5
    assert slow["correction_p"] == 0.3 and math.isnan(out["exact"]["meter_efficiency"])
    assert slow["projected_iter_ratio"] == pytest.approx(cost.iteration_ratio(0.5))
    assert slow["projected_time_efficiency"] == pytest.approx(0.5 * cost.iteration_ratio(0.5))
    assert out["exact"]["projected_iter_ratio"] == 1.0
    assert "projected_iter_ratio" not in compare(runs, ["exact", "slow"], [0, 1, 2], "cpu", "test")[1]
