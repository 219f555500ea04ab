"""The meter inside a training run (``estimator.meter_every``): every audit record holds the meter's running error,
bias and predictions (global and per tensor), its warnings come at most once per run, and a run stopped and resumed
continues the meter from its checkpoint to the same audits and weights as one that never stopped."""

import math

import pytest
import torch

from jagg.cli import main
from tiny_runs import records, tiny_train_args


def test_trainer_audit_logs_the_meter_and_warns_once(tmp_path, tiny_ckpt, capsys):
    args = tiny_train_args(tiny_ckpt, tmp_path, 5, "estimator.mode=jagg", "estimator.window=4",
                           "estimator.correction_p=0", "estimator.meter_every=1", "estimator.meter_samples=2",
                           "eval.every=0", "sample.prompts_per_iter=3", "reward.name=reward_plugins:brightness")
    assert main(args) == 0
    recs = records(tmp_path)
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
    recs = records(straight)
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
    assert strip(records(split)) == strip(recs)
    a, b = load_latest(straight / "checkpoints")[0], load_latest(split / "checkpoints")[0]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
