"""Prompt datasets in Flow-GRPO's two formats, with each prompt's metadata for the reward.

- ``.txt``: one prompt a line (surrounding spaces and blank lines dropped); no metadata (the reward gets ``None``).
- ``.jsonl``: one JSON object a line with a non-empty string ``"prompt"`` and any other fields (Flow-GRPO's
  ``train_metadata.jsonl`` / ``test_metadata.jsonl``: GenEval's ``tag``, ``include``, ``exclude``, an OCR target,
  ...); the whole object is that prompt's metadata, as Flow-GRPO passes it to its rewards.

A test set beside a training set follows Flow-GRPO's dataset layout (:func:`eval_set_beside`): ``train.txt`` ->
``test.txt``, ``train_metadata.jsonl`` -> ``test_metadata.jsonl``. Every problem is a ValueError naming the config key
(or option), the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config_loader import read_prompt_lines, read_text

JSONL = ".jsonl"


@dataclass(frozen=True)
class PromptSet:
    """A prompt dataset: ``prompts`` ``[n]`` and, read from a ``.jsonl``, each line's object ``metadata`` ``[n]``
    (None for a ``.txt``)."""

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
    """The prompt dataset at ``path`` (a ``.jsonl`` with metadata, else one prompt a line); errors name ``what``."""
    if Path(path).suffix.lower() != JSONL:
        return PromptSet(str(path), read_prompt_lines(str(path), what))
    prompts, metadata = [], []
    for n, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{what} {str(path)!r} line {n} is not a JSON object ({e}); a .jsonl prompt set holds one "
                             "object a line, e.g. {\"prompt\": \"a red cube\", \"tag\": \"single_object\"}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            got = f"a JSON {type(item).__name__}" if not isinstance(item, dict) else (
                "an object without a 'prompt'" if "prompt" not in item else f"'prompt' {item['prompt']!r}")
            raise ValueError(f"{what} {str(path)!r} line {n}: each line must be a JSON object with a non-empty string "
                             f"'prompt' (and any fields the reward reads); got {got}")
        prompts.append(item["prompt"].strip())
        metadata.append(item)
    if not prompts:
        raise ValueError(f"{what} {str(path)!r} holds no prompt; put one JSON object with a 'prompt' a line")
    return PromptSet(str(path), prompts, metadata)


def eval_set_beside(train: str | Path) -> Path | None:
    """The test set of Flow-GRPO's dataset layout beside the training set ``train``, if that file exists: the name with
    its leading ``train`` replaced by ``test`` (``train.txt`` -> ``test.txt``, ``train_metadata.jsonl`` ->
    ``test_metadata.jsonl``); None when ``train``'s name does not start with ``train`` or there is no such file."""
    p = Path(train)
    if not p.name.startswith("train"):
        return None
    test = p.with_name("test" + p.name[len("train"):])
    return test if test.is_file() else None
