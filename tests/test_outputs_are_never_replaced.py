"""A file a command writes for its user is the user's data: every output (pretrain --out and its snapshots, sample
--out and its captions, eval --json, every bench's --json) that exists is refused before any work and replaced only
with --overwrite, atomically: a write that fails midway leaves the old file whole. (A run directory:
tests/test_a_run_directory_belongs_to_one_run.py; the lab's outputs: lab/tests/test_lab_refusals.py.)"""

from __future__ import annotations

import pytest

from command_line import files_under, refused, run as run_cli
from jagg.cli import main
from tiny_runs import pretrain_args


@pytest.mark.parametrize("name,argv,cheap", [
    ("w.safetensors", lambda ck, p: pretrain_args(p), True),
    ("w.step1.safetensors", lambda ck, p: pretrain_args(p.replace(".step1", ""), "snapshot_every=1"), True),
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
    """Every file a command writes for its user (pretrain --out and its snapshots, sample --out and its captions, eval
    --json, every bench's --json) is refused when it exists, before any work, and replaced only with --overwrite,
    atomically."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the user's data")
    before = files_under(tmp_path)
    refused(main, argv(tiny_ckpt, str(path)), capsys, str(path), "--overwrite")
    assert files_under(tmp_path) == before
    if cheap:
        code, line, _ = run_cli(main, argv(tiny_ckpt, str(path)) + ["--overwrite"], capsys)
        assert code == 0, line
        assert path.read_bytes() != b"the user's data" and not list(tmp_path.rglob("*.tmp"))


def test_a_failed_write_leaves_the_old_file(tmp_path):
    """Those writes go through one atomic helper: a write that fails midway leaves the old file whole and no
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
