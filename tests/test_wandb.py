"""wandb logging (``log.wandb``): what jagg sends (a stand-in module records it, with or without wandb installed), the
error without the package, the settings' checks, a real offline wandb run read back from its files, and wandb's
start-up (a bad project or entity, no API key, an unknown WANDB_MODE, a failing init) refused in one line naming
the key before anything is written."""

import json
import math
import struct
import sys
from pathlib import Path

import pytest

import fake_wandb
from command_line import train_refused_alike
from tiny_runs import records, tiny_train_args
from jagg.cli import main
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.infra import config_loader as configuration
from jagg.infra.checkpoint import load_latest
from jagg.infra.wandb_run import redacted


def _expected_log(record: dict) -> dict:
    """What wandb must get for a metrics.jsonl record: its iteration and every finite number as <kind>/<key>."""
    numbers = {f"{record['kind']}/{k}": v for k, v in record.items() if k not in ("kind", "iteration")
               and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return {"iteration": record["iteration"], **numbers}


def _wandb_args(ckpt, out, iterations, *extra):
    return tiny_train_args(ckpt, out, iterations, "log.wandb=true", "log.wandb_mode=offline", "log.wandb_project=proj",
                           "estimator.mode=jagg", "estimator.meter_every=2", *extra)


def test_wandb_gets_the_config_every_scalar_and_the_grids_and_resume_continues_its_run(tmp_path, tiny_ckpt,
                                                                                       monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    calls = fake_wandb.install(monkeypatch)
    out = tmp_path / "run"
    assert main(_wandb_args(tiny_ckpt, out, 3)) == 0
    assert main(_wandb_args(tiny_ckpt, out, 4) + ["--resume"]) == 0
    first, second = fake_wandb.sessions(calls)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    recs = records(out)
    assert {r["kind"] for r in recs} == {"train", "eval", "audit"}
    for session, iterations, logged in ((first, 3, [r for r in recs if r["iteration"] <= 3]),
                                        (second, 4, [r for r in recs if r["iteration"] == 4])):
        init = session[0][1]
        # the same wandb run both times: its id is the run directory's run id
        assert init["id"] == run_id and init["resume"] == "allow"
        assert (init["project"], init["entity"], init["mode"]) == ("proj", None, "offline")
        assert init["dir"] == str(out.resolve()) and init["name"] == "run"
        config = dict(init["config"])
        assert config.pop("run_dir") == str(out.resolve()) and config.pop("run_id") == run_id
        assert config["grpo"]["iterations"] == iterations and config["log"]["wandb"] is True
        assert session[1] == ("define_metric", "*", {"step_metric": "iteration"})
        logs = [c[1] for c in session if c[0] == "log"]
        images = [d for d in logs if any(isinstance(v, fake_wandb.Image) for v in d.values())]
        # every record of metrics.jsonl, in order, under the names TensorBoard shows
        assert [d for d in logs if d not in images] == [_expected_log(r) for r in logged]
        shown = [(k, Path(v.path).name, d["iteration"]) for d in images for k, v in d.items() if k != "iteration"]
        grids = [("images/eval", "eval_000000.png", 0), ("images/eval", "eval_000002.png", 2),
                 ("images/eval", "eval_000003.png", 3), ("images/comparison", "comparison.png", 3)]
        assert shown == (grids if iterations == 3 else [("images/eval", "eval_000004.png", 4),
                                                        ("images/comparison", "comparison.png", 4)])
        assert all(Path(v.path).is_file() for d in images for k, v in d.items() if k != "iteration")
        assert session[-1] == ("finish",)
    state, _ = load_latest(out / "checkpoints")
    assert {k: v for k, v in second[0][1]["config"].items() if k not in ("run_dir", "run_id")} == state["config"]


def test_log_wandb_without_the_package_is_one_line_naming_the_extra_and_changes_nothing(tmp_path, tiny_ckpt,
                                                                                       monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)             # import wandb raises ImportError
    new = tmp_path / "new"
    assert main(tiny_train_args(tiny_ckpt, new, 1, "log.wandb=true")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "log.wandb" in err and "pip install 'jagg[wandb]'" in err
    assert not new.exists()
    old = tmp_path / "old"                                        # --overwrite moves nothing aside either
    assert main(tiny_train_args(tiny_ckpt, old, 1)) == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(tiny_train_args(tiny_ckpt, old, 1, "log.wandb=true") + ["--overwrite"]) == 2
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("sets, culprit", [
    (["log.wandb_mode=shared"], "log.wandb_mode must be one of"),
    (["log.wandb_project="], "log.wandb_project must be a name"),
])
def test_bad_wandb_settings_are_refused_by_key(sets, culprit):
    with pytest.raises(ValueError, match=culprit):
        configuration.load(ShapesTrainConfig, None, sets)


def test_a_token_in_the_config_is_not_sent():
    config = {"reward_server": {"url": "http://h:1", "token": "s3cret"}, "x": [{"token": "t"}], "log": {"token": None}}
    assert redacted(config) == {"reward_server": {"url": "http://h:1", "token": "<redacted>"},
                                "x": [{"token": "<redacted>"}], "log": {"token": None}}


# ----------------------------------------------------------------------------- the real package, offline


def _wandb_file_records(path: Path) -> list:
    """The records of a ``run-<id>.wandb`` file: wandb's LevelDB-style log (a 7-byte header ``:W&B`` + magic +
    version, then 32 KiB blocks of chunks ``crc32 u32, length u16, type u8`` (1 full, 2 first, 3 middle, 4 last)),
    each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:                               # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:                                             # zero padding up to the block's end
            pos += block - pos % block
            continue
        piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            chunks.append(pending)
    found = []
    for chunk in chunks:
        r = wandb_internal_pb2.Record()
        r.ParseFromString(chunk)
        found.append(r)
    return found


def _offline_run(run_dir: Path, wait_s: float = 20.0) -> dict:
    """An offline run directory's id, config and history rows (name -> value, images as their sub-keys). wandb's
    service process may still be writing the file when the run has ended: read it again until it holds the run's exit
    record (at most ``wait_s`` seconds)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        out = _read_offline_run(run_dir)
        if out["exited"] or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _read_offline_run(run_dir: Path) -> dict:
    (path,) = run_dir.glob("run-*.wandb")
    out = {"id": None, "config": {}, "history": [], "exited": False}
    for r in _wandb_file_records(path):
        kind = r.WhichOneof("record_type")
        out["exited"] |= kind == "exit"
        if kind == "run":
            out["id"] = r.run.run_id
            out["config"] = {c.key: json.loads(c.value_json) for c in r.run.config.update}
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return out


def test_an_offline_wandb_run_holds_the_metrics_and_grids_and_resume_reuses_its_id(tmp_path, tiny_ckpt, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    out = tmp_path / "run"
    args = lambda n: tiny_train_args(tiny_ckpt, out, n, "log.wandb=true", "estimator.mode=jagg")
    assert main(args(2)) == 0
    assert main(args(3) + ["--resume"]) == 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    runs = sorted((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    first, second = (_offline_run(r) for r in runs)
    assert first["id"] == second["id"] == run_id                  # --resume continued the same wandb run
    assert first["config"]["run_dir"] == str(out.resolve()) and first["config"]["grpo"]["iterations"] == 2
    assert second["config"]["grpo"]["iterations"] == 3
    recs = records(out)
    for run_dir, run, logged in ((runs[0], first, [r for r in recs if r["iteration"] <= 2]),
                                 (runs[1], second, [r for r in recs if r["iteration"] == 3])):
        rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in run["history"]]
        images = [row for row in rows if any(k.endswith("/_type") for k in row)]
        # every record of metrics.jsonl, in order, under the names TensorBoard shows
        assert [row for row in rows if row not in images] == [_expected_log(r) for r in logged]
        evals = [r["iteration"] for r in logged if r["kind"] == "eval"]
        assert [row["iteration"] for row in images if "images/eval/path" in row] == evals
        assert [row["iteration"] for row in images if "images/comparison/path" in row] == [evals[-1]]
        for row in images:                                        # the PNGs are in the offline run's files
            path = next(v for k, v in row.items() if k.endswith("/path"))
            assert {v for k, v in row.items() if k.endswith("/_type")} == {"image-file"}
            assert (run_dir / "files" / path).is_file() and path.endswith(".png")


@pytest.mark.parametrize("sets,env,culprit", [
    (["log.wandb_project=a/b:c"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_project 'a/b:c'"),
    ([f"log.wandb_project={'p' * 129}"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_project"),
    (["log.wandb_entity=team#1"], {"WANDB_API_KEY": "x" * 40}, "log.wandb_entity"),
    ([], {"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus'"),
    ([], {}, "needs a W&B API key"),                                         # online, no key, no netrc
    (["log.wandb_mode=online"], {"WANDB_MODE": "offline"}, "needs a W&B API key"),
])
def test_wandb_start_up_errors_are_one_line_before_anything_is_written(sets, env, culprit, tmp_path, capsys,
                                                                        monkeypatch):
    import fake_wandb

    fake_wandb.install(monkeypatch)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL", "WANDB_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))      # no settings file with a key
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    train_refused_alike(main, ["log.wandb=true", *sets], capsys, tmp_path, culprit)


def test_wandb_start_up_passes_offline_or_with_a_key(tmp_path, capsys, monkeypatch):
    import fake_wandb

    from jagg.infra.wandb_run import check_start
    from jagg.trainers.sections import LogSection

    fake_wandb.install(monkeypatch)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    config_dir = tmp_path / "wandb_config"
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(config_dir))
    check_start(LogSection(wandb=True, wandb_mode="offline"))
    check_start(LogSection(wandb=True, wandb_mode="disabled"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_start(LogSection(wandb=True))
    monkeypatch.delenv("WANDB_MODE")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    check_start(LogSection(wandb=True))                                          # `wandb login`'s entry
    monkeypatch.delenv("NETRC")
    with pytest.raises(ValueError, match="needs a W&B API key"):
        check_start(LogSection(wandb=True))
    config_dir.mkdir()
    (config_dir / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    check_start(LogSection(wandb=True))                                          # wandb's settings file


def test_a_wandb_init_failure_is_one_line_naming_log_wandb(monkeypatch):
    import fake_wandb

    from jagg.infra.wandb_run import WandbRun
    from jagg.trainers.sections import LogSection

    fake_wandb.install(monkeypatch)

    class UsageError(Exception):
        pass

    def refuse(**kwargs):
        raise UsageError("Invalid project name\nwith a second line")

    monkeypatch.setattr(sys.modules["wandb"], "init", refuse)
    with pytest.raises(ValueError) as e:
        WandbRun(LogSection(wandb=True, wandb_mode="offline"), "id", Path("."), {})
    assert str(e.value).startswith("log.wandb: wandb could not start (UsageError: Invalid project name with")
    assert "\n" not in str(e.value)
