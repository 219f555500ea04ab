"""A run directory belongs to one run: what a new run, ``--overwrite`` and ``--resume`` may do with it.

- A **new run** starts only in a directory that holds no run: no ``metrics.jsonl`` with records, no checkpoint, no
  sample grid, no reward curve (other files are left alone). Otherwise it is refused, naming what is there.
- ``--overwrite`` **moves** the old run aside to ``<dir>.old-<YYYYmmdd-HHMMSS>`` (never deletes it), then starts.
- Every run has a **run id**, written to ``<dir>/run.json`` when it starts and into every checkpoint it saves.
  ``--resume`` refuses a checkpoint of another run, and checkpoint pruning (``log.keep_last``) deletes only older
  checkpoints carrying the current run's id.
- ``--resume`` **never starts over**: without a readable checkpoint it is an error naming every checkpoint file
  and why it could not be read (or saying that there is none). Only ``require_checkpoint=False`` (``--resume-or-start``
  and the library's ``ShapesTrainer.run(cfg, resume=True)`` that ``python -m lab quality`` uses) starts a new run, and only in a
  directory that holds no run, or after moving aside one that saved no checkpoint (records, samples: a run that
  stopped before its first checkpoint cannot be continued).
- A run directory is **used by one run at a time**: :func:`open_run` first takes an exclusive lock on
  ``<dir>/run.lock`` (``fcntl.flock``: the operating system releases it when the process ends, however it ends;
  creating ``<dir>`` for it when needed), which the trainer holds until the run ends, so any other ``open_run`` on
  that directory (a second ``jagg train``, new or ``--resume``, ``--overwrite``, ``python -m lab quality`` comparing
  while another process trains the run) is refused while it is held, before anything in the directory is read, moved
  or written and before a model loads. Under torchrun the run's main process holds it and the others go on only
  once it does (one collective), so they never refuse each other.
- Filesystem errors while preparing the directory (a file where the directory should be, read-only, no
  permission) are :class:`RunDirError` naming the path and what to do.
- ``--resume`` reads ``metrics.jsonl`` before anything is written: a line before the last that is not a record is
  an error naming the file and the line (a torn last line is set aside by :class:`jagg.infra.metrics.MetricsLogger`).
- What to do is said in the words of the command that trains (:class:`RunHints`: ``jagg train``'s flags, or
  ``python -m lab quality``'s, which has none of them).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from .atomic import atomic_write_text
from .checkpoint import UnsafeCheckpoint, list_checkpoints, read_checkpoint
from .metrics import MetricsError, scan_records

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"


class RunDirError(ValueError):
    """A run directory that this command may not use as asked (``jagg`` exits 2 with the message)."""


@dataclass(frozen=True)
class RunHints:
    """What a command that trains in a run directory tells its user to do, in its own words: ``jagg train``'s flags
    (the defaults, :data:`TRAIN`), or another command's (``python -m lab quality`` keeps its runs in ``--out`` and has
    neither ``--resume`` nor ``--output-dir``)."""

    continue_run: str = "continue with --resume"
    other_dir: str = "use another --output-dir"
    start_over: str = "start over with --overwrite (moves the old run aside, deletes nothing)"


TRAIN = RunHints()


def new_run_id() -> str:
    """A run id: the start time and 6 random hex digits, e.g. ``20261201-143012-9f3a1c``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace collapsed), cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fs_error(e: OSError, out: Path, doing: str, hints: RunHints = TRAIN) -> RunDirError:
    """A filesystem error on the run directory ``out`` as one line that names the path and says what to do."""
    what = e.strerror or type(e).__name__
    if e.errno == errno.EROFS:
        what = "read-only file system"
    path = e.filename if e.filename is not None else out
    return RunDirError(f"cannot {doing} {path}: {what}; {hints.other_dir}, a writable one, instead of {out}")


def check_run_directories(out: Path, hints: RunHints = TRAIN) -> None:
    """Raise :class:`RunDirError` when ``out`` or ``out/checkpoints`` exists but is not a directory."""
    for path, what in ((out, "the run directory"), (out / "checkpoints", "its checkpoints/")):
        if path.exists() and not path.is_dir():
            raise RunDirError(f"{what} {path} is a file, not a directory; {hints.other_dir} or move the file away")


