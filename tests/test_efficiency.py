"""The efficiency meter: its statistics on synthetic gradients with known noise, error and bias, and
``jagg bench meter`` end to end on the tiny checkpoint."""

import json
import math

import pytest
import torch

from jagg.meter import error_noise_stats, extrapolate, predicted_efficiency
from jagg.cli import main
from conftest import meter_sets


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
    assert predicted_efficiency(1.0, 0.0) == 1.0 and math.isnan(predicted_efficiency(1.0, math.nan))


def test_the_meter_gives_a_range_or_says_unknown():
    """#32: the prediction spans SGD's model at the error's upper end (+ 2 SE) to Adam's at its lower end (- 2 SE),
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
    """#32: a job of U updates per rollout learns at the mean of its updates' rates: the job's range is the mean of
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
    assert job_prediction([u0])[1]["prediction_range"] == p0["prediction_range"]      # one update per rollout
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
    assert adam_efficiency(2.0, 3.0) == pytest.approx(1.0) and math.isnan(adam_efficiency(1.0, math.nan))


def test_bench_efficiency_end_to_end(tmp_path, bench_ckpt, capsys):
    out = tmp_path / "eff.json"
    sets = meter_sets(bench_ckpt)
    args = ["bench", "meter", "--batches", "3", "--draws", "2", "--estimator", "config", "--estimator", "plain",
            "--estimator", "subsample", "--estimator", "w8:window=8,correction_p=0", "--target-batch", "32", "--by-tensor", "plain", "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    records = json.loads(out.read_text())
    recs = {r["estimator"]: r for r in records if "kind" not in r}
    assert list(recs) == ["exact", "config", "plain", "subsample", "w8"]
    ex = recs["exact"]
    assert ex["rows_per_sample"] == 8 and ex["error_to_noise"] == 0 and ex["efficiency"] == 1
    assert ex["iter_ratio"] == 1 and ex["samples_per_batch"] == 8 and ex["target_batch"] == 32
    # W = 4 groups on 8 steps: 4 rows plain, 4 + 0.25 x 4 on average with the config's correction (meter_sets)
    assert recs["plain"]["rows_per_sample"] == 4 and recs["plain"]["draws"] == 1
    assert 4 <= recs["config"]["rows_per_sample"] <= 8 and recs["config"]["draws"] == 2
    assert recs["w8"]["rows_per_sample"] == 2 and recs["w8"]["estimator_config"]["window"] == 8
    # subsample at the config's rows: round(8 x 5/8) = 5 steps per sample, weighted 8 / 5
    assert recs["subsample"]["rows_per_sample"] == 5 and recs["subsample"]["mode"] == "subsample"
    for r in recs.values():
        for key in ("error_to_noise", "bias_to_noise", "bias_to_noise_se", "efficiency", "time_efficiency",
                    "adam_efficiency", "adam_time_efficiency", "error_to_noise_at_target", "efficiency_at_target",
                    "adam_time_efficiency_at_target", "noise"):
            assert math.isfinite(r[key]), (r["estimator"], key)
        e2n = max(r["error_to_noise"], 0)
        assert r["efficiency"] == pytest.approx(r["rows_ratio"] / (1 + e2n))
        assert r["adam_time_efficiency"] == pytest.approx(r["iter_ratio"] / math.sqrt(1 + e2n))
        assert r["bias_z"] == pytest.approx(r["bias_to_noise"] / r["bias_to_noise_se"]) if r["bias_to_noise"] else True
    assert recs["plain"]["error_to_noise"] > 0 and recs["plain"]["same_batch_cosine"] < 1
    out_text = capsys.readouterr().out
    assert "Adam time eff." in out_text
    assert recs["exact"]["bias_z"] == 0 and recs["exact"]["adam_efficiency"] == 1
    # Adam per tensor, beside the global model; the projected columns of the default cost structure
    from jagg.cost import DEFAULT, PRESETS

    cost = PRESETS[DEFAULT]
    for r in recs.values():
        assert r["adam_tensor_time_efficiency"] == pytest.approx(r["iter_ratio"] * r["adam_tensor_factor"])
        assert r["adam_tensor_efficiency_at_target"] == pytest.approx(r["rows_ratio"] * r["adam_tensor_factor_at_target"])
        assert sum(t["numel"] for t in r["tensors"]) == sum(t["numel"] for t in recs["exact"]["tensors"])
        assert sum(t["weight"] for t in r["tensors"]) == pytest.approx(1.0)
        assert r["projected_iter_ratio"] == pytest.approx(cost.iteration_ratio(1 / r["rows_ratio"]))
        assert r["projected_adam_time_efficiency"] == pytest.approx(r["projected_iter_ratio"] / math.sqrt(1 + max(
            r["error_to_noise"], 0)))
        assert r["cost_structure"].startswith(f"{DEFAULT}: B/F")
    assert recs["w8"]["projected_iter_ratio"] > recs["plain"]["projected_iter_ratio"] > 1
    assert "projected, not measured" in out_text and "flow_grpo_sd35: B/F 1" in out_text
    # --by-tensor: the tensors carrying most of plain JAGG's error
    parts = [r for r in records if r.get("kind") == "tensor"]
    assert parts and all(p["estimator"] == "plain" for p in parts) and "by parameter tensor" in out_text
    shares = [p["error_share"] for p in parts]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert main(["bench", "meter", "--by-tensor", "nope", "--estimator", "plain"]) == 2     # before any batch
    assert "--by-tensor 'nope': not one of the estimators" in capsys.readouterr().err


@pytest.mark.parametrize("spec, match", [("nope", "unknown name"), ("x:window", "not KEY=VALUE"),
                                         ("x:window=0", "window"), (":window=3", "give a name"),
                                         ("a:correction_p=auto", "estimator.correction_p: 'auto' was retired")])
def test_bench_efficiency_rejects_bad_estimators(spec, match):
    from jagg import EstimatorConfig
    from jagg.bench.meter import parse_estimator

    with pytest.raises(ValueError, match=match):
        parse_estimator(spec, EstimatorConfig())


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


def test_trainer_audit_logs_the_meter_and_warns_once(tmp_path, tiny_ckpt, capsys):
    from conftest import tiny_train_args

    args = tiny_train_args(tiny_ckpt, tmp_path, 5, "estimator.mode=jagg", "estimator.window=4",
                           "estimator.correction_p=0", "estimator.meter_every=1", "estimator.meter_samples=2",
                           "eval.every=0", "sample.prompts_per_iter=3", "reward.name=reward_plugins:brightness")
    assert main(args) == 0
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    audits = [r for r in recs if r["kind"] == "audit"]
    assert [r["audits"] for r in audits] == [1, 2, 3, 4, 5]
    for r in audits:
        assert r["samples"] == 4 and r["rows_exact"] == 16 and r["rows_estimator"] == 8   # 2 groups of 2; 4 steps
        assert math.isfinite(r["error_to_noise"]) and r["error_to_noise"] > 0
        assert r["predicted_efficiency"] == pytest.approx(2 / (1 + r["error_to_noise"]))
        assert r["predicted_adam_efficiency"] == pytest.approx(2 / math.sqrt(1 + r["error_to_noise"]))
    assert math.isnan(audits[0]["predicted_time_efficiency"]) and math.isfinite(audits[1]["predicted_time_efficiency"])
    out = capsys.readouterr().out
    assert out.count("audit: this estimator") <= 2          # each warning at most once per run


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


def test_bench_efficiency_by_interval(tmp_path, bench_ckpt, capsys):
    """--by-interval: each interval's error alone; an interval the layout keeps exact has none, and the noisy one's
    equals the whole estimator's when it is the only JAGG interval."""
    out = tmp_path / "eff.json"
    sets = ["reward.weights=null", "reward.name=reward_plugins:brightness", f"model.checkpoint={bench_ckpt}",
            "sample.num_steps=8", "sample.prompts_per_iter=2", "sample.group_size=4", "estimator.micro_batch=8",
            "threads=1", "sample.sde_window=null", "grpo.drop_zero_spread=false"]
    spec = "el:window=4,exact_last_intervals=1,correction_p=0"
    args = ["bench", "meter", "--batches", "3", "--estimator", spec, "--by-interval", spec,
            "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    recs = json.loads(out.read_text())
    parts = [r for r in recs if r.get("kind") == "interval"]
    whole = next(r for r in recs if r.get("estimator") == "el" and r.get("kind") is None)
    assert [p["steps"] for p in parts] == ["0-3", "4-7"]
    assert parts[1]["error_to_noise"] == 0 and parts[1]["same_batch_cosine"] == pytest.approx(1.0)
    assert parts[0]["error_to_noise"] > 0
    assert parts[0]["error_to_noise"] == pytest.approx(whole["error_to_noise"], rel=1e-6)
    assert "where el's error lives" in capsys.readouterr().out
    with pytest.raises(ValueError, match="JAGG estimator"):
        from jagg.bench.meter import by_interval
        from jagg.infra import config_loader as configuration
        from jagg.trainers.shapes_config import ShapesTrainConfig

        by_interval(configuration.load(ShapesTrainConfig, None, sets), "exact", 3, 1)


def test_bench_efficiency_off_policy_update(tmp_path, bench_ckpt, capsys):
    """--update N measures every estimator where a rollout's (N+1)-th update starts: off-policy, ``auto`` (fresh inner
    forwards) clips exactly what exact clips and ``stale`` runs no inner forward; on-policy (--update 0) ``auto`` is
    ``interp``. (That ``interp`` clips more than exact off-policy: tests/test_off_policy.py.)"""
    out = tmp_path / "eff.json"
    sets = meter_sets(bench_ckpt) + ["estimator.correction_p=0", "optim.lr=1e-3"]
    est = ["--estimator", "interp:intermediate=interp", "--estimator", "auto:intermediate=auto",
           "--estimator", "stale:intermediate=stale"]
    base = ["bench", "meter", "--batches", "3", "--draws", "1", *est, "--json", str(out)]
    assert main(base + ["--update", "1"] + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["estimator"]: r for r in json.loads(out.read_text()) if r.get("kind") is None}
    assert all(r["update"] == 1 for r in recs.values())
    assert recs["auto"]["clip_frac"] == recs["exact"]["clip_frac"] > 0
    assert recs["auto"]["nograd_per_sample"] == 4 and recs["stale"]["nograd_per_sample"] == 0
    assert "off-policy: update 1 of each rollout" in capsys.readouterr().out
    out.unlink()
    assert main(base + ["--update", "0"] + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["estimator"]: r for r in json.loads(out.read_text()) if r.get("kind") is None}
    assert recs["auto"]["error_to_noise"] == recs["interp"]["error_to_noise"] and recs["auto"]["nograd_per_sample"] == 0
    with pytest.raises(SystemExit):
        main(["bench", "meter", "--update", "-1"])
    assert "argument --update" in capsys.readouterr().err


def test_bench_efficiency_update_all(tmp_path, bench_ckpt, capsys):
    """--update all measures each of the job's update positions (inner_epochs x updates_per_epoch) in turn and adds the
    job's answer (:func:`job_prediction` of those very records) to the table and the JSON."""
    from jagg.verdict import job_prediction

    out = tmp_path / "eff.json"
    sets = meter_sets(bench_ckpt) + ["grpo.updates_per_epoch=2", "sample.group_size=4", "optim.lr=1e-3"]
    argv = ["bench", "meter", "--batches", "3", "--draws", "1", "--estimator", "plain", "--update", "all",
            "--json", str(out), *[a for s in sets for a in ("--set", s)]]
    assert main(argv) == 0
    recs = json.loads(out.read_text())
    per = [[r for r in recs if r.get("kind") is None and r["update"] == u] for u in (0, 1)]
    assert [[r["estimator"] for r in p] for p in per] == [["exact", "plain"]] * 2
    job = [r for r in recs if r.get("kind") == "job"]
    assert job == json.loads(json.dumps(job_prediction(per)))
    for p in per:                     # routing's score of plain JAGG's layout (step groups of 4), none for exact's
        assert p[0]["linearity"] is None or math.isnan(p[0]["linearity"])
        assert -1 <= p[1]["linearity_min"] <= p[1]["linearity"] <= 1
    assert per[0][1]["linearity"] == per[1][1]["linearity"]          # the same rollouts, at other parameters
    text = capsys.readouterr().out
    assert "== update 1 of 2 per rollout" in text and "the job's per-update rate of exact's (2 updates" in text
    out.unlink()
    assert main(argv + ["--by-tensor", "plain"]) == 2                  # refused before any batch is measured
    assert "not --update all" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["bench", "meter", "--update", "every"])
    assert "argument --update" in capsys.readouterr().err
