"""benchmarks/gpu_bench.py: the --scaled-down smoke run on the CPU, its JSON, the time budget, and the full-size
configs (built on the meta device: no memory, no download)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = mod                  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_scaled_down_run_writes_table_and_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--scaled-down", "--out", str(out)])
    text = capsys.readouterr().out
    assert "speedup" in text and f"wrote {out}" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 3 * 2 * 6 == len(result["rows"])        # models x resolutions x (exact, W2, W4 x2, W8 x2)
    assert all(r["status"] == "ok" and r["seconds"] > 0 for r in rows)
    by = {(r["model"], r["resolution"], r["mode"], r["window"], r["intermediate"]): r for r in rows}
    for model in ("sd35m", "flux", "qwen_image"):
        for res in (512, 1024):
            k = (model, res)
            assert by[k + ("exact", 1, "-")]["backward_items"] == 8      # 1 sample x 8 trained steps
            assert by[k + ("jagg", 2, "-")]["backward_items"] == 8
            assert by[k + ("jagg", 4, "fresh")]["backward_items"] == 4
            assert by[k + ("jagg", 4, "fresh")]["forward_nograd_items"] == 4
            assert by[k + ("jagg", 8, "interp")]["backward_items"] == 2
            assert by[k + ("jagg", 8, "interp")]["forward_nograd_items"] == 0
            assert by[k + ("jagg", 8, "fresh")]["cost_limit"] == pytest.approx(2.0)
            assert by[k + ("jagg", 8, "interp")]["cost_limit"] == pytest.approx(4.0)
    assert data["config"]["scaled_down"] is True and data["env"]["torch"] == torch.__version__
    # one branch's forward and backward per model and resolution: the B/F that --gpu-bench-json reads
    costs = {(c["model"], c["resolution"]): c for c in data["costs"]}
    assert set(costs) == {(m, r) for m in ("sd35m", "flux", "qwen_image") for r in (512, 1024)}
    for c in costs.values():
        assert c["f_grad_s"] > 0 and c["backward_s"] > 0 and c["b_over_f"] == pytest.approx(c["backward_s"] / c["f_grad_s"])
    from jagg.cost import gpu_bench_b_over_f

    assert gpu_bench_b_over_f(out, "sd35m", 512)[0] == costs[("sd35m", 512)]["b_over_f"]
    assert "B/F" in text


def test_bf16_path_and_time_budget(bench, tmp_path):
    r = bench.main(["--scaled-down", "--dtype", "bf16", "--models", "sd35m", "--resolutions", "512", "--windows", "4",
                    "--intermediates", "interp", "--autocast", "--detach-uncond", "--clock", "process",
                    "--out", str(tmp_path / "a.json")])
    assert [x["status"] for x in r["rows"]] == ["ok", "ok"]
    assert r["config"]["detach_uncond"] is True and r["config"]["clock"] == "process"
    with pytest.raises(ValueError, match="choose one of --scaled-down"):
        bench.main(["--scaled-down", "--small"])
    r = bench.main(["--scaled-down", "--time-budget", "0", "--out", str(tmp_path / "b.json")])
    assert r["rows"] and all(x["status"].startswith("skipped") for x in r["rows"])
    with pytest.raises(ValueError, match="micro-batch"):
        bench.main(["--scaled-down", "--micro-batch", "1"])


def test_full_size_configs_build(bench):
    import diffusers

    counts = {}
    for name, spec in bench.FULL.items():
        with torch.device("meta"):
            model = getattr(diffusers, spec["cls"])(**spec["config"])
        counts[name] = sum(p.numel() for p in model.parameters())
    assert 2.2e9 < counts["sd35m"] < 2.6e9          # SD3.5-Medium transformer
    assert 11.8e9 < counts["flux"] < 12.0e9         # FLUX.1-dev transformer
    assert 20.3e9 < counts["qwen_image"] < 20.5e9   # Qwen-Image transformer (20.4B)
    assert 1.40e9 < counts["wan_1_3b"] < 1.44e9     # Wan 2.1 T2V "1.3B" transformer (1.42B)


def test_wan_scaled_down_runs_on_video_latents(bench, tmp_path):
    """--models wan_1_3b (not in the default list): Wan 2.1 with CFG on 2 latent frames at Flow-GRPO's aspect."""
    r = bench.main(["--scaled-down", "--models", "wan_1_3b", "--resolutions", "512", "--windows", "4",
                    "--intermediates", "interp", "--out", str(tmp_path / "wan.json")])
    assert [(x["model"], x["mode"], x["status"], x["backward_items"]) for x in r["rows"]] == [
        ("wan_1_3b", "exact", "ok", 8), ("wan_1_3b", "jagg", "ok", 4)]
    assert bench.latent_shape(bench.FULL["wan_1_3b"], 240 // 8) == (16, 9, 30, 52)     # 33 frames at 240 x 416
    assert r["costs"][0]["model"] == "wan_1_3b" and r["costs"][0]["b_over_f"] > 0


def test_sharded_full_finetuning_scaled_down(bench, tmp_path, capsys):
    """--sharded: full fine-tuning through jagg train's FSDP engine (a process group of one on the CPU): every update
    with its AdamW step, this process's stored elements, the computed per-GPU memory."""
    r = bench.main(["--scaled-down", "--sharded", "--models", "sd35m,qwen_image", "--resolutions", "512",
                    "--windows", "4", "--intermediates", "interp", "--out", str(tmp_path / "sharded.json")])
    assert [(x["model"], x["mode"], x["status"], x["backward_items"]) for x in r["rows"]] == [
        ("sd35m", "exact", "ok", 8), ("sd35m", "jagg", "ok", 4), ("qwen_image", "exact", "ok", 8),
        ("qwen_image", "jagg", "ok", 4)]
    for x in r["rows"]:
        assert x["processes"] == 1 and x["param_local"] == x["params"] == x["trainable"]   # full fine-tuning, 1 shard
        assert x["params"] < x["adam_local"] <= 2 * x["params"] and x["seconds"] > 0   # moments of the used weights
        assert x["computed_gb"] == pytest.approx(16 * x["params"] / 2**30)
    assert "sharded over 1 process(es)" in capsys.readouterr().out


def test_memory_table_is_the_documented_one(bench, capsys):
    """docs/real_models.md's table of per-GPU memory under FSDP is what --memory-table computes."""
    assert bench.sharded_memory(8 * 2**30, 8, reference=True) == dict(weights=4.0, gradients=4.0, adamw=8.0,
                                                                     reference=2.0, total=18.0)
    table = bench.main(["--memory-table"])["memory_table"]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "real_models.md").read_text()
    assert table in docs and "| Qwen-Image | 20.43B |" in table
