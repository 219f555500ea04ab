"""The efficiency meter of #26: Adam's per-tensor model (checked on torch's Adam), its state (round trip, the trainer's
log and resume), ``correction_p: auto`` retired (#32), the projected time of a named cost structure, and the audit's
per-prompt-group gradients."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import tiny_train_args
from jagg import EstimatorConfig
from jagg.audit import audit_parts
from jagg.meter import Meter, adam_efficiency, adam_tensor_factor, error_noise_stats, extrapolate, tensor_weights
from jagg.cost import PRESETS, CostStructure, gpu_bench_b_over_f, parse_cost, resolve
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


# ----------------------------------------------------------------------------- the meter's state; auto retired


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


def test_correction_p_auto_is_retired_with_a_clear_error(tmp_path):
    """#32: ``correction_p: auto`` is refused by name wherever it can come from (the library's config, a config file,
    --set, a checkpoint to resume), saying it was retired and what to give instead; other words stay number errors."""
    from jagg.trainers.base import check_resumable
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig

    retired = "'auto' was retired \\(the rate the meter chose fell 12-15% short.*give a fixed rate in \\[0, 1\\] instead, e.g. 0 .* or 0.25, " \
              "chosen with jagg bench meter"
    with pytest.raises(ValueError, match="^correction_p " + retired):
        EstimatorConfig(correction_p="auto")
    with pytest.raises(ValueError, match="^estimator.correction_p: " + retired):
        configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=auto", "estimator.meter_every=2"])
    path = tmp_path / "old.yaml"
    path.write_text("estimator:\n  correction_p: auto\n  meter_every: 1\n")
    with pytest.raises(ValueError, match="^estimator.correction_p: " + retired):
        configuration.load(ShapesTrainConfig, str(path))
    with pytest.raises(ValueError, match="correction_p must be a finite number in \\[0, 1\\]"):
        EstimatorConfig(correction_p="sometimes")
    with pytest.raises(ValueError, match="estimator.correction_p: expected a number, got 'sometimes'"):
        configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=sometimes"])
    assert configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=0.5"]).estimator.correction_p == 0.5
    now = {"estimator": {"correction_p": 0.25, "meter_every": 1}}
    with pytest.raises(ValueError, match="^cannot resume: the checkpoint was trained with estimator.correction_p "
                                         "'auto', which was retired .*fixed rate.*start a new run in another directory"):
        check_resumable({"estimator": {"correction_p": "auto", "meter_every": 1}}, now)
    assert check_resumable({"estimator": {"correction_p": 0.25, "meter_every": 1}}, now) == []


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


def test_the_trainer_logs_the_meter_and_a_resume_continues_it(tmp_path, tiny_ckpt):
    """Every audit record holds the meter's running error, bias z and predictions (global and per tensor); a run
    stopped after 2 iterations and resumed to 4 ends with the same weights and audits as one that ran 4 (the meter is
    in the checkpoint)."""
    from jagg.infra.checkpoint import load_latest

    extra = ("estimator.mode=jagg", "estimator.window=4", "estimator.correction_p=0.25", "estimator.meter_every=1",
             "eval.every=0", "sample.prompts_per_iter=3", "reward.name=reward_plugins:brightness")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_train_args(tiny_ckpt, straight, 4, *extra)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 2, *extra)) == 0
    state, _ = load_latest(split / "checkpoints")
    assert state["meter"]["audits"] == 2 and "correction_p" not in state
    assert main(tiny_train_args(tiny_ckpt, split, 4, *extra) + ["--resume"]) == 0
    recs = _records(straight)
    train = [r for r in recs if r["kind"] == "train"]
    audits = [r for r in recs if r["kind"] == "audit"]
    assert len(train) == 4 and len(audits) == 4 and "correction_p" not in train[0]
    for a in audits:
        for key in ("error_to_noise", "bias_to_noise", "predicted_efficiency", "predicted_adam_efficiency",
                    "predicted_adam_tensor_efficiency"):
            assert math.isfinite(a[key]), key
        assert "bias_z" in a and "correction_p" not in a
    assert math.isfinite(audits[-1]["bias_z"]) and math.isfinite(audits[-1]["predicted_adam_tensor_time_efficiency"])
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s") and "time_eff" not in k
                         and k != "seconds"} for r in rs if r["kind"] != "eval"]
    assert strip(_records(split)) == strip(recs)
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


