"""The sliding SDE window (MixGRPO): where it is at each iteration, what its settings may be, what a rollout and the
estimator do with it, and both trainers moving it (a resumed run included)."""

import copy
import json

import pytest
import torch

import jagg
from tiny_runs import real_model_config, tiny_train_args
from jagg import EstimatorConfig
from jagg.cli import main
from jagg.trainers.diffusers_config import load_config
from jagg.trainers.shapes_trainer import ShapesSampler
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import load_latest
from toy import AffineInSigma, run, sampled_traj

TIGHT = dict(rtol=1e-9, atol=1e-12)


def test_the_window_moves_stride_steps_every_n_iterations_and_returns_to_the_start():
    # span [0, 8), 4 steps, 1 step later every 3 iterations: 5 positions, then back to [0, 4)
    windows = [jagg.sliding_sde_window(i, (0, 8), 4, stride=1, every=3) for i in range(18)]
    assert windows == [(0, 4)] * 3 + [(1, 5)] * 3 + [(2, 6)] * 3 + [(3, 7)] * 3 + [(4, 8)] * 3 + [(0, 4)] * 3
    # a stride that does not divide the room left: positions 2, 5 (a third, 8, would run past 10), then 2 again
    assert [jagg.sliding_sde_window(i, (2, 10), 4, stride=3) for i in range(5)] == [(2, 6), (5, 9), (2, 6), (5, 9),
                                                                                    (2, 6)]
    # the window as large as its span never moves; disjoint windows (stride = size) tile the span
    assert {jagg.sliding_sde_window(i, (1, 5), 4, stride=2, every=1) for i in range(7)} == {(1, 5)}
    assert [jagg.sliding_sde_window(i, (0, 12), 4, stride=4, every=2) for i in range(0, 14, 2)] == [
        (0, 4), (4, 8), (8, 12), (0, 4), (4, 8), (8, 12), (0, 4)]
    for i in range(300):                          # never past the end, always its size
        a, b = jagg.sliding_sde_window(i, (3, 17), 5, stride=2, every=7)
        assert 3 <= a and b <= 17 and b - a == 5


@pytest.mark.parametrize("kw, culprit", [
    (dict(size=0), "size must be an integer >= 1"),
    (dict(size=2.5), "size must be an integer >= 1"),
    (dict(stride=0), "stride must be an integer >= 1"),
    (dict(every=0), "every must be an integer >= 1"),
    (dict(every=True), "every must be an integer >= 1"),
    (dict(size=9), "size=9 is longer than the 8 steps"),
    (dict(span=(4, 4)), r"span\) must be \[start, end\)"),
    (dict(span=(0, 8.0)), r"span\) must be \[start, end\)"),
    (dict(span=(0,)), r"span\) must be \[start, end\)"),
    (dict(iteration=-1), "iteration must be an integer >= 0"),
])
def test_bad_sliding_window_arguments_name_the_culprit(kw, culprit):
    args = dict(iteration=0, span=(0, 8), size=4, stride=1, every=1) | kw
    with pytest.raises(ValueError, match=culprit):
        jagg.sliding_sde_window(**args)


@pytest.mark.parametrize("sets, culprit", [
    (["sample.sde_window_size=4"], "sample.sde_window_size is the size of a sliding SDE window: set "
                                   "sample.sde_window_schedule=sliding"),
    (["sample.sde_window_schedule=sliding"], "needs sample.sde_window_size"),
    (["sample.sde_window_schedule=progressive"], "sample.sde_window_schedule must be one of"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=0"], "sample.sde_window_size must be an integer"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=9"], r"sample.sde_window_size=9 is longer than the 8 "
                                                                         r"steps \[0, 8\)"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window_stride=0"],
     "sample.sde_window_stride must be an integer >= 1"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window_every=0"],
     "sample.sde_window_every must be an integer >= 1"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window=null",
      "sample.timestep_fraction=0.5"], "set either sample.timestep_fraction or a sliding SDE window"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window=[0, 11]"],
     "sample.sde_window must be"),
    (["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window=[0, 10]",
      "sample.sde_type=cps", "sample.eta=0.5"], "'cps' cannot take an SDE step to sigma = 0"),
])
def test_bad_sliding_window_settings_are_refused_by_key(sets, culprit):
    with pytest.raises(ValueError, match=culprit):
        configuration.load(ShapesTrainConfig, None, ["sample.sde_window=[0, 8]", *sets])


