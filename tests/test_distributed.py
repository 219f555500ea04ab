"""Two CPU processes (gloo, loopback) give the same optimizer update as one process on the same global batch.

The parent samples one global batch of trajectories; each of 2 spawned ranks takes its shard, computes rewards
locally, gets advantages from the gathered batch (per prompt), and accumulates the policy gradient of its shard in
two calls through a DDP-wrapped model, with the KL term, in `exact` and `jagg` (fresh and interp) modes, synchronised
by the ``no_sync_except_last`` backward context. After one SGD step its parameters must equal the single-process
ones.
"""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import jagg
from jagg.infra.distributed import (distributed_advantages, end_process_group, exit_process, gather, gather_objects,
                                    loss_scale, no_sync_except_last, shard)

S = (2, 3, 3)
N_PROMPTS, GROUP = 4, 2
N = N_PROMPTS * GROUP            # global batch
T = 6
MODES = [("exact", 1, "interp"), ("jagg", 3, "fresh"), ("jagg", 3, "interp")]


class CondMLP(nn.Module):
    """Velocity MLP in (x, sigma) with a learned per-prompt embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(N_PROMPTS, 4).double()
        self.net = nn.Sequential(nn.Linear(18 + 1 + 4, 32), nn.Tanh(), nn.Linear(32, 18)).double()

    def forward(self, x, sigma, prompt):
        h = torch.cat([x.flatten(1).double(), sigma.double()[:, None], self.emb(prompt)], 1)
        return self.net(h).view(-1, *S)




PROMPTS = torch.arange(N) % N_PROMPTS           # sample -> prompt id (a prompt's group spans both ranks)


def reward(latents):                            # [n, *S] -> [n]: any deterministic function of the sample
    return latents.flatten(1).tanh().mean(1) * 10


def make_batch():
    model = CondMLP()
    g = torch.Generator().manual_seed(0)
    v = lambda x, s, i: model(x, s, PROMPTS[i])                        # noqa: E731
    with torch.no_grad():
        traj = jagg.sample_trajectories(v, torch.randn(N, *S, generator=g, dtype=torch.float64),
                                        jagg.flow_sigmas(T, shift=3.0, dtype=torch.float64), 0.7, generator=g)
    return traj


def config(mode, window, inter):
    return jagg.EstimatorConfig(correction_p=0.0, mode=mode, window=window, intermediate=inter, micro_batch=4, kl_beta=0.5,
                                clip_range=0.2)


def single_process_update(traj, mode, window, inter):
    model = CondMLP()
    ref = copy.deepcopy(model)
    with torch.no_grad():                                  # move off-policy so ratios, clipping and KL all matter
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    adv = jagg.group_advantages(reward(traj.latents[:, -1]), PROMPTS.tolist())
    v = lambda x, s, i: model(x, s, PROMPTS[i])                        # noqa: E731
    rv = jagg.reference_velocities(lambda x, s, i: ref(x, s, PROMPTS[i]), traj)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    jagg.policy_gradient(v, traj, adv, config(mode, window, inter), ref_velocities=rv)
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, world, traj, out_dir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"                           # loopback only
    torch.set_num_threads(1)
    # rendezvous through a file (no port to pick and race for); gloo then connects over loopback
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))  # fails, never hangs
    try:
        sl = shard(N)
        idx = torch.arange(N)[sl]
        local = traj.select(idx)
        # rewards and prompt ids are local; advantages come from the gathered batch
        adv = distributed_advantages(reward(local.latents[:, -1]), PROMPTS[idx].tolist())
        assert gather(adv).shape == (N,) and gather_objects([rank]) == list(range(world))
        results = {}
        for mode, window, inter in MODES:
            model = CondMLP()
            ref = copy.deepcopy(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
            ddp = nn.parallel.DistributedDataParallel(model)
            glob = idx                                         # local sample -> global prompt via its index
            opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
            halves = [torch.arange(0, 2), torch.arange(2, 4)]  # two accumulation calls per rank
            for j, h in enumerate(halves):
                part = local.select(h)
                rows = glob[h]                                  # this call's samples -> global index
                v = lambda x, s, i, m=ddp, r=rows: m(x, s, PROMPTS[r[i]])              # noqa: E731
                rv = jagg.reference_velocities(lambda x, s, i, m=ref, r=rows: m(x, s, PROMPTS[r[i]]), part)
                jagg.policy_gradient(v, part, adv[h], config(mode, window, inter), ref_velocities=rv,
                                     loss_scale=loss_scale(len(h), N),
                                     backward_context=no_sync_except_last(ddp, sync=(j == len(halves) - 1)))
            opt.step()
            results[(mode, window, inter)] = [p.detach().clone() for p in model.parameters()]
        all_adv = gather(adv)                                      # a collective: every rank calls it
        if rank == 0:
            torch.save({"results": results, "adv": all_adv}, os.path.join(out_dir, "rank0.pt"))
        dist.barrier()
    finally:
        end_process_group()
    exit_process(0)                      # as jagg ends a process on gloo: DDP keeps the group alive past its end


def test_shard_and_loss_scale_without_process_group():
    assert shard(8, 1, 2) == slice(4, 8)
    with pytest.raises(ValueError, match="does not split evenly"):
        shard(7, 0, 2)
    assert loss_scale(4, 8, 2) == 1.0 and loss_scale(2, 8, 2) == 0.5
    adv = distributed_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]), ["a", "a", "b", "b"])
    torch.testing.assert_close(adv, jagg.group_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]), ["a", "a", "b", "b"]))
    ctx = no_sync_except_last(nn.Linear(1, 1))
    with ctx(False), ctx(True):
        pass


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_processes_equal_one_process(tmp_path):
    traj = make_batch()
    mp.spawn(_worker, args=(2, traj, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    torch.testing.assert_close(got["adv"], jagg.group_advantages(reward(traj.latents[:, -1]), PROMPTS.tolist()))
    for mode, window, inter in MODES:
        want = single_process_update(traj, mode, window, inter)
        start = CondMLP()
        moved = sum(float((w - p.detach()).abs().max()) for w, p in zip(want, start.parameters()))
        assert moved > 1e-3, "the update must move the parameters for the comparison to mean anything"
        for a, b in zip(got["results"][(mode, window, inter)], want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{mode} W={window} {inter}")


@pytest.mark.parametrize("name, kind", [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("deepspeed_zero2", "DEEPSPEED")])
def test_accelerate_configs_parse(name, kind):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from pathlib import Path

    cfg = config_args.load_config_from_file(str(Path(__file__).resolve().parents[1] / "configs" / "accelerate"
                                                 / f"{name}.yaml"))
    assert cfg.distributed_type.name == kind and cfg.mixed_precision == "bf16"


def test_fsdp2_two_cpu_processes_equal_one_process(tmp_path):
    """FSDP2 (``fully_shard``) through ``torch.distributed.run`` on 2 CPU processes (gloo): a tiny SD3 with LoRA,
    sharded per transformer block, CFG with both branches, the KL term, JAGG with fresh inner steps and
    ``no_sync_except_last``: after one SGD step the full trainable weights equal one process's on the whole batch."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    import sys
    from pathlib import Path

    from tiny_pipelines import embeds, tiny_sd3
    from tiny_runs import run_launch

    from jagg.integrations import (LoraSettings, VelocityConfig, add_lora, reference_velocity,
                                   velocity_adapter)

    lora = dict(rank=2, alpha=4.0)
    model = tiny_sd3()
    torch.manual_seed(1)
    add_lora(model, LoraSettings(**lora))
    with torch.no_grad():                                      # LoRA B off zero: A gets gradient, KL is not 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    cond, neg = embeds()
    v = velocity_adapter(model, cond, neg, VelocityConfig(cfg_scale=4.5))
    g = torch.Generator().manual_seed(0)
    traj = jagg.sample_trajectories(v, torch.randn(4, 4, 16, 16, generator=g), jagg.flow_sigmas(6, shift=3.0), 0.7,
                                    generator=g)
    est = jagg.EstimatorConfig(correction_p=0.0, mode="jagg", window=3, intermediate="fresh", micro_batch=2, kl_beta=0.5)
    setup = dict(state={k: t.clone() for k, t in model.state_dict().items()}, lora=lora, traj=traj,
                 adv=torch.tensor([1.0, -1.0, 0.5, -0.5]), cond=cond, neg=neg, estimator=est, lr=0.5)
    torch.save(setup, tmp_path / "setup.pt")
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ref = jagg.reference_velocities(reference_velocity(v), traj, micro_batch=2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=setup["lr"])
    jagg.policy_gradient(v, traj, setup["adv"], est, ref_velocities=ref)
    opt.step()
    want = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    worker = Path(__file__).parent / "fsdp_rank.py"
    proc = run_launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(worker), str(tmp_path)], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "fsdp.pt")
    assert set(got) == set(want)
    assert max(float((want[n] - start[n]).abs().max()) for n in want) > 1e-3     # the step moved the weights
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


EXIT_SCRIPT = """
import atexit, sys, torch.distributed as dist
from jagg.infra.distributed import end_process_group, exit_process
atexit.register(lambda: open(sys.argv[1], "w").write("exit handler ran"))
if sys.argv[2] == "gloo":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".rdv", rank=0, world_size=1)
    group = dist.group.WORLD                     # held past the end, as DDP and FSDP2 hold it
    end_process_group()
    assert not dist.is_initialized()
    import threading                             # a finalizing interpreter would wait for it forever
    threading.Thread(target=threading.Event().wait).start()
print("unterminated output", end="")
exit_process(int(sys.argv[3]))
"""


@pytest.mark.parametrize("group", ["gloo", "none"])
def test_exit_process_runs_the_exit_handlers_and_keeps_the_status(tmp_path, group):
    """``exit_process`` (the ``jagg`` command's end): after a gloo group ended it leaves without finalizing the
    interpreter (the group's threads outlive it: a thread that never ends does not hold the process), and still runs
    the exit handlers, flushes the output and exits with the status; without one it is ``sys.exit``."""
    import subprocess
    import sys

    flag = tmp_path / "flag"
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(flag), group, "3"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.endswith("unterminated output") and flag.read_text() == "exit handler ran"
