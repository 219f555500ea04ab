"""Files that parse but have the wrong structure are named with what was expected: every file jagg reads (training
checkpoints and the meter state in them, a run's run.json, a TinyDiT's metadata, a CLIP model's config.json, the
aesthetic head, the prompt-embedding cache's prompts) is checked for its shape through jagg.checks (check_fields,
read_json, parse_json, read_json_lines), and a bad one is one error line naming the file and the key, never an
AttributeError or KeyError; a run's own files are never replaced."""

from __future__ import annotations


import pytest
import torch

from command_line import files_under, refused
from jagg.checks import check_fields, parse_json, read_json, read_json_lines
from jagg.cli import main


# ----------------------------------------------------------------------------- the shared checks


@pytest.mark.parametrize("data,message", [
    ([], "the file must hold an object with 'run_id', 'meter'; it holds a list"),
    ({}, "the file has no 'run_id' (a string)"),
    ({"run_id": 3}, "the file: 'run_id' must be a string; it holds an integer 3"),
    ({"run_id": "x", "meter": float("nan")}, "'meter' must be an object (key: value) or null; it holds the number nan"),
    ({"run_id": "x", "meter": True}, "'meter' must be an object (key: value) or null; it holds true or false"),
])
def test_check_fields_names_the_key_and_what_was_expected(data, message):
    with pytest.raises(ValueError) as e:
        check_fields(data, {"run_id": "string", "meter": "object|null"}, "the file", optional=("meter",), fix="redo it")
    assert message in str(e.value) and str(e.value).endswith("; redo it")
    assert check_fields({"run_id": "x"}, {"run_id": "string", "meter": "object|null"}, "f", ("meter",)) == {"run_id": "x"}


