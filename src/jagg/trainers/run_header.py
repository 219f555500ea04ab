"""The first screen of ``jagg train`` on a real model: a short header of what runs, and the third-party messages of
loading a model held back and said in one line.

:func:`header` says the run directory, the model (family, path, dtype, device, LoRA or full fine-tuning and the
trainable parameters), the engine (one process, DDP or FSDP2 on N processes, and what rank 0 holds of the trainable
weights, AdamW's moments and the frozen weights), the sampling (steps, sigma grid, SDE, guidance, size), the estimator with its rows back-propagated
per sample against exact's, the reward, the batch and the evaluation. :func:`quiet_loading` runs a model's loading
with diffusers' and transformers' log messages and progress bars held back and Python warnings recorded;
:func:`loading_note` says how many there were and the first (``JAGG_LOAD_MESSAGES=1`` shows them all as they come).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import warnings
from typing import Callable, Iterator, TypeVar

import torch

from ..integrations.schedules import grid_name
from ..knots import plan_update
from ..trajectory import Trajectory
from .minibatches import minibatch_line

T = TypeVar("T")

LIBRARIES = ("diffusers", "transformers")
SHOW_ENV = "JAGG_LOAD_MESSAGES"


def rows_per_sample(estimator, train_steps: torch.Tensor, sigmas: torch.Tensor, draws: int = 32) -> float:
    """Rows back-propagated per sample in one update of ``estimator`` on trajectories of ``sigmas`` ``[T + 1]`` with
    the trained steps ``train_steps`` (the mean over ``draws`` plans of a random estimator; no network call)."""
    T = sigmas.numel() - 1
    traj = Trajectory(torch.zeros(1, T + 1, 1), sigmas.double().cpu(), torch.zeros(1, T), torch.zeros(1, T, 1),
                      train_steps.cpu(), 0.5)
    gen = torch.Generator().manual_seed(0)
    return statistics.fmean(plan_update(traj, estimator, None, gen).rows for _ in range(draws if estimator.random
                                                                                          else 1))


def _count(n: int) -> str:
    """``n`` as ``960``, ``4.72M``, ``2.5B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _reward(cfg) -> str:
    if cfg.reward_server is not None:
        return f"reward server {cfg.reward_server.url}"
    spec = cfg.reward.spec
    return spec if isinstance(spec, str) else " + ".join(f"{w:g} x {n}" for n, w in spec.items())


def _estimator(e, rows: float, exact: int) -> str:
    kind = e.mode + (f", window {e.window}, knots {e.knots}, intermediate {e.intermediate}" if e.mode == "jagg" else "")
    if e.corrects:
        kind += f", correction_p {e.correction_p:g}"
    about = "about " if 0 < e.jagg_frac < 1 else ""           # routing decides per sample on the rollout's velocities
    return (f"{kind}: {about}{rows:.3g} rows back-propagated per sample against exact's {exact} "
            f"({rows / exact:.2f}x)")


def _local(t: torch.Tensor) -> int:
    """The elements of ``t`` this process stores (its shard of a ``DTensor``)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def engine_line(engine: str, world: int, policy) -> str:
    """How the ``world`` processes share the model on ``engine`` (``single``, ``ddp``, ``fsdp``; ``policy`` wrapped):
    what this process (rank 0) holds of the trainable weights, of AdamW's two moments and of the frozen weights."""
    if world == 1:
        return "  engine     one process"
    trainable = list(policy.params)
    ids = {id(q) for q in trainable}
    frozen = [q for m in [policy.bare, policy.reference_model] if m is not None for q in m.parameters()
              if id(q) not in ids]
    mine, full = sum(_local(q) for q in trainable), sum(q.numel() for q in trainable)
    mine_f, full_f = sum(_local(q) for q in frozen), sum(q.numel() for q in frozen)
    name = {"ddp": "DDP (replicated)", "fsdp": "FSDP2 (sharded)"}.get(engine, engine)
    return (f"  engine     {name} on {world} processes; rank 0 holds {_count(mine)} of {_count(full)} trainable "
            f"weights, {_count(2 * mine)} of {_count(2 * full)} AdamW moments, {_count(mine_f)} of {_count(full_f)} "
            "frozen weights" + (f" (each rank about 1/{world})" if engine == "fsdp" else " (each rank all)"))


