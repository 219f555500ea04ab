"""Prompt files and starting adapters a user hands a real-model run, each class of bad file refused by name before
the model loads: a prompt file read by its extension (``.txt``, ``.jsonl``, ``.json``; any other refused), its lines,
prompts and size bounded, JSON nested past the parser's limit a one-line error; an adapter directory whose
``.safetensors`` is empty, truncated, garbage, holds no LoRA tensor or another rank than ``pipeline.lora.rank``; an
adapter whose keys fit no module of the model, one line naming the file."""

from __future__ import annotations

import json

import pytest

from jagg.infra import prompt_sets
from jagg.infra.prompt_sets import MAX_LINE_CHARS, MAX_PROMPT_CHARS, read_prompt_set

GOOD = [{"prompt": "a red cube", "tag": "colors"}, {"prompt": "a blue ball", "tag": "colors"}]


@pytest.mark.parametrize("name, text, prompts, metadata", [
    ("p.txt", "a red cube\n\n  a blue ball \n", ["a red cube", "a blue ball"], None),
    ("p.TXT", "a red cube\n", ["a red cube"], None),
    ("p.jsonl", "".join(json.dumps(o) + "\n" for o in GOOD) + "\n", ["a red cube", "a blue ball"], GOOD),
    ("p.json", json.dumps(["a red cube", " a blue ball"]), ["a red cube", "a blue ball"], None),
    ("p.json", json.dumps(GOOD), ["a red cube", "a blue ball"], GOOD),
    ("p.json", json.dumps([GOOD[0], "a blue ball"]), ["a red cube", "a blue ball"],
     [GOOD[0], {"prompt": "a blue ball"}]),
])
def test_each_format_is_read_by_its_extension(tmp_path, name, text, prompts, metadata):
    (tmp_path / name).write_text(text)
    got = read_prompt_set(tmp_path / name)
    assert got.prompts == prompts and got.metadata == metadata


DEEP = "[" * 100_000 + "]" * 100_000
LONG = "a" * (MAX_PROMPT_CHARS + 1)


@pytest.mark.parametrize("name, text, culprits", [
    # the extension: a file read the wrong way would train on its literal text
    ("p.csv", "a red cube\n", ("must end in .txt", ".jsonl", ".json", "got .csv")),
    ("prompts", "a red cube\n", ("must end in .txt", "got no extension")),
    ("p.yaml", "- a red cube\n", ("must end in .txt", "got .yaml")),
    # the content: a .txt holding .jsonl lines, JSON that is not a prompt set
    ("p.txt", json.dumps(GOOD[0]) + "\n", ("line 1 is a JSON object with a 'prompt'", "name the file .jsonl")),
    ("p.json", json.dumps({"prompts": ["a red cube"]}), ("holds a JSON dict", "one list of prompts")),
    ("p.json", '["a red cube",', ("is not valid JSON",)),
    ("p.json", json.dumps(["a red cube", 3]), ("item 1", "got a JSON int")),
    ("p.json", "[]", ("holds no prompt",)),
    ("p.jsonl", json.dumps(GOOD[0]) + "\n[1, 2]\n", ("line 2", "got a JSON list")),
    ("p.jsonl", "\n" + json.dumps({"text": "a red cube"}), ("line 2", "without a 'prompt'")),
    ("p.jsonl", "{not json\n", ("line 1 is not valid JSON",)),
    # nesting past the parser's limit: one line, not a RecursionError
    ("p.jsonl", json.dumps(GOOD[0]) + "\n" + "[" * 50_000 + "]" * 50_000 + "\n", ("line 2", "nested too deeply")),
    ("p.json", DEEP, ("nested too deeply",)),
    ("p.txt", "{" * 100_000 + "\n", ("line 1", "more than 8,192")),
    # sizes: a prompt past what any text encoder reads, a .jsonl line past its bound
    ("p.txt", "a red cube\n" + LONG + "\n", ("line 2", f"a prompt of {len(LONG):,} characters", "truncates")),
    ("p.jsonl", json.dumps({"prompt": LONG}) + "\n", ("line 1", f"more than {MAX_PROMPT_CHARS:,}")),
    ("p.json", json.dumps(["a red cube", LONG]), ("item 1", f"more than {MAX_PROMPT_CHARS:,}")),
    ("p.jsonl", json.dumps({"prompt": "a", "x": "b" * MAX_LINE_CHARS}) + "\n", ("line 1", "characters long")),
])
def test_each_bad_prompt_file_is_one_error_naming_the_file(tmp_path, name, text, culprits):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as e:
        read_prompt_set(tmp_path / name, "eval.prompts_file")
    message = str(e.value)
    assert message.startswith(f"eval.prompts_file {str(tmp_path / name)!r}") and "\n" not in message
    assert len(message) < 400 and all(c in message for c in culprits), message


@pytest.mark.parametrize("bound, text, culprit", [
    ("MAX_FILE_BYTES", "a red cube\n" * 20, "MiB a prompt set may be"),
    ("MAX_PROMPTS", "a red cube\n" * 20, "holds 20 prompts, more than the 10"),
])
def test_a_prompt_set_larger_than_its_bound_is_refused(tmp_path, monkeypatch, bound, text, culprit):
    monkeypatch.setattr(prompt_sets, bound, 10)
    (tmp_path / "p.txt").write_text(text)
    with pytest.raises(ValueError, match=culprit):
        read_prompt_set(tmp_path / "p.txt")
