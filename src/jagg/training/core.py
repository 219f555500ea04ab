"""What both trainers (the shapes world's and the real models') share around their loop: the guarded optimizer
step, the abort after repeated non-finite updates, the save after an early failure, the signal handler, the
estimator audit, and the check that a checkpoint's config allows resuming."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from ..audit import AuditMeter, audit_flag, audit_parts, meter_flag

# config keys that may change between a checkpoint and its resumption
RESUMABLE_CHANGES = ("grpo.iterations", "log.", "eval.", "threads")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "weights":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _may_change(key: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``allowed``: a key, a section (``"log."``) or a key with sub-keys (``"reward_server"``)."""
    return any(key.startswith(a) if a.endswith(".") else key == a or key.startswith(a + ".") for a in allowed)


_ABSENT = object()


def _shown(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def check_resumable(saved: dict, current: dict, allowed: tuple[str, ...] = RESUMABLE_CHANGES) -> list[str]:
    """Raise a ValueError naming the first config key whose change would break continuation; return one line per
    key that changed and may (``allowed``), e.g. ``"grpo.iterations: 30 in the checkpoint, 200 now"``."""
    a, b = _flatten(saved), _flatten(current)
    changed = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if not _may_change(key, allowed):
            raise ValueError(f"cannot resume: config key {key!r} was {a.get(key)!r} in the checkpoint but is "
                             f"{b.get(key)!r} now; use the checkpoint's value or start a new run (another log.output_dir)")
        changed.append(f"{key}: {_shown(a.get(key, _ABSENT))} in the checkpoint, {_shown(b.get(key, _ABSENT))} now")
    return changed


class TrainerCore:
    """What both trainers (TinyDiT and diffusers) share around the loop: the optimizer step, skipped (gradient
    dropped, counted) when the update's loss or gradient norm is not finite, the abort after too many skips,
    the checkpoint after a failure before the first update, and the SIGINT/SIGTERM handler. Needs ``self.opt``,
    ``self.skipped_updates``, ``self.consecutive_skips``, ``self._stop``, ``self._updating``,
    ``self._rng_at_start``, ``save()`` and ``_set_rng_state()``."""

    world, rank = 1, 0                                     # processes and this one's rank

    def guarded_step(self, stats: dict) -> bool:
        """Step unless ``stats["loss"]`` or ``stats["grad_norm"]`` is non-finite; sets ``stats["skipped"]``."""
        if not (np.isfinite(stats["loss"]) and np.isfinite(stats["grad_norm"])):
            self.opt.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.consecutive_skips += 1
            stats["skipped"] = 1
            return False
        self.opt.step()
        self.consecutive_skips = 0
        stats["skipped"] = 0
        return True

    def skip_limit_error(self, limit: int) -> RuntimeError | None:
        """The error to stop with after ``limit`` consecutive skipped updates (0 = never), else None."""
        if limit and self.consecutive_skips >= limit:
            return RuntimeError(f"aborting: {limit} consecutive updates had a non-finite loss or gradient "
                                "(see metrics.jsonl 'skipped'); lower optim.lr")
        return None

    @torch.enable_grad()
    def audit(self, make_velocity: Callable[[list[int]], Callable], traj, adv, ref_v, groups,
              params: Sequence[torch.nn.Parameter]) -> tuple[float, float]:
        """The estimator audit (:func:`jagg.audit.audit_parts`) on whole GRPO groups (``groups`` ``[B]``) of the batch,
        at least ``estimator.audit_samples`` samples and two groups where the batch has them, picked at random with
        an RNG of its own, so a run is the same with and without it. ``make_velocity(indices)`` gives the velocity
        callable of those samples. Feeds the run's :class:`jagg.audit.AuditMeter` (error against noise, predicted
        efficiency), logs an ``audit`` record (on the main process), prints each warning once per run, and returns
        its ``(seconds, CPU seconds)`` so that the caller can leave them out of the iteration's time."""
        c = self.cfg
        c0 = time.process_time()
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + self.iteration)
        ids = torch.unique(groups)
        chosen: list[int] = []
        for n, gi in enumerate(ids[torch.randperm(ids.numel(), generator=gen)]):
            chosen += torch.nonzero(groups == gi).flatten().tolist()
            if len(chosen) >= c.estimator.audit_samples and n >= 1:
                break
        sub = sorted(chosen)
        idx = torch.tensor(sub, device=traj.latents.device)
        g_sub = groups[torch.tensor(sub)]
        a, exact, est = audit_parts(make_velocity(sub), traj.select(idx), adv[idx], c.estimator, params,
                                    None if ref_v is None else ref_v[idx], g_sub, gen, split=g_sub)
        if getattr(self, "_meter", None) is None:
            self._meter = AuditMeter(seed=c.seed)
        per_update = c.sample.batch_size / c.grpo.updates_per_epoch / c.sample.group_size
        last = self.logger.records("train")[-1:] if self.logger is not None else []
        share = last[0]["train_s"] / last[0]["iter_s"] if last and last[0].get("iter_s") else None
        a.update(self._meter.update(exact, est, a["rows_exact"], a["rows_estimator"], per_update, share))
        flags = [f for f in (audit_flag(a, c.estimator), meter_flag(a)) if f]
        if self.logger is not None:
            self.logger.log({"kind": "audit", "iteration": self.iteration + 1, "samples": len(sub), **a,
                             "flagged": int(bool(flags))})
        shown = getattr(self, "_flags_shown", set())
        for f in flags:
            key = f.split("(")[0]
            if key not in shown:
                shown.add(key)
                self._print(f"\niteration {self.iteration + 1}: {f}")
        self._flags_shown = shown
        return a["seconds"], time.process_time() - c0

    def audit_due(self) -> bool:
        """Whether the coming iteration runs the estimator audit (``estimator.audit_every``)."""
        every = self.cfg.estimator.audit_every
        return bool(every) and (self.iteration + 1) % every == 0

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def _save_on_failure(self) -> None:
        """A failure before this iteration's first update (sampling, reward) left the weights untouched: in a
        single process, rewind the RNGs to the iteration's start and save, so ``--resume`` retries exactly
        this iteration."""
        if self._updating or self.world > 1:
            return
        self._set_rng_state(self._rng_at_start)
        path = self.save()
        print(f"\nthe run failed in iteration {self.iteration + 1}; saved {path}: fix the cause and use --resume")

    def _handle_signal(self, signum, frame):
        self._stop = True
        self._print(f"\nreceived signal {signum}: finishing this iteration, saving a checkpoint, exiting")
