"""A model family is one record (jagg.integrations.families): a made-up family of one more record trains end to end
on a tiny model; a record that contradicts its adapter, a taken name and an unknown family are refused by name; and
no family name is spelt out in more than two source files."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from jagg.integrations.families import FAMILIES, Family, register_family

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def my_dit():
    """A made-up family: the tiny SD3 transformer under a new name, LoRA on two of its projections only."""
    record = register_family(dataclasses.replace(FAMILIES["sd3"], name="my_dit", title="my DiT",
                                                 lora_targets=("attn.to_q", "attn.to_v")))
    yield record
    FAMILIES.pop(record.name)


def test_a_made_up_family_of_one_record_trains_end_to_end(tmp_path, sd3_dir, my_dit, monkeypatch):
    pytest.importorskip("diffusers")
    from tiny_runs import records, write_sd3_config

    from jagg.cli import main
    from jagg.trainers import diffusers_trainer as real_train

    seen, original = [], real_train.DiffusersTrainer.train
    monkeypatch.setattr(real_train.DiffusersTrainer, "train", lambda self: seen.append(self) or original(self))
    cfg, out = write_sd3_config(tmp_path, sd3_dir), tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--set", "pipeline.family=my_dit",
                 "--set", "grpo.iterations=1"]) == 0
    rec = records(out)
    assert [r["iteration"] for r in rec] == [1] and math.isfinite(rec[0]["loss"])
    trainer = seen[0]
    assert trainer.cfg.pipeline.family == "my_dit"
    # the LoRA defaults came from the record: adapters on to_q and to_v only
    assert trainer.named_params and {re.sub(r".*attn\.(to_[qv])\.lora_[AB].*", r"\1", n)
                                     for n in trainer.named_params} == {"to_q", "to_v"}
    assert (out / "checkpoints" / "adapter_000001").is_dir()


def test_a_record_that_contradicts_its_adapter_is_refused():
    pytest.importorskip("diffusers")
    from jagg.integrations.velocity_adapters import adapter_class

    for name in FAMILIES:                                   # the shipped records agree with their adapters
        assert adapter_class(name).__name__ == FAMILIES[name].adapter
    with pytest.raises(ValueError, match=r"packed=True but its adapter SD3Velocity is not a PackedVelocity"):
        adapter_class(dataclasses.replace(FAMILIES["sd3"], packed=True))
    with pytest.raises(ValueError, match=r"adapter 'NoSuchVelocity' is not a velocity adapter"):
        adapter_class(dataclasses.replace(FAMILIES["sd3"], adapter="NoSuchVelocity"))


def test_unknown_taken_and_malformed_families_are_refused_by_name():
    with pytest.raises(ValueError, match=r"pipeline.family must be one of \('sd3', .*got 'sd4'"):
        FAMILIES["sd4"]
    with pytest.raises(ValueError, match="'sd3' is already registered"):
        register_family(FAMILIES["sd3"])
    with pytest.raises(ValueError, match="shift_rule must be one of"):
        dataclasses.replace(FAMILIES["sd3"], name="x", shift_rule="linear")
    from jagg.integrations import PipelineConfig

    with pytest.raises(ValueError, match=r"pipeline.family must be one of .* got 'sd4'"):
        PipelineConfig(family="sd4")
    assert isinstance(PipelineConfig().record, Family)


def test_no_family_name_is_spelt_out_in_more_than_two_source_files():
    """Everything about a family is read from its record, so its name is a literal in the record's module (and at
    most one other, where the same word names something else: a bench model, a cost structure's model)."""
    sources = {p: p.read_text() for p in SRC.rglob("*.py")}
    for name in FAMILIES:
        files = sorted(str(p.relative_to(SRC)) for p, text in sources.items()
                       if re.search(rf"""["']{name}["']""", text))
        assert len(files) <= 2, f"family {name!r} is spelt out in {files}"
