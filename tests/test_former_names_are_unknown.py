"""One vocabulary, the glossary's (docs/design.md §0): a former name of a keyword, config key, statistic or module is
not read as the new one; an old config key gets the usual unknown-key error, with the current key suggested."""

import importlib

import pytest
import torch

import jagg
from jagg import EstimatorConfig
from jagg.cli import main
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.infra import config_loader as configuration
from toy import Nonlinear, sampled_traj


@pytest.mark.parametrize("old, new", [("exact_first_groups", "exact_first_intervals"),
                                      ("exact_last_groups", "exact_last_intervals")])
def test_an_old_config_key_is_an_unknown_key_with_the_new_one_suggested(tmp_path, capsys, old, new):
    hint = f"unknown config key 'estimator.{old}'; did you mean '{new}'?"
    with pytest.raises(ValueError, match=hint):
        configuration.load(ShapesTrainConfig, None, [f"estimator.{old}=1"])
    yaml = tmp_path / "old.yaml"
    yaml.write_text(f"estimator:\n  {old}: 1\n")
    with pytest.raises(ValueError, match=hint):
        configuration.load(ShapesTrainConfig, yaml)
    for args in (["--set", f"estimator.{old}=1"], ["--config", str(yaml)]):
        assert main(["train", "--print-config", *args]) == 2
        assert hint in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"unknown EstimatorConfig key '{old}'; did you mean '{new}'"):
        EstimatorConfig.from_dict({old: 1})
    with pytest.raises(TypeError, match=old):
        EstimatorConfig(**{old: 1})


def test_old_keywords_statistics_and_modules_are_gone():
    torch.manual_seed(0)
    model = Nonlinear(batch=4)
    traj = sampled_traj(model, B=4, T=8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    cfg = EstimatorConfig(mode="jagg", window=4, correction_p=0.5)
    for call in (lambda **k: jagg.policy_gradient(model, traj, adv, cfg, **k),
                 lambda **k: jagg.audit_gradient(model, traj, adv, cfg, list(model.parameters()), **k)):
        with pytest.raises(TypeError, match="sample_groups"):
            call(sample_groups=[0, 0, 1, 1])
    stats = jagg.policy_gradient(model, traj, adv, cfg, prompt_groups=[0, 0, 1, 1])
    assert stats.intervals > 0 and not hasattr(stats, "groups") and not hasattr(stats, "groups_corrected")
    for module in ("jagg.loss", "jagg.deprecation"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
