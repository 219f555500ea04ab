"""Nested dataclass configs from YAML plus ``--set section.key=value`` overrides.

Every key is checked once at load: unknown keys raise with the closest valid name suggested, values are
coerced to the field's type and checked to fit the dtype they are used in (every float finite in float32, every
integer in int64, every field named ``seed`` a seed: :mod:`jagg.checks`), and each dataclass validates itself in
``__post_init__``. Text files a config names (prompt files) are read with :func:`read_text`. A required input
(:func:`required`) that is unset is an error, except under :func:`load_for_print`, which loads the config anyway and
reports what is unset, for ``jagg train --print-config`` to mark.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..checks import check_float32, check_int64, check_seed, shown
from .old_configs import refuse_old_names


def helped(text: str) -> dict:
    """A config field's metadata holding its help (``field(default=..., metadata=helped("..."))``): what ``jagg train
    --help``, ``--print-config`` and the docs show for the key."""
    return {"help": text}


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value to the annotated type ``tp`` (int, float, bool, str, Optional, list/tuple, dict); a numpy
    scalar (a config built in Python) counts as the Python number it holds."""
    if isinstance(value, np.generic):
        value = value.item()
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        numeric = [a for a in args if a in (int, float)]
        if numeric and _is_number(value):           # a number is coerced as one: its range error stands (float | str
            return _coerce(value, numeric[0], where)  # must not take an overflowing 1e39 as the string '1e39')
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is Any or tp is typing.Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        return {k: _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()} if args else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise ValueError(f"{where}: expected an integer, got {value!r}")
            value = int(value)
        check_int64(value, where)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 6e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:                         # an integer beyond any float
            raise ValueError(f"{where}: {shown(value)} overflows float32, the dtype it is used in") from None
        if not math.isfinite(value):                  # NaN would pass every range check after this
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        check_float32(value, where)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _is_number(value) -> bool:
    """Whether ``value`` is a number, or a string YAML 1.1 leaves unparsed that reads as one (``1e39``, ``nan``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass ``cls`` from a (nested) dict, rejecting unknown keys (naming the closest valid one); a key or
    value of an earlier jagg is refused saying what to write now (:func:`jagg.infra.old_configs.refuse_old_names`)."""
    if isinstance(data, dict):
        refuse_old_names(data, where)
    return _build(cls, data, where)


def _build(cls, data: dict, where: str):
    """:func:`from_dict` below its top: each section built from its own mapping."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise ValueError(f"unknown config key {path!r}{_suggest(key, list(fields))} "
                             f"(valid keys here: {', '.join(fields)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
            if key == "seed" and kwargs[key] is not None:
                check_seed(kwargs[key], path)
    try:
        return cls(**kwargs)
    except ValueError as e:                   # named by section, unless the message names the key already
        raise ValueError(f"{where + ': ' if where and not str(e).startswith(where + '.') else ''}{e}") from None


def differences(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """``(key, value in a, value in b)`` of every dotted key (``sample.eta``) where two configs as dicts
    (:func:`to_dict`) differ, sorted, but those under ``ignore`` (keys, or sections ``"log."``); a key one of them
    lacks has the value None there. What the tools that reuse stored results compare them by."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
        return out

    fa, fb = flat(a), flat(b)
    skip = lambda key: any(key == i or (i.endswith(".") and key.startswith(i)) for i in ignore)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k) and not skip(k)]


def to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists) that :func:`from_dict` round-trips."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


