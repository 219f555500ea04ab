"""Data-parallel GRPO: split sampling across processes, advantages on the gathered batch, DDP-correct gradients.

One optimizer update over a *global* batch of ``N`` trajectories on ``P`` processes (DDP, FSDP, torchrun,
accelerate)::

    sl = shard(N)                                     # this rank's contiguous slice of the global batch
    traj = jagg.sample_trajectories(v_local, noise[sl], sigmas, eta)       # sampling is split
    scores, _ = reward_fn(images, prompts[sl], None)                       # so are the rewards
    adv = distributed_advantages(scores, prompts[sl])  # gathered, per prompt on all N, then this rank's slice
    for j, part in enumerate(micro_batches):          # optional accumulation inside the rank
        jagg.policy_gradient(v, part, adv[...], cfg, loss_scale=loss_scale(len(part), N),
                             backward_context=no_sync_except_last(ddp_model, sync=(j == last)))
    opt.step()

The engine (DDP, FSDP) averages the gradients over the ranks; ``jagg train`` runs it through
:mod:`jagg.infra.engine`.

Loss normalisation. ``policy_gradient`` averages its loss over the samples it is given. DDP / FSDP / DeepSpeed
*average* gradients over ranks. With ``loss_scale(n_call, N) = P * n_call / N`` the result is exactly the
gradient of the single-process loss over the global batch: ``1/P * sum_r sum_calls P n/N * grad(mean over n) =
1/N * sum over all N samples``. With equal shards and no accumulation it is 1.

Prompts must not be split away from their prompt group for the advantages: :func:`distributed_advantages` therefore
gathers rewards *and* prompt ids of every rank before normalising per prompt (as Flow-GRPO's gather + per-prompt
stat tracker). Sampling itself may split a prompt group across ranks freely.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Callable, ContextManager, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..advantages import group_advantages


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without an initialised process group."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def local_processes(world: int) -> int:
    """The processes of the job on this machine: torchrun's and accelerate's ``LOCAL_WORLD_SIZE``, else all
    ``world`` of them (one machine)."""
    try:
        return max(int(os.environ["LOCAL_WORLD_SIZE"]), 1)
    except (KeyError, ValueError):
        return max(int(world), 1)


def init_process_group_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun / accelerate variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); a no-op when already initialised or when ``WORLD_SIZE`` is unset or 1.
    ``backend`` defaults to nccl with CUDA, else gloo. Returns ``(rank, world_size)``."""
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return rank_and_world()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return rank_and_world()


_gloo_outlives_destroy = False      # a gloo group of this process ended by end_process_group (see exit_process)


