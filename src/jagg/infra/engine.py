"""The distributed engine of ``jagg train``: how several processes share the trainable transformer.

Three engines, chosen by :func:`resolve_engine` from the config's ``distributed:`` section and the launcher
(:mod:`jagg.infra.launch`):

- :class:`Engine` (one process): the transformer as loaded.
- :class:`DDPEngine`: torch's ``DistributedDataParallel``, replicated weights (LoRA, or a model that fits one GPU).
  Each update's chunks run under ``no_sync`` but the last, whose backward all-reduces the accumulated gradient once
  (:func:`jagg.infra.distributed.no_sync_except_last`); a process that trained no sample in the update makes one
  zero-gradient call (:func:`jagg.infra.lockstep.zero_call`) so that every process joins that all-reduce.
- :class:`FSDPEngine`: torch's FSDP2 ``fully_shard``, one unit per transformer block (``distributed.wrap_classes``,
  default the model's ``_no_split_modules``) plus the root: parameters, gradients and AdamW state are sharded; the
  frozen KL reference of a full fine-tune is sharded the same way. The model is sharded on the CPU, where it was
  loaded, then moved to the device and (full fine-tuning with ``lora.fp32_params``) upcast to fp32 master weights,
  shard by shard. Every backward reduce-scatters (gradients accumulate sharded, never whole). Calls of the sharded
  modules are collectives, so processes with different work are kept in step by :class:`jagg.infra.lockstep.Lockstep`.

Why torch's own calls and not ``accelerate.Accelerator.prepare``: jagg's estimator calls the transformer many times per
optimizer update (no-grad rollouts, both branches of CFG, fresh inner steps, the KL reference, one backward per chunk
of knot rows) and must choose per backward whether gradients synchronise and keep processes with different work in
step; ``DistributedDataParallel`` and ``fully_shard`` expose exactly that, and ``prepare`` wraps the same torch calls in
an autocast and output conversion jagg already does itself (``pipeline.autocast``). An accelerate config's settings are
read with accelerate's meaning (:mod:`jagg.infra.launch`) and applied here.

Checkpoints: the replicated engines keep the whole state in one file (:mod:`jagg.infra.checkpoint`); the FSDP engine
saves the shards (model, optimizer, and any other entry keyed like the trainable parameters, e.g. an EMA) with
``torch.distributed.checkpoint`` (:meth:`Engine.save_shards`, :meth:`Engine.load_shards`), which reads them back on
another number of processes (resharding), or into unsharded weights; :meth:`Engine.load_whole` reads whole weights
into any engine (under FSDP each process takes its shard). :meth:`Engine.full_state_dict` gathers the
weights once, on the main process, for the final export.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .distributed import no_sync_except_last
from .launch import LaunchSettings
from .lockstep import CallRecorder, Lockstep, zero_call

STRATEGIES = ("auto", "ddp", "fsdp")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineSettings:
    """The engine :func:`resolve_engine` chose. ``strategy``: ``"single"``, ``"ddp"`` or ``"fsdp"``; for FSDP:
    ``wrap`` (``"blocks"``: one unit per module of ``wrap_classes``, default the model's ``_no_split_modules``;
    ``"root"``: the whole model as one unit), ``wrap_key`` (the key that named the classes, for errors),
    ``reshard_after_forward``, ``param_dtype`` (compute dtype of ``MixedPrecisionPolicy``, or None). ``notes``: one
    line per setting taken from the launcher, printed by the trainer."""

    strategy: str = "single"
    wrap: str = "blocks"
    wrap_classes: tuple[str, ...] | None = None
    wrap_key: str = "distributed.wrap_classes"
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def _pick(key: str, mine, theirs, accelerate_key: str):
    """The config's ``key`` value ``mine`` or the accelerate config's ``theirs``; both set and different: refused."""
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"{key} is {mine!r} but the accelerate config's {accelerate_key} is {theirs!r}; set one of "
                         "them (or both alike)")
    return mine if mine is not None else theirs


def _strategy(d, launch: LaunchSettings, world: int) -> str:
    if d.strategy not in STRATEGIES:
        raise ValueError(f"distributed.strategy must be one of {STRATEGIES}; got {d.strategy!r}")
    asked = None if d.strategy == "auto" else d.strategy
    strategy = _pick("distributed.strategy", asked, launch.strategy, "distributed_type") or "ddp"
    return strategy if world > 1 else "single"


def resolve_engine(cfg, launch: LaunchSettings, world: int) -> EngineSettings:
    """The engine of a ``jagg train`` config ``cfg`` (its ``distributed:`` and ``pipeline:`` sections) under the
    launcher's ``launch`` settings with ``world`` processes. Applies the launcher's settings that live in
    ``pipeline:`` (mixed precision as ``pipeline.autocast`` outside FSDP, activation checkpointing, ``use_cpu``) to
    ``cfg.pipeline`` before the model loads. Raises a ``ValueError`` naming the keys that conflict."""
    d, p, notes = cfg.distributed, cfg.pipeline, []
    strategy = _strategy(d, launch, world)
    if launch.launcher == "accelerate":
        notes.append(f"accelerate launch: {world} process(es), engine {strategy}")
    if launch.use_cpu:
        if p.device not in ("auto", "cpu"):
            raise ValueError(f"pipeline.device is {p.device!r} but the accelerate config's use_cpu is true; set one")
        p.device = "cpu"
    if launch.activation_checkpointing and not p.gradient_checkpointing:
        p.gradient_checkpointing = True
        notes.append("fsdp_activation_checkpointing: true -> pipeline.gradient_checkpointing: true (per block)")
    param_dtype = None
    if launch.mixed_precision:
        mp = launch.mixed_precision
        if not p.lora.fp32_params:
            raise ValueError(f"the accelerate config's mixed_precision {mp} keeps fp32 master weights: set "
                             "pipeline.lora.fp32_params: true (or mixed_precision: no)")
        _pick("pipeline.autocast", p.autocast, mp, "mixed_precision")
        if strategy == "fsdp":
            param_dtype = mp
            notes.append(f"mixed_precision: {mp} -> FSDP MixedPrecisionPolicy(param_dtype={mp}, reduce_dtype=fp32)")
        else:
            p.autocast = mp
            notes.append(f"mixed_precision: {mp} -> pipeline.autocast: {mp}")
    classes = _pick("distributed.wrap_classes", tuple(d.wrap_classes) if d.wrap_classes else None,
                    launch.wrap_classes, "fsdp_transformer_layer_cls_to_wrap")
    wrap_key = "fsdp_transformer_layer_cls_to_wrap" if launch.wrap_classes and not d.wrap_classes \
        else "distributed.wrap_classes"
    wrap = "blocks" if classes or launch.wrap != "root" else "root"
    reshard = _pick("distributed.reshard_after_forward", d.reshard_after_forward, launch.reshard_after_forward,
                    "fsdp_reshard_after_forward")
    return EngineSettings(strategy, wrap, classes, wrap_key, True if reshard is None else reshard, param_dtype,
                          tuple(notes))


def make_engine(settings: EngineSettings, rank: int, world: int, device: torch.device) -> "Engine":
    """The :class:`Engine` of ``settings`` for this process."""
    kind = {"single": Engine, "ddp": DDPEngine, "fsdp": FSDPEngine}[settings.strategy]
    return kind(settings, rank, world, device)


class Engine:
    """One process (also the interface of the others): the transformer as loaded and placed.

    The trainer calls :meth:`wrap` once, after loading, then per optimizer update ``with engine.update() as
    backward_context:`` around its :func:`jagg.policy_gradient` call (``backward_context`` goes to that call), ``with
    engine.region():`` around any other calls of the transformer whose number may differ between processes (rollouts,
    the KL reference), and ``with engine.local():`` around work of this process alone (the estimator audit)."""

    sharded = False                 # whether the trainable weights are sharded (checkpoints through DCP)
    places_model = True             # whether the policy is loaded straight onto its device (False: wrap moves it)

    def __init__(self, settings: EngineSettings, rank: int = 0, world: int = 1,
                 device: torch.device = torch.device("cpu")):
        self.settings, self.rank, self.world, self.device = settings, rank, world, device

    @property
    def name(self) -> str:
        return self.settings.strategy

    def wrap(self, policy) -> None:
        """Wrap ``policy``'s transformer (:class:`jagg.integrations.policy.Policy`); ``policy.transformer`` becomes
        what the velocity callables call and ``policy.named_params`` the trainable weights to optimise."""

    @contextlib.contextmanager
    def update(self) -> Iterator[Callable[[bool], ContextManager] | None]:
        """One update's gradient on this process: yields the ``backward_context`` of its policy-gradient call."""
        yield None

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Calls of the transformer whose number may differ between processes."""
        yield

    def local(self) -> ContextManager:
        """Work of this process alone (its gradients are not synchronised)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ state
    def full_state_dict(self, module: nn.Module, trainable_only: bool = False) -> dict[str, Tensor]:
        """``module``'s whole weights (``trainable_only``: those with ``requires_grad``) on the CPU, gathered on the
        main process (a collective under FSDP: every process calls it; the others get an empty dict)."""
        if self.rank:
            return {}
        names = {n for n, p in module.named_parameters() if p.requires_grad} if trainable_only else None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if names is None or k in names}

    def full_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (keyed like the trainable weights, e.g. an EMA's averages) whole, on the CPU, on the main
        process (a collective under FSDP: every process calls it; the others get an empty dict)."""
        if self.rank:
            return {}
        return {n: t.detach().cpu().clone() for n, t in tensors.items()}

    def save_shards(self, module: nn.Module, opt: torch.optim.Optimizer, entries: dict[str, dict[str, Tensor]],
                    directory: Path) -> None:
        """Write the trainable weights of ``module``, the optimizer state and ``entries`` (name -> {parameter name:
        tensor}, e.g. an EMA) to ``directory`` with ``torch.distributed.checkpoint`` (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(module, opt, options=StateDictOptions(ignore_frozen_params=True))
        with one_process_quiet():
            dcp.save({"model": model, "optimizer": optim, **entries}, checkpoint_id=str(directory),
                     no_dist=not dist.is_initialized())

    def load_shards(self, module: nn.Module, opt: torch.optim.Optimizer, entries: dict[str, dict[str, Tensor]],
                    directory: Path) -> None:
        """Read :meth:`save_shards`' ``directory`` into ``module``'s trainable weights, the optimizer and ``entries``
        (in place), resharded to this engine's layout (any number of processes, or unsharded weights)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        options = StateDictOptions(ignore_frozen_params=True)
        model, optim = get_state_dict(module, opt, options=options)
        # the shards hold the trainable weights only (the frozen ones are the loaded model's): not strict
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        state = {"model": model, "optimizer": optim, **entries}
        with one_process_quiet():
            dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
        set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)


    def load_whole(self, params: dict[str, Tensor], opt: torch.optim.Optimizer, model: dict[str, Tensor],
                   optim: dict) -> None:
        """Read whole weights (``model``: {parameter name: tensor}, as one process or DDP saves them) into ``params``
        and the optimizer's state ``optim`` (``opt.state_dict()`` of the same parameters, in order) into ``opt``, each
        tensor laid out as its parameter (:func:`placed_like`: under FSDP every process takes its shard, a
        collective), so a checkpoint of any number of processes resumes on this engine."""
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(placed_like(model[n], p))
        order = [p for group in opt.param_groups for p in group["params"]]
        state = {i: {k: placed_like(v, order[i]) if torch.is_tensor(v) and v.shape == order[i].shape else v
                     for k, v in s.items()} for i, s in optim["state"].items()}
        opt.load_state_dict({"state": state, "param_groups": optim["param_groups"]})


@contextlib.contextmanager
def one_process_quiet() -> Iterator[None]:
    """``torch.distributed.checkpoint`` without a process group (one process), without its warning that it assumes
    so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def placed_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` (a tensor of ``like``'s full shape) in ``like``'s dtype and layout: this process's shard of it when
    ``like`` is sharded (a ``DTensor``; a collective), else on ``like``'s device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements)
    return whole.to(like.device, like.dtype)


class DDPEngine(Engine):
    """Replicated weights under ``DistributedDataParallel`` (module docstring)."""

    def wrap(self, policy) -> None:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(policy.bare, device_ids=ids, **no_buffer_sync())
        policy.transformer = self.ddp                 # DDP broadcast rank 0's weights: the replicas start equal
        self.recorder = CallRecorder(policy.bare)

    @contextlib.contextmanager
    def update(self):
        synced = []
        inner = no_sync_except_last(self.ddp)

        def backward_context(last: bool) -> ContextManager:
            synced.append(last)
            return inner(last)
        yield backward_context
        if not any(synced):                           # no sample here: join the others' all-reduce with zeros
            zero_call(self.ddp, self.recorder.call, grad=True)

    def local(self) -> ContextManager:
        return self.ddp.no_sync()


def no_buffer_sync() -> dict[str, bool]:
    """``DistributedDataParallel``'s argument that keeps it from broadcasting buffers before each forward (the
    estimator's many calls): ``forward_sync_buffers=False`` from torch 2.13, which deprecates the
    ``broadcast_buffers=False`` of earlier versions with a warning per process."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class FSDPEngine(Engine):
    """Sharded weights under FSDP2 ``fully_shard`` (module docstring)."""

    sharded = True
    places_model = False

    def wrap(self, policy) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.world,))
        modules = [policy.bare] + ([policy.reference_model] if policy.reference_model is not None else [])
        units = self._units(policy.bare)
        for module in modules:
            self._shard(module, mesh, units)
            module.to(self.device)
        if not policy.config.lora.enabled and policy.config.lora.fp32_params:
            policy.bare.float()                       # fp32 master weights, shard by shard
        policy.refresh_params()
        self.lockstep = Lockstep(dist.new_group(backend="gloo"))
        for module in modules:
            self.lockstep.register(module)

    def _units(self, model: nn.Module) -> set[str]:
        """The class names sharded as one unit each (empty: the root only), checked against ``model``."""
        s = self.settings
        if s.wrap == "root":
            return set()
        own = list(getattr(model, "_no_split_modules", None) or [])
        classes = set(s.wrap_classes or own)
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(classes - present)
        if missing or not classes:
            raise ValueError(f"{s.wrap_key}: {missing or '(none)'} name no module of {type(model).__name__}; its "
                             f"transformer blocks are {own}")
        return classes

    def _shard(self, model: nn.Module, mesh, units: set[str]) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        s = self.settings
        mp = MixedPrecisionPolicy()
        if s.param_dtype is not None:
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[s.param_dtype], reduce_dtype=torch.float32)
        kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=s.reshard_after_forward)
        for module in reversed(list(model.modules())):        # innermost first
            if module is not model and type(module).__name__ in units:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    @contextlib.contextmanager
    def update(self):
        with self.lockstep.region():
            yield None

    @contextlib.contextmanager
    def region(self):
        with self.lockstep.region():
            yield

    def local(self) -> ContextManager:
        raise RuntimeError("FSDP shards the weights: no process can compute a gradient alone")

    def full_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for n, t in tensors.items()}
        return {} if self.rank else full

    def full_state_dict(self, module: nn.Module, trainable_only: bool = False) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(module, options=options)
