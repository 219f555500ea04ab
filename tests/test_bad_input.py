"""Bad input, second round (issue #28): the nine classes of failure a hostile-user probe of the CLI found, one test
each, every test named after its class and run over several inputs through ``jagg.cli.main`` in this process. A
refusal is exit 2 with one line naming its culprit (argparse's usage lines aside) and nothing written; a run that
aborts is exit 1; Ctrl-C is exit 130; never a traceback."""

from __future__ import annotations

import dataclasses
import json
import shutil
import types
import typing
from pathlib import Path

import pytest

from command_line import files_under, refused, run
from conftest import real_model_config, tiny_train_args
from jagg.checks import FLOAT32_MAX, SEED_MAX
from jagg.cli import main
from jagg.infra import config_loader as configuration


def _files(root: Path) -> dict[str, bytes]:
    return files_under(root)


def _jagg(argv: list[str], capsys) -> tuple[int, str, str]:
    return run(main, argv, capsys)


def _refused(argv: list[str], capsys, *culprits: str, code: int = 2) -> str:
    return refused(main, argv, capsys, *culprits, code=code)


def _train(ckpt: str, out: Path, iterations: int, *extra: str) -> list[str]:
    return tiny_train_args(ckpt, out, iterations, "eval.every=0", *extra)


# ---------------------------------------------------------------------------------------------- 1. the dtype a value is used in


def _leaves(cls, prefix: str = ""):
    """``(key, annotation)`` of every leaf field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _too_big(tp) -> str | None:
    """A YAML value of type ``tp`` that its Python type holds and its dtype does not (None: not a number)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    origin = typing.get_origin(base)
    if base is float:
        return "1.0e39"
    if base is int:
        return str(2**63)
    if origin in (list, tuple) and typing.get_args(base) and typing.get_args(base)[0] in (int, float):
        return f"[{'1.0e39' if typing.get_args(base)[0] is float else 2**63}, 1]"
    if origin is dict and typing.get_args(base)[1] in (int, float):
        return "{jpeg_compressibility: 1.0e39}"
    return None


def test_every_number_is_checked_in_the_dtype_it_is_used_in(tmp_path, tiny_ckpt, capsys):
    """Class 1, values that pass validation and then crash: every float and int key of every config dataclass (both
    trainers', jagg pretrain's) is refused at load beyond float32 / int64, seeds outside [0, 2**32 - 1] and every
    numeric option of sample, eval and the benches likewise; nothing is written (no checkpoint, no metrics.jsonl)."""
    from jagg.cli import PretrainRunConfig
    from jagg.trainers.diffusers_config import DiffusersTrainConfig
    from jagg.trainers.shapes_config import ShapesTrainConfig

    real = real_model_config(tmp_path)
    checked = 0
    for cls, path in ((ShapesTrainConfig, None), (DiffusersTrainConfig, real), (PretrainRunConfig, None)):
        for key, tp in _leaves(cls):
            value = _too_big(tp)
            if value is None:
                continue
            with pytest.raises(ValueError) as e:
                configuration.load(cls, path, [f"{key}={value}"])
            assert key in str(e.value) and ("float32" in str(e.value) or "64-bit" in str(e.value)), (key, e.value)
            checked += 1
    assert checked > 60
    before = _files(tmp_path)
    run = tmp_path / "run"
    for sets, culprit in ((["sample.eta=1e300"], "sample.eta"), (["optim.lr=1e39"], "optim.lr"),
                          (["estimator.correction_p=1e-50"], "estimator.correction_p"),
                          ([f"sample.prompts_per_iter={10**19 + 7}"], "sample.prompts_per_iter"),
                          ([f"sample.eta=1{'0' * 400}"], "sample.eta"), (["seed=-1"], "seed"),
                          ([f"seed={SEED_MAX + 1}"], "seed"), (["eval.seed=-3"], "eval.seed"),
                          (["reward.name=null", "reward.weights={jpeg_compressibility: 1.0e39}"], "reward.weights.jpeg_compressibility"),
                          ([f"threads={2**40}"], "threads must be in [0, 1024]")):
        line = _refused(_train(tiny_ckpt, run, 1, *sets), capsys, culprit)
        assert len(line) < 400
    assert _files(tmp_path) == before and not run.exists()
    for argv, culprit in ((["eval", "--seed", str(10**20)], "--seed"), (["eval", "--seed", "-1"], "--seed"),
                          (["sample", "--prompt", "a red circle", "--guidance-scale", "1e39"], "--guidance-scale"),
                          (["sample", "--prompt", "a red circle", "--steps", str(2**63)], "--steps"),
                          (["bench", "speed", "--batch", str(10**20)], "--batch"),
                          (["bench", "meter", "--batches", str(2**63)], "--batches"),
                          (["pretrain", "--out", "x.safetensors", "--set", "train.seed=-1"], "train.seed"),
                          (["pretrain", "--out", "x.safetensors", "--set", f"model.dim={2**63}"], "model.dim")):
        _refused(argv, capsys, culprit)
    assert _files(tmp_path) == before
    assert 1e38 < FLOAT32_MAX                                  # large values that do fit still load
    assert configuration.load(ShapesTrainConfig, None, ["optim.lr=1e37", "optim.weight_decay=0",   # AdamW's first
                                                        f"seed={SEED_MAX}"]).seed == SEED_MAX      # step: 1e38