def test_the_diffusers_config_checks_the_window_against_pipeline_num_steps(tmp_path):
    cfg = real_model_config(tmp_path)                 # pipeline.num_steps: 4, no sde_window
    ok = load_config(cfg, ["sample.sde_window_schedule=sliding", "sample.sde_window_size=2"])
    assert [ok.sample.sde_window_at(4, i) for i in (0, 25, 50, 75)] == [(0, 2), (1, 3), (2, 4), (0, 2)]
    with pytest.raises(ValueError, match=r"sde_window_size=5 is longer than the 4 steps \[0, 4\)"):
        load_config(cfg, ["sample.sde_window_schedule=sliding", "sample.sde_window_size=5"])


def test_a_fixed_window_is_the_same_every_iteration_and_no_window_trains_every_step():
    cfg = configuration.load(ShapesTrainConfig, None, ["sample.sde_window=[2, 6]"])
    assert {cfg.sample.sde_window_at(10, i) for i in range(100)} == {(2, 6)}
    none = configuration.load(ShapesTrainConfig, None, ["sample.timestep_fraction=0.5"])
    steps, mask = none.sample.sde_steps(10, 7)
    assert none.sample.sde_window_at(10, 7) is None and steps.tolist() == [0, 1, 2, 3, 4] and bool(mask.all())


def test_outside_the_window_steps_are_ode_steps_and_untrained(tiny_ckpt):
    """The trainers' draw: the SDE mask and trained steps are the iteration's window; the steps outside it are Euler
    steps of the stored velocity with log-prob 0."""
    cfg = configuration.load(ShapesTrainConfig, None, [
        f"model.checkpoint={tiny_ckpt}", "sample.num_steps=6", "sample.prompts_per_iter=2", "sample.group_size=2",
        "sample.sde_window=[0, 5]", "sample.sde_window_schedule=sliding", "sample.sde_window_size=2",
        "sample.sde_window_every=2", "sample.eta=1.0", "sample.guidance_scale=1.0"])
    sampler = ShapesSampler(cfg)
    sig = jagg.flow_sigmas(6)
    for iteration, (a, b) in ((0, (0, 2)), (3, (1, 3)), (5, (2, 4)), (6, (3, 5)), (8, (0, 2))):
        draw = sampler.draw(iteration)
        assert draw.train_steps.tolist() == list(range(a, b))
        assert draw.sde_mask.tolist() == [a <= k < b for k in range(6)]
        traj = sampler.rollout(draw).traj
        assert traj.train_steps.tolist() == list(range(a, b))
        for k in range(6):
            euler = jagg.euler_step(traj.latents[:, k], traj.velocities[:, k], sig[k].expand(4), sig[k + 1].expand(4))
            if a <= k < b:
                assert not torch.allclose(traj.latents[:, k + 1], euler) and bool((traj.log_probs[:, k] != 0).all())
            else:
                assert torch.equal(traj.latents[:, k + 1], euler) and bool((traj.log_probs[:, k] == 0).all())


