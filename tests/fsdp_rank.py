"""One rank of the FSDP2 check in tests/test_distributed.py, launched there with
``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_rank.py <dir>`` (CPU, gloo).

Reads ``<dir>/setup.pt`` (a tiny SD3 with LoRA, one trajectory batch, advantages, prompt embeddings), shards the
transformer with ``fully_shard`` (one unit per ``JointTransformerBlock`` plus the root), takes this rank's half of the
batch, computes the policy gradient with CFG (both branches), the KL term to the adapters-off reference and
``no_sync_except_last``, makes one SGD step and (rank 0) writes the full trainable weights to ``<dir>/fsdp.pt``;
then leaves as ``jagg`` does after a run on CPU processes (:func:`jagg.infra.distributed.exit_process`).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import jagg
    from jagg.integrations import LoraSettings, VelocityConfig, add_lora, reference_velocity, velocity_adapter
    from jagg.infra.distributed import end_process_group, loss_scale, no_sync_except_last, shard
    from tiny_pipelines import tiny_sd3

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        setup = torch.load(out / "setup.pt", weights_only=False)
        model = tiny_sd3()
        add_lora(model, LoraSettings(**setup["lora"]))
        model.load_state_dict(setup["state"])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.transformer_blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        traj, adv = setup["traj"], setup["adv"]
        rows = torch.arange(traj.batch_size)[shard(traj.batch_size)]
        local = traj.select(rows)
        v = velocity_adapter(model, setup["cond"].select(rows), setup["neg"], VelocityConfig(cfg_scale=4.5))
        ref = jagg.reference_velocities(reference_velocity(v), local, micro_batch=2)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=setup["lr"])
        jagg.policy_gradient(v, local, adv[rows], setup["estimator"], ref_velocities=ref,
                             loss_scale=loss_scale(len(rows), traj.batch_size),
                             backward_context=no_sync_except_last(model))
        opt.step()
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters() if p.requires_grad}
        if dist.get_rank() == 0:
            torch.save(full, out / "fsdp.pt")
        dist.barrier()
    finally:
        end_process_group()


if __name__ == "__main__":
    from jagg.infra.distributed import exit_process

    main(Path(sys.argv[1]))
    exit_process(0)                      # FSDP2 keeps the gloo group alive past destroy_process_group
