"""grpo.minibatches: how an epoch's samples are cut into minibatches (whole prompt groups or shuffled samples), the
refusals by name, and both trainers training on the cut they say."""

from __future__ import annotations

import pytest
import torch

from jagg.cli import main
from jagg.trainers.minibatches import check_groups_fit, cut_minibatches, resolve_cut
from jagg.infra import config_loader as configuration
from jagg.trainers.shapes_config import ShapesTrainConfig
from tiny_runs import records, tiny_train_args


@pytest.mark.parametrize("groups, sizes, updates", [(8, [4] * 8, 4), (5, [4] * 5, 2), (3, [2, 4, 3], 3),
                                                    (7, [4] * 7, 3)])
def test_groups_cut_holds_whole_groups_as_equal_as_the_counts_allow(groups, sizes, updates):
    prompt_groups = torch.cat([torch.full((s,), g) for g, s in enumerate(sizes)])          # [n] group of each sample
    gen = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(20):
        mbs = cut_minibatches(prompt_groups, updates, "groups", gen)
        assert len(mbs) == updates
        assert sorted(torch.cat(mbs).tolist()) == list(range(len(prompt_groups)))          # every sample once
        counts = []
        for mb in mbs:
            assert mb.tolist() == sorted(mb.tolist())
            ids = set(prompt_groups[mb].tolist())
            for g in ids:                                                                  # whole groups only
                assert (prompt_groups[mb] == g).sum() == sizes[g]
            counts.append(len(ids))
        assert max(counts) - min(counts) <= 1
        seen.append(tuple(tuple(prompt_groups[mb].unique().tolist()) for mb in mbs))
    assert len(set(seen)) > 1                                                              # shuffled by group


def test_samples_cut_is_a_shuffled_split_that_splits_groups():
    prompt_groups = torch.arange(32) // 4
    mbs = cut_minibatches(prompt_groups, 4, "samples", torch.Generator().manual_seed(0))
    want = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tensor_split(4)
    assert [m.tolist() for m in mbs] == [w.tolist() for w in want]                  # the trainers' cut as it was
    assert any(len(set(prompt_groups[m].tolist())) > 2 for m in mbs)                 # groups spread over updates


def test_auto_resolves_by_estimator_and_bad_values_are_refused():
    assert [resolve_cut("auto", m, 8, 4) for m in ("exact", "subsample", "jagg", "auto")] == ["samples", "samples",
                                                                                              "groups", "groups"]
    assert resolve_cut("auto", "jagg", 2, 4) == resolve_cut("auto", "jagg", 3, 1, processes=2) == "samples"   # no fit
    assert resolve_cut("samples", "jagg") == "samples" and resolve_cut("groups", "exact") == "groups"
    with pytest.raises(ValueError, match="grpo.minibatches must be one of samples, groups, auto; got 'group'"):
        resolve_cut("group", "exact")
    with pytest.raises(ValueError, match="sample.prompts_per_iter = 2 prompt groups cannot fill "
                                         "grpo.updates_per_epoch = 4"):
        check_groups_fit(2, 4)
    with pytest.raises(ValueError, match="do not split evenly over 2 processes"):
        check_groups_fit(3, 1, processes=2)
    with pytest.raises(ValueError, match="grpo.minibatches must be one of"):
        load_config(None, ["grpo.minibatches=whole"])
    with pytest.raises(ValueError, match="grpo.updates_per_epoch = 4 minibatches of whole groups"):
        load_config(None, ["grpo.minibatches=groups", "sample.prompts_per_iter=2", "grpo.updates_per_epoch=4"])
    assert load_config(None, ["estimator.mode=jagg", "sample.prompts_per_iter=2", "grpo.updates_per_epoch=4"]
                       ).minibatch_cut == "samples"                  # auto where the groups do not fit


def load_config(path, sets):
    return configuration.load(ShapesTrainConfig, path, sets)


def _train_groups(tmp_path, tiny_ckpt, name, iterations, *extra):
    out = tmp_path / name
    args = tiny_train_args(tiny_ckpt, out, iterations, "eval.every=0", "grpo.updates_per_epoch=2",
                           "sample.prompts_per_iter=4", "grpo.minibatches=groups", *extra)
    return out, args