def test_json_files_are_read_with_their_kind(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[1, 2]")
    assert read_json(path, "a thing", "list") == [1, 2]
    with pytest.raises(ValueError, match=f"a thing: {path} must hold an object .*; it holds a list; repair"):
        read_json(path, "a thing", "object")
    with pytest.raises(ValueError, match=r"its prompts is not valid JSON \(line 1, column 1"):
        parse_json("prompts", "its prompts", "list")
    lines = tmp_path / "a.jsonl"
    lines.write_text('{"a": 1}\n\n"text"\n')
    with pytest.raises(ValueError, match=f"{lines} line 3 must hold a JSON object .* a string; fix"):
        read_json_lines(lines, "records", "fix")


# ----------------------------------------------------------------------------- checkpoints


LOOP = {"config": {}, "iteration": 1, "wall": 1.0, "skipped_updates": 0, "rng": {}, "optimizer": {}}


@pytest.mark.parametrize("state,culprit", [
    ({"model": {}, "manifest": {}, **LOOP, "iteration": "three"}, "'iteration' must be an integer; it holds a string"),
    ({"model": {}, "manifest": {}, **{k: v for k, v in LOOP.items() if k != "optimizer"}}, "has no 'optimizer'"),
    ({"model": {}, "manifest": [], **LOOP}, "'manifest' must be an object"),
    ({"model": {}, "manifest": {}, **LOOP, "meter": {"audits": 2}}, "its 'meter' has no 'sizes'"),
    ({"model": {}, "manifest": {}, **LOOP, "iteration": -4}, "its 'iteration' is -4, below 0"),
    ({"model": "ckpt_000001.dcp", "manifest": {}, **LOOP},                 # an FSDP checkpoint without its shards
     "its 'model' names the shard directory 'ckpt_000001.dcp', which is not there beside it"),
])
def test_a_checkpoint_of_the_wrong_shape_is_named_and_nothing_changes(state, culprit, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save(state, run / "checkpoints" / "ckpt_000001.pt")
    before = files_under(tmp_path)
    refused(main, ["train", "--resume", "--output-dir", str(run)], capsys, "ckpt_000001.pt", "not a loadable checkpoint",
            culprit)
    assert files_under(tmp_path) == before


def test_a_checkpoint_whose_model_is_not_a_state_dict_is_named_by_sample(tmp_path, capsys):
    path = tmp_path / "bad.pt"
    torch.save({"model": [1, 2], "manifest": {}}, path)
    refused(main, ["sample", "--checkpoint", str(path), "--prompt", "a red circle", "--out", str(tmp_path / "x.png")],
            capsys, str(path), "'model' must be an object (key: value) or a string; it holds a list")
    assert not (tmp_path / "x.png").exists()


def test_a_tinydit_whose_metadata_is_not_its_config_is_named(tmp_path, capsys):
    from safetensors.torch import save_file

    path = tmp_path / "tiny.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"jagg_dit_config": "[1, 2]"})
    refused(main, ["sample", "--checkpoint", str(path), "--prompt", "a red circle", "--out", str(tmp_path / "x.png")],
            capsys, str(path), "'jagg_dit_config' metadata must hold an object")


# ----------------------------------------------------------------------------- run.json


def test_a_lone_run_json_is_kept_aside_never_replaced(tmp_path, capsys):
    """A directory holding only a run.json (a run that stopped before any other output, or a file of the user's)
    does not hold a run, so a new run starts there; its run.json is kept as run.json.old-<stamp>, byte for byte."""
    from jagg.infra.rundir import read_run_file, write_run_file

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"run_id": "20260101-000000-abcdef", "started": "then"}\n')
    old = (out / "run.json").read_bytes()
    write_run_file(out, "20270101-000000-123456")
    assert read_run_file(out)["run_id"] == "20270101-000000-123456"
    (aside,) = out.glob("run.json.old-*")
    assert aside.read_bytes() == old and "kept as" in capsys.readouterr().out
    write_run_file(out, "20270101-000000-123456")                 # its own run.json is rewritten in place
    assert len(list(out.glob("run.json.old-*"))) == 1
    (out / "run.json").write_text("[]")                            # the wrong shape is no run file: kept too
    write_run_file(out, "20270101-000000-123456")
    assert sorted(p.read_text() for p in out.glob("run.json.old-*"))[0] == "[]"


# ----------------------------------------------------------------------------- rewards and caches


def test_reward_model_files_of_the_wrong_shape_are_named(tmp_path):
    pytest.importorskip("transformers")
    from jagg.rewards import get_reward
    from tiny_clip import save_tiny_clip

    clip = save_tiny_clip(tmp_path / "clip")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text("[]")
    torch.save([1, 2], tmp_path / "list_head.pth")
    torch.save({"layers.0.weight": [1, 2], "layers.0.bias": [0]}, tmp_path / "list_weights.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a torch file")
    for spec, message in ((f"pickscore:path={odd}", f"{odd / 'config.json'} must hold an object"),
                          (f"aesthetic:path={clip},head={tmp_path / 'garbage.pth'}", "is not a torch state dict"),
                          (f"aesthetic:path={clip},head={tmp_path / 'list_head.pth'}", "no 'layers.N.weight' keys"),
                          (f"aesthetic:path={clip},head={tmp_path / 'list_weights.pth'}",
                           "does not hold the aesthetic predictor's MLP weights")):
        with pytest.raises(ValueError) as e:
            get_reward(spec)
        assert message in str(e.value) and "\n" not in str(e.value), spec


def test_a_prompt_cache_whose_prompts_are_not_a_list_is_named(tmp_path):
    from safetensors.torch import save_file

    from jagg.integrations.velocity_adapters import PromptEmbeddings

    path = tmp_path / "cache.safetensors"
    save_file({"prompt_embeds": torch.zeros(2, 3, 4)}, str(path), metadata={"prompts": '{"a": 1}'})
    with pytest.raises(ValueError, match=f"{path}: its 'prompts' metadata must hold a list; it holds an object"):
        PromptEmbeddings.load(path)
