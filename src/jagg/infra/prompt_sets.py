"""Prompt datasets in Flow-GRPO's two formats (and a JSON list), with each prompt's metadata for the reward.

- ``.txt``: one prompt a line (surrounding spaces and blank lines dropped); no metadata (the reward gets ``None``).
- ``.jsonl``: one JSON object a line with a non-empty string ``"prompt"`` and any other fields (Flow-GRPO's
  ``train_metadata.jsonl`` / ``test_metadata.jsonl``: GenEval's ``tag``, ``include``, ``exclude``, an OCR target,
  ...); the whole object is that prompt's metadata, as Flow-GRPO passes it to its rewards.
- ``.json``: one JSON list of prompts, each a string or an object with a ``"prompt"`` as a ``.jsonl`` line.

Any other extension is refused, naming these three: the extension says how the file is read, and a file read the wrong
way (a JSON file as text) would train on its literal text. A ``.txt`` whose first line is a JSON object with a
``"prompt"`` is refused too, asking for the ``.jsonl`` name. Bounds, each refused naming the file (and the line):
a prompt of more than :data:`MAX_PROMPT_CHARS` characters (every text encoder truncates at its context, at most 1024
tokens; characters past 8 a token are never read), a ``.jsonl`` line of more than :data:`MAX_LINE_CHARS`, JSON nested
deeper than the parser's recursion limit, a file of more than :data:`MAX_FILE_BYTES` or more than :data:`MAX_PROMPTS`
prompts (the set is held in memory; sample a larger one down first).

A test set beside a training set follows Flow-GRPO's dataset layout (:func:`eval_set_beside`): ``train.txt`` ->
``test.txt``, ``train_metadata.jsonl`` -> ``test_metadata.jsonl``. Every problem is a ValueError naming the config key
(or option), the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config_loader import read_text

TXT, JSONL, JSON = ".txt", ".jsonl", ".json"
MAX_PROMPT_CHARS = 8192          # 1024 tokens (the longest text-encoder context, Qwen-Image's) x 8 characters
MAX_LINE_CHARS = 1 << 20         # a .jsonl line: its prompt and its metadata
MAX_FILE_BYTES = 256 << 20
MAX_PROMPTS = 1_000_000
_EXAMPLE = '{"prompt": "a red cube", "tag": "single_object"}'


@dataclass(frozen=True)
class PromptSet:
    """A prompt dataset: ``prompts`` ``[n]`` and, read from a ``.jsonl`` (or a ``.json`` list holding objects), each
    prompt's object ``metadata`` ``[n]`` (None for a ``.txt``)."""

    path: str
    prompts: list[str]
    metadata: list[dict] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, indices) -> tuple[list[str], list[dict] | None]:
        """The prompts and metadata at ``indices`` (positions into the set, repeats allowed)."""
        prompts = [self.prompts[i] for i in indices]
        return prompts, None if self.metadata is None else [self.metadata[i] for i in indices]


def read_prompt_set(path: str | Path, what: str = "sample.prompts_file") -> PromptSet:
    """The prompt dataset at ``path`` by its extension (``.txt``, ``.jsonl``, ``.json``); errors name ``what``, the
    file and the line (the module's docstring lists what is refused)."""
    where, suffix = f"{what} {str(path)!r}", Path(path).suffix.lower()
    if suffix not in (TXT, JSONL, JSON):
        raise ValueError(f"{where} must end in {TXT} (one prompt a line), {JSONL} (one JSON object with a 'prompt' a "
                         f"line) or {JSON} (a JSON list of prompts); got {suffix or 'no extension'}: rename the file "
                         "for the format it holds")
    p = Path(path).expanduser()
    if p.is_file() and p.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{where} is {p.stat().st_size / 2**20:.0f} MiB, more than the {MAX_FILE_BYTES >> 20} MiB a "
                         f"prompt set may be (it is held in memory); sample it down to at most {MAX_PROMPTS:,} prompts")
    text = read_text(path, what)
    items = _txt(text, where) if suffix == TXT else _jsonl(text, where) if suffix == JSONL else _json(text, where)
    if not items:
        raise ValueError(f"{where} holds no prompt; put " + ("one prompt a line" if suffix == TXT else
                                                              f"one JSON object with a 'prompt' a line, e.g. {_EXAMPLE}"
                                                              if suffix == JSONL else "a list of prompts in it"))
    if len(items) > MAX_PROMPTS:
        raise ValueError(f"{where} holds {len(items):,} prompts, more than the {MAX_PROMPTS:,} a prompt set may hold "
                         "(it is held in memory); sample it down")
    prompts = [prompt for prompt, _ in items]
    objects = [meta for _, meta in items]
    return PromptSet(str(path), prompts, None if all(m is None for m in objects) else
                     [m if m is not None else {"prompt": s} for s, m in zip(prompts, objects)])


