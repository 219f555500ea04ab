"""Sharded checkpoints read back in one process (a gloo process group of one, no launcher): FSDP's shards with LoRA
(the frozen weights are not in them) and whole weights, each read into the other engine's layout."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch.distributed as dist  # noqa: E402
from pathlib import Path  # noqa: E402
from tiny_pipelines import tiny_sd3  # noqa: E402

from jagg.infra.engine import EngineSettings, make_engine  # noqa: E402
from jagg.infra.shards import read_whole  # noqa: E402
from jagg.integrations import PipelineConfig  # noqa: E402
from jagg.integrations.policy import Policy  # noqa: E402
from jagg.trainers.ema import EMA  # noqa: E402

LORA = PipelineConfig(family="sd3", dtype="fp32", device="cpu", resolution=128, lora={"rank": 2})


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(strategy: str, seed: int):
    """A LoRA SD3 on the engine ``strategy`` after one AdamW step from adapters shifted by ``seed``, its EMA and
    optimizer."""
    policy = Policy(LORA, tiny_sd3(), place=False)
    engine = make_engine(EngineSettings(strategy), 0, 1, torch.device("cpu"))
    engine.wrap(policy)
    with torch.no_grad():
        for p in policy.params:
            p.add_(seed)
    opt = torch.optim.AdamW(policy.params, lr=1e-2)
    ema = EMA(policy.named_params, 0.5)
    for p in policy.params:
        p.grad = torch.ones_like(p)
    opt.step()
    ema.update()
    return engine, policy, opt, ema


def _whole(policy, opt, ema) -> dict:
    """The weights, the EMA and AdamW's moments, whole."""
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    moments = {f"{n}/{k}": full(opt.state[p][k]) for n, p in policy.named_params.items()
               for k in ("exp_avg", "exp_avg_sq")}
    return {**{n: full(p) for n, p in policy.named_params.items()},
            **{f"ema/{n}": full(s) for n, s in zip(ema.names, ema.shadow)}, **moments}


def test_fsdp_lora_shards_and_whole_weights_read_into_either_layout(tmp_path, group):
    """The shards of a sharded LoRA run hold only the adapters and read back into a sharded or a whole model; the
    whole weights of a one-process run read into a sharded model."""
    engine, policy, opt, ema = _trained("fsdp", 1)
    want = _whole(policy, opt, ema)
    engine.save_shards(policy.bare, opt, {"ema": dict(zip(ema.names, ema.shadow))}, tmp_path / "ckpt.dcp")
    for strategy in ("fsdp", "single"):
        e2, p2, o2, ema2 = _trained(strategy, 2)                  # other adapters, other moments
        assert not torch.equal(_whole(p2, o2, ema2)[ema.names[0]], want[ema.names[0]])
        e2.load_shards(p2.bare, o2, {"ema": dict(zip(ema2.names, ema2.shadow))}, tmp_path / "ckpt.dcp")
        got = _whole(p2, o2, ema2)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), strategy
    whole = read_whole(tmp_path / "ckpt.dcp", "ema", ema.names)             # jagg eval's read, no process group
    assert all(torch.equal(whole[n], want[f"ema/{n}"]) for n in ema.names)
    with pytest.raises(ValueError, match="holds no 'ema' weights named \\['proj_out.weight'\\]"):
        read_whole(tmp_path / "ckpt.dcp", "ema", ["proj_out.weight"])
    one, p1, o1, ema1 = _trained("single", 1)
    saved = {"model": {n: p.detach().clone() for n, p in p1.named_params.items()}, "optimizer": o1.state_dict(),
             "ema": ema1.state_dict()}
    e2, p2, o2, ema2 = _trained("fsdp", 2)
    ema2.load_state_dict(saved["ema"])
    e2.load_whole(p2.named_params, o2, saved["model"], saved["optimizer"])
    got, want = _whole(p2, o2, ema2), _whole(p1, o1, ema1)
    assert {type(p).__name__ for p in p2.params} == {"DTensor"}
    assert all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------- damaged shards