class _Dumper(yaml.SafeDumper):
    """Block-style sections, lists on one line (``sde_window: [0, 4]``)."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def dump(cfg, unset: dict[str, str] | None = None) -> str:
    """``cfg`` as YAML, keys in declaration order, that :func:`load` reads back to an equal config; each key of
    ``unset`` (``{dotted key: what to give}``, from :func:`load_for_print`) marked ``# REQUIRED, unset: ...``."""
    text = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    if not unset:
        return text
    out, path = [], []
    for line in text.splitlines():
        body = line.lstrip(" ")
        path = path[: (len(line) - len(body)) // 2] + [body.split(":", 1)[0]]
        dotted = ".".join(path)
        out.append(line + (f"  # REQUIRED, unset: {unset[dotted]}" if dotted in unset else ""))
    return "\n".join(out) + "\n"


_UNSET: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jagg_config_unset", default=None)


def required(value, key: str, what: str) -> bool:
    """Whether the required input ``key`` (dotted) is set. Unset (None) it is a ``ValueError`` saying what to give,
    except while :func:`load_for_print` loads: then it is recorded and False comes back (the caller skips the checks
    of its value)."""
    if value is not None:
        return True
    unset = _UNSET.get()
    if unset is None:
        raise ValueError(f"{key} must be set: {what}")
    unset[key] = what
    return False


def load_for_print(load_fn: typing.Callable[[], Any]) -> tuple[Any, dict[str, str]]:
    """``(load_fn(), {dotted key: what to give})``: a config loaded with its unset required inputs (:func:`required`)
    left unset and reported, not refused; every other check runs as usual."""
    token = _UNSET.set({})
    try:
        cfg = load_fn()
        return cfg, dict(_UNSET.get())
    finally:
        _UNSET.reset(token)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings (values parsed as YAML) to a nested dict, in order."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {k!r} is not a section")
        try:
            node[keys[-1]] = safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: the value {raw!r} is not valid YAML ({_yaml_problem(e)}); fix it "
                             "(a string holding YAML syntax such as ': ' needs quotes)") from None
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` of a PyYAML error (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def read_text(path: str | Path, what: str) -> str:
    """The text of the file ``path`` that the setting or option ``what`` names (a prompt file, a config); a
    ``ValueError`` naming both when it is missing, not a file, unreadable, not UTF-8 or binary (a NUL byte)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{what} {str(path)!r} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{what} {str(path)!r} is not a UTF-8 text file (byte {e.start}, line {line}: {e.reason}); "
                         "give a text file") from None
    if "\x00" in text:
        raise ValueError(f"{what} {str(path)!r} is a binary file (a NUL byte on line "
                         f"{text[: text.index(chr(0))].count(chr(10)) + 1}); give a text file")
    return text


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last one and
    drops the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], key_node.start_mark.line + 1)
                seen[key] = key_node.start_mark.line + 1
            except TypeError:                             # an unhashable key: PyYAML's own error follows
                continue
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping (:class:`_UniqueKeyLoader`)."""

    def __init__(self, key, first: int, again: int):
        super().__init__(f"key {key!r} is given twice (line {first} and line {again}); give it once")


def safe_load(text: str):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (:class:`DuplicateKeyError`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_prompt_lines(path: str, what: str = "sample.prompts_file") -> list[str]:
    """The prompts of a text file, one per line (surrounding spaces and blank lines dropped); errors name ``what``
    (:func:`read_text`)."""
    prompts = [line.strip() for line in read_text(path, what).splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{what} {str(path)!r} holds no prompt; put one prompt per line")
    return prompts


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file (``{}`` when empty). Raises ``FileNotFoundError`` for a missing file
    and ``ValueError`` naming the file (and the line and column of a syntax error) for anything unreadable."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} {'is not a file' if p.exists() else 'not found'}; pass a "
                                "YAML file to --config (the real-model examples are in the repository's configs/)")
    text = read_text(p, "config file")
    try:
        data = safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(e)}") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping of keys (section: {{key: value}}); "
                         f"got a {type(data).__name__}")
    return data or {}


def load(cls, path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None):
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None; or the mapping ``data`` already read from
    one with :func:`read_yaml`) plus overrides."""
    if data is None:
        data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides or []))


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(key, default, help)`` for every leaf field, for ``--help`` texts."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out += describe(tp, key + ".")
        else:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
            out.append((key, repr(default), f.metadata.get("help", "")))
    return out
