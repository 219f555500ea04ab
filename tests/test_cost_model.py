"""The cost model (jagg.cost): the speedup limit of every estimator layout in backward-pass rows, the rows it expects
against the mean of what the estimator's plans run, the projected iteration ratio of a named cost structure
(rollout, CFG, B/F) on hand-made numbers, cost structures given on the command line or read from a GPU bench JSON;
and the rank correlation the benches report."""

import json

import pytest
import torch

from jagg.bench.common import spearman
from jagg.cost import PRESETS, CostStructure, cost_limit, gpu_bench_b_over_f, parse_cost, resolve


def test_cost_model_and_spearman():
    assert cost_limit(4, "interp") == 2.0 and cost_limit(8, "interp") == 4.0
    assert cost_limit(4, "fresh") == pytest.approx(12 / 8) and cost_limit(8, "fresh") == pytest.approx(24 / 12)
    assert cost_limit(2, "fresh") == cost_limit(2, "interp") == 1.0
    assert cost_limit(4, "interp", steps=10) == pytest.approx(10 / 6)       # groups 4, 4, 2
    # routing: half of each eligible group through JAGG; exact first/last groups count as exact
    assert cost_limit(4, "interp", steps=8, jagg_frac=0.5) == pytest.approx(24 / (2 * (0.5 * 6 + 0.5 * 12)))
    assert cost_limit(4, "interp", steps=10, exact_first=1) == pytest.approx(30 / (12 + 6 + 6))
    assert cost_limit(4, "interp", steps=10, knots="shared") == pytest.approx(10 / 4)    # knots 0, 3, 6, 9
    assert cost_limit(4, "fresh", steps=10, knots="shared") == pytest.approx(30 / (12 + 6))
    assert cost_limit(4, "interp", steps=8, correction_p=0.25) == pytest.approx(8 / (4 + 0.25 * 4))
    assert cost_limit(4, "interp", steps=8, correction_probs=[0.25, 0.0]) == pytest.approx(8 / (4 + 0.25 * 2))
    assert cost_limit(4, "interp", steps=10, exact_last=1) == pytest.approx(10 / 8)  # the last group JAGG could take
    # interval subsampling: m of n intervals kept; exact's is n / m; a knot shared with a drawn neighbour counts once
    assert cost_limit(5, "interp", steps=20, interval_frac=0.6) == pytest.approx(20 / 4)      # 2 of 4 step groups
    assert cost_limit(4, "interp", steps=10, jagg_frac=0.0, interval_frac=0.5) == pytest.approx(1.5)
    assert cost_limit(4, "interp", steps=10, knots="shared", interval_frac=0.67) == pytest.approx(10 / (10 / 3))
    assert cost_limit(4, "interp", steps=8, correction_probs=[0.5, 0.0]) == pytest.approx(8 / (4 + 0.5 * 2))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)       # ties get average ranks


@pytest.mark.parametrize("est", [
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.5, correction_p=0.25),
    dict(mode="jagg", window=4, knots="shared", interval_frac=0.67, correction_p=0.0, intermediate="fresh"),
    dict(mode="jagg", window=5, interval_frac=0.6, correction_p=0.5, exact_last_intervals=1),
    dict(mode="jagg", window=4, correction_probs=[0.5, 0.25, 1.0, 0.0], intermediate="fresh"),
    dict(mode="jagg", window=4, knots="shared", correction_p=0.5, interval_frac=0.5),
    dict(mode="exact", window=4, knots="shared", interval_frac=0.4),
])
def test_cost_model_expects_the_rows_the_plans_run(est):
    """estimator_limit's expected rows (B = 2F) against the mean over 400 plans of what they run (rows with grad,
    no-grad inner rows), for interval subsampling and the corrections on 14 trained steps."""
    from jagg import EstimatorConfig
    from jagg.cost import estimator_limit
    from jagg.knots import plan_update
    from toy import Nonlinear, sampled_traj

    torch.manual_seed(0)
    traj = sampled_traj(Nonlinear(batch=4), B=4, T=14)
    cfg = EstimatorConfig(micro_batch=64, **est)
    gen, cost = torch.Generator().manual_seed(0), []
    for _ in range(400):
        plan = plan_update(traj, cfg, generator=gen)
        rows = plan.rows
        nograd = sum(t.source[1] >= 0 for b in plan.bundles for t in b.terms) if cfg.intermediate == "fresh" else 0
        cost.append(3 * rows + nograd)
    assert 14 * 3 * 4 / (sum(cost) / len(cost)) == pytest.approx(estimator_limit(cfg, 14), rel=0.02)


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
