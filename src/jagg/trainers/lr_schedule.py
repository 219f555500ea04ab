"""The learning-rate schedule of both trainers (``optim.lr_schedule``, ``optim.warmup_steps``).

The schedule is a function of the optimizer update's index ``k`` (counted from 0 over the whole run: iteration x
``inner_epochs x updates_per_epoch`` + the update's place in its iteration) and of the run's ``total`` updates
(``grpo.iterations x inner_epochs x updates_per_epoch``). The factor on ``optim.lr``:

    warm-up, k < W:      (k + 1) / W                       (linear; the first update already moves)
    then, p = (k - W) / (total - W) in [0, 1):
      constant           1
      linear             1 - p                             (to 0 at the end of the run)
      cosine             (1 + cos(pi p)) / 2               (to 0 at the end of the run)

Because it depends on the update's index alone, and the index on the iteration a checkpoint saves, a resumed run
continues the schedule bit-identically; a decay's length is the run's length, so a resumed run with a decay keeps its
``grpo.iterations`` (:func:`check_resumable_schedule`). ``constant`` without warm-up (the default) leaves the
optimizer's learning rate untouched.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(schedule: str, warmup_steps: int, k: int, total: int) -> float:
    """The factor on the base learning rate of update ``k`` (from 0) of ``total`` (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.lr_schedule must be one of {SCHEDULES}; got {schedule!r}")
    if k < warmup_steps:
        return (k + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(max((k - warmup_steps) / max(total - warmup_steps, 1), 0.0), 1.0)
    return 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))


def schedules_lr(optim) -> bool:
    """Whether the ``optim`` section's schedule ever changes the learning rate (not ``constant`` without warm-up)."""
    return optim.lr_schedule != "constant" or optim.warmup_steps > 0


def how_to_continue(cfg) -> str:
    """What a finished run (at ``grpo.iterations``) is told to do to train on: raise ``grpo.iterations`` when nothing
    decays over the run's length; with a decaying ``optim.lr_schedule``, which a resume may not stretch
    (:func:`check_resumable_schedule`), a new run."""
    if cfg.optim.lr_schedule == "constant":
        return "raise grpo.iterations to continue it"
    return (f"optim.lr_schedule={cfg.optim.lr_schedule} has decayed over its grpo.iterations, which a resume keeps: "
            "to train longer, start a new run in another directory")


def check_resumable_schedule(saved: dict, cfg) -> None:
    """Raise when a checkpoint's config ``saved`` (a dict) ran a decaying schedule over another run length than
    ``cfg``'s: the decay would jump."""
    optim, grpo = saved.get("optim", {}), saved.get("grpo", {})
    if optim.get("lr_schedule", "constant") == "constant" or cfg.optim.lr_schedule != optim.get("lr_schedule"):
        return                                      # nothing decays (a changed schedule is refused elsewhere)
    if grpo.get("iterations") != cfg.grpo.iterations:
        raise ValueError(f"cannot resume: optim.lr_schedule {cfg.optim.lr_schedule!r} decays over the run's "
                         f"grpo.iterations, {grpo.get('iterations')} in the checkpoint but {cfg.grpo.iterations} now; "
                         "keep the checkpoint's grpo.iterations, or start a new run in another directory")
