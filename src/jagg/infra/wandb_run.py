"""Weights & Biases logging, the optional extra ``pip install 'jagg[wandb]'``: a run directory's run mirrored to one
wandb run (``log.wandb: true``).

:class:`jagg.infra.metrics.MetricsLogger` forwards to a :class:`WandbRun` what it writes (``metrics.jsonl`` stays
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


ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")   # what wandb takes in $WANDB_MODE
BAD_PROJECT_CHARS = "/\\#?%:"                # wandb refuses a project name with these, or longer than 128


def check_start(log) -> None:
    """What would make ``wandb.init`` fail for the ``log:`` section ``log``, checked before anything is written (and
    by ``jagg train --print-config``): the package (:func:`require_wandb`), a project or entity name wandb refuses, a
    ``$WANDB_MODE`` it does not know, and online mode (``log.wandb_mode``, else ``$WANDB_MODE``, else online) without
    an API key (``$WANDB_API_KEY`` or ``wandb login``'s netrc entry). A ValueError names the key or variable."""
    require_wandb()
    for key, name in (("log.wandb_project", log.wandb_project), ("log.wandb_entity", log.wandb_entity)):
        bad = sorted({c for c in BAD_PROJECT_CHARS if c in (name or "")})
        if bad or len(name or "") > 128:
            raise ValueError(f"{key} {name!r} is not a name wandb takes (at most 128 characters, none of "
                             f"{' '.join(BAD_PROJECT_CHARS)}{'; it has ' + ' '.join(bad) if bad else ''}); rename it")
    env = os.environ.get("WANDB_MODE")
    if log.wandb_mode is None and env is not None and env not in ENV_MODES:
        raise ValueError(f"the environment variable WANDB_MODE={env!r} is not a wandb mode ({', '.join(ENV_MODES)}); "
                         "fix or unset it, or set log.wandb_mode")
    mode = log.wandb_mode or env or "online"
    if mode in ("online", "run", "shared") and not _has_api_key():
        raise ValueError(f"log.wandb: true in online mode (log.wandb_mode {log.wandb_mode!r}, WANDB_MODE {env!r}) needs "
                         "a W&B API key: set WANDB_API_KEY or run `wandb login`, or log offline with "
                         "log.wandb_mode=offline (`wandb sync` later)")


def _has_api_key() -> bool:
    """Whether wandb will find an API key (or may log anonymously, ``$WANDB_ANONYMOUS``): ``$WANDB_API_KEY``, an
    ``api_key`` in wandb's settings file, or a netrc entry (``$NETRC``, ``~/.netrc`` or ``~/_netrc``) for the host of
    ``$WANDB_BASE_URL`` (api.wandb.ai). An unreadable file counts as a key (wandb then says what is wrong)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_ANONYMOUS") in ("allow", "must"):
        return True
    settings = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
    try:                                             # wandb's global settings may hold a key too
        if settings.is_file() and "api_key" in settings.read_text():
            return True
    except OSError:
        return True
    paths = [Path(os.environ["NETRC"]).expanduser()] if os.environ.get("NETRC") else [Path.home() / ".netrc",
                                                                                      Path.home() / "_netrc"]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return False
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return True


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
        try:
            self.run = self._init(log, run_id, out, config)
        except Exception as e:                      # wandb's UsageError, pydantic's ValidationError, a network error
            text = " ".join(str(e).split())
            raise ValueError(f"log.wandb: wandb could not start ({type(e).__name__}: {text[:300]}); check "
                             "log.wandb_project, log.wandb_entity, log.wandb_mode and $WANDB_MODE, or set "
                             "log.wandb=false") from None
        self.run.define_metric("*", step_metric="iteration")

    def _init(self, log, run_id: str, out: Path, config: dict):
        return self.wandb.init(project=log.wandb_project, entity=log.wandb_entity, mode=log.wandb_mode,
                               id=run_id, resume="allow", name=out.name, dir=os.environ.get("WANDB_DIR", str(out)),
                               config={**redacted(config), "run_dir": str(out), "run_id": run_id})

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