# ---------------------------------------------------------------------------------------------- 2. a run that trains nothing


@pytest.mark.parametrize("sets,reason", [
    (["reward.name=null", "reward.weights={jpeg_compressibility: 0.0, geneval: 0.0}"], "every reward weight is 0"),
    (["reward.name=reward_plugins:constant"], "no prompt group had any reward spread"),
    (["sample.sde_type=dance", "sample.eta=1e30"], "no prompt group had any reward spread"),     # NaN images
])
def test_a_run_that_trains_nothing_says_why_and_stops(sets, reason, tmp_path, tiny_ckpt, capsys):
    """Class 2, runs that cannot learn finishing with exit 0 and no word: the first iteration that trains no sample
    is warned about once, with its reason, and after grpo.max_empty_iterations in a row the run saves and stops with
    exit 1 and one line; 0 = never stop."""
    run = tmp_path / "run"
    code, line, out = _jagg(_train(tiny_ckpt, run, 5, *sets, "grpo.max_empty_iterations=2"), capsys)
    assert code == 1 and line.startswith("jagg train: aborted: 2 iterations in a row had nothing to learn from: ")
    assert reason in line
    assert out.count("nothing to learn from: every advantage was 0 (the 4 samples trained with "
                     "grpo.drop_zero_spread=false") == 1 and reason in out and "grpo.max_empty_iterations" in out
    assert [json.loads(l)["iteration"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "checkpoints" / "ckpt_000002.pt").is_file()                 # saved: nothing lost
    never = tmp_path / "never"
    code, _, out = _jagg(_train(tiny_ckpt, never, 3, *sets, "grpo.max_empty_iterations=0"), capsys)
    assert code == 0 and out.count("nothing to learn from") == 1


# ---------------------------------------------------------------------------------------------- 3. duplicate names


@pytest.mark.parametrize("argv,culprit", [
    (["bench", "meter", "--estimator", "w8:window=8", "--estimator", "w8:window=4"], "'w8' is given twice"),
    (["bench", "meter", "--estimator", "plain", "--estimator", "plain"], "'plain' is given twice"),
    (["bench", "meter", "--estimator", "exact:mode=jagg,window=8"], "'exact' is a built-in name"),
    (["bench", "meter", "--estimator", "subsample:subsample_frac=0.3"], "'subsample' is a built-in name"),
    (["bench", "meter", "--by-interval", "config:window=3"], "--by-interval 'config:window=3'"),
])
def test_duplicate_and_reserved_names_are_refused(argv, culprit, tmp_path, capsys):
    """Class 3, duplicate names silently replacing one another: a name given twice, or a definition taking a
    built-in name, is one line, exit 2, before any batch (nothing written)."""
    before = _files(tmp_path)
    _refused([*argv, "--quick", "--json", str(tmp_path / "out.json")], capsys, culprit)
    assert _files(tmp_path) == before


# ---------------------------------------------------------------------------------------------- 4. outputs are the user's


def _pretrain(out: str, *extra: str) -> list[str]:
    sets = ["train.steps=2", "train.batch_size=2", "train.log_every=1", "train.warmup=0", "model.dim=32", "model.depth=1",
            "model.heads=2", "model.text_dim=16", "model.text_depth=1", "model.text_heads=2", "model.patch_size=8"]
    return ["pretrain", "--out", out, *[a for s in [*sets, *extra] for a in ("--set", s)]]


@pytest.mark.parametrize("name,argv,cheap", [
    ("w.safetensors", lambda ck, p: _pretrain(p), True),
    ("w.step1.safetensors", lambda ck, p: _pretrain(p.replace(".step1", ""), "snapshot_every=1"), True),
    ("grid.png", lambda ck, p: ["sample", "--checkpoint", ck, "--prompt", "a red circle", "--num-per-prompt", "1",
                                "--steps", "2", "--out", p], True),
    ("grid.txt", lambda ck, p: ["sample", "--checkpoint", ck, "--prompt", "a red circle", "--num-per-prompt", "1",
                                "--steps", "2", "--out", p.replace(".txt", ".png")], True),
    ("eval.json", lambda ck, p: ["eval", "--checkpoint", ck, "--num-prompts", "2", "--images-per-prompt", "1",
                                 "--steps", "2", "--json", p], True),
    ("eff.json", lambda ck, p: ["bench", "meter", "--quick", "--json", p], False),
    ("speed.json", lambda ck, p: ["bench", "speed", "--quick", "--json", p], False),
])
def test_outputs_are_never_replaced_without_overwrite(name, argv, cheap, tmp_path, tiny_ckpt, capsys):
    """Class 4, jagg pretrain overwriting its --out without asking: every file a command writes for its user (pretrain
    --out and its snapshots, sample --out and its captions, eval --json, every bench's --json and quality's --plot)
    is refused when it exists, before any work, and replaced only with --overwrite, atomically."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the user's data")
    before = _files(tmp_path)
    _refused(argv(tiny_ckpt, str(path)), capsys, str(path), "--overwrite")
    assert _files(tmp_path) == before
    if cheap:
        code, line, _ = _jagg(argv(tiny_ckpt, str(path)) + ["--overwrite"], capsys)
        assert code == 0, line
        assert path.read_bytes() != b"the user's data" and not list(tmp_path.rglob("*.tmp"))


def test_a_failed_write_leaves_the_old_file(tmp_path):
    """Class 4's writes go through one atomic helper: a write that fails midway leaves the old file whole and no
    temporary file."""
    from jagg.infra.atomic import atomic_write

    path = tmp_path / "result.json"
    path.write_text("old")

    def torn(f):
        f.write(b"half a fi")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, torn)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


# ---------------------------------------------------------------------------------------------- 5. torn metrics lines


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory, tiny_ckpt):
    """A run of 2 iterations (checkpoints at 1 and 2), to be copied and damaged."""
    run = tmp_path_factory.mktemp("torn") / "run"
    assert main(_train(tiny_ckpt, run, 2)) == 0
    return run


@pytest.mark.parametrize("bad", [b'{"kind": "train", "iteration": 3, "rew', b"\xff\xfe\x00\x01", b"[1, 2", b'{"no": 1}',
                                 b'"a string"'])
def test_a_torn_metrics_line_never_blocks_a_resume(bad, two_iterations, tmp_path, tiny_ckpt, capsys):
    """Class 5, a torn last line of metrics.jsonl blocking --resume with the raw decoder's text: the last line that is
    not a record is dropped with a warning naming the file and the line and kept aside next to it; the same line
    before the last is an error (exit 2, nothing changed) naming the file, the line and what to do."""
    torn = tmp_path / "torn"
    shutil.copytree(two_iterations, torn)
    metrics = torn / "metrics.jsonl"
    good = metrics.read_bytes()
    metrics.write_bytes(good + bad)                              # an append cut short
    code, line, out = _jagg(_train(tiny_ckpt, torn, 3) + ["--resume"], capsys)
    assert code == 0, line
    assert f"{metrics} line 3 is not a complete record" in out
    kept = list(torn.glob("metrics.jsonl.torn-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == bad + b"\n"
    assert [json.loads(l)["iteration"] for l in metrics.read_text().splitlines()] == [1, 2, 3]

    corrupt = tmp_path / "corrupt"
    shutil.copytree(two_iterations, corrupt)
    first, rest = (corrupt / "metrics.jsonl").read_bytes().split(b"\n", 1)
    (corrupt / "metrics.jsonl").write_bytes(first + b"\n" + bad + b"\n" + rest)
    before = _files(corrupt)
    line = _refused(_train(tiny_ckpt, corrupt, 3) + ["--resume"], capsys,
                    f"{corrupt / 'metrics.jsonl'} line 2 is not a JSON record", "repair or delete that line", "--resume")
    assert _files(corrupt) == before and "run.json" in before


# ---------------------------------------------------------------------------------------------- 7. Ctrl-C


def _interrupt(*a, **k):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where,target", [
    ("train", "jagg.trainers.shapes.load_model"),                       # the trainer's setup
    ("eval", "jagg.shapes.evaluation.evaluate"),
    ("sample", "jagg.shapes.evaluation.generate"),
    ("pretrain", "jagg.shapes.pretrain.pretrain"),
    ("bench meter", "jagg.bench.meter.ShapesSampler"),
])
def test_ctrl_c_anywhere_is_one_line_and_exit_130(where, target, tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Class 7, Ctrl-C printing a traceback: in a trainer's setup, an evaluation, sampling, pretraining and the benches,
    one line `jagg ...: interrupted`, exit 130."""
    monkeypatch.setattr(target, _interrupt)
    argv = {"train": _train(tiny_ckpt, tmp_path / "run", 1),
            "eval": ["eval", "--checkpoint", tiny_ckpt],
            "sample": ["sample", "--checkpoint", tiny_ckpt, "--prompt", "a red circle"],
            "pretrain": _pretrain("w.safetensors"),
            "bench meter": ["bench", "meter", "--quick"]}[where]
    code, line, _ = _jagg(argv, capsys)
    assert code == 130 and line == f"jagg {where}: interrupted"


# ---------------------------------------------------------------------------------------------- 8. errors name their culprit


def test_errors_name_their_culprit(tmp_path, tiny_ckpt, capsys):
    """Class 8, errors that do not name their culprit (a negative seed, a binary prompt file, a directory as an
    image): each names the key, option or file."""
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"a red circle\n\xff\xfe\x00\x81")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"a red circle\n\x00\x00\n")
    (tmp_path / "grids").mkdir()
    yaml_binary = tmp_path / "c.yaml"
    yaml_binary.write_bytes(b"seed: 0\n\xff")
    sample = ["sample", "--checkpoint", tiny_ckpt, "--steps", "2"]
    for argv, culprits in (
            (["train", "--set", "seed=-1", "--print-config"], ("seed must be an integer in [0, 4294967295]",)),
            (["train", "--set", "eval.seed=-1", "--print-config"], ("eval.seed",)),
            ([*sample, "--prompt-file", str(binary)], ("--prompt-file", str(binary), "not a UTF-8 text file", "line 2")),
            ([*sample, "--prompt-file", str(nul)], ("--prompt-file", str(nul), "binary", "line 2")),
            ([*sample, "--prompt-file", str(tmp_path / "missing.txt")], ("--prompt-file", "missing.txt")),
            ([*sample, "--prompt", "a red circle", "--out", str(tmp_path / "grids")], ("--out", "is a directory")),
            ([*sample, "--prompt", "a red circle", "--out", str(tmp_path / "grid")], ("--out", "must end in")),
            (["train", "--set", f"sample.prompts_file={binary}", "--print-config"], ("sample.prompts_file", str(binary))),
            (["train", "--config", str(yaml_binary), "--print-config"], ("config file", str(yaml_binary))),
            (["pretrain", "--out", str(tmp_path / "w.pt")], ("--out", ".safetensors")),
            (["eval", "--json", str(tmp_path / "grids")], ("--json", "is a directory"))):
        _refused(argv, capsys, *culprits)
    assert not list(tmp_path.glob("grid*.png"))


