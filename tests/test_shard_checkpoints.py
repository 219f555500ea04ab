"""Sharded checkpoints read back in one process (a gloo process group of one, no launcher): FSDP's shards with LoRA
(the frozen weights are not in them) and whole weights, each read into the other engine's layout."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch.distributed as dist  # noqa: E402
from tiny_pipelines import tiny_sd3  # noqa: E402

from jagg.infra.engine import EngineSettings, make_engine  # noqa: E402
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
    one, p1, o1, ema1 = _trained("single", 1)
    saved = {"model": {n: p.detach().clone() for n, p in p1.named_params.items()}, "optimizer": o1.state_dict(),
             "ema": ema1.state_dict()}
    e2, p2, o2, ema2 = _trained("fsdp", 2)
    ema2.load_state_dict(saved["ema"])
    e2.load_whole(p2.named_params, o2, saved["model"], saved["optimizer"])
    got, want = _whole(p2, o2, ema2), _whole(p1, o1, ema1)
    assert {type(p).__name__ for p in p2.params} == {"DTensor"}
    assert all(torch.equal(got[k], want[k]) for k in want)
