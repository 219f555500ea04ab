"""``jagg bench meter`` end to end on the tiny checkpoint: each estimator's error, bias and predicted rates against
exact on the same batches (globally, per tensor, projected onto a named cost structure), the tensors and the
intervals where an estimator's error lives, an off-policy update position, every position of the job with the
job's answer, and estimator specs refused by name. (Its options that must fit the job:
tests/test_bench_options_fit_the_job.py; on a diffusers model: tests/test_bench_diffusers.py.)"""

import json
import math

import pytest

from jagg.cli import main
from tiny_runs import meter_sets


def test_bench_meter_end_to_end(tmp_path, bench_ckpt, capsys):
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
    assert ex["iter_ratio"] == 1 and ex["target_batch"] == 32
    # measured on what one update trains: a minibatch cut as the trainer cuts it (8 samples, 4 updates; 2 prompt
    # groups cannot fill 4 updates, so auto's batching is shuffled samples here)
    assert ex["samples_per_batch"] == 2 and ex["minibatches"] == "samples"
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


@pytest.mark.parametrize("update", ["0", "all"])
def test_bench_meter_refuses_what_the_machine_cannot_hold_before_a_batch(bench_ckpt, capsys, monkeypatch, update):
    """The gradients held at an update position (float64, one per batch and estimator draw: 3 x (1 + 2 + 1) = 12 here)
    may take half the machine's memory; a byte more is refused, naming the count and what to lower, before any batch
    is sampled (one position and every position alike)."""
    import jagg.bench.meter_command as meter_command
    import jagg.infra.sizes as sizes
    import jagg.trainers.side_by_side as sbs

    for module in (sbs, meter_command):
        monkeypatch.setattr(module, "draw_batches", lambda *a, **k: pytest.fail("sampled a batch before refusing"))
    numel = {}
    real = sbs.check_held_gradients

    def small_machine(sampler, ests, batches, draws):
        numel["n"] = sum(p.numel() for p in sampler.params)
        monkeypatch.setattr(sizes, "machine_memory", lambda: 2 * 12 * 8 * numel["n"] - 1)
        return real(sampler, ests, batches, draws)

    monkeypatch.setattr(sbs, "check_held_gradients", small_machine)
    monkeypatch.setattr(meter_command, "check_held_gradients", small_machine)
    args = ["bench", "meter", "--batches", "3", "--draws", "2", "--estimator", "config", "--estimator", "plain",
            "--update", update]
    assert main(args + [a for s in meter_sets(bench_ckpt) for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert f"the meter holds 12 float64 gradients of the {numel['n']:,} trainable parameters" in err, err
    assert "more than half this machine's" in err and "--batches" in err


@pytest.mark.parametrize("spec, match", [("nope", "unknown name"), ("x:window", "not KEY=VALUE"),
                                         ("x:window=0", "window"), (":window=3", "give a name"),
                                         ("a:correction_p=auto", "estimator.correction_p: 'auto' was retired")])
def test_bench_meter_rejects_bad_estimators(spec, match):
    from jagg import EstimatorConfig
    from jagg.bench.meter_command import parse_estimator

    with pytest.raises(ValueError, match=match):
        parse_estimator(spec, EstimatorConfig())


def test_bench_meter_by_interval(tmp_path, bench_ckpt, capsys):
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
        from jagg.bench.meter_command import by_interval
        from jagg.infra import config_loader as configuration
        from jagg.trainers.shapes_config import ShapesTrainConfig

        by_interval(configuration.load(ShapesTrainConfig, None, sets), "exact", 3, 1)


def test_bench_meter_off_policy_update(tmp_path, bench_ckpt, capsys):
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


def test_bench_meter_update_all(tmp_path, bench_ckpt, capsys):
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
    assert "== update 1 of 2 per iteration" in text and "the job's per-update rate of exact's (2 updates" in text
    out.unlink()
    assert main(argv + ["--by-tensor", "plain"]) == 2                  # refused before any batch is measured
    assert "not --update all" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["bench", "meter", "--update", "every"])
    assert "argument --update" in capsys.readouterr().err
