"""The lab's tools on a real-model config (a tiny random SD3 on disk): fidelity, signal and paired seeds with the
diffusers trainer's sampler."""

import json
import math

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tiny_runs import write_sd3_config  # noqa: E402

from lab.__main__ import main  # noqa: E402


def test_signal_on_a_diffusers_config(tmp_path, sd3_dir, capsys):
    """``python -m lab signal`` on the same config: the agreement of independent LoRA gradients, JAGG's and exact's and
    their errors', with the config's reward (and the KL term), printed and written."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "signal.json"
    assert main(["signal", "--config", str(cfg), "--batches", "3", "--estimators", "config", "exact",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cos(g_i, g_j)" in text and "'pipeline.lora'" in text
    records = json.loads(out.read_text())
    assert [r["estimator"] for r in records] == ["config", "exact", "config x exact", "error (config - exact)"]
    assert all(r["reward"] == "jpeg_compressibility" and r["samples_per_batch"] == 4 for r in records)
    assert all(math.isfinite(r["cosine"]) and math.isfinite(r["cosine_se"]) for r in records)
    assert 0 < records[2]["same_batch_cosine"] <= 1 and records[0]["params"] == records[1]["params"] > 0
    assert not (tmp_path / "default_run").exists()


def test_fidelity_on_a_diffusers_config(tmp_path, sd3_dir, capsys):
    """``python -m lab fidelity --config`` on the diffusers config: the trainer's sampler draws the batch, the LoRA
    weights' gradients are compared on- and off-policy (the weights restored after) and in the routing study."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "fidelity.json"
    assert main(["fidelity", "--config", str(cfg), "--windows", "3", "--knots", "shared", "--intermediates",
                 "interp", "--fracs", "0.5", "1", "--advantages", "random", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sd3:sd3: rollout of 4 samples" in text and "Pareto table" in text and "routing" in text
    records = json.loads(out.read_text())
    tot = {r["policy"]: r for r in records if r["kind"] == "fidelity"}
    assert set(tot) == {"on", "off"} and tot["on"]["backward_items_jagg"] < tot["on"]["backward_items_exact"]
    assert all(math.isfinite(r["cosine"]) and -1 <= r["cosine"] <= 1 for r in tot.values())
    assert any(r["kind"] == "routing" for r in records) and not (tmp_path / "default_run").exists()


def test_fidelity_refuses_the_shapes_options_on_a_diffusers_config(tmp_path, capsys):
    cfg = write_sd3_config(tmp_path, tmp_path / "no_model_here")
    assert main(["fidelity", "--config", str(cfg), "--checkpoint", "builtin:tiny_dit"]) != 0
    assert "--checkpoint" in capsys.readouterr().err


def test_quality_on_a_diffusers_config(tmp_path, sd3_dir, capsys):
    """``python -m lab quality --config``: paired runs with the diffusers trainer (exact and the config's estimator, one
    seed, 2 iterations), compared on the training reward; the held-out options are refused, naming them."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    base = ["quality", "--config", str(cfg), "--seeds", "1", "--out", str(tmp_path / "q")]
    assert main([*base, "--target", "test"]) != 0
    assert "--target test" in capsys.readouterr().err
    assert main([*base, "--eval-every", "1"]) != 0
    assert "--eval-every" in capsys.readouterr().err
    small = ["--set", "sample.prompts_per_iter=2", "--set", "sample.group_size=2"]      # the user's keys win
    assert main([*base, "--quick", "--iterations", "2", *small]) == 0                   # --quick: no eval. keys
    text = capsys.readouterr().out
    assert "flow_grpo_sd35" in text                       # the family's cost preset
    records = json.loads((tmp_path / "q" / "quality.json").read_text())
    runs = [r for r in records if r["kind"] == "run"]
    assert sorted(r["variant"] for r in runs) == ["config", "exact"]
    assert all(len(r["train_curve"]) == 2 and r["test_curve"] == [] and r["iter_cpu_s"] > 0 for r in runs)
    assert (tmp_path / "q" / "exact" / "seed0" / "checkpoints").is_dir()
    assert (tmp_path / "q" / "quality.png").is_file()
