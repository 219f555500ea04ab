"""Renamed words (issue #17): every former name of a keyword, config key or statistic still works, with a
deprecation message that names the new one, and gives the same result as the new name."""

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from toy import Nonlinear, run, sampled_traj


def test_exact_first_and_last_groups_keywords_are_the_intervals_ones(capsys):
    with pytest.warns(DeprecationWarning, match="exact_first_intervals"):
        old = EstimatorConfig(exact_first_groups=1, exact_last_groups=2)
    assert old == EstimatorConfig(exact_first_intervals=1, exact_last_intervals=2)
    with pytest.warns(DeprecationWarning, match="exact_last_intervals"):
        assert EstimatorConfig.from_dict({"exact_last_groups": 3}).exact_last_intervals == 3
    with pytest.raises(TypeError, match="exact_first_intervals only"):
        EstimatorConfig(exact_first_groups=1, exact_first_intervals=2)


def test_old_yaml_keys_load_with_a_message_naming_the_new_key(capsys):
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.training import config_loader as configuration

    with pytest.warns(DeprecationWarning):
        cfg = configuration.load(ShapesTrainConfig, None, ["estimator.exact_first_groups=1",
                                                     "estimator.exact_last_groups=1"])
    assert (cfg.estimator.exact_first_intervals, cfg.estimator.exact_last_intervals) == (1, 1)
    with pytest.raises(ValueError, match="former name of exact_first_intervals"):
        configuration.load(ShapesTrainConfig, None, ["estimator.exact_first_groups=1", "estimator.exact_first_intervals=2"])
    # a config saved under the old names (an old checkpoint) reads as the new one, silently
    saved = {"estimator": {"exact_first_groups": 1}, "seed": 0}
    assert configuration.renamed_keys(ShapesTrainConfig, saved, warn=False) == {"estimator": {"exact_first_intervals": 1},
                                                                         "seed": 0}


def test_the_deprecation_line_reaches_a_jagg_train_user(tmp_path):
    """Python hides a library's DeprecationWarnings by default: the CLI user sees a stderr line naming the new key."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "jagg.cli", "train", "--print-config", "--set",
                           "estimator.exact_first_groups=1"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "estimator.exact_first_groups is deprecated: use estimator.exact_first_intervals" in proc.stderr
    assert "exact_first_intervals: 1" in proc.stdout


def test_sample_groups_and_the_group_statistics_are_the_new_names():
    torch.manual_seed(0)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    cfg = EstimatorConfig(mode="jagg", window=4, jagg_frac=0.5, correction_p=0.5)
    g_new, s_new = run(model, traj, adv, cfg, prompt_groups=[0, 0, 1, 1], generator=torch.Generator().manual_seed(0))
    with pytest.warns(DeprecationWarning, match="prompt_groups"):
        g_old, s_old = run(model, traj, adv, cfg, sample_groups=[0, 0, 1, 1],
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(g_new, g_old) and s_new == s_old
    assert (s_old.groups, s_old.groups_jagg, s_old.groups_corrected) == (
        s_old.intervals, s_old.intervals_jagg, s_old.intervals_corrected)
    with pytest.raises(AttributeError):
        s_old.groups = 3                                                  # read-only aliases
    with pytest.warns(DeprecationWarning, match="prompt_groups"):
        a = jagg.audit_gradient(model, traj, adv, cfg, list(model.parameters()), sample_groups=[0, 0, 1, 1],
                                generator=torch.Generator().manual_seed(0))
    b = jagg.audit_gradient(model, traj, adv, cfg, list(model.parameters()), prompt_groups=[0, 0, 1, 1],
                            generator=torch.Generator().manual_seed(0))
    assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}
    with pytest.raises(TypeError, match="prompt_groups only"):
        jagg.policy_gradient(model, traj, adv, cfg, prompt_groups=[0, 0, 1, 1], sample_groups=[0, 0, 1, 1])


def test_a_checkpoint_saved_with_reward_weights_and_the_default_name_resumes():
    """Before reward.name and reward.weights became exclusive, a config with weights saved name 'geneval' too (the
    weights overrode it); resuming such a run must not stop on that key. A real change of the reward still does."""
    import pytest

    from jagg.trainers.base import check_resumable

    weights = {"jpeg_compressibility": 1.0, "geneval": 0.0}
    old = {"reward": {"name": "geneval", "weights": weights}, "grpo": {"iterations": 10}}
    now = {"reward": {"name": None, "weights": weights}, "grpo": {"iterations": 10}}
    assert check_resumable(old, now) == []
    with pytest.raises(ValueError, match="reward.weights"):
        check_resumable(old, {"reward": {"name": None, "weights": {"jpeg_compressibility": 1.0}},
                              "grpo": {"iterations": 10}})
    with pytest.raises(ValueError, match="reward.name"):
        check_resumable({"reward": {"name": "geneval", "weights": None}}, {"reward": {"name": "x:y", "weights": None}})


def test_reward_name_and_weights_together_are_refused_by_name():
    import pytest

    from jagg.training import config_loader as configuration
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path

    main = str(main_job_path())                                                      # it sets reward.weights
    with pytest.raises(ValueError, match="reward.name or reward.weights, not both.*reward.weights=null"):
        configuration.load(ShapesTrainConfig, main, ["reward.name=geneval"])
    cfg = configuration.load(ShapesTrainConfig, main, ["reward.weights=null", "reward.name=jpeg_compressibility"])
    assert cfg.reward.name == "jpeg_compressibility" and cfg.reward.weights is None
    cfg = configuration.load(ShapesTrainConfig, main, ["reward.weights=null"])
    assert cfg.reward.name == "geneval"                                               # neither set: geneval


def test_the_loss_head_keeps_its_former_import_path():
    """The loss head moved to jagg.sde beside the densities it is built from; jagg.loss still names the same objects."""
    import jagg.loss
    import jagg.sde

    assert jagg.loss.step_loss is jagg.sde.step_loss is jagg.step_loss
    assert jagg.loss.StepLoss is jagg.sde.StepLoss
