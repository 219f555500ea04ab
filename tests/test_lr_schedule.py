"""optim.lr_schedule and optim.warmup_steps: the factors, the checks of the keys, the default that leaves the optimizer
alone, the lr logged, and a resumed run that continues the schedule bit-identically."""

import json
import math

import pytest
import torch

from tiny_runs import tiny_train_args
from jagg.cli import main
from jagg.trainers.lr_schedule import lr_factor
from jagg.trainers.sections import OptimSection
from jagg.trainers.shapes_trainer import ShapesTrainer
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import load_latest


def test_the_factors():
    assert [lr_factor("constant", 0, k, 10) for k in range(10)] == [1.0] * 10
    assert [lr_factor("constant", 4, k, 10) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor("linear", 0, k, 4) for k in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_factor("linear", 2, k, 6) for k in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cos = [lr_factor("cosine", 0, k, 4) for k in range(4)]
    assert cos == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])
    with pytest.raises(ValueError, match="optim.lr_schedule"):
        lr_factor("step", 0, 0, 4)


@pytest.mark.parametrize("sets, key", [(["optim.lr_schedule=step"], "optim.lr_schedule"),
                                       (["optim.warmup_steps=-1"], "optim.warmup_steps"),
                                       (["optim.warmup_steps=1.5"], "optim.warmup_steps"),
                                       (["optim.warmup_steps=8", "grpo.iterations=2", "grpo.updates_per_epoch=2"],
                                        "optim.warmup_steps \\(8\\) must be below the run's optimizer updates")])
def test_bad_values_name_the_key(sets, key):
    with pytest.raises(ValueError, match=key):
        configuration.load(ShapesTrainConfig, None, sets)


def test_the_defaults_are_constant_without_warmup():
    o = OptimSection()
    assert (o.lr_schedule, o.warmup_steps) == ("constant", 0)


def _config(out, ckpt, iterations, *extra):
    args = tiny_train_args(ckpt, out, iterations, "eval.every=0", "log.tensorboard=false", *extra)
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"] + [f"log.output_dir={out}"]
    return configuration.load(ShapesTrainConfig, None, sets)


def _lrs(out):
    return [json.loads(l).get("lr") for l in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["kind"] == "train"]


def test_a_constant_schedule_leaves_the_optimizer_untouched(tmp_path, tiny_ckpt, monkeypatch):
    """The default never writes the optimizer's learning rate (so the main job stays bit-identical), and the lr in use
    is logged."""
    writes = []

    class Watched(dict):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

    trainer = ShapesTrainer(_config(tmp_path, tiny_ckpt, 2))
    trainer.opt.param_groups[0] = Watched(trainer.opt.param_groups[0])
    trainer.train()
    assert "lr" not in writes and "initial_lr" not in trainer.opt.param_groups[0]
    assert _lrs(tmp_path) == [0.01, 0.01]


class StopAfter2(ShapesTrainer):
    """A run stopped (as by Ctrl-C) after its second iteration."""

    def stop_requested(self) -> bool:
        return self.iteration == 2


def test_resume_continues_the_schedule_bit_identically(tmp_path, tiny_ckpt, schedule="cosine"):
    extra = (f"optim.lr_schedule={schedule}", "optim.warmup_steps=2", "grpo.updates_per_epoch=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    ShapesTrainer.run(_config(straight, tiny_ckpt, 4, *extra))
    StopAfter2.run(_config(split, tiny_ckpt, 4, *extra))
    assert len(_lrs(split)) == 2
    ShapesTrainer.run(_config(split, tiny_ckpt, 4, *extra), resume=True)
    a, b = load_latest(straight / "checkpoints")[0], load_latest(split / "checkpoints")[0]
    assert a["iteration"] == b["iteration"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    lrs = _lrs(straight)
    assert _lrs(split) == lrs
    # 8 updates, 2 per iteration (the record: their mean): warm-up 0.5, 1 then the decay over the 6 others
    per_update = [0.01 * lr_factor(schedule, 2, k, 8) for k in range(8)]
    assert lrs == pytest.approx([(per_update[2 * i] + per_update[2 * i + 1]) / 2 for i in range(4)])
    assert lrs[-1] < lrs[1] < 0.01


def test_resume_refuses_another_length_under_a_decay(tmp_path, tiny_ckpt, capsys):
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 2, "optim.lr_schedule=cosine")) == 0
    capsys.readouterr()
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 2, "optim.lr_schedule=cosine") + ["--resume"]) == 0
    said = capsys.readouterr().out                # a finished decayed run is not told to raise what resume refuses
    assert "nothing to train (optim.lr_schedule=cosine has decayed" in said and "raise grpo.iterations" not in said
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 4, "optim.lr_schedule=cosine") + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr_schedule 'cosine' decays over the run's grpo.iterations" in err
    assert main(tiny_train_args(tiny_ckpt, tmp_path, 4, "optim.lr_schedule=linear") + ["--resume"]) == 2
    assert "optim.lr_schedule" in capsys.readouterr().err                # another schedule: refused too


def test_the_dense_evaluation_schedule_and_its_checks():
    """eval.dense_iterations / eval.dense_every (bench quality's --eval-dense): more evaluations where the curve rises,
    the regular ones after."""
    e = configuration.load(ShapesTrainConfig, None, ["eval.every=10", "eval.dense_iterations=6",
                                                     "eval.dense_every=2"]).eval
    assert [i for i in range(1, 31) if e.due(i)] == [2, 4, 6, 10, 20, 30] and e.due(7, done=True)
    plain = ShapesTrainConfig().eval
    assert [i for i in range(1, 51) if plain.due(i)] == [25, 50]
    for sets in (["eval.dense_iterations=6"], ["eval.dense_every=2"],
                 ["eval.every=0", "eval.dense_iterations=6", "eval.dense_every=2"], ["eval.dense_every=-1"]):
        with pytest.raises(ValueError, match="eval.dense"):
            configuration.load(ShapesTrainConfig, None, sets)


def test_a_config_saved_before_the_new_keys_resumes_as_their_defaults():
    """A checkpoint (or a bench result) whose config predates optim.lr_schedule, optim.warmup_steps and eval.dense_*
    ran as their defaults: it resumes (and is reused) unless they are set otherwise now."""
    from jagg.trainers.resume import check_resumable

    current = configuration.to_dict(ShapesTrainConfig())
    saved = json.loads(json.dumps(current))
    for section, key in (("optim", "lr_schedule"), ("optim", "warmup_steps"), ("eval", "dense_iterations"),
                         ("eval", "dense_every")):
        del saved[section][key]
    assert check_resumable(saved, current) == []
    cosine = configuration.to_dict(configuration.load(ShapesTrainConfig, None, ["optim.lr_schedule=cosine"]))
    with pytest.raises(ValueError, match="optim.lr_schedule"):
        check_resumable(saved, cosine)