def _sharded_run(tmp_path, run_id: str = "20270101-000000-aaaaaa") -> Path:
    """A run directory with two FSDP-style checkpoints (``ckpt_<n>.pt`` naming ``ckpt_<n>.dcp/``) of run ``run_id``,
    the shards written by torch.distributed.checkpoint in this one process."""
    from jagg.infra.checkpoint import write_checkpoint, write_shards
    from jagg.infra.rundir import write_run_file

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    write_run_file(out, run_id)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    engine = make_engine(EngineSettings("single"), 0, 1, torch.device("cpu"))
    for it in (1, 2):
        name = write_shards(lambda d: engine.save_shards(model, opt, {}, d), ckpts, it, True, lambda: None, run_id)
        write_checkpoint({"model": name, "optimizer": name, "run_id": run_id, "config": {}, "iteration": it,
                          "wall": 1.0, "skipped_updates": 0, "rng": []}, ckpts, it)
    return out


def _damage(dcp: Path, how: str) -> str:
    """Damage the shard directory ``dcp`` as ``how`` says; the words of the refusal."""
    (shard,) = dcp.glob("*.distcp")
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
        return "holds"
    if how == "emptied":
        shard.write_bytes(b"")
        return "(truncated or emptied)"
    if how == "missing":
        shard.unlink()
        return f"{shard.name} is missing"
    if how == "corrupted":                        # overwritten in place, its length kept
        shard.write_bytes(bytes(len(shard.read_bytes())))
        return "is corrupt"
    if how == "no metadata":
        (dcp / ".metadata").unlink()
        return "has no readable .metadata"
    if how == "directory":
        import shutil
        shutil.rmtree(dcp)
        return "which is not there beside it"
    from jagg.infra.shards import mark_run          # another run's shards under this run's name
    mark_run(dcp, "20270101-000000-bbbbbb")
    return "was written by run 20270101-000000-bbbbbb, not by the checkpoint's run 20270101-000000-aaaaaa"


DAMAGES = ["truncated", "emptied", "missing", "corrupted", "no metadata", "directory", "another run's"]


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_shards_are_refused_before_the_model_loads_and_the_older_checkpoint_resumes(tmp_path, how):
    """A damaged newest shard directory makes its checkpoint unreadable (read_checkpoint names the file and the
    problem, reading no tensor); resuming skips it with a warning and takes the older one; when none is left the
    refusal names each."""
    from jagg.infra.checkpoint import read_checkpoint
    from jagg.infra.rundir import RunDirError, open_run

    out = _sharded_run(tmp_path)
    ckpts = out / "checkpoints"
    assert read_checkpoint(ckpts / "ckpt_000002.pt", resume=True)["model"] == "ckpt_000002.dcp"
    words = _damage(ckpts / "ckpt_000002.dcp", how)
    with pytest.raises(ValueError, match="ckpt_000002.pt is not a loadable checkpoint: its 'model' ") as e:
        read_checkpoint(ckpts / "ckpt_000002.pt", resume=True)
    assert words in str(e.value) and str(e.value).endswith("; restore it, or resume from another checkpoint")
    said = []
    start = open_run(out, resume=True, log=said.append)
    assert start.resumed[1] == ckpts / "ckpt_000001.pt" and start.resumed[0]["iteration"] == 1
    assert len(said) == 1 and said[0].startswith("warning: skipping unreadable checkpoint") and words in said[0]
    start.lock.release(out)                                      # the run this start would have trained ends
    _damage(ckpts / "ckpt_000001.dcp", how)
    with pytest.raises(RunDirError, match="cannot resume: no readable checkpoint") as e:
        open_run(out, resume=True)
    assert "ckpt_000001.pt" in str(e.value) and "ckpt_000002.pt" in str(e.value)


def test_ddp_wraps_without_a_deprecation_warning(group):
    """The DDP engine keeps buffers from being broadcast before each forward with the argument this torch takes,
    so no process prints torch's deprecation warning."""
    import warnings

    policy = Policy(LORA, tiny_sd3(), place=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_engine(EngineSettings("ddp"), 0, 1, torch.device("cpu")).wrap(policy)
    assert not [w for w in seen if "deprecated" in str(w.message)], [str(w.message) for w in seen]
    assert policy.transformer.forward_sync_buffers is False if hasattr(policy.transformer, "forward_sync_buffers") \
        else policy.transformer.broadcast_buffers is False
