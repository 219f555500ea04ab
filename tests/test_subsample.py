"""``mode="subsample"``: random timestep subsampling (DanceGRPO's timestep_fraction), the baseline JAGG must beat
at equal rows. Unbiased, exact at ``subsample_frac=1`` bit for bit, fresh per sample; and it runs in the trainers."""

import json

import pytest
import torch

from tiny_runs import tiny_train_args
from jagg import EstimatorConfig
from jagg.cli import main
from jagg.knots import plan_update
from toy import Nonlinear, perturb, run, sampled_traj

TIGHT = dict(rtol=1e-9, atol=1e-12)


def _case(seed=3, B=6, T=10):
    torch.manual_seed(seed)
    model = Nonlinear(batch=B)
    traj = sampled_traj(model, B=B, T=T)
    perturb(model, 0.05)
    adv = torch.linspace(-1.5, 1.5, B, dtype=torch.float64)
    return model, traj, adv


@pytest.mark.parametrize("micro_batch", [1, 4, 64])
def test_subsample_frac_one_is_exact_bit_for_bit(micro_batch):
    model, traj, adv = _case()
    ge, se = run(model, traj, adv, EstimatorConfig(mode="exact", micro_batch=micro_batch, clip_range=0.05))
    gs, ss = run(model, traj, adv, EstimatorConfig(mode="subsample", subsample_frac=1.0, micro_batch=micro_batch,
                                                   clip_range=0.05), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gs, ge)
    assert (ss.backward_items, ss.loss, ss.clip_frac) == (se.backward_items, se.loss, se.clip_frac)


def test_subsample_is_unbiased_and_trains_round_f_k_steps_per_sample():
    model, traj, adv = _case()
    B, K = 6, 10
    ge, _ = run(model, traj, adv, EstimatorConfig(mode="exact", clip_range=0.05))
    gen = torch.Generator().manual_seed(0)
    cfg = EstimatorConfig(mode="subsample", subsample_frac=0.3, clip_range=0.05)
    runs = [run(model, traj, adv, cfg, generator=gen) for _ in range(600)]
    assert all(s.backward_items == B * 3 for _, s in runs)                 # round(0.3 * 10) = 3 steps per sample
    grads = torch.stack([g for g, _ in runs])
    one = (grads[0] - ge).norm() / ge.norm()
    mean = (grads.mean(0) - ge).norm() / ge.norm()
    assert one > 0.3                                                        # one draw is far from exact ...
    assert mean < 0.2 * one                                                 # ... the mean converges (~1/sqrt(600))


def test_subsample_draws_fresh_steps_per_sample_from_the_generator():
    _, traj, _ = _case(B=8)
    cfg = EstimatorConfig(mode="subsample", subsample_frac=0.4)
    plan = plan_update(traj, cfg, generator=torch.Generator().manual_seed(1))
    steps = {}
    for b in plan.bundles:
        assert len(b.rows) == 1 and b.terms[0].weights == [(0, 10 / 4)]
        steps.setdefault(b.sample, []).append(b.rows[0])
    assert sorted(steps) == list(range(8)) and all(len(s) == 4 for s in steps.values())
    assert len({tuple(s) for s in steps.values()}) > 4                     # different samples, different steps
    again = plan_update(traj, cfg, generator=torch.Generator().manual_seed(1))
    assert [(b.sample, b.rows) for b in again.bundles] == [(b.sample, b.rows) for b in plan.bundles]
    other = plan_update(traj, cfg, generator=torch.Generator().manual_seed(2))
    assert [(b.sample, b.rows) for b in other.bundles] != [(b.sample, b.rows) for b in plan.bundles]
    tiny = plan_update(traj, EstimatorConfig(mode="subsample", subsample_frac=0.01), generator=torch.Generator())
    assert len(tiny.bundles) == 8                                             # at least one step per sample


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), "half"])
def test_subsample_frac_is_validated(bad):
    with pytest.raises(ValueError, match="subsample_frac"):
        EstimatorConfig(mode="subsample", subsample_frac=bad)


def test_trainer_runs_subsample(tmp_path, tiny_ckpt):
    """4 trained steps, subsample_frac 0.5: 2 rows per sample, 4 samples -> 8 backward rows per iteration."""
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 2, "estimator.mode=subsample",
                                "estimator.subsample_frac=0.5")) == 0
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["backward_items"] for r in train] == [8, 8]
