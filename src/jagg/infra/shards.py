"""FSDP's shard directories ``ckpt_<n>.dcp/`` (written by :func:`jagg.infra.checkpoint.write_shards`): checked before
a model loads, and read whole on one process.

A shard directory holds ``torch.distributed.checkpoint``'s ``.metadata`` (where each item lies: its file, offset and
length), the shard files (each item a ``torch.save`` archive) and :data:`RUN_MARK`, the id of the run that wrote it.
:func:`check_shards` reads the metadata and a few bytes around each item, never the tensors: a missing, truncated,
emptied or overwritten shard file and another run's directory are refused in seconds, before the weights load.
:func:`read_whole` reads entries of a shard directory into whole tensors without a process group (``jagg eval``,
``jagg sample``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import Tensor

RUN_MARK = "jagg_run.json"                 # {"run_id": ...} of the run that wrote the directory
_ZIP_HEAD, _ZIP_END, _END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22     # a torch.save archive's first and last record


def mark_run(directory: Path, run_id: str | None) -> None:
    """Write :data:`RUN_MARK` into the shard directory ``directory`` (before it is renamed into place)."""
    (Path(directory) / RUN_MARK).write_text(json.dumps({"run_id": run_id}) + "\n")


def shard_metadata(directory: Path):
    """The ``.metadata`` of the shard directory ``directory``; a ``ValueError`` saying why it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as e:      # missing, emptied or torn: the message says which
        raise ValueError(f"its shard directory {Path(directory).name} has no readable .metadata "
                         f"({type(e).__name__}: {str(e)[:200]})") from None


def check_shards(directory: Path, run_id: str | None) -> None:
    """Raise a ``ValueError`` (what is wrong, for "<checkpoint> is not a loadable checkpoint: ...") unless
    ``directory`` is a complete shard directory of run ``run_id``: it exists, its run mark (when it has one) names
    ``run_id``, its metadata reads, every shard file it names is there and as long as the metadata says, and every
    item starts and ends as a ``torch.save`` archive (a file overwritten in place)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"names the shard directory {directory.name!r}, which is not there beside it")
    mark = directory / RUN_MARK
    if mark.exists():
        try:
            theirs = json.loads(mark.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"its shard directory's {RUN_MARK} cannot be read ({type(e).__name__}: {e})") from None
        if run_id is not None and theirs != run_id:
            raise ValueError(f"its shard directory {directory.name} was written by run {theirs}, not by the "
                             f"checkpoint's run {run_id}")
    items = defaultdict(list)
    for info in shard_metadata(directory).storage_data.values():
        items[info.relative_path].append(info)
    for name, infos in sorted(items.items()):
        _check_file(directory / name, infos)


def _check_file(path: Path, infos: list) -> None:
    """One shard file against the items the metadata places in it."""
    where = f"its shard file {path.parent.name}/{path.name}"
    if not path.is_file():
        raise ValueError(f"{where} is missing")
    size, end = path.stat().st_size, max(i.offset + i.length for i in infos)
    if size < end:
        raise ValueError(f"{where} holds {size} bytes but its .metadata places {end} there (truncated or emptied)")
    with open(path, "rb") as f:
        for i in infos:
            if i.transform_descriptors or i.length < len(_ZIP_HEAD) + _END_SIZE:   # compressed: not an archive
                continue
            f.seek(i.offset)
            head = f.read(len(_ZIP_HEAD))
            f.seek(i.offset + i.length - _END_SIZE)
            if head != _ZIP_HEAD or f.read(len(_ZIP_END)) != _ZIP_END:
                raise ValueError(f"{where} is corrupt: the item at byte {i.offset} is not what its .metadata says")


def read_whole(directory: Path, entry: str, names) -> dict[str, Tensor]:
    """The tensors ``names`` of ``entry`` (e.g. ``"model"``, ``"ema"``) of the shard directory ``directory``, whole, on
    the CPU, each in its saved shape and dtype, read without a process group; a name the directory lacks is a
    ``ValueError`` naming it."""
    import torch.distributed.checkpoint as dcp

    from .engine import one_process_quiet

    saved = shard_metadata(directory).state_dict_metadata
    missing = [n for n in names if f"{entry}.{n}" not in saved]
    if missing:
        raise ValueError(f"the shard directory {directory} holds no {entry!r} weights named {missing[:3]}; it was "
                         "written for another model or LoRA setting")
    state = {entry: {n: torch.empty(saved[f"{entry}.{n}"].size, dtype=saved[f"{entry}.{n}"].properties.dtype)
                     for n in names}}
    with one_process_quiet():
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state[entry]