def run_contents(out: Path, hints: RunHints = TRAIN) -> list[str]:
    """What of a run ``out`` holds, one short phrase each; empty when a new run may start there."""
    found = []
    metrics = out / "metrics.jsonl"
    try:
        if metrics.is_file() and metrics.stat().st_size > 0:
            scan = scan_records(metrics)
            n, bad = len(scan.records), len(scan.bad)
            found.append(f"metrics.jsonl with {n} record{'s' * (n != 1)}"
                         + (f" (and {bad} line{'s' * (bad != 1)} not a record)" if bad else ""))
        ckpts = list_checkpoints(out / "checkpoints")
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint{'s' * (len(ckpts) != 1)} (newest {ckpts[-1].name})")
        ckpt_dir = out / "checkpoints"
        exports = ([p for p in ckpt_dir.iterdir() if p.name.startswith(("adapter_", "transformer_"))]
                   if ckpt_dir.is_dir() else [])                          # a real model's exported weights
        if exports and not ckpts:
            found.append(f"{len(exports)} exported weight director{'ies' if len(exports) != 1 else 'y'} (adapter_*, "
                         "transformer_*)")
        samples = out / "samples"
        if samples.is_dir() and any(samples.iterdir()):
            found.append("samples/")
        if (out / "reward_curve.png").exists():
            found.append("reward_curve.png")
    except OSError as e:
        raise fs_error(e, out, "read", hints) from None
    return found


def read_run_file(out: Path) -> dict | None:
    """``out/run.json`` (``{"run_id", "started", "jagg_version"}``), or None when there is none or it is unreadable."""
    try:
        data = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else None


def run_file_error(out: Path, path: Path, run_id: str, hints: RunHints = TRAIN) -> str:
    """Why ``--resume`` refuses a run directory whose ``run.json`` is missing or unreadable while its checkpoint
    ``path`` names the run ``run_id``: the file holds the id every checkpoint must match (and the start time), so it
    is never silently rewritten; what to do."""
    file = out / RUN_FILE
    if not file.exists():
        what = "is missing"
    else:
        try:
            text = file.read_text()
            json.loads(text)
            what = "holds no run id (a JSON object with a string 'run_id')"
        except (OSError, ValueError) as e:
            what = f"cannot be read ({one_line(getattr(e, 'strerror', None) or e, 120)})"
    return (f"cannot resume: {file} {what}; it names the run every checkpoint must belong to, and is not rewritten "
            f"on its own. Restore it, or, if {path.name} (run {run_id}) is this directory's own run, recreate it: "
            f"echo '{{\"run_id\": \"{run_id}\"}}' > {file} and {hints.continue_run}; nothing was changed")


