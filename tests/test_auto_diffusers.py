"""``estimator.mode: auto`` in the diffusers trainer, on a tiny random SD3 with LoRA: the pre-flight measures the
candidates on the run's own model and reward, records its decision, counts its seconds in the run's clocks, and a
pre-flight that picks exact leaves the run identical to an exact run (its batches drawn with RNGs of its own)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tiny_runs import records, write_sd3_config  # noqa: E402

from jagg.cli import main  # noqa: E402


def _weights(out) -> dict:
    return torch.load(sorted((out / "checkpoints").glob("ckpt_*.pt"))[-1], weights_only=False)["model"]


def test_auto_on_a_diffusers_model_decides_records_and_trains_as_exact(tmp_path, sd3_dir, capsys, monkeypatch):
    """The real-model trainer measures while it trains as the shapes trainer does: a measurement that picks exact
    (a margin of 100) is update for update the exact run with the same batching, every position measured."""
    import jagg.trainers.auto as auto_mod

    monkeypatch.setattr(auto_mod.AutoEstimator, "_too_costly", lambda self: None)
    cfg = write_sd3_config(tmp_path, sd3_dir)
    sets = ["grpo.iterations=4", "estimator.preflight_batches=3", "estimator.preflight_share=1",
            "estimator.candidates=[\"g3:window=3\"]", "estimator.preflight_margin=100", "grpo.minibatches=groups"]
    runs = {}
    for mode in ("exact", "auto"):
        runs[mode] = out = tmp_path / mode
        argv = ["train", "--config", str(cfg), "--output-dir", str(out), "--set", f"estimator.mode={mode}"]
        assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    screen = capsys.readouterr().out
    assert "the first 3 iterations train exact and measure g3" in screen and "\ntrain with exact: " in screen
    assert "minibatches of whole prompt groups (grpo.minibatches groups)" in screen
    decision = json.loads((runs["auto"] / "preflight.json").read_text())
    assert decision["train_with"] == "exact" and decision["measured_updates"] == 2 and decision["updates"] == 2
    assert decision["measured_iterations"] == 3 and {r["estimator"] for r in decision["records"]} == {"exact", "g3"}
    a, e = records(runs["auto"]), records(runs["exact"])
    (pre,) = [r for r in a if r["kind"] == "preflight"]
    ta, te = [r for r in a if r["kind"] == "train"], [r for r in e if r["kind"] == "train"]
    assert [r["reward_mean"] for r in ta] == [r["reward_mean"] for r in te]
    assert [(r["loss"], r["grad_norm"], r["backward_items"]) for r in ta] == [
        (r["loss"], r["grad_norm"], r["backward_items"]) for r in te]
    assert pre["preflight_cpu_s"] > 0
    wa, we = _weights(runs["auto"]), _weights(runs["exact"])
    assert wa.keys() == we.keys() and all(torch.equal(wa[k], we[k]) for k in wa)