def test_shapes_trainer_updates_on_whole_groups_and_resumes_bit_identically(tmp_path, tiny_ckpt, monkeypatch,
                                                                             capsys):
    seen = []
    from jagg.trainers import shapes_trainer

    original = shapes_trainer.ShapesGRPO.gradient

    def spy(self, mb):
        seen.append(mb.prompt_groups.tolist())
        return original(self, mb)

    monkeypatch.setattr(shapes_trainer.ShapesGRPO, "gradient", spy)
    straight, args = _train_groups(tmp_path, tiny_ckpt, "straight", 3)
    assert main(args) == 0
    assert "minibatches of whole prompt groups (grpo.minibatches groups)" in capsys.readouterr().out
    assert len(seen) == 6
    for groups in seen:                                  # 2 of the 4 prompt groups, each whole (group_size 2)
        assert len(groups) == 4 and all(groups.count(g) == 2 for g in set(groups))
    split, args2 = _train_groups(tmp_path, tiny_ckpt, "split", 2)
    assert main(args2) == 0
    _, args3 = _train_groups(tmp_path, tiny_ckpt, "split", 3)
    assert main(args3 + ["--resume"]) == 0
    a, b = records(straight), records(split)
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


def test_two_processes_update_on_whole_groups_as_one_process_does(tmp_path, sd3_dir, monkeypatch):
    """torchrun, 2 CPU processes (DDP, LoRA, tiny SD3), 4 prompt groups of 2 and 2 updates of whole groups: no group
    straddles the processes, every update's global minibatch is whole groups, the same groups as one process's, and
    the update is one process's (records and weights)."""
    import os
    import sys
    from pathlib import Path

    from diffusers import SD3Transformer2DModel  # noqa: F401  (skips without diffusers, as the fixture does)
    from safetensors.torch import load_file

    from jagg.trainers.diffusers_trainer import DiffusersTrainer
    from tiny_runs import assert_same_update, free_port, run_launch, write_sd3_config

    cfg = write_sd3_config(tmp_path, sd3_dir)
    (tmp_path / "four.txt").write_text("a red cube\na blue ball\na green cone\na red ball\n")
    sets = ["grpo.iterations=1", "grpo.updates_per_epoch=2", "grpo.minibatches=groups", "grpo.drop_zero_spread=false",
            "sample.prompts_per_iter=4", "sample.micro_batch=2", f"sample.prompts_file={tmp_path / 'four.txt'}",
            "log.sample_images=0", "eval.every=0"]
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    one, two = tmp_path / "one", tmp_path / "two"
    cuts = []
    real = DiffusersTrainer.minibatches

    def recorded(self, pg):
        out = real(self, pg)
        cuts.append([pg[mb].tolist() for mb in out])
        return out

    monkeypatch.setattr(DiffusersTrainer, "minibatches", recorded)
    assert main(args + ["--output-dir", str(one)]) == 0
    launcher = Path(__file__).parent / "real_train_launch.py"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = run_launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), str(launcher), *args, "--output-dir", str(two)], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(two / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    (epoch0,), (epoch1,) = (r["minibatches"] for r in ranks)
    assert not set(sum(epoch0, [])) & set(sum(epoch1, []))                # no group on both processes
    for u in range(2):
        union = epoch0[u] + epoch1[u]
        assert sorted(union) == sorted(cuts[0][u])                         # the one-process update's samples
        assert all(union.count(g) == 2 for g in set(union)) and len(set(union)) == 2     # 2 whole groups
    (a,), (b,) = records(one), records(two)
    assert_same_update(b, a)
    got, want = (load_file(d / "final" / "adapter" / "pytorch_lora_weights.safetensors") for d in (two, one))
    for k in want:     # AdamW's steps lr g / (|g| + eps): entries with |g| near eps move by a few % of lr = 0.01
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-4, msg=k)             # as test_real_train's DDP
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < max(float(want[k].abs().max()) for k in want)