# ---------------------------------------------------------------------------------------------- 9. every path, the same checks


def test_every_path_runs_the_same_checks(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """Class 9, checks that differ by path: --print-config refuses what train refuses; --by-interval and --json are
    checked before the computation; an empty --output-dir, --config or --out is refused, not replaced by a default
    (the lab's tools: lab/tests/test_lab_refusals.py)."""
    for sets, culprit in ((["reward.weights={jpeg_compressibility: .nan}"], "reward.weights.jpeg_compressibility"),
                          (["reward.name=null", "reward.weights={nosuch: 1.0}"], "unknown reward 'nosuch'"),
                          (["reward.weights=null", "reward.name=nosuch"], "unknown reward 'nosuch'"),
                          (["reward.weights=null", "reward.name=no_such_module:f"], "no_such_module"),
                          (["reward.weights={}"], "reward.weights is empty"), (["reward.weights=null", "reward.name="],
                                                                               "reward.name is empty")):
        argv = ["train", *[a for s in sets for a in ("--set", s)]]
        printed = _refused([*argv, "--print-config"], capsys, culprit)
        assert _refused([*argv, "--output-dir", str(tmp_path / "run")], capsys, culprit) == printed
    from jagg.bench import meter as efficiency

    monkeypatch.setattr(efficiency, "measure", lambda *a, **k: pytest.fail("computed before the arguments' checks"))
    _refused(["bench", "meter", "--quick", "--by-interval", "w:window=3,knots=nosuch"], capsys, "knots")
    _refused(["bench", "meter", "--quick", "--by-interval", "subsample"], capsys, "--by-interval")
    _refused(["bench", "meter", "--quick", "--json", str(tmp_path)], capsys, "--json", "is a directory")
    (tmp_path / "file").write_text("")
    _refused(["bench", "meter", "--quick", "--json", str(tmp_path / "file" / "x.json")], capsys, "is a file")

    before = _files(tmp_path)
    for argv, culprit in ((["train", "--output-dir", "", "--print-config"], "log.output_dir"),
                          (["train", "--config", "", "--print-config"], "config file ''"),
                          (["sample", "--prompt", "a red circle", "--out", ""], "--out is empty"),
                          (["pretrain", "--out", ""], "--out is empty"),
                          (["eval", "--json", ""], "--json is empty"),
                          (["bench", "meter", "--json", ""], "--json is empty")):
        _refused(argv, capsys, culprit)
    assert _files(tmp_path) == before and not Path("runs").exists()
