"""What a config or checkpoint of an earlier jagg needs to load (jagg.infra.old_configs): an old key name is refused
naming the new one and a saved config resumes under it; a retired option resumes at the value that meant "off" and
is refused at any other; a retired value is refused by name in a config, --set or a checkpoint."""

import pytest

from jagg import EstimatorConfig
from jagg.cli import main
from jagg.infra import config_loader as configuration
from jagg.trainers.resume import check_resumable
from jagg.trainers.shapes_config import ShapesTrainConfig


@pytest.mark.parametrize("old, new", [("audit_every", "meter_every"), ("correction_rates", "correction_probs")])
def test_an_old_key_name_is_refused_naming_the_new_one_and_resumes_under_it(tmp_path, capsys, old, new):
    with pytest.raises(ValueError, match=f"config key 'estimator.{old}' was renamed '{new}': write estimator.{new}: "):
        configuration.load(ShapesTrainConfig, None, [f"estimator.{old}=1"])
    yaml = tmp_path / "old.yaml"
    yaml.write_text(f"estimator:\n  {old}: 1\n")
    assert main(["train", "--print-config", "--config", str(yaml)]) == 2
    assert f"was renamed '{new}'" in capsys.readouterr().err
    now = {"estimator": {"mode": "jagg", new: [0.5] if new == "correction_probs" else 2}}
    assert check_resumable({"estimator": {"mode": "jagg", old: now["estimator"][new]}}, now) == []


def test_runs_saved_with_retired_options_off_still_resume():
    """A checkpoint (or bench result) written before the options were retired holds their keys: at the value that
    meant "off" it ran as today's code runs it and resumes; any other value was an estimator that no longer exists."""

    now = {"estimator": {"mode": "jagg", "window": 4}}
    saved = {"estimator": {"mode": "jagg", "window": 4, "control_variate": 0.0, "correction": "interval",
                           "correction_intervals": 0, "score": "cosine"}}
    assert check_resumable(saved, now) == []
    for key, value in (("control_variate", 0.5), ("correction", "step"), ("correction_intervals", 2),
                       ("score", "chord")):
        bad = {"estimator": {**saved["estimator"], key: value}}
        with pytest.raises(ValueError, match=f"estimator.{key}, an option since retired"):
            check_resumable(bad, now)


def test_correction_p_auto_is_retired_with_a_clear_error(tmp_path):
    """``correction_p: auto`` is refused by name wherever a config can bring it (a config file, --set, a checkpoint to
    resume), saying it was retired and what to give instead; other words stay number errors."""
    retired = "'auto' was retired \\(the probability the meter chose learned 12-15% less.*give a fixed probability in \\[0, 1\\] instead, e.g. 0 .* or 0.25, " \
              "chosen with jagg bench meter"
    with pytest.raises(ValueError, match="correction_p must be a finite number in \\[0, 1\\]"):
        EstimatorConfig(correction_p="auto")                 # the library: a number error like any other word
    with pytest.raises(ValueError, match="^estimator.correction_p: " + retired):
        configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=auto", "estimator.meter_every=2"])
    path = tmp_path / "old.yaml"
    path.write_text("estimator:\n  correction_p: auto\n  meter_every: 1\n")
    with pytest.raises(ValueError, match="^estimator.correction_p: " + retired):
        configuration.load(ShapesTrainConfig, str(path))
    with pytest.raises(ValueError, match="correction_p must be a finite number in \\[0, 1\\]"):
        EstimatorConfig(correction_p="sometimes")
    with pytest.raises(ValueError, match="estimator.correction_p: expected a number, got 'sometimes'"):
        configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=sometimes"])
    assert configuration.load(ShapesTrainConfig, None, ["estimator.correction_p=0.5"]).estimator.correction_p == 0.5
    now = {"estimator": {"correction_p": 0.25, "meter_every": 1}}
    with pytest.raises(ValueError, match="^cannot resume: the checkpoint was trained with estimator.correction_p "
                                         "'auto', which was retired .*fixed probability.*start a new run in another directory"):
        check_resumable({"estimator": {"correction_p": "auto", "meter_every": 1}}, now)
    assert check_resumable({"estimator": {"correction_p": 0.25, "meter_every": 1}}, now) == []