@pytest.mark.parametrize("iteration", [0, 1, 3, 4])
def test_jagg_lays_its_step_groups_out_inside_the_window(iteration):
    """A window of 4 with step groups of 4 is one interval per sample, 2 knot rows instead of 4; on a model whose
    parameter-Jacobian is affine in sigma it equals exact there (the alphas are the window's sigmas, shifted
    schedule), and what the rollout stored outside the window does not enter either gradient."""
    torch.manual_seed(0)
    model, B, T = AffineInSigma(), 3, 12
    window = jagg.sliding_sde_window(iteration, (0, 12), 4, stride=2, every=1)
    steps, mask = jagg.select_train_steps(T, sde_window=window)
    traj = sampled_traj(model, B=B, T=T, train_steps=steps, sde_mask=mask)
    ref_v = jagg.reference_velocities(copy.deepcopy(model), traj)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))        # off-policy: ratios are not 1
    adv = torch.tensor([1.5, -1.0, 0.3], dtype=torch.float64)
    kw = dict(clip_range=0.05, kl_beta=0.1, micro_batch=8)
    exact_cfg = EstimatorConfig(mode="exact", **kw)
    jagg_cfg = EstimatorConfig(mode="jagg", window=4, knots="groups", jagg_frac=1.0, correction_p=0.0,
                               exact_first_intervals=0, exact_last_intervals=0, **kw)
    ge, se = run(model, traj, adv, exact_cfg, ref_velocities=ref_v)
    gj, sj = run(model, traj, adv, jagg_cfg, ref_velocities=ref_v)
    assert se.backward_items == 4 * B and sj.backward_items == 2 * B
    assert sj.intervals == sj.intervals_jagg == B
    assert ge.abs().max() > 1e-3 and torch.allclose(gj, ge, **TIGHT)
    outside = ~mask
    scrambled = copy.copy(traj)
    scrambled.velocities, scrambled.log_probs = traj.velocities.clone(), traj.log_probs.clone()
    scrambled.velocities[:, outside] += 3.0
    scrambled.log_probs[:, outside] -= 7.0
    ref_scrambled = ref_v.clone()
    ref_scrambled[:, outside] += 5.0
    assert torch.equal(run(model, scrambled, adv, exact_cfg, ref_velocities=ref_scrambled)[0], ge)
    assert torch.equal(run(model, scrambled, adv, jagg_cfg, ref_velocities=ref_scrambled)[0], gj)


SLIDING = ("sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window_every=2",
           "estimator.mode=jagg")


def _train_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]


def test_the_trainer_moves_the_window_logs_it_and_a_resumed_run_has_the_same_window(tmp_path, tiny_ckpt):
    """4 steps, a window of 2 moved every 2 iterations: starts 0, 0, 1, 1, 2, 2, 0; trained 2 steps per sample (window 2:
    exact rows). A run stopped at iteration 3 and resumed has the same windows, rewards and weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(tiny_train_args(tiny_ckpt, straight, 7, *SLIDING)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 3, *SLIDING)) == 0
    assert main(tiny_train_args(tiny_ckpt, split, 7, *SLIDING) + ["--resume"]) == 0
    a, b = _train_records(straight), _train_records(split)
    assert [r["sde_window_start"] for r in a] == [0, 0, 1, 1, 2, 2, 0]
    assert [r["sde_window_start"] for r in b] == [r["sde_window_start"] for r in a]
    assert [r["reward_mean"] for r in b] == [r["reward_mean"] for r in a]
    assert all(r["backward_items"] == 4 * 2 for r in a)            # 4 samples x the window's 2 steps
    pa, pb = load_latest(straight / "checkpoints")[0]["model"], load_latest(split / "checkpoints")[0]["model"]
    assert all(torch.allclose(pa[k], pb[k], rtol=1e-5, atol=1e-7) for k in pa)
    fixed = tmp_path / "fixed"                                      # a fixed window logs no start
    assert main(tiny_train_args(tiny_ckpt, fixed, 1, "sample.sde_window=[1, 3]")) == 0
    assert "sde_window_start" not in _train_records(fixed)[0]


def test_resuming_with_another_window_schedule_is_refused_by_key(tmp_path, tiny_ckpt, capsys):
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 1, *SLIDING)) == 0
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 2, *SLIDING, "sample.sde_window_every=3") + ["--resume"]) == 2
    assert "sample.sde_window_every" in capsys.readouterr().err
