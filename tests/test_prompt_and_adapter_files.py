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


def test_a_bad_prompt_file_stops_a_real_run_before_anything(tmp_path, capsys):
    """The trainer's config reads sample.prompts_file by the same rules: a .json object is refused, exit 2, one line
    naming the key and the file, no run directory."""
    from jagg.cli import main
    from tiny_runs import write_sd3_config

    cfg = write_sd3_config(tmp_path, tmp_path / "no_model_needed")
    (tmp_path / "p.json").write_text(json.dumps({"prompt": "a red cube"}))
    assert main(["train", "--config", str(cfg), "--set", f"sample.prompts_file={tmp_path / 'p.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sample.prompts_file" in err and "p.json" in err and "holds a JSON dict" in err and "\n" not in err
    assert not (tmp_path / "default_run").exists()


ADAPTER = "pytorch_lora_weights.safetensors"
PEFT_ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter(sd3_dir, tmp_path_factory):
    """A rank-2 LoRA adapter of the tiny SD3 in both formats (jagg's save_adapter)."""
    from diffusers import SD3Transformer2DModel

    from jagg.integrations.lora_files import save_adapter
    from jagg.integrations.config import LoraSettings
    from jagg.integrations.policy import add_lora

    model = SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer")
    add_lora(model, LoraSettings(rank=2))
    return save_adapter(model, tmp_path_factory.mktemp("adapters") / "rank2")


def _rewritten(path, change):
    """The safetensors file ``path`` written again with ``change(tensors) -> tensors`` (its metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    save_file(change(load_file(path)), path, metadata=metadata)


BREAKS = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "garbage": lambda p: p.write_bytes(b"not a safetensors file at all " * 40),
    "header cut": lambda p: p.write_bytes(p.read_bytes()[:12]),
    "no lora tensor": lambda p: _rewritten(p, lambda t: {k.replace("lora_", "kept_"): v for k, v in t.items()}),
    "lora_A alone": lambda p: _rewritten(p, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}),
}


@pytest.mark.parametrize("fmt", ["diffusers", "peft"])
@pytest.mark.parametrize("case", [*BREAKS, "rank 4 in the config"])
def test_a_bad_adapter_file_is_refused_before_the_model_loads(tmp_path, sd3_dir, adapter, monkeypatch, capsys, fmt,
                                                              case):
    """Each broken adapter, in either format, as pipeline.lora.path: exit 2, one line naming the key and the file,
    the model never loaded, no run directory."""
    import shutil

    from jagg.cli import main
    from jagg.trainers import diffusers_trainer as real_train
    from tiny_runs import write_sd3_config

    loads = []
    monkeypatch.setattr(real_train, "load_model", lambda *a: loads.append(a))
    d = tmp_path / "adapter"
    shutil.copytree(adapter, d)
    if fmt == "peft":
        (d / ADAPTER).unlink()
    target = d / (ADAPTER if fmt == "diffusers" else PEFT_ADAPTER)
    sets = [f"pipeline.lora.path={d}"]
    if case in BREAKS:
        BREAKS[case](target)
    else:
        sets.append("pipeline.lora.rank=4")
    cfg = write_sd3_config(tmp_path, sd3_dir)
    assert main(["train", "--config", str(cfg), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pipeline.lora.path" in err and str(target) in err, err
    assert ("rank 2, not pipeline.lora.rank=4" in err) == (case not in BREAKS), err
    assert not loads and not (tmp_path / "default_run").exists()


def test_an_adapter_for_other_modules_is_one_line_naming_the_file(tmp_path, sd3_dir, adapter, capsys):
    """An adapter whose modules the model lacks (renamed keys): diffusers would keep the modules it finds and print
    warnings; the load is one error naming the file, and the directory it leaves does not block the same command
    with the right adapter."""
    import shutil

    from jagg.cli import main
    from tiny_runs import write_sd3_config

    d = tmp_path / "adapter"
    shutil.copytree(adapter, d)
    _rewritten(d / ADAPTER, lambda t: {k.replace("attn.to_q", "attn.to_query"): v for k, v in t.items()})
    cfg = write_sd3_config(tmp_path, sd3_dir)
    args = ["train", "--config", str(cfg), "--set", "grpo.iterations=1"]
    assert main([*args, "--set", f"pipeline.lora.path={d}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"pipeline.lora.path: {d / ADAPTER}" in err and "attn.to_query" in err, err
    assert main([*args, "--set", f"pipeline.lora.path={adapter}"]) == 0
