"""Checks of files: the file a command will write (:func:`check_output_file`, never replacing a user's file without
``--overwrite``) and the files jagg reads (:func:`read_json`, :func:`read_json_lines`, :func:`check_json_files`),
each named when bad: not valid JSON, or valid JSON of the wrong shape (:func:`check_fields`: an object whose keys hold
what was expected, named with the key)."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

from .values import shown

# the kinds of value a file's field may hold, by their JSON names (``"number|null"``: either)
KINDS = {
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "nan": lambda v: isinstance(v, float) and math.isnan(v),          # a measurement not made (the meter's records)
}
ARTICLES = {"object": "an object (key: value)", "list": "a list", "string": "a string", "integer": "an integer",
            "number": "a finite number", "bool": "true or false", "null": "null",
            "nan": "NaN (not measured)"}


def json_kind(value) -> str:
    """What ``value`` is, in JSON's words (``an object``, ``a list``, ``a string``, ...), for the messages."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"the number {value}"
    return next((ARTICLES[k] for k, test in KINDS.items() if test(value)), f"a {type(value).__name__}")


def has_kind(value, kinds: str) -> bool:
    """Whether ``value`` is one of ``kinds`` (names of :data:`KINDS` joined by ``|``, e.g. ``"number|null"``)."""
    return any(KINDS[k](value) for k in kinds.split("|"))


def expected(kinds: str) -> str:
    """``kinds`` in words: ``"number|null"`` -> ``a finite number or null``."""
    return " or ".join(ARTICLES[k] for k in kinds.split("|"))


def check_fields(data, fields: dict[str, str], where: str, optional: tuple[str, ...] = (), fix: str = ""):
    """``data`` (a file's parsed content, or a part of it) checked to be an object whose keys ``fields`` (key ->
    kinds, e.g. ``{"run_id": "string", "meter": "object|null"}``) are present (but those in ``optional``) and hold
    those kinds. A ValueError otherwise, naming ``where`` (the file and what it is) and the key, with what was
    expected and ``fix`` (what to do); returns ``data``."""
    tail = f"; {fix}" if fix else ""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold an object with {', '.join(repr(k) for k in fields)}; it holds "
                         f"{json_kind(data)}{tail}")
    for key, kinds in fields.items():
        if key not in data:
            if key in optional:
                continue
            raise ValueError(f"{where} has no {key!r} ({expected(kinds)}){tail}")
        if not has_kind(data[key], kinds):
            raise ValueError(f"{where}: {key!r} must be {expected(kinds)}; it holds {json_kind(data[key])} "
                             f"{shown(data[key])}{tail}")
    return data


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


def parse_json(text: str, what: str, kind: str | None = None, fix: str = "repair it"):
    """The JSON value of ``text`` (what ``what`` holds: a file, a metadata entry); text that is not valid JSON, or
    (with ``kind``, e.g. ``"object"``, ``"list"``) not a value of that kind, is a ValueError naming ``what`` (with the
    line and column), never a bare decoder error; ``fix`` says what to do."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); {fix}") from None
    if kind is not None and not has_kind(value, kind):
        raise ValueError(f"{what} must hold {expected(kind)}; it holds {json_kind(value)}; {fix}")
    return value


def read_json(path: str | Path, what: str, kind: str | None = None, fix: str = "repair the file or copy it again"):
    """The JSON value of the file ``path``, a part of ``what`` (a model directory, an option, a result), checked as
    :func:`parse_json` does (``kind``: the kind of value it must hold); a file that is not UTF-8 is named too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {path} is not a UTF-8 JSON file (byte {e.start}: {e.reason}); {fix}") from None
    return parse_json(text, f"{what}: {path}", kind, fix)


def read_json_lines(path: str | Path, what: str, fix: str) -> list[dict]:
    """The records of a JSON-lines file (one JSON object per non-blank line), a part of ``what``; a line that is not
    a JSON object is a ValueError naming the file and the line, with ``fix``."""
    records = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: {path} line {n} is not valid JSON ({e.msg}, column {e.colno}); {fix}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{what}: {path} line {n} must hold a JSON object (a record); it holds "
                             f"{json_kind(record)}; {fix}")
        records.append(record)
    return records


def check_json_files(directory: str | Path, what: str, limit: int = 64 * 2**20) -> None:
    """Every ``*.json`` file of ``directory`` and of its subdirectories one level down (a model directory's
    ``model_index.json``, ``transformer/config.json``, a tokenizer's files), up to ``limit`` bytes each, read as JSON
    (:func:`read_json`): a broken one is named before a library loads it with a bare decoder error."""
    d = Path(directory)
    for path in sorted([*d.glob("*.json"), *d.glob("*/*.json")]):
        if path.is_file() and path.stat().st_size <= limit:
            read_json(path, what)