def _checked(prompt: str, where: str) -> str:
    """``prompt`` stripped, refused (naming ``where``: the file and line) when longer than :data:`MAX_PROMPT_CHARS`."""
    prompt = prompt.strip()
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"{where}: a prompt of {len(prompt):,} characters, more than {MAX_PROMPT_CHARS:,}; every "
                         "text encoder truncates at its context (at most 1024 tokens), so the rest is never read: "
                         "shorten it")
    return prompt


def _txt(text: str, where: str) -> list[tuple[str, None]]:
    """The prompts of a ``.txt``, one a line; a first line that is a ``.jsonl`` object is refused."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if lines and lines[0][1].lstrip().startswith("{") and len(lines[0][1]) <= MAX_LINE_CHARS:
        try:
            first = json.loads(lines[0][1])
        except (ValueError, RecursionError):
            first = None
        if isinstance(first, dict) and "prompt" in first:
            raise ValueError(f"{where} line {lines[0][0]} is a JSON object with a 'prompt': a .txt is read as one "
                             "prompt a line, literally; name the file .jsonl to read one object a line")
    return [(_checked(line, f"{where} line {n}"), None) for n, line in lines]


def _jsonl(text: str, where: str) -> list[tuple[str, dict]]:
    """The prompts and objects of a ``.jsonl``, one object a line."""
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"{where} line {n} is {len(line):,} characters long, more than {MAX_LINE_CHARS:,}; a "
                             f"line holds one prompt (at most {MAX_PROMPT_CHARS:,} characters) and its metadata")
        items.append(_item(_parse(line, f"{where} line {n}", "a .jsonl prompt set holds one object a line, e.g. "
                                  + _EXAMPLE), f"{where} line {n}"))
    return items


def _json(text: str, where: str) -> list[tuple[str, dict | None]]:
    """The prompts of a ``.json``: a list of strings or of objects with a ``"prompt"``."""
    data = _parse(text, where, 'a .json prompt set holds one list, e.g. ["a red cube", ' + _EXAMPLE + "]")
    if not isinstance(data, list):
        raise ValueError(f"{where} holds a JSON {type(data).__name__}; a .json prompt set is one list of prompts, "
                         f"each a string or an object with a 'prompt' (or give a .jsonl, one object a line)")
    return [(_checked(x, f"{where} item {i}"), None) if isinstance(x, str) and x.strip() else
            _item(x, f"{where} item {i}") for i, x in enumerate(data)]


def _parse(text: str, where: str, hint: str):
    """``text`` parsed as JSON; a syntax error or a nesting past the parser's recursion limit names ``where``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} is JSON nested too deeply to read; {hint}") from None
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); {hint}") from None


def _item(item, where: str) -> tuple[str, dict]:
    """A prompt's ``(prompt, object)`` from a parsed ``.jsonl`` line or ``.json`` item, named by ``where``."""
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        got = f"a JSON {type(item).__name__}" if not isinstance(item, dict) else (
            "an object without a 'prompt'" if "prompt" not in item else f"'prompt' {str(item['prompt'])[:80]!r}")
        raise ValueError(f"{where}: each prompt must be a JSON object with a non-empty string 'prompt' (and any "
                         f"fields the reward reads); got {got}")
    return _checked(item["prompt"], where), item


def eval_set_beside(train: str | Path) -> Path | None:
    """The test set of Flow-GRPO's dataset layout beside the training set ``train``, if that file exists: the name with
    its leading ``train`` replaced by ``test`` (``train.txt`` -> ``test.txt``, ``train_metadata.jsonl`` ->
    ``test_metadata.jsonl``); None when ``train``'s name does not start with ``train`` or there is no such file."""
    p = Path(train)
    if not p.name.startswith("train"):
        return None
    test = p.with_name("test" + p.name[len("train"):])
    return test if test.is_file() else None
