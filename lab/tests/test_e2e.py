"""`python -m lab e2e`: whole GRPO iterations, exact against JAGG, round-robin."""

import json

import pytest

from tiny_runs import GENERIC
from lab.__main__ import main


def test_bench_e2e_round_robin(tmp_path, bench_ckpt, capsys):
    from lab.e2e import routed_limit
    from jagg.infra import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig

    out = tmp_path / "e2e.json"
    sets = [*(s for s in GENERIC if not s.startswith("estimator.mode=")),           # the variants set the mode
            f"model.checkpoint={bench_ckpt}", "sample.num_steps=8", "sample.prompts_per_iter=2", "sample.group_size=2",
            "estimator.micro_batch=4", "estimator.window=4", "estimator.jagg_frac=1.0", "threads=1",
            "grpo.drop_zero_spread=false", "sample.sde_window=null", "estimator.correction_p=0"]
    args = ["e2e", "--iterations", "2", "--variants", "jagg_fresh", "jagg_interp", "--json", str(out)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    recs = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"exact", "jagg_fresh", "jagg_interp"}
    assert recs["exact"]["iter_ratio"] == pytest.approx(1.0) and recs["exact"]["limit"] == 1.0
    # 8 trained steps, W=4: 32 backward rows exact, 16 with JAGG (two endpoints per group)
    assert recs["exact"]["backward_items"] == 32 and recs["jagg_interp"]["backward_items"] == 16
    for v in ("jagg_fresh", "jagg_interp"):
        r = recs[v]
        assert r["iter_s"] > 0 and r["sample_s"] > 0 and 1.0 < r["iter_ratio_ideal"] < r["limit"]
    assert recs["jagg_interp"]["limit"] == pytest.approx(2.0) and recs["jagg_fresh"]["limit"] == pytest.approx(1.5)
    half = configuration.load(ShapesTrainConfig, None, ["estimator.jagg_frac=0.5", "sample.num_steps=8",
                                                  "sample.sde_window=null", "estimator.window=4",
                                                  "estimator.correction_p=0", "estimator.intermediate=interp"])
    assert routed_limit(half) == pytest.approx(1 / (0.5 + 0.5 / 2))        # half the groups at the W/2 limit
    unb = configuration.load(ShapesTrainConfig, None, ["sample.num_steps=8", "sample.sde_window=null",
                                                 "estimator.intermediate=interp", "estimator.correction_p=0.25"])
    assert routed_limit(unb) == pytest.approx(8 / (4 + 0.25 * 4))           # unbiased, p = 0.25
    # intermediate auto: fresh inner forwards (one F each, a row costs F + 2F) in all but the first of U updates
    for u in (1, 4):
        auto = configuration.load(ShapesTrainConfig, None, ["sample.num_steps=8", "sample.sde_window=null",
                                                      "estimator.correction_p=0", "estimator.intermediate=auto",
                                                      f"grpo.updates_per_epoch={u}", "grpo.inner_epochs=1"])
        assert routed_limit(auto) == pytest.approx(8 * 3 / (4 * 3 + 4 * (u - 1) / u))
    assert "ideal" in capsys.readouterr().out
