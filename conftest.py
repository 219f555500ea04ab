"""Shared fixtures of both test folders (tests/: the package; lab/tests/: the lab), and what keeps the suite
hermetic: every test runs in its own temporary directory, with a temporary home, and the suite fails when a test
leaves anything in the checkout (`git status`, or the checkout's runs/, which git ignores).

The fixtures: tiny TinyDiT checkpoints (``tiny_ckpt``, ``bench_ckpt``) and tiny random diffusers pipelines saved as
model directories (``sd3_dir``, ``qwen_dir``). The helpers the tests share are modules of tests/, never test files:
tiny_runs.py (arguments of seconds-long runs, a run's records), tiny_pipelines.py and tiny_clip.py (tiny random
models), toy.py (float64 stand-in models), gradient_checks.py (how a gradient is judged), command_line.py (how a
command ends), reward_plugins.py and fake_wandb.py."""

import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "tests"), HERE]     # the helpers of tests/ (toy.py, ...); the lab (lab/)
torch.set_num_threads(1)  # tiny models: threads only add contention (30-60x slower on a busy 2-core box)

import pytest

ROOT = Path(__file__).resolve().parent
_HOME: str | None = None


def pytest_configure(config):
    """A temporary home for the whole session (and every process it starts), before any test module is imported:
    caches and configs (matplotlib, Hugging Face, accelerate, torch) are neither read from nor written to the user's.
    Packages installed in the user's site directory still import (``PYTHONUSERBASE`` keeps pointing there)."""
    global _HOME
    _HOME = tempfile.mkdtemp(prefix="jagg-tests-home-")
    os.environ.setdefault("PYTHONUSERBASE", site.getuserbase())
    os.environ["HOME"] = _HOME
    for name, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share")):
        os.environ[name] = os.path.join(_HOME, sub)


def pytest_unconfigure(config):
    if _HOME is not None:
        shutil.rmtree(_HOME, ignore_errors=True)


def _git_status() -> str | None:
    """``git status --porcelain --untracked-files=all`` of the checkout, or None when the tests do not run from a git
    checkout (an unpacked sdist, no git)."""
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except OSError:
        return None
    if top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        return None
    return subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout


def _runs_listing() -> dict[str, int]:
    """Every path under the checkout's runs/ (gitignored: `make train` writes there) with its modification time."""
    runs = ROOT / "runs"
    paths = [runs, *runs.rglob("*")] if runs.exists() else []
    return {str(p.relative_to(ROOT)): p.lstat().st_mtime_ns for p in paths}


@pytest.fixture(scope="session", autouse=True)
def checkout_left_as_found():
    """Fail the suite when the tests changed the checkout: a file added, changed or deleted (``git status``), or
    anything under runs/ written (a test that trained into ``runs/default`` of the cwd, say). Tests write into their
    ``tmp_path``; :func:`in_tmp_path` makes that the cwd."""
    status, runs = _git_status(), _runs_listing()
    yield
    problems = []
    after = _git_status()
    if status is not None and after != status:
        changed = sorted(set(after.splitlines()) ^ set(status.splitlines()))
        problems.append("git status changed: " + "; ".join(changed))
    now = _runs_listing()
    if now != runs:
        touched = sorted(k for k in set(now) | set(runs) if now.get(k) != runs.get(k))
        problems.append(f"{ROOT / 'runs'} changed: " + ", ".join(touched[:10]) + (" ..." if len(touched) > 10 else ""))
    if problems:
        pytest.fail("the tests left the checkout changed (a test must write into its tmp_path only):\n  "
                    + "\n  ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Every test runs with its own temporary directory as the cwd: relative paths (``runs/default``, the
    benchmarks' defaults) land there, never in the checkout or wherever pytest was started."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def restore_threads():
    """Commands under test set their own torch threads (the benchmarks one: tiny models, a busy machine); restore
    the session's after each test."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny random TinyDiT checkpoint (fast to sample and train)."""
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, dim=32, depth=1, heads=2, text_dim=16,
                              text_depth=1, text_heads=2, patch_size=8))
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_pretrained(model, path)
    return str(path)


@pytest.fixture(scope="session")
def bench_ckpt(tmp_path_factory):
    """A tiny TinyDiT whose zero-initialised layers are randomised (non-zero velocities and gradients)."""
    from jagg.shapes.dit import DiTConfig, TinyDiT, save_pretrained
    from jagg.shapes import tokenizer

    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size, image_size=16, dim=32, depth=1, heads=2,
                              text_dim=16, text_depth=1, text_heads=2, patch_size=4))
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.normal_(std=0.05)
    path = tmp_path_factory.mktemp("bench_ckpt") / "tiny.safetensors"
    save_pretrained(model, path)
    return str(path)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> Path:
    """A tiny random SD3 pipeline (2 tiny CLIP text encoders, no T5) saved as a local diffusers directory (one per
    test module; tests/tiny_pipelines.py)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from tiny_pipelines import save_sd3_pipeline

    return save_sd3_pipeline(tmp_path_factory.mktemp("models") / "sd3")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen-Image pipeline with its text encoder and tokenizer, saved as a local diffusers directory
    (one per test module; tests/tiny_pipelines.py)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from tiny_pipelines import save_qwen_pipeline

    return save_qwen_pipeline(tmp_path_factory.mktemp("models") / "qwen_image")
