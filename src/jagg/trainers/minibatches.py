"""How an epoch's kept samples are cut into ``grpo.updates_per_epoch`` minibatches (``grpo.minibatches``): the one
cut the trainers, ``estimator.mode: auto``'s measurement and ``jagg bench meter`` all use.

- ``samples``: the samples shuffled, then split (Flow-GRPO's habit): a prompt group is spread over several updates.
- ``groups``: the prompt groups shuffled, then split, each minibatch whole prompt groups, as equal in size as the
  counts allow (DanceGRPO's and UniRL's habit). JAGG's interpolation error is largely shared by the samples of a
  group, whose advantages sum to zero: it cancels in an update that holds the whole group, and not in one that holds
  part of it.
- ``auto``: ``groups`` for a JAGG estimator and for ``estimator.mode: auto`` (whose candidates are JAGG estimators,
  measured on the minibatches they would train on) where the prompt groups fill the updates, else ``samples``; always
  ``samples`` for ``exact`` and ``subsample`` (exact learned more per update from shuffled samples: docs/results.md).

Under several processes each process cuts its own samples, which are whole prompt groups
(:func:`check_groups_fit`), so every update's global minibatch is whole prompt groups too.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAMPLES, GROUPS, AUTO = "samples", "groups", "auto"
CUTS = (SAMPLES, GROUPS, AUTO)


def resolve_cut(cut: str, estimator_mode: str, prompts_per_iter: int = 0, updates_per_epoch: int = 0,
                processes: int = 1) -> str:
    """``samples`` or ``groups``: ``cut`` (``grpo.minibatches``), with ``auto`` resolved for ``estimator_mode`` and a
    batch of ``prompts_per_iter`` prompt groups cut into ``updates_per_epoch`` updates on ``processes`` processes."""
    if cut not in CUTS:
        raise ValueError(f"grpo.minibatches must be one of {', '.join(CUTS)}; got {cut!r}")
    if cut != AUTO:
        return cut
    fits = groups_fit(prompts_per_iter, updates_per_epoch, processes) is None
    return GROUPS if estimator_mode in ("jagg", "auto") and fits else SAMPLES


def groups_fit(prompts_per_iter: int, updates_per_epoch: int, processes: int = 1) -> str | None:
    """Why ``prompts_per_iter`` prompt groups cannot fill ``updates_per_epoch`` minibatches of whole groups split
    evenly over ``processes`` (a group never straddles two processes), or None when they can."""
    if prompts_per_iter < updates_per_epoch:
        return (f"sample.prompts_per_iter = {prompts_per_iter} prompt groups cannot fill grpo.updates_per_epoch = "
                f"{updates_per_epoch} minibatches of whole groups")
    if prompts_per_iter % processes:
        return (f"sample.prompts_per_iter = {prompts_per_iter} prompt groups do not split evenly over {processes} "
                "processes (a group would straddle two)")
    return None


def check_groups_fit(prompts_per_iter: int, updates_per_epoch: int, processes: int = 1) -> None:
    """Raise, naming the keys, unless the prompt groups fit the updates and processes (:func:`groups_fit`)."""
    why = groups_fit(prompts_per_iter, updates_per_epoch, processes)
    if why is not None:
        raise ValueError(f"grpo.minibatches groups: {why}; lower grpo.updates_per_epoch, make "
                         "sample.prompts_per_iter a multiple of the process count and at least the updates, or set "
                         "grpo.minibatches: samples")


def cut_minibatches(prompt_groups: Tensor, updates: int, cut: str, generator: torch.Generator,
                    all_groups: Tensor | None = None) -> list[Tensor]:
    """One epoch's ``updates`` minibatches of the ``n`` samples whose prompt groups are ``prompt_groups`` ``[n]``:
    positions ``[m_u]`` into them (some may be empty), drawn with ``generator``. ``cut`` is ``samples`` (a random
    permutation of the positions, split) or ``groups`` (a random permutation of the groups, split; a minibatch's
    positions in ascending order). ``all_groups``: the sorted ids of every process's groups, permuted with a generator
    in the same state on every process, so that each update's global minibatch is the same for any process count
    (default: this process's own groups)."""
    n = int(prompt_groups.numel())
    if cut == SAMPLES:
        return list(torch.randperm(n, generator=generator).tensor_split(updates))
    if cut != GROUPS:
        raise ValueError(f"cut must be {SAMPLES!r} or {GROUPS!r}; got {cut!r}")
    groups = torch.unique(prompt_groups.cpu()) if all_groups is None else all_groups   # [G] sorted group ids
    order = groups[torch.randperm(len(groups), generator=generator)]             # [G] shuffled
    return [torch.nonzero(torch.isin(prompt_groups.cpu(), part)).flatten() for part in order.tensor_split(updates)]


def minibatch_line(cfg, processes: int = 1) -> str:
    """How a trainer config ``cfg`` cuts its updates' minibatches on ``processes`` processes, as the first screen
    says it: ``minibatches of whole prompt groups (grpo.minibatches auto for mode jagg)``."""
    g = cfg.grpo
    what = "whole prompt groups" if cfg.cut_for(processes) == GROUPS else "shuffled samples"
    how = f"grpo.minibatches {g.minibatches}" + (f" for mode {cfg.estimator.mode}" if g.minibatches == AUTO else "")
    return f"minibatches of {what} ({how})"