def end_process_group() -> None:
    """``dist.destroy_process_group()`` of an initialised group, noting a gloo one for :func:`exit_process`."""
    global _gloo_outlives_destroy
    if is_distributed():
        _gloo_outlives_destroy |= dist.get_backend() == "gloo"
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` (the ``jagg`` command's last call).

    After :func:`end_process_group` ended a gloo group (processes on CPU), the group itself outlives
    ``destroy_process_group``: DDP and FSDP2 keep references to it, and gloo only joins its worker threads when the
    last one goes. A worker thread still releasing the tensors of the last collective then takes the GIL while the
    interpreter finalizes, and the process aborts (``terminate called without an active exception``, SIGABRT):
    torchrun reports a finished run as failed. Such a process runs its exit handlers (``atexit``), flushes its
    output and leaves without finalizing the interpreter; any other exits as usual."""
    if not _gloo_outlives_destroy:
        sys.exit(code)
    atexit._run_exitfuncs()                 # what a normal exit runs before finalizing, with the interpreter alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard(n: int, rank: int | None = None, world_size: int | None = None) -> slice:
    """This rank's contiguous slice of a global batch of ``n`` items. ``n`` must divide evenly: unequal shards
    would make ranks run different numbers of backward passes (a DDP hang) and change the gradient weighting."""
    r, w = rank_and_world()
    rank = r if rank is None else rank
    world_size = w if world_size is None else world_size
    if n % world_size:
        raise ValueError(f"global batch of {n} samples does not split evenly over {world_size} processes; make "
                         "prompts_per_iter * group_size a multiple of the number of processes")
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def gather(t: Tensor) -> Tensor:
    """Concatenate ``t`` ``[n_r, ...]`` of every rank in rank order -> ``[sum_r n_r, ...]`` (sizes may differ).
    Without a process group it returns ``t``. Not differentiable (for rewards, statistics)."""
    if not is_distributed():
        return t
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    pad = max(sizes)
    buf = torch.zeros((pad, *t.shape[1:]), dtype=t.dtype, device=t.device)
    buf[: t.shape[0]] = t
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf.contiguous())
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def gather_objects(items: Sequence) -> list:
    """Concatenate Python lists (prompt ids, metadata) of every rank in rank order."""
    if not is_distributed():
        return list(items)
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def distributed_advantages(local_rewards: Tensor, local_prompt_ids: Sequence, **kwargs) -> Tensor:
    """Group-relative advantages computed on the *gathered* batch, returned for this rank's samples.

    Args:
        local_rewards: ``[n]`` rewards of this rank's samples.
        local_prompt_ids: ``n`` prompt ids (strings or ints) of this rank's samples.
        kwargs: passed to :func:`jagg.group_advantages` (``global_std``, ``adv_clip_max``, ``eps``).

    Returns ``[n]`` advantages, identical to slicing the single-process advantages of the global batch.
    """
    local_rewards = local_rewards.detach().float().flatten()
    if len(local_prompt_ids) != local_rewards.numel():
        raise ValueError(f"got {local_rewards.numel()} rewards but {len(local_prompt_ids)} prompt ids on this rank")
    rewards = gather(local_rewards)
    prompt_ids = gather_objects(list(local_prompt_ids.tolist() if isinstance(local_prompt_ids, Tensor)
                                     else local_prompt_ids))
    adv = group_advantages(rewards, prompt_ids, **kwargs)
    if not is_distributed():
        return adv
    n = torch.tensor([local_rewards.numel()], device=local_rewards.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    start = sum(int(s) for s in sizes[: dist.get_rank()])
    return adv[start:start + local_rewards.numel()]


def loss_scale(samples_in_call: int, global_batch: int, world_size: int | None = None) -> float:
    """``loss_scale`` for one :func:`jagg.policy_gradient` call so that the ranks' *averaged* gradient equals the
    single-process gradient over the ``global_batch`` samples of one optimizer update: ``P * n_call / N``.

    Examples: equal shards, one call per rank -> 1; ``A`` equal accumulation calls per rank -> ``1 / A``.
    """
    world = rank_and_world()[1] if world_size is None else world_size
    if samples_in_call < 1 or global_batch < samples_in_call:
        raise ValueError(f"need 1 <= samples_in_call <= global_batch; got {samples_in_call}, {global_batch}")
    return world * samples_in_call / global_batch


def _no_sync(model: torch.nn.Module) -> Callable[[], ContextManager] | None:
    """The model's "accumulate locally" context: DDP / FSDP1 ``no_sync``, FSDP2 ``set_requires_gradient_sync``."""
    if hasattr(model, "no_sync"):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def fsdp2_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return fsdp2_no_sync
    return None


def no_sync_except_last(model: torch.nn.Module, sync: bool = True) -> Callable[[bool], ContextManager]:
    """A ``backward_context`` for :func:`jagg.policy_gradient`: every backward of the call runs under the model's
    ``no_sync`` (DDP / FSDP: gradients accumulate locally) except the call's last one when ``sync`` is True, which
    reduces the accumulated gradient once. With several accumulation calls before one optimizer step pass
    ``sync=False`` to all but the last call. Models without ``no_sync`` (one process) get a null context.

    ``policy_gradient`` enters the context around each chunk's forward with grad and its backward (DDP reads
    ``require_backward_grad_sync`` in the forward), so only the last chunk of the last call all-reduces. Every rank
    must make that one synchronised backward per update: a rank without samples makes a zero-gradient call
    (:func:`jagg.infra.lockstep.zero_call`, as :class:`jagg.infra.engine.DDPEngine` does).

    DeepSpeed: pass ``backward_fn=engine.backward`` to :func:`jagg.policy_gradient` as well.
    """
    no_sync = _no_sync(model)
    if no_sync is None:
        return lambda last: contextlib.nullcontext()
    return lambda last: contextlib.nullcontext() if (last and sync) else no_sync()
