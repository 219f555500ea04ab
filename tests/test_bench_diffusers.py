"""``jagg bench meter --config <yaml with pipeline:>``: the meter on the user's own diffusers model (a tiny random
SD3 saved to disk, LoRA, the KL term, a local reward), with the sampler the diffusers trainer trains with."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tiny_runs import write_sd3_config  # noqa: E402

from jagg.cli import main  # noqa: E402
from jagg.trainers import diffusers_trainer as real_train  # noqa: E402
from jagg.trainers.diffusers_config import load_config  # noqa: E402


def _bench(tmp_path, sd3_dir, *extra: str) -> tuple[list[dict], str]:
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "eff.json"
    assert main(["bench", "meter", "--config", str(cfg), "--batches", "3", "--draws", "1", "--estimator", "plain",
                 "--json", str(out), *extra]) == 0
    records = json.loads(out.read_text())
    verdicts = [r for r in records if r.get("kind") == "verdict"]        # the recommendation, on the user's model
    assert len(verdicts) == 1 and verdicts[0]["line"].startswith(f"train with {verdicts[0]['train_with']}")
    return [r for r in records if r.get("kind") is None], str(cfg)


@pytest.mark.parametrize("update", [0, 1])
def test_efficiency_on_a_diffusers_config(tmp_path, sd3_dir, capsys, monkeypatch, update):
    """On-policy and as a rollout's second update: a table, finite errors against the noise, exact's rows the trained
    steps (4 of pipeline.num_steps=4), plain JAGG's fewer; the run directory is never opened; the model's loading
    messages are held back, as the trainer does, and counted in one line on stderr."""
    import logging

    load = real_train.load_model

    def noisy_load(*args, **kwargs):
        logging.getLogger("diffusers.models").warning("a loading message")
        return load(*args, **kwargs)
    monkeypatch.setattr(real_train, "load_model", noisy_load)
    cost = ["--cost", "B_F=1"] if update else []                 # the config's own structure, B/F changed
    records, _ = _bench(tmp_path, sd3_dir, "--update", str(update), *cost)
    text, err = capsys.readouterr()
    assert "a loading message" not in text and "(loading: 1 message of diffusers / transformers held back" in err
    assert "E|e|^2/V_b" in text and "projected, not measured" in text
    assert ("off-policy: update 1" in text) == bool(update)
    by = {r["estimator"]: r for r in records}
    assert set(by) == {"exact", "plain"}
    assert by["exact"]["rows_per_sample"] == 4 and by["exact"]["error_to_noise"] == 0
    assert 0 < by["plain"]["rows_per_sample"] < 4
    assert math.isfinite(by["plain"]["error_to_noise"]) and by["plain"]["error_to_noise"] > 0
    assert by["plain"]["noise"] > 0 and by["plain"]["update"] == update
    assert all(t["tensor"].find("lora_") >= 0 for t in by["plain"]["tensors"])       # the LoRA weights, by name
    # the projected columns: a named preset by default; KEY=VALUE on top of the config's own structure (pipeline.
    # num_steps=4, all 4 trained, cfg_scale 4.5 with both branches through training)
    line = by["plain"]["cost_structure"]
    assert (line.startswith("custom: B/F 1, CFG branches 2 per forward (2 with grad in training), 4 rollout steps, "
                            "4 trained") if update else line.startswith("flow_grpo_sd35"))
    assert not (tmp_path / "default_run").exists()


def test_sampler_draws_as_the_trainer_does(tmp_path, sd3_dir):
    """The bench's sampler is the trainer's: the same trainable weights (LoRA seeded by ``seed``) and, for iteration
    0, the same prompts, noise and trajectories as the trainer's first rollout."""
    cfg = load_config(write_sd3_config(tmp_path, sd3_dir), [f"log.output_dir={tmp_path / 'run'}"])
    sampler = real_train.DiffusersSampler(cfg)
    first = sampler.sample()
    trainer = real_train.DiffusersTrainer(cfg)
    assert sampler.param_names == list(trainer.named_params)
    assert all(torch.equal(a, b) for a, b in zip(sampler.params, trainer.params))
    ro = trainer.rollout(trainer.draw_batch())
    assert ro.prompts == first.prompts and torch.equal(ro.traj.latents, first.traj.latents)
    second = sampler.sample()                                   # the next batch: other SDE noise
    assert not torch.equal(second.traj.latents, first.traj.latents)


def test_shapes_kl_refused_before_loading(capsys):
    """The shapes world's sampler carries no KL reference: refused with the key, before anything runs."""
    assert main(["bench", "meter", "--set", "estimator.kl_beta=0.1", "--batches", "3"]) != 0
    assert "estimator.kl_beta" in capsys.readouterr().err


@pytest.mark.parametrize("extra, culprit", [(["--by-tensor", "nope"], "--by-tensor"),
                                            (["--estimator", "w9:window=9"], "w9"),
                                            (["--by-interval", "exact"], "--by-interval")])
def test_arguments_are_checked_before_the_model_loads(tmp_path, capsys, extra, culprit):
    """A diffusers config whose model directory does not exist: the bad argument is named, not the directory."""
    cfg = write_sd3_config(tmp_path, tmp_path / "no_model_here")
    assert main(["bench", "meter", "--config", str(cfg), *extra]) != 0
    err = capsys.readouterr().err
    assert culprit in err and "no_model_here" not in err


def test_speed_times_the_config_model(tmp_path, sd3_dir, capsys):
    """``jagg bench speed --config``: the config's transformer with its LoRA, on one of its trainer's rollouts (its 4
    steps), timed exact vs JAGG."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "speed.json"
    assert main(["bench", "speed", "--config", str(cfg), "--models", "config", "--windows", "3", "--knots", "shared",
                 "--intermediates", "interp", "--subsample", "--interval-fracs", "--corrections", "--batch", "2",
                 "--micro-batch", "4", "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "config(sd3,128px)" in text and "speed-up" in text
    (rec,) = json.loads(out.read_text())
    assert rec["model"] == "config(sd3,128px)" and rec["steps"] == 4 and rec["batch"] == 2
    assert rec["guidance_scale"] == 4.5 and rec["backward_items_jagg"] < rec["backward_items_exact"]
    assert main(["bench", "speed", "--models", "config"]) != 0
    assert "--config" in capsys.readouterr().err


@pytest.mark.parametrize("family, lora, preset", [("sd3", True, "flow_grpo_sd35"), ("sd3", False, "flow_grpo_sd35_full"),
                                                  ("wan", True, "flow_grpo_wan")])
def test_cost_defaults_to_the_family_preset(family, lora, preset):
    from types import SimpleNamespace

    from jagg.cost import DEFAULT, default_cost
    from jagg.integrations import LoraSettings, PipelineConfig

    cfg = SimpleNamespace(pipeline=PipelineConfig(family=family, lora=LoraSettings(enabled=lora)))
    assert default_cost(cfg) == preset and default_cost(SimpleNamespace(sample=None)) == DEFAULT
