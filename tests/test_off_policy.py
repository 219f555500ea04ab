"""Off-policy updates (after an optimizer step on the rollout): ``interp`` extrapolates the inner steps' velocities
and its error enters their ratios and clip decisions; ``intermediate="auto"`` runs ``fresh`` there, so the inner
steps' ratios, clipping and approx-KL are exact's; on-policy it is ``interp`` bit for bit (float64)."""

import dataclasses
import warnings

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg.estimator import inner_velocities
from toy import Nonlinear, perturb, run, sampled_traj

INNER = [1, 2, 5, 6]           # step groups of 4 over trained steps 0-9: knots 0, 3, 4, 7, 8, 9


def _case(scale: float = 0.05):
    """A rollout of the toy model, then the model moved as an optimizer step would (off-policy)."""
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=11)
    perturb(model, scale)
    return model, traj, torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)


def _inner_stats(model, traj, adv, cfg, **kw):
    return run(model, traj, adv, cfg, only_steps=INNER, prompt_groups=[0, 0, 1, 1, 2, 2], **kw)[1]


def _clip_range_for_half(model, traj, adv) -> float:
    """A clip range at which about half of exact's inner terms are clipped: the median |log ratio|."""
    with torch.no_grad():
        lp = []
        for k in INNER:
            B = traj.batch_size
            v = model(traj.latents[:, k], traj.sigmas[k].expand(B), torch.arange(B))
            out = jagg.sde.step_loss(v, traj.latents[:, k], traj.latents[:, k + 1], traj.sigmas[k].expand(B),
                                     traj.sigmas[k + 1].expand(B), float(traj.sigmas[1]), traj.eta,
                                     traj.log_probs[:, k], adv, 1.0, reduction=traj.logprob_reduction)
            lp.append((out.log_prob - traj.log_probs[:, k]).abs())
    return float(torch.cat(lp).median())


@pytest.mark.parametrize("intermediate", ["auto", "fresh"])
def test_off_policy_inner_ratios_and_clipping_are_exacts(intermediate):
    """Off-policy, the shipped setting's inner terms have exact's ratios, clip decisions and approx-KL (to rounding):
    their velocities come from a fresh forward at the current parameters."""
    model, traj, adv = _case()
    eps = _clip_range_for_half(model, traj, adv)
    exact = _inner_stats(model, traj, adv, EstimatorConfig(mode="exact", clip_range=eps))
    assert 0.2 < exact.clip_frac < 0.8                       # the clip decisions are not all alike
    cfg = EstimatorConfig(mode="jagg", window=4, intermediate=intermediate, correction_p=0.0, clip_range=eps)
    est = _inner_stats(model, traj, adv, cfg, on_policy=False)
    assert est.clip_frac == exact.clip_frac
    assert est.ratio_mean == pytest.approx(exact.ratio_mean, rel=1e-12)
    assert est.approx_kl == pytest.approx(exact.approx_kl, rel=1e-9)
    assert est.forward_nograd_items == 6 * len(INNER)       # one no-grad row per inner term


def test_interp_off_policy_ratios_are_not_exacts_and_warn():
    """What the fix is for: ``interp`` after an optimizer step gives the inner terms other ratios and clip decisions
    than exact (this test fails if interp were exact off-policy), and says so."""
    model, traj, adv = _case()
    eps = _clip_range_for_half(model, traj, adv)
    exact = _inner_stats(model, traj, adv, EstimatorConfig(mode="exact", clip_range=eps))
    cfg = EstimatorConfig(mode="jagg", window=4, intermediate="interp", correction_p=0.0, clip_range=eps)
    with pytest.warns(UserWarning, match="off-policy"):
        est = _inner_stats(model, traj, adv, cfg, on_policy=False)
    assert abs(est.approx_kl - exact.approx_kl) > 0.05 * exact.approx_kl
    assert est.forward_nograd_items == 0


