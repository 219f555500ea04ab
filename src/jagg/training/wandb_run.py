"""Weights & Biases logging, the optional extra ``pip install 'jagg[wandb]'``: a run directory's run mirrored to one
wandb run (``log.wandb: true``).

:class:`jagg.training.metrics.MetricsLogger` forwards to a :class:`WandbRun` what it writes (``metrics.jsonl`` stays
the source of truth; TensorBoard gets the same scalars):

- the resolved config, with the run directory's absolute path (``run_dir``) and the run id, when the run starts (any
  key named ``token`` is sent as ``<redacted>``: a reward server's token never leaves the machine);
- every finite scalar of every record, under the names TensorBoard has (``train/reward_mean``, ``eval/accuracy``,
  ``audit/cos``: kind/name), against the record's ``iteration`` (wandb's x-axis metric);
- the sample grids as images: ``images/eval`` (each evaluation's grid), ``images/comparison`` (the end of a shapes
  run), ``images/rollouts`` (the diffusers trainer's rollout grid at each checkpoint).

The wandb run's id is the jagg run id (``run.json``'s ``run_id``, in every checkpoint), opened with ``resume="allow"``:
``--resume`` continues the same wandb run, a new run (``--overwrite``) starts another. Iterations that a resume from
an older checkpoint trains again appear twice in wandb's history (``metrics.jsonl`` drops the first copies). wandb
writes its local files under ``<run directory>/wandb/`` unless ``WANDB_DIR`` is set. Only the main process logs.
"""

from __future__ import annotations

import os
from pathlib import Path

WANDB_MODES = ("online", "offline", "disabled")
EXTRA = "pip install 'jagg[wandb]'"


def require_wandb():
    """The ``wandb`` module, or a ValueError (one line, naming the extra) when it cannot be imported."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"log.wandb: true needs the wandb package, which cannot be imported ({e}): {EXTRA}, or set "
                         "log.wandb=false") from None
    return wandb


def redacted(data):
    """``data`` (a config as nested dicts and lists) with the value of every key named ``token`` replaced by
    ``"<redacted>"`` (when set)."""
    if isinstance(data, dict):
        return {k: "<redacted>" if k == "token" and v else redacted(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redacted(v) for v in data]
    return data


class WandbRun:
    """The wandb run of the run directory ``out`` (module docstring): opened here with the ``log:`` section ``log``
    (``wandb_project``, ``wandb_entity``, ``wandb_mode``), the run id ``run_id`` and the resolved ``config`` (a dict)."""

    def __init__(self, log, run_id: str, out: Path, config: dict):
        self.wandb = require_wandb()
        out = Path(out).resolve()
        self.run = self.wandb.init(project=log.wandb_project, entity=log.wandb_entity, mode=log.wandb_mode,
                                   id=run_id, resume="allow", name=out.name, dir=os.environ.get("WANDB_DIR", str(out)),
                                   config={**redacted(config), "run_dir": str(out), "run_id": run_id})
        self.run.define_metric("*", step_metric="iteration")

    def log(self, iteration: int, scalars: dict) -> None:
        """Log ``scalars`` (name -> finite number, names already ``kind/name``) at ``iteration``."""
        self.run.log({"iteration": iteration, **scalars})

    def image(self, key: str, path: Path, iteration: int) -> None:
        """Log the PNG at ``path`` as the image ``key`` of ``iteration`` (an animated GIF of videos as a
        ``wandb.Video``)."""
        media = self.wandb.Video if Path(path).suffix.lower() == ".gif" else self.wandb.Image
        self.run.log({"iteration": iteration, key: media(str(path), caption=f"iteration {iteration}")})

    def finish(self) -> None:
        self.run.finish()