def header(cfg, policy, out, run_id: str, resumed: bool, world: int, engine: str = "single") -> list[str]:
    """The header lines of a run of ``cfg`` (a :class:`~jagg.trainers.diffusers_config.DiffusersTrainConfig`) on
    ``policy`` (wrapped by the engine ``engine``) in the run directory ``out`` (module docstring)."""
    p, s, e, g, ev = cfg.pipeline, cfg.sample, cfg.estimator, cfg.grpo, cfg.eval
    train_steps, _ = s.sde_steps(p.num_steps, 0)
    sigmas = policy.sigmas()
    rows = rows_per_sample(e, train_steps, sigmas)
    n_params = sum(q.numel() for q in policy.params)
    how = (f"LoRA {'from ' + p.lora.path if p.lora.path else 'rank %d alpha %g' % p.lora.resolved(p.family)[:2]}"
           if p.lora.enabled else "full fine-tuning")
    h, w = p.size
    size = f"{h} x {w}" + (f" x {p.frames} frames" if p.video else "")
    guidance = f"cfg {p.cfg_scale:g}" + (f", embedded guidance {p.guidance_embed:g}" if p.guidance_embed else "")
    lines = [f"jagg train: {'resuming' if resumed else 'new'} run {run_id} in {out}",
             f"  model      {p.family} at {p.path} ({p.dtype} on {policy.device}), {how}: "
             f"{_count(n_params)} trainable parameters",
             f"  sampling   {p.num_steps} steps ({len(train_steps)} trained), sigmas: "
             f"{grid_name(p.sigma_grid, p.family, policy.scheduler_config, p.shift)} "
             f"(last before 0: {float(sigmas[-2]):.4g}); {s.sde_type} SDE eta {p.eta:g}; {guidance}; {size}",
             engine_line(engine, world, policy),
             f"  estimator  {_estimator(e, rows, len(train_steps))}",
             f"  reward     {_reward(cfg)}",
             f"  batch      {s.prompts_per_iter} prompts x {s.group_size} images = {s.batch_size} samples per "
             f"iteration{f' over {world} processes' if world > 1 else ''}; {g.inner_epochs * g.updates_per_epoch} "
             f"updates each; {g.iterations} iterations; lr {cfg.optim.lr:g}"
             + (f"; EMA {cfg.optim.ema_decay:g}" if cfg.optim.ema_decay else "") + f"; {minibatch_line(cfg, world)}",
             f"  prompts    {s.prompts_file}: {len(s.prompt_set)} prompts"
             + (" with metadata" if s.prompt_set.metadata is not None else "")]
    if ev.enabled:
        lines.append(f"  eval       every {ev.every} iterations: {len(ev.prompts()[0])} images of {ev.test_set.path}, "
                     f"ODE {p.eval_num_steps} steps, seed {ev.seed}" + (", EMA weights" if cfg.optim.ema_decay else ""))
    else:
        why = "eval.every: 0" if not ev.every else ("no test set: set eval.prompts_file, or put test.txt / "
                                                    "test_metadata.jsonl beside the training prompts")
        lines.append(f"  eval       none ({why})")
    return lines


@contextlib.contextmanager
def quiet_loading() -> Iterator[list[str]]:
    """Run a model's loading with the log messages of diffusers and transformers (their ``logging`` records of level
    WARNING and above) and their progress bars held back and Python warnings recorded: the block gets the list they
    are collected in (:func:`loading_note` says them in one line). With ``$JAGG_LOAD_MESSAGES`` set to 1 nothing is
    held back."""
    held: list[str] = []
    if os.environ.get(SHOW_ENV) == "1":
        yield held
        return

    class Hold(logging.Handler):
        def emit(self, record):
            held.append(f"[{record.name.split('.')[0]}] {record.getMessage()}")

    loggers = [logging.getLogger(name) for name in LIBRARIES]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    bars = _progress_bars(False)
    handler = Hold(logging.WARNING)
    try:
        for lg in loggers:
            lg.handlers, lg.propagate = [handler], False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield held
        held += [f"[{w.category.__name__}] {w.message}" for w in caught]
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        _progress_bars(bars)


def loading_note(held: list[str]) -> str | None:
    """One line on the messages :func:`quiet_loading` held back (their count and the first), or None without any."""
    unique = list(dict.fromkeys(held))
    if not unique:
        return None
    first = " ".join(unique[0].split())
    return (f"  (loading: {len(unique)} message{'s' * (len(unique) != 1)} of diffusers / transformers held back, e.g. "
            f"{first[:150]}{'...' if len(first) > 150 else ''}; {SHOW_ENV}=1 shows them)")


def loaded_quietly(load: Callable[[], T]) -> T:
    """``load()`` under :func:`quiet_loading`, then its :func:`loading_note` on stderr (a command whose stdout may be
    JSON: ``jagg eval``, ``jagg bench meter``); returns what ``load`` returned."""
    with quiet_loading() as held:
        loaded = load()
    note = loading_note(held)
    if note:
        print(note.strip(), file=sys.stderr)
    return loaded


def _progress_bars(enabled) -> tuple[bool, bool] | None:
    """Turn diffusers' and transformers' progress bars off (``enabled`` False: returns their states before) or back
    to the states ``enabled``."""
    try:
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog
    except ImportError:
        return None
    if enabled is False:
        states = (dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled())
        dlog.disable_progress_bar()
        tlog.disable_progress_bar()
        return states
    if enabled is not None:
        for module, on in zip((dlog, tlog), enabled):
            module.enable_progress_bar() if on else module.disable_progress_bar()
    return None