def test_auto_on_policy_is_interp_bit_for_bit():
    """On-policy, ``auto`` is ``interp``: the same gradient and statistics bit for bit, and no forward of the inner
    steps (interp is exact there)."""
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=11)
    adv = torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)
    base = EstimatorConfig(mode="jagg", window=4, correction_p=0.0)
    g_i, st_i = run(model, traj, adv, dataclasses.replace(base, intermediate="interp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # no off-policy warning on-policy
        g_a, st_a = run(model, traj, adv, dataclasses.replace(base, intermediate="auto"), on_policy=True)
    assert torch.equal(g_a, g_i)
    assert st_a.to_dict() == st_i.to_dict() and st_a.forward_nograd_items == 0


@pytest.mark.parametrize("on_policy", [False, None])
def test_auto_off_policy_or_unknown_is_fresh_bit_for_bit(on_policy):
    """Off-policy, or when the caller does not say, ``auto`` is ``fresh`` bit for bit."""
    model, traj, adv = _case()
    base = EstimatorConfig(mode="jagg", window=4, correction_p=0.0)
    g_f, st_f = run(model, traj, adv, dataclasses.replace(base, intermediate="fresh"))
    g_a, st_a = run(model, traj, adv, dataclasses.replace(base, intermediate="auto"), on_policy=on_policy)
    assert torch.equal(g_a, g_f) and st_a.to_dict() == st_f.to_dict()


def test_inner_velocities_rule_and_bad_on_policy():
    auto, interp = EstimatorConfig(intermediate="auto"), EstimatorConfig(intermediate="interp")
    assert [inner_velocities(auto, x) for x in (True, False, None)] == ["interp", "fresh", "fresh"]
    assert inner_velocities(interp, True) == "interp" and inner_velocities(EstimatorConfig(intermediate="fresh"),
                                                                           True) == "fresh"
    with pytest.raises(TypeError, match="on_policy"):
        inner_velocities(auto, 1)
    with pytest.raises(ValueError, match="intermediate must be one of"):
        EstimatorConfig(intermediate="fresher")


def test_trainer_passes_on_policy_to_the_first_update_of_each_rollout(tmp_path, monkeypatch):
    """The trainers call the estimator with ``on_policy=True`` on a rollout's first update only (every later update of
    its epochs follows an optimizer step), so ``auto`` runs no inner forward there and ``fresh`` in the others."""
    from jagg.trainers import shapes_trainer as shapes_mod
    from jagg.trainers.shapes_trainer import ShapesGRPO
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.infra.config_loader import load

    seen = []
    real = shapes_mod.policy_gradient

    def spy(*args, on_policy=None, **kw):
        st = real(*args, on_policy=on_policy, **kw)
        seen.append((on_policy, st.forward_nograd_items))
        return st

    monkeypatch.setattr(shapes_mod, "policy_gradient", spy)
    cfg = load(ShapesTrainConfig, None, [
        "sample.prompts_per_iter=2", "sample.group_size=2", "sample.num_steps=6", "sample.sde_window=[0,6]",
        "estimator.mode=jagg", "estimator.window=3", "estimator.intermediate=auto", "estimator.correction_p=0",
        "grpo.updates_per_epoch=2", "grpo.inner_epochs=2", "grpo.drop_zero_spread=false", "threads=1",
        f"log.output_dir={tmp_path / 'run'}"])
    trainer = ShapesGRPO(cfg)
    for _ in range(2):
        trainer.step()
    assert [on for on, _ in seen] == [True, False, False, False] * 2
    assert all((n == 0) == on for on, n in seen)              # interp on-policy, fresh forwards off-policy


def _audits_of(monkeypatch, path, sets: list[str], iterations: int) -> list[dict]:
    """The audit results (with the ``on_policy`` each was told) of ``iterations`` iterations of a shapes run of the
    config ``path`` (None: the defaults) and ``sets``."""
    from jagg.trainers import loop
    from jagg.trainers.shapes_trainer import ShapesGRPO
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.infra.config_loader import load

    seen = []
    real = loop.audit_parts

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append(dict(out[0], on_policy=kw["on_policy"]))
        return out

    monkeypatch.setattr(loop, "audit_parts", spy)
    trainer = ShapesGRPO(load(ShapesTrainConfig, path, sets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(iterations):
            trainer.step()
    return seen


def _audited_run(monkeypatch, intermediate: str) -> list[dict]:
    """Two iterations of a tiny shapes run with an audit every iteration and 2 updates per iteration: the audits' results
    (the first before update 0, the second before update 1)."""
    return _audits_of(monkeypatch, None, [
        "sample.prompts_per_iter=4", "sample.group_size=2", "sample.num_steps=6", "sample.sde_window=[0,6]",
        "estimator.mode=jagg", "estimator.window=3", f"estimator.intermediate={intermediate}",
        "estimator.correction_p=0", "estimator.meter_every=1", "estimator.meter_samples=4", "estimator.clip_range=1e-4",
        "optim.lr=1e-5", "grpo.updates_per_epoch=2", "grpo.drop_zero_spread=false", "threads=1"], 2)


def test_audits_cycle_through_the_updates_and_see_interps_off_policy_clipping(monkeypatch):
    """The trainer's audits run before update 0, then update 1, ... of their rollouts, so the meter sees off-policy
    updates: there ``interp`` clips terms exact does not (and :func:`jagg.audit.clip_flag` says so), ``auto`` clips as
    exact does."""
    from jagg.audit import clip_flag

    for intermediate in ("interp", "auto"):
        audits = _audited_run(monkeypatch, intermediate)
        assert [a["on_policy"] for a in audits] == [True, False]
        on, off = audits
        assert on["clip_frac_est"] == pytest.approx(on["clip_frac_exact"], abs=1e-9)   # interp is exact on-policy
        if intermediate == "auto":
            assert off["clip_frac_est"] == pytest.approx(off["clip_frac_exact"], abs=1e-9)
            assert clip_flag(off) is None
        else:
            assert off["clip_frac_est"] > 1.5 * off["clip_frac_exact"] + 0.01
            assert "intermediate=auto" in clip_flag(dict(off, update=1))
        monkeypatch.undo()


def test_stale_takes_the_rollout_velocities_at_inner_steps():
    """``stale`` runs no inner forward and gives the inner terms the rollout's own velocities: off-policy their ratio
    is 1 and none is clipped (PPO's clipping acts at the knots only); on-policy it equals ``interp`` to rounding."""
    model, traj, adv = _case()
    cfg = EstimatorConfig(mode="jagg", window=4, intermediate="stale", correction_p=0.0, clip_range=1e-6)
    st = _inner_stats(model, traj, adv, cfg, on_policy=False)
    assert st.ratio_mean == 1.0 and st.clip_frac == 0.0 and st.approx_kl == 0.0 and st.forward_nograd_items == 0
    knots = run(model, traj, adv, cfg, only_steps=[0, 3, 4, 7], on_policy=False)[1]
    assert knots.clip_frac > 0                                # the knots' own rows still clip off-policy
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    traj = sampled_traj(model, B=6, T=11)
    g_s, _ = run(model, traj, adv, dataclasses.replace(cfg, clip_range=1e-4))
    g_i, _ = run(model, traj, adv, dataclasses.replace(cfg, clip_range=1e-4, intermediate="interp"))
    torch.testing.assert_close(g_s, g_i, rtol=1e-10, atol=1e-13)


def _main_job_audits(monkeypatch, sets: list[str]) -> list[dict]:
    """Four iterations of the shipped main job in mode jagg (its JAGG layout, what its auto candidates build on),
    smaller (4 prompts x 4, 4 updates per iteration as shipped; lr 1e-3 so
    that four iterations move the policy enough to clip), with an audit every iteration: the audits run before updates
    0, 1, 2 and 3 of their rollouts."""
    from jagg.trainers.shapes_config import main_job_path

    return _audits_of(monkeypatch, main_job_path(), ["estimator.mode=jagg", "sample.prompts_per_iter=4",
                                                     "estimator.meter_every=1", "estimator.meter_samples=8", "threads=1",
                                                     "optim.lr=1e-3", *sets], 4)


def test_the_shipped_main_job_clips_as_exact_at_every_update(monkeypatch):
    """The main job as shipped, audited before each update of an epoch: its clip fraction is exact's (within 1.5x;
    here equal to rounding), on-policy and off. With ``intermediate: interp`` the off-policy updates clip far more
    (the second half of the test)."""
    audits = _main_job_audits(monkeypatch, [])
    assert [a["on_policy"] for a in audits] == [True, False, False, False]
    for a in audits:
        assert a["clip_frac_est"] == pytest.approx(a["clip_frac_exact"], abs=1e-9)
    assert max(a["clip_frac_exact"] for a in audits[1:]) > 0      # off-policy updates clip: the check has teeth
    monkeypatch.undo()
    old = _main_job_audits(monkeypatch, ["estimator.intermediate=interp"])
    assert any(a["clip_frac_est"] > 1.5 * a["clip_frac_exact"] + 0.01 for a in old[1:])
