"""Checks of files: the file a command will write (:func:`check_output_file`, never replacing a user's file without
``--overwrite``) and the JSON files jagg reads (:func:`read_json`, :func:`check_json_files`), each named when bad."""

from __future__ import annotations

import json
from pathlib import Path


def check_output_file(path: str | Path, flag: str, overwrite: bool = False, suffixes: tuple[str, ...] = ()) -> Path:
    """The file a command will write for ``flag`` (``--out``, ``--json``), checked before any work: a non-empty path
    that is not a directory, whose parent is not a file, ending in one of ``suffixes`` (when given), and that does not
    exist unless ``overwrite`` (``--overwrite``): a user's file is never replaced without asking."""
    if str(path).strip() == "":
        raise ValueError(f"{flag} is empty; give the file to write")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give the file to write, e.g. {flag} "
                         f"{p / ('out' + (suffixes[0] if suffixes else ''))}")
    parent = next((a for a in p.parents if a.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: the file name must end in one of {', '.join(suffixes)} (the format is "
                         f"taken from it); got {p.suffix or 'no extension'!r}")
    if p.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another path")
    return p


def read_json(path: str | Path, what: str):
    """The JSON value of the file ``path``, a part of ``what`` (a model directory, an option); a file that is not valid
    JSON is a ValueError naming it, with the line and column, never a bare decoder error."""

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); repair the "
                         "file or copy it again") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {path} is not a UTF-8 JSON file (byte {e.start}: {e.reason})") from None


def check_json_files(directory: str | Path, what: str, limit: int = 64 * 2**20) -> None:
    """Every ``*.json`` file of ``directory`` and of its subdirectories one level down (a model directory's
    ``model_index.json``, ``transformer/config.json``, a tokenizer's files), up to ``limit`` bytes each, read as JSON
    (:func:`read_json`): a broken one is named before a library loads it with a bare decoder error."""
    d = Path(directory)
    for path in sorted([*d.glob("*.json"), *d.glob("*/*.json")]):
        if path.is_file() and path.stat().st_size <= limit:
            read_json(path, what)