def write_run_file(out: Path, run_id: str, hints: RunHints = TRAIN) -> None:
    """Create ``out`` if needed and write ``out/run.json`` atomically; filesystem errors become :class:`RunDirError`.
    A ``run.json`` already there that is not this run's (a run that stopped before any other output, a file of the
    user's) is never replaced: it is kept as ``run.json.old-<YYYYmmdd-HHMMSS>`` next to it, with a note."""
    from .. import __version__

    try:
        out.mkdir(parents=True, exist_ok=True)
        old = out / RUN_FILE
        if old.exists() and (read_run_file(out) or {}).get("run_id") != run_id:
            stamp, k = time.strftime("%Y%m%d-%H%M%S"), 1
            aside = old.with_name(f"{RUN_FILE}.old-{stamp}")
            while aside.exists():
                k += 1
                aside = old.with_name(f"{RUN_FILE}.old-{stamp}-{k}")
            os.rename(old, aside)
            print(f"note: {old} was not this run's (another run's, with no other output, or not a run file): kept "
                  f"as {aside}", flush=True)
        atomic_write_text(out / RUN_FILE, json.dumps({"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                      "jagg_version": __version__}) + "\n")
    except OSError as e:
        raise fs_error(e, out, "write the run directory", hints) from None


def move_aside(out: Path, hints: RunHints = TRAIN) -> Path:
    """Rename ``out`` to ``out.old-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... if taken); returns the new path."""
    out = Path(os.path.abspath(out))
    cwd = Path.cwd().resolve()
    if cwd == out.resolve() or out.resolve() in cwd.parents:
        raise RunDirError(f"cannot move {out} aside: it holds the current directory; run from elsewhere or "
                          f"{hints.other_dir}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while target.exists():
        n += 1
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
    try:
        os.rename(out, target)
    except OSError as e:
        raise fs_error(e, out, "move aside", hints) from None
    return target


def _flock(f, exclusive_now: bool) -> bool:
    """Try to lock the open file ``f`` without waiting; True when taken. ``exclusive_now``: an exclusive lock, kept
    (a run's, :func:`lock_run`); else a probe (:func:`lock_holder`): a shared lock, released at once, which only a
    run's lock refuses (probes made at the same moment never refuse each other). Where
    ``fcntl`` is missing (not POSIX): always True."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(f.fileno(), (fcntl.LOCK_EX if exclusive_now else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError:
        return False
    if not exclusive_now:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return True


def lock_holder(out: Path) -> str | None:
    """The process that holds ``out``'s run lock (its pid as written in the lock file), or None when it is free."""
    path = Path(out) / LOCK_FILE
    if not path.is_file():
        return None
    try:
        with open(path) as f:
            if _flock(f, exclusive_now=False):
                return None
            return f.read().strip() or "unknown"
    except OSError:
        return None


def lock_run(out: Path, hints: RunHints = TRAIN):
    """Take ``out``'s run lock for this process (the open lock file: keep it, close it to release), or raise
    :class:`RunDirError` naming the process that holds it."""
    path = Path(out) / LOCK_FILE
    try:
        f = open(path, "a+")
    except OSError as e:
        raise fs_error(e, Path(out), "lock", hints) from None
    if not _flock(f, exclusive_now=True):
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirError(f"{out} is in use by another jagg process (pid {holder}), which is training in it: wait for "
                          f"it to end (then {hints.continue_run}), or {hints.other_dir}; nothing was changed")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@dataclass
class RunLock:
    """A run's hold on its directory, taken before anything in it is read, moved or written (:func:`claim_run`):
    on the main process the open lock file (``file``; None on the others), the topmost directory created to hold it
    (``created``: ``out`` or an ancestor; None when ``out`` was there) and whether the lock file is new (``fresh``)."""

    file: IO | None = None
    created: Path | None = None
    fresh: bool = False

    def release(self, out: Path, remove: bool = False) -> None:
        """Release the lock (close the file); ``remove``: first remove what taking it created (the lock file, and
        the directories made for it while they hold nothing else), so that a refused start leaves nothing."""
        if remove and (self.fresh or self.created is not None):
            (out / LOCK_FILE).unlink(missing_ok=True)
            for d in [out, *out.parents] if self.created is not None else []:
                if d.is_dir() and any(d.iterdir()):
                    break
                if d.is_dir():
                    d.rmdir()
                if d == self.created:
                    break
        if self.file is not None:
            self.file.close()
            self.file = None

    def before(self, out: Path) -> set[str] | None:
        """What ``out`` held before this run (:func:`snapshot`, without the lock file it created): None when it
        created ``out`` (:func:`discard_new_run` then removes ``out``)."""
        if self.created is not None:
            return None
        found = snapshot(out)
        return found - {LOCK_FILE} if found is not None and self.fresh else found


def _agree(agree: Callable[[str | None], list], error: str | None) -> None:
    """Every process of a run learns every process's ``error`` (``agree``: a collective gathering one value per
    process; it is also their barrier): all raise :class:`RunDirError` with the first, or all go on."""
    errors = [e for e in agree(error) if e]
    if errors:
        raise RunDirError(errors[0])


def claim_run(out: Path, main: bool, agree: Callable[[str | None], list], hints: RunHints = TRAIN) -> RunLock:
    """Take ``out``'s run lock on the main process (creating ``out`` for it when needed), or raise
    :class:`RunDirError` on every process (``agree``) naming the process that holds it, with nothing changed. The
    other processes of the run take no lock: they go on (and read) only once the main process holds it."""
    held, error = RunLock(), None
    if main:
        try:
            for d in reversed([out, *out.parents]):          # the topmost one this process creates, if any
                try:
                    d.mkdir()
                    held.created = held.created or d
                except FileExistsError:
                    pass
            held.fresh = not (out / LOCK_FILE).exists()
            held.file = lock_run(out, hints)
        except OSError as e:
            error = str(fs_error(e, out, "create", hints))
        except RunDirError as e:                 # another process's directory and lock file: never removed
            held, error = RunLock(), str(e)
    try:
        _agree(agree, error)
    except RunDirError:
        held.release(out, remove=True)
        raise
    return held


def _move_aside_all(out: Path, held: RunLock, main: bool, agree: Callable[[str | None], list],
                    hints: RunHints) -> tuple[Path | None, RunLock]:
    """The main process moves the run in ``out`` aside (:func:`move_aside`; its lock file goes with it) and locks
    the new, empty ``out``, every process agreeing; returns where it went (on the main process) and the new lock."""
    moved, error = None, None
    if main:
        try:
            moved = move_aside(out, hints)
        except RunDirError as e:
            error = str(e)
    _agree(agree, error)
    new = claim_run(out, main, agree, hints)
    held.release(out)
    return moved, new


@dataclass
class RunStart:
    """What :func:`open_run` decided: the run's id, the checkpoint to resume from (``(state, path)``, or None for a
    new run), where an old run was moved (``--overwrite``), the run lock (:class:`RunLock`, held until released) and,
    for a new run, what ``out`` held before it (:meth:`RunLock.before`)."""

    run_id: str
    resumed: tuple[dict, Path] | None = None
    moved_to: Path | None = None
    lock: RunLock | None = None
    before: set[str] | None = None


def open_run(out: Path, *, resume: bool = False, require_checkpoint: bool = True, overwrite: bool = False,
             main: bool = True, agree: Callable[[str | None], list] | None = None,
             log: Callable[[str], None] = print, hints: RunHints = TRAIN) -> RunStart:
    """Decide how a trainer may use the run directory ``out`` (module docstring). First the run lock
    (:func:`claim_run`): while another process holds it, every start is refused before anything in ``out`` is read,
    moved or written. Then it reads only, except that the main process moves an old run aside (``overwrite``). The
    caller writes ``run.json`` (:func:`write_run_file`) on the main process after every process has decided, and
    releases ``RunStart.lock`` when the run ends; a refusal here releases it and removes what taking it created.

    ``resume=False``: a new run; ``out`` must hold no run (``overwrite``: moved aside first). ``resume=True``: the
    newest readable checkpoint of ``out/checkpoints``, which must belong to the directory's run; without one, an
    error naming each unreadable file, or (``require_checkpoint=False``) a new run: at once when ``out`` holds no run,
    after moving it aside when it holds one without any checkpoint. With several processes every one must call this
    with ``agree`` (a collective: every process's value, as a list; it runs in every branch that does not raise). A
    resumed run's ``metrics.jsonl`` must read as records up to its last line (:func:`jagg.infra.metrics.scan_records`).
    ``hints``: what the messages tell the user to do. Raises :class:`RunDirError` (a ``ValueError``)."""
    out = Path(out)
    agree = agree or (lambda error: [error])
    check_run_directories(out, hints)
    if resume and require_checkpoint and not out.exists():
        raise RunDirError(_no_run(out))
    held = claim_run(out, main, agree, hints)
    try:
        start = _decide(out, held, resume, require_checkpoint, overwrite, main, agree, log, hints)
    except BaseException:
        held.release(out, remove=True)
        raise
    if start.resumed is None and main:
        start.before = start.lock.before(out)
    return start


def _no_run(out: Path) -> str:
    state = "does not exist" if not out.exists() else "holds no checkpoint"
    return (f"cannot resume: there is no run in {out} (it {state}); drop --resume to start a new run there, or use "
            "--resume-or-start")


def _decide(out: Path, held: RunLock, resume: bool, require_checkpoint: bool, overwrite: bool, main: bool,
            agree: Callable[[str | None], list], log: Callable[[str], None], hints: RunHints) -> RunStart:
    """:func:`open_run` once the lock is held: the run to start or resume; its ``lock`` is ``held``, or the lock
    of the new ``out`` after the old run was moved aside."""
    if not resume:
        moved = None
        if overwrite and run_contents(out, hints):            # every process reads the same: all move, or none
            moved, held = _move_aside_all(out, held, main, agree, hints)
            if main:
                log(f"--overwrite: moved the previous run in {out} to {moved} (nothing deleted)")
        there = run_contents(out, hints)
        if there:
            raise RunDirError(f"{out} already holds a run ({'; '.join(there)}); {hints.continue_run}, "
                              f"{hints.other_dir} for a new run, or {hints.start_over}")
        return RunStart(new_run_id(), None, moved, held)

    ckpt_dir = out / "checkpoints"
    own = read_run_file(out)
    own_id = own["run_id"] if own else None
    found, unreadable = None, []
    for path in reversed(list_checkpoints(ckpt_dir)):     # every process reads before any moves (_agree below)
        try:
            found = (read_checkpoint(path, resume=True), path)
            break
        except UnsafeCheckpoint as e:             # planted, not a damaged file of this run's: never skipped past
            raise RunDirError(f"cannot resume: {e}; nothing was changed") from None
        except ValueError as e:
            unreadable.append(f"{path.name} {one_line(str(e).replace(str(path), '').strip(' :,'), 200)}")
        except OSError as e:                      # e.g. no read permission
            unreadable.append(f"{path.name} cannot be read: {e.strerror or e}")
    there = run_contents(out, hints) if found is None and not unreadable else []
    _agree(agree, None)
    if found is not None:
        state, path = found
        theirs = state.get("run_id")
        if own_id is None and theirs is not None:
            raise RunDirError(run_file_error(out, path, theirs, hints))
        if own_id is not None and theirs is not None and theirs != own_id:
            raise RunDirError(f"cannot resume: {path} belongs to run {theirs}, but {out}/{RUN_FILE} names run "
                              f"{own_id}: the directory mixes two runs; move {path.name} out of {ckpt_dir} (or resume "
                              "in the directory it came from)")
        check_metrics(out, hints)
        for line in unreadable:
            log(f"warning: skipping unreadable checkpoint {ckpt_dir}/{line}")
        return RunStart(theirs or own_id or new_run_id(), found, None, held)
    if unreadable:
        raise RunDirError(f"cannot resume: no readable checkpoint in {ckpt_dir}, nothing was changed: "
                          + "; ".join(unreadable) + f". Restore a checkpoint, {hints.other_dir} for a new run, or "
                          f"{hints.start_over}")
    if there and require_checkpoint:
        raise RunDirError(f"cannot resume: {out} holds {'; '.join(there)} but no checkpoint (the run stopped before "
                          f"its first one, see log.checkpoint_every); {hints.start_over}, or --resume-or-start, or "
                          f"{hints.other_dir}")
    if there:                                      # a run that cannot be continued: kept aside, a new one starts
        moved, held = _move_aside_all(out, held, main, agree, hints)
        if main:
            log(f"{out} holds {'; '.join(there)} but no checkpoint to resume: moved it to {moved} (nothing deleted); "
                "starting a new run")
        return RunStart(new_run_id(), None, moved, held)
    if require_checkpoint:
        raise RunDirError(_no_run(out))
    log(f"no run in {out} yet: starting a new one")
    return RunStart(new_run_id(), None, None, held)




def check_metrics(out: Path, hints: RunHints = TRAIN) -> None:
    """Raise :class:`RunDirError` when ``out/metrics.jsonl`` holds a line before its last that is not a record
    (a torn last line is no error: the resumed run sets it aside); reads only."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return
    try:
        scan_records(path).check()
    except MetricsError as e:
        raise RunDirError(f"cannot resume: {e}; repair or delete that line (the records after it stay), then "
                          f"{hints.continue_run}; or {hints.start_over}, or {hints.other_dir}") from None
    except OSError as e:
        raise fs_error(e, out, "read", hints) from None


def snapshot(out: Path) -> set[str] | None:
    """The paths under ``out`` (relative, files and directories) before a new run writes there; None when ``out``
    does not exist (:func:`discard_new_run`)."""
    out = Path(out)
    if not out.is_dir():
        return None
    found = set()
    for root, dirs, files in os.walk(out):
        rel = Path(root).relative_to(out)
        found.update(str(rel / name) for name in dirs + files)
    return found


def discard_new_run(out: Path, before: set[str] | None) -> list[str]:
    """Remove what a new run wrote in ``out`` before it trained anything: every path not in ``before`` (its
    :func:`snapshot` when it started), and ``out`` itself when it did not exist (``before`` None); what was there
    before stays. Returns the top-level names removed."""
    out = Path(out)
    if not out.is_dir():
        return []
    if before is None:
        names = sorted(p.name for p in out.iterdir())
        shutil.rmtree(out, ignore_errors=True)
        return names
    removed = []
    for root, dirs, files in os.walk(out, topdown=False):
        rel = Path(root).relative_to(out)
        for name in files + dirs:
            path = Path(root) / name
            if str(rel / name) in before:
                continue
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
            if rel == Path(".") and not path.exists():
                removed.append(name)
    return sorted(removed)


def outputs(out: Path) -> list[str]:
    """The run outputs present in ``out``, for the end-of-run line (only what exists)."""
    names = []
    for name in ("metrics.jsonl", "tensorboard", "wandb", "reward_curve.png", "samples", "checkpoints", "final",
                 "preflight.json"):
        p = out / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            names.append(name + "/" * p.is_dir())
    return names
