"""Keeping the processes' calls of a sharded transformer in step, when each process has its own amount of work.

Under FSDP every call of a sharded module is a collective: its forward gathers each block's weights from all
processes, its backward gathers them again and reduce-scatters the gradients. So every process must make the same
sequence of calls. ``jagg train`` does not: after zero-spread prompt groups are dropped a process may train fewer
samples than another (or none), the estimator's chunks depend on the samples (routing, unbiased JAGG's picks, interval
draws), and the KL reference runs on the kept samples only.

:class:`Lockstep` makes the sequences equal without changing anyone's work. Before each call of a registered module a
process announces its kind (which module; with or without grad) and the processes agree, on a side process group, on
the smallest kind announced; those whose next call is of that kind make it, the others make a *filler* call of that kind
(the module on the arguments of its latest call; with grad, followed by a backward of zeros, so it adds nothing to any
gradient). A process that has finished a region of calls (:meth:`Lockstep.finish`) announces ``done`` and makes filler
calls until every process is done. Each round costs one all-reduce of one integer. The averaged gradient stays right:
FSDP divides the reduce-scattered sum by the number of processes, and a filler contributes zeros, as a process with
fewer samples should (``jagg.infra.distributed.loss_scale``).

:func:`zero_call` is the filler call; DDP uses it too (:mod:`jagg.infra.engine`), for a process that made no
synchronised backward in an update while the others did.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

DONE = 1 << 30


def _tensors(obj) -> list[Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them, e.g. diffusers' outputs)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _cast(obj, dtype: torch.dtype):
    """``obj`` (call arguments) with its floating tensors in ``dtype``."""
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def zero_call(module: nn.Module, call: tuple[tuple, dict], grad: bool) -> None:
    """Call ``module`` on ``call`` (``(args, kwargs)`` of an earlier call) for its collectives alone: without grad, a
    forward whose output is dropped; with grad, a forward and a backward of zeros (every gradient it adds is 0)."""
    args, kwargs = call
    if not grad:
        with torch.no_grad():
            module(*args, **kwargs)
        return
    with torch.enable_grad():
        out = [t for t in _tensors(module(*args, **kwargs)) if t.requires_grad]
        if out:
            torch.autograd.backward(out, [torch.zeros_like(t) for t in out])


class CallRecorder:
    """The arguments ``(args, kwargs)`` of ``module``'s latest call (:attr:`call`, None before the first)."""

    def __init__(self, module: nn.Module):
        self.call: tuple[tuple, dict] | None = None
        module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.call = (args, kwargs)


class Lockstep:
    """Keep the calls of the :meth:`register`-ed modules in step across the processes of ``group`` (module
    docstring). Use ``with lockstep.region(): ...`` around any code whose calls of those modules may differ in number
    or kind between processes; every process must enter and leave the region at the same point of its program (no
    other collective may run inside it)."""

    def __init__(self, group: Any = None):
        self.group = group
        self.modules: list[nn.Module] = []
        self.calls: list[tuple[tuple, dict] | None] = []
        self.fillers = 0                       # filler calls made by this process (a diagnostic)
        self._filling = False

    def register(self, module: nn.Module) -> None:
        """Negotiate before every call of ``module`` (a forward pre-hook that runs before FSDP's own); the first
        registered module's latest arguments are the fallback of the filler calls of the others (same signature)."""
        index = len(self.modules)
        self.modules.append(module)
        self.calls.append(None)

        def before_call(mod, args, kwargs):
            if not self._filling:
                self.calls[index] = (args, kwargs)
                self._wait_for(2 * index + int(torch.is_grad_enabled()))
        module.register_forward_pre_hook(before_call, prepend=True, with_kwargs=True)

    def finish(self) -> None:
        """This process has no more calls in the region: make filler calls until every process is done."""
        self._wait_for(DONE)

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """A region of calls that may differ between processes, closed by :meth:`finish`."""
        yield
        self.finish()

    def _agree(self, kind: int) -> int:
        t = torch.tensor([kind], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def _wait_for(self, kind: int) -> None:
        """Agree rounds until the processes agree on ``kind``, making a filler call of each smaller kind agreed."""
        while (agreed := self._agree(kind)) != kind:
            self._fill(agreed)

    def _fill(self, kind: int) -> None:
        index, grad = divmod(kind, 2)
        module = self.modules[index]
        call = self.calls[index]
        if call is None:                       # never called here: the first module's arguments, in its dtype
            if self.calls[0] is None:
                raise RuntimeError("lockstep: a filler call is needed before this process called the transformer "
                                   "at all; the first region of calls (the rollouts) must be the same everywhere")
            dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
            call = _cast(self.calls[0], dtype)
        self._filling = True
        try:
            zero_call(module, call, bool(grad))
        finally:
            self._filling = False
        self.fillers += 1
