"""Every command shown in README.md and docs/*.md works as written, in a fast form: a documented command fails a test
before it fails a user.

The commands are found, not listed: every line of a ```bash / ```sh / plain ``` block and every inline `code` span
that starts with ``jagg``, ``python``, ``python3``, ``make``, ``torchrun`` or ``accelerate launch``. Shell syntax is
followed as far as the docs use it: ``\\`` continuations, ``# comments``, ``;``, ``&``, ``&&``, ``|``, ``NAME=value``
assignments and ``$NAME``, ``for X in a b; do ...; done`` (the first value), a leading ``time`` or ``ENV=value``.
Documentation shorthand: ``...`` marks elided arguments, ``[--opt X]`` an optional group (a *synopsis*),
``a|b|c`` after ``jagg`` or ``jagg bench`` alternative sub-commands, ``S``/``N``/``G`` a number the reader fills in.

Each command is then checked:

1. **parsed** by the real parser: ``jagg`` (and ``-m jagg.cli`` under torchrun / accelerate) by
   :func:`jagg.cli.build_parser`, ``jagg bench ...`` included; a script or ``-m`` module that uses argparse by its own
   parser (its ``parse_args`` is intercepted, nothing runs); ``make X`` must be a Makefile target;
2. **loaded**, where that is fast: ``jagg train ...`` runs with ``--print-config`` (the config and every ``--set`` are
   validated, nothing trains; under torchrun / accelerate launch a real model's engine is decided too, with the
   launcher's settings, as every launched process decides before the model loads), ``jagg pretrain`` and ``jagg
   bench ...`` load their ``--config``/``--set``; a prompts
   file the command names (``sample.prompts_file=prompts.txt``) is created in the scratch directory, as a user would
   have it. Elided commands (``...``) and synopses are only parsed;
3. **run as written**, for the commands of code blocks (inline mentions name commands, they are not instructions,
   so only their ``--help`` and ``--print-config`` run), unless ``SKIP`` below says why not (a GPU, a model
   directory, a trained run, minutes of CPU, a server, a Makefile recipe). Runs happen in a scratch directory that
   links the repository's top-level entries (outputs land there), with one torch thread (``--set threads=1``), and
   must take < ``RUN_LIMIT_S`` seconds each: a slower command belongs in ``SKIP`` with its reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from unittest import mock

import pytest
import torch

from jagg.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "lab" / "README.md"]
STARTS = ("jagg", "python", "python3", "make", "torchrun", "accelerate")
RUN_LIMIT_S = 10.0

# Prose that looks like a command but names something else (checked: each must still occur in the docs).
NOT_COMMANDS = {
    "jagg fresh": "the JAGG variant with fresh intermediate velocities (usage.md)",
    "jagg interp": "the JAGG variant with interpolated intermediate velocities (usage.md)",
    "jagg train: error: ...": "the form of an error message (usage.md)",
    "jagg train: aborted: ...": "the form of the message of a run that aborts (usage.md)",
    "accelerate launch": "the launcher named in prose (real_models.md)",
    "accelerate launch --multi_gpu --num_processes 2": "how the test launches 2 CPU processes (real_models.md)",
    "accelerate launch --cpu --num_processes 2": "a launch mode that starts one process (real_models.md)",
}

# Placeholders the docs write for a number the reader fills in (a whole word, or the value after '=').
PLACEHOLDERS = {"S": "0", "N": "2", "G": "1.0"}

# Code-block commands that are parsed and loaded but not run, and why (a regular expression over the command as
# normalised here: one line, single spaces). Only a GPU, a model directory or trained run, minutes of CPU, a server
# that runs until stopped or a Makefile recipe are reasons.
SKIP = [
    (r"^make ", "a Makefile recipe: installs a venv, trains for minutes, runs the suite or deletes .venv and runs/ "
                "(the target is checked)"),
    (r"^jagg train(?!.*--help)(?!.*--print-config)", "trains: minutes of CPU, or a diffusers model directory and a "
                                                     "GPU (loaded with --print-config instead)"),
    (r"^jagg pretrain(?!.*--help)", "10,000 steps: about an hour (its keys are loaded instead)"),
    (r"^jagg (sample|eval) .*--checkpoint (runs/|CKPT)", "needs a trained run directory or checkpoint"),
    (r"^jagg bench speed(?!.*--help)", "a benchmark: a minute (--quick) to an hour of CPU, or a GPU (its smoke run "
                                       "is tests/test_bench_speed.py)"),
    (r"^jagg bench meter(?!.*--help)", "batches x estimators x draws of the main job: minutes of CPU (--quick: "
                                       "10 s idle; its smoke run is tests/test_bench_meter.py)"),
    (r"benchmarks/gpu_bench\.py --scaled-down", "the same command runs in tests/test_gpu_bench.py"),
    (r"benchmarks/gpu_bench\.py(?!.*--scaled-down)", "full-size models on a GPU, or minutes of CPU (--small)"),
    (r"-m lab (quality|fidelity|signal|e2e|regime-map|profile-training)(?!.*--help)",
     "a lab study: a minute (--quick) to hours of CPU (each tool's smoke run is in lab/tests/)"),
    (r"-m lab (paired|weight-changes)(?!.*--help)", "needs trained checkpoints (runs/.../checkpoints/...)"),
    (r"-m lab plateau(?!.*--help)", "needs finished paired-seed runs (python -m lab quality: minutes to hours of CPU; "
                                    "its run on constructed runs is lab/tests/test_plateau_mechanism.py)"),
    (r"-m lab trace-file-changes(?!.*--help)", "builds a tiny SD3 and traces a run (its smoke run is in lab/tests/)"),
    (r"-m jagg\.rewards\.server", "starts a reward server that runs until stopped (and loads model weights)"),
    (r"-m jagg\.integrations\.pipeline cache", "needs a diffusers model directory with its text encoders"),
    (r"^(torchrun|accelerate launch|python -m torch\.distributed\.run)", "launches several processes: GPUs"),
]


@dataclass
class Command:
    text: str                       # as shown (normalised to one line)
    argv: list[str]                 # after placeholders, alternatives and optional groups
    where: str                      # file:line
    fenced: bool                    # from a code block (inline mentions are not run)
    elided: bool = False            # '...' in it: parse only
    synopsis: bool = False          # '[--optional]' groups: parse only
    notes: list[str] = field(default_factory=list)

    def __str__(self):
        return f"{self.where}: {self.text}"


# ---------------------------------------------------------------------------------------------- finding commands


def _code_blocks(text: str):
    """``(first line number, language, lines)`` of each fenced block."""
    out, lang, start, buf = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence and lang is None:
            lang, start, buf = fence.group(1), n + 1, []
        elif fence and lang is not None and not fence.group(1):
            out.append((start, lang, buf))
            lang = None
        elif lang is not None:
            buf.append(line)
    return out


def _expand(tokens: list[str], variables: dict[str, str]) -> list[str]:
    """``$NAME`` / ``${NAME}`` replaced by the variable's value (a whole-token ``$V`` may hold several arguments)."""
    out = []
    for tok in tokens:
        whole = re.fullmatch(r"\$\{?(\w+)\}?", tok)
        if whole and whole.group(1) in variables:
            out += shlex.split(variables[whole.group(1)])
        else:
            out.append(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), tok))
    return out


def _segments(line: str, variables: dict[str, str]) -> list[list[str]]:
    """One shell line -> its simple commands (token lists), assignments recorded and variables expanded in order."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    parts, cur = [], []
    for tok in tokens:
        if tok in ("|", "||", "&&", "&", ";"):
            parts.append(cur)
            cur = []
        elif tok.endswith(";") or (tok.endswith("&") and not tok.startswith("-")):
            cur.append(tok.rstrip(";&"))
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    parts.append(cur)
    out = []
    for part in parts:
        if part[:1] == ["for"] and len(part) >= 4 and part[2] == "in":
            variables[part[1]] = part[3]                         # the loop's first value
            continue
        while part and (part[0] in ("do", "time") or re.fullmatch(r"[A-Za-z_]\w*=.*", part[0])):
            if part[0] not in ("do", "time") and len(part) == 1:
                name, value = part[0].split("=", 1)
                variables[name] = value
            part = part[1:]
        part = _expand(part, variables)
        if part and part[0] in STARTS:
            out.append(part)
    return out


def _normalise(tokens: list[str], text: str, where: str, fenced: bool) -> list[Command]:
    """Placeholders, optional groups, elisions and sub-command alternatives -> one or more Commands."""
    cmd = Command(text, [], where, fenced)
    argv, group = [], None
    for tok in tokens:
        if group is None and tok.startswith("[") and not tok.startswith("[0"):
            cmd.synopsis, group = True, []
            tok = tok[1:]
        if group is not None:
            end = tok.endswith("]")
            group.append(tok.rstrip("]") if end else tok)
            if end:
                if "..." not in group and "|" not in group:         # '[--json PATH]' -> '--json PATH'
                    argv += [t for t in group if t]
                group = None
            continue
        if tok == "...":
            cmd.elided = True
            continue
        if tok in PLACEHOLDERS:
            tok = PLACEHOLDERS[tok]
        elif "=" in tok and tok.split("=", 1)[1] in PLACEHOLDERS:
            tok = tok.split("=", 1)[0] + "=" + PLACEHOLDERS[tok.split("=", 1)[1]]
        argv.append(tok)
    at = 2 if argv[:2] == ["jagg", "bench"] else 1 if argv[:1] == ["jagg"] else None
    if at is not None and len(argv) > at and "|" in argv[at]:
        return [Command(text, argv[:at] + [alt] + argv[at + 1:], where, fenced, cmd.elided, cmd.synopsis)
                for alt in argv[at].split("|")]
    cmd.argv = argv
    return [cmd]


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(REPO)
        for start, lang, lines in _code_blocks(text):
            if lang not in ("bash", "sh", "shell", ""):
                continue
            variables: dict[str, str] = {}
            n = 0
            while n < len(lines):
                first, line = n, lines[n]
                while line.rstrip().endswith("\\") and n + 1 < len(lines):
                    n += 1
                    line = line.rstrip()[:-1] + " " + lines[n].strip()
                n += 1
                for tokens in _segments(line, variables):
                    shown = " ".join(line.split("#")[0].split()) if "#" in line else " ".join(line.split())
                    found += _normalise(tokens, shown, f"{name}:{start + first}", fenced=True)
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for m in re.finditer(r"`((?:jagg|python3?|make|torchrun|accelerate) [^`]+)`", prose):
            shown = " ".join(m.group(1).split())
            if shown in NOT_COMMANDS:
                continue
            line = prose.count("\n", 0, m.start()) + 1
            for tokens in _segments(shown, {}):
                found += _normalise(tokens, shown, f"{name}:{line}", fenced=False)
    return found


COMMANDS = documented_commands()


# ---------------------------------------------------------------------------------------------- parsing


class _Parsed(Exception):
    pass


def _argparse_only(run, argv0: str, args: list[str]) -> argparse.Namespace:
    """Run ``run()`` (a script or ``-m`` module) until its argparse parser has parsed ``args``; nothing else runs."""
    real = argparse.ArgumentParser.parse_args

    def capture(self, a=None, namespace=None):
        raise _Parsed(real(self, a, namespace))

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
            mock.patch.object(sys, "argv", [argv0, *args]), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)            # runpy: "found in sys.modules after import ..."
        try:
            run()
        except _Parsed as p:
            return p.args[0]
        except SystemExit as e:
            if e.code not in (0, None):
                raise AssertionError(f"argparse refused it: {err.getvalue().strip()}") from None
            return argparse.Namespace(help=True)
    raise AssertionError("it never called argparse")


def _program(argv: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, args)``: kind ``jagg`` (args for jagg's parser), ``module`` or ``script``; launchers
    (torchrun, accelerate launch, python -m torch.distributed.run) give the program they launch."""
    if argv[0] == "jagg":
        return "jagg", "jagg", argv[1:]
    rest = argv[1:]
    if argv[0] in ("torchrun", "accelerate") or rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:] if rest[:1] == ["-m"] else rest[1:] if argv[0] == "accelerate" else rest
        for i, tok in enumerate(rest):
            if tok == "-m":
                return ("jagg", "jagg", rest[i + 2:]) if rest[i + 1] == "jagg.cli" else ("module", rest[i + 1], rest[i + 2:])
            if tok.endswith(".py"):
                return "script", tok, rest[i + 1:]
        raise AssertionError("a launcher without a program")
    if rest[:1] == ["-m"]:
        return ("jagg", "jagg", rest[2:]) if rest[1] == "jagg.cli" else ("module", rest[1], rest[2:])
    return "script", rest[0], rest[1:]


def _is_name(cmd: Command) -> bool:
    """An inline mention without options (`jagg pretrain`, `jagg bench meter`, `python -m jagg.rewards.server`)
    names a command: its (sub)commands must exist, its required options need not be shown."""
    return not cmd.fenced and not any(t.startswith("-") for t in cmd.argv[1:] if t != "-m")


def _parse(cmd: Command) -> tuple[str, list[str], argparse.Namespace | None]:
    argv = cmd.argv
    if _is_name(cmd) and argv[0] != "make":
        argv = argv + ["--help"]
    if argv[0] == "make":
        targets = re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M)
        assert all(t in targets for t in argv[1:] if not t.startswith("-")), f"no such make target (has {targets})"
        return "make", argv, None
    kind, target, args = _program(argv)
    if kind == "jagg":
        parser = build_parser(args)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                return "jagg", args, parser.parse_args(args)
            except SystemExit as e:
                assert e.code in (0, None), f"jagg's parser refused it: {err.getvalue().strip()}"
                return "jagg", args, None
    if kind == "module":
        import importlib.util

        assert importlib.util.find_spec(target) is not None, f"no module {target}"
        return kind, argv, _argparse_only(lambda: runpy.run_module(target, run_name="__main__"), target, args)
    path = REPO / target
    assert path.is_file(), f"no such file {target}"
    source = path.read_text()
    if "argparse" in source and "parse_args(" in source:
        return kind, argv, _argparse_only(lambda: runpy.run_path(str(path), run_name="__main__"), str(path), args)
    assert not [a for a in args if not (_is_name(cmd) and a == "--help")], \
        f"{target} takes no arguments (no argparse) but the docs pass {args}"
    return kind, argv, None


# ---------------------------------------------------------------------------------------------- loading and running


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory that links the repository's top-level entries: documented relative paths work, outputs stay
    here."""
    d = tmp_path_factory.mktemp("docs_cwd")
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".venv", "runs") and not entry.name.startswith(".pytest"):
            (d / entry.name).symlink_to(entry)
    return d


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _user_files(args: list[str], scratch: Path) -> None:
    """Create the prompts files a command names by a relative path, as its user would have them."""
    for a in args:
        m = re.match(r"sample\.prompts_file=(.+)$", a)
        if m and not Path(m.group(1)).is_absolute() and not (scratch / m.group(1)).exists():
            (scratch / m.group(1)).parent.mkdir(parents=True, exist_ok=True)
            line = ('{"prompt": "a red circle", "tag": "single_object", "include": [{"class": "circle", "count": 1}]}'
                    if m.group(1).endswith(".jsonl") else "a red circle")       # Flow-GRPO's metadata prompt sets
            (scratch / m.group(1)).write_text(line + "\n")


def _load(cmd: Command, args: list[str], ns: argparse.Namespace, scratch: Path, capsys) -> None:
    """The fast form: the configs a jagg command would load, loaded; nothing trains."""
    from jagg.cli import PretrainRunConfig
    from jagg.trainers.diffusers_config import DiffusersTrainConfig, has_pipeline_section
    from jagg.trainers.shapes_config import ShapesTrainConfig
    from jagg.infra import config_loader as configuration

    _user_files(args, scratch)
    if ns.command == "train" and not ns.print_config:
        assert main(args + ["--print-config"]) == 0, capsys.readouterr().err
    elif ns.command == "pretrain":
        configuration.load(PretrainRunConfig, None, ns.set or [])
    elif ns.command == "bench" and hasattr(ns, "set") and getattr(ns, "config", None):
        kind = DiffusersTrainConfig if has_pipeline_section(ns.config) else ShapesTrainConfig   # as bench meter
        configuration.load(kind, ns.config, ns.set or [])


def _check_launched(cmd: Command, ns: argparse.Namespace) -> None:
    """A documented multi-process ``jagg train`` of a real model: its engine decided as each launched process decides
    before the model loads (:func:`jagg.trainers.diffusers_trainer.engine_for`), with the launcher's settings (torchrun's none,
    an accelerate config's environment) on the processes the command names."""
    from tiny_runs import accelerate_env

    from jagg.infra.launch import LaunchSettings, read_launch
    from jagg.trainers.diffusers_trainer import engine_for
    from jagg.trainers.diffusers_config import has_pipeline_section, load_config

    argv = cmd.argv
    if argv[0] not in ("torchrun", "accelerate") or ns.command != "train" or not has_pipeline_section(ns.config):
        return
    launcher = argv[2:argv.index("-m")] if argv[0] == "accelerate" else argv[1:argv.index("-m")]
    world = int(launcher[launcher.index("--nproc_per_node") + 1]) if "--nproc_per_node" in launcher else 8
    launch = read_launch(accelerate_env(*launcher[1:])) if argv[0] == "accelerate" else LaunchSettings()
    engine_for(load_config(ns.config, ns.set or []), launch, world)


def _skip_reason(cmd: Command) -> str | None:
    text = " ".join(cmd.argv)
    for pattern, reason in SKIP:
        if re.search(pattern, text):
            return reason
    return None


def _run(cmd: Command, kind: str, args: list[str], scratch: Path, capsys) -> float:
    """Run the command as written (one torch thread); returns its seconds."""
    t0 = time.perf_counter()
    if kind == "jagg":
        extra = ["--set", "threads=1"] if args[:1] in (["train"], ["pretrain"]) or args[:2] in (
            ["bench", "meter"], ["bench", "speed"]) else []
        if "--help" in args or "-h" in args:
            with pytest.raises(SystemExit) as exc:
                main(args)
            assert exc.value.code == 0
        else:
            assert main(args + extra) == 0, capsys.readouterr().err
    else:
        proc = subprocess.run([sys.executable, *args[1:]] if args[0] in ("python", "python3") else args,
                              cwd=scratch, capture_output=True, text=True, timeout=4 * RUN_LIMIT_S)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return time.perf_counter() - t0


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where}:{' '.join(c.argv)[:60]}" for c in COMMANDS])
def test_documented_command(cmd: Command, scratch, monkeypatch, capsys):
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)     # the docs' log.wandb commands assume a `wandb login`ed user,
    if importlib.util.find_spec("wandb") is None:      # and the extra installed: --print-config checks both
        import fake_wandb

        fake_wandb.install(monkeypatch)
    try:
        kind, args, ns = _parse(cmd)
    except AssertionError as e:
        pytest.fail(f"{cmd}\n  does not parse: {e}")
    if ns is None or kind == "make" or cmd.elided or cmd.synopsis:
        return                                                       # --help parsed and printed, or parse only
    if not cmd.fenced:                                               # a mention: its --help / --print-config run
        if kind == "jagg" and any(a in ("--help", "-h", "--print-config", "--help-config") for a in args):
            _run(cmd, kind, args, scratch, capsys)
        return
    if kind == "jagg":
        _load(cmd, args, ns, scratch, capsys)
        _check_launched(cmd, ns)
    if _skip_reason(cmd):
        return
    seconds = _run(cmd, kind, args if kind == "jagg" else cmd.argv, scratch, capsys)
    # a guard against documenting minutes-long commands here, not a timing test: 3x the limit leaves room for a busy
    # machine (the suite runs on 2 shared cores)
    assert seconds < 3 * RUN_LIMIT_S, (f"{cmd}\n  took {seconds:.1f} s: add it to SKIP in {Path(__file__).name} with "
                                       "the reason, or make it faster")


# ---------------------------------------------------------------------------------------------- the finder itself


def test_the_finder_sees_the_commands_of_every_kind():
    """The docs show commands of every kind the finder knows; if one kind vanished, the finder broke."""
    kinds = {c.argv[0] for c in COMMANDS}
    assert {"jagg", "python", "make", "torchrun"} <= kinds
    texts = {" ".join(c.argv) for c in COMMANDS}
    assert "make train" in texts and "make test" in texts                     # README's two commands
    assert "jagg train --help" in texts and any(t.startswith("jagg bench meter --quick") for t in texts)
    assert any(c.fenced for c in COMMANDS) and any(not c.fenced for c in COMMANDS)
    assert sum(c.argv[:2] == ["jagg", "bench"] for c in COMMANDS) > 5
    assert any(c.argv[:3] == ["python", "-m", "lab"] for c in COMMANDS)
    for phrase in NOT_COMMANDS:                                            # each exception still refers to the docs
        assert any(f"`{phrase}`" in " ".join(d.read_text().split()) for d in DOCS), phrase


def test_the_finder_follows_the_shell_syntax_the_docs_use():
    cmds = []
    for tokens in _segments('V="--variant exact"', (v := {})):
        cmds.append(tokens)
    assert not cmds and v == {"V": "--variant exact"}
    seg = _segments("for P in 0 0.5; do python -m lab signal --set estimator.correction_p=$P $V; done", v)
    assert seg == [["python", "-m", "lab", "signal", "--set", "estimator.correction_p=0", "--variant", "exact"]]
    seg = _segments("python -m lab quality --train-only a & python -m lab quality --train-only b; wait  # both", {})
    assert seg == [["python", "-m", "lab", "quality", "--train-only", "a"],
                   ["python", "-m", "lab", "quality", "--train-only", "b"]]
    assert _segments("JAGG_REWARD_TOKEN=x python -m jagg.rewards.server --port 1", {}) == [
        ["python", "-m", "jagg.rewards.server", "--port", "1"]]
    (c,) = _normalise(["jagg", "train", "[--config", "FILE]", "[--set", "k=v", "...]", "[--resume", "|", "--overwrite]"],
                      "", "x", True)
    assert c.synopsis and c.argv == ["jagg", "train", "--config", "FILE"]
    alts = _normalise(["jagg", "bench", "speed|e2e", "..."], "", "x", True)
    assert [a.argv for a in alts] == [["jagg", "bench", "speed"], ["jagg", "bench", "e2e"]] and alts[0].elided
    (c,) = _normalise(["jagg", "bench", "quality", "--first-seed", "S", "--set", "seed=S"], "", "x", True)
    assert c.argv[4:] == ["0", "--set", "seed=0"]
    with pytest.raises(AssertionError, match="unrecognized arguments: --quikc"):
        _parse(Command("", ["jagg", "bench", "meter", "--quikc"], "x", True))
    with pytest.raises(AssertionError, match="no such make target"):
        _parse(Command("", ["make", "trian"], "x", True))
    with pytest.raises(AssertionError, match="argparse refused it"):
        _parse(Command("", ["python", "-m", "lab", "paired"], "x", True))      # its two checkpoints missing


# ---------------------------------------------------------------------------------------------- what the docs say


def test_the_readme_quickstart_runs(scratch):
    """README: "runnable: `python examples/quickstart.py`" (an inline mention, so the loop above only parses it)."""
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=scratch, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"cosine\(JAGG gradient, exact gradient\) = 0\.9\d", proc.stdout), proc.stdout


def test_every_benchmark_has_quick_and_json():
    """benchmarks.md, `jagg bench --help` and lab/README.md say every benchmark and every lab tool with a result has
    --quick and --json PATH."""
    from lab.__main__ import TOOLS, build_parser as lab_parser

    p = build_parser(["bench"])
    bench = p._subparsers._group_actions[0].choices["bench"]
    subs = dict(bench._subparsers._group_actions[0].choices)
    assert set(subs) == {"meter", "speed"}
    lab = lab_parser()._subparsers._group_actions[0].choices
    subs.update({f"lab {name}": lab[name] for name in TOOLS if name != "paired"})     # paired: two checkpoints
    for name, sp in subs.items():
        opts = {o for a in sp._actions for o in a.option_strings}
        assert {"--quick", "--json"} <= opts, name


def test_the_pipeline_key_list_names_every_key():
    """real_models.md's `pipeline:` row lists every PipelineConfig key (vae_dtype and max_sequence_length were
    missing)."""
    from jagg.integrations.config import PipelineConfig

    row = next(l for l in (REPO / "docs" / "real_models.md").read_text().splitlines() if l.startswith("| `pipeline:`"))
    missing = [f.name for f in fields(PipelineConfig) if f"`{f.name}" not in row]
    assert not missing, missing


def test_the_main_jobs_settings_table_matches_the_main_job():
    """usage.md's table of the main job's settings: each single-key row's value is the main job's."""
    from jagg.trainers.shapes_config import ShapesTrainConfig, main_job_path
    from jagg.infra import config_loader as configuration
    from jagg.cli import _value

    job = configuration.load(ShapesTrainConfig, main_job_path())
    text = (REPO / "docs" / "usage.md").read_text().split("**Its settings**", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([\w.]+)` \| `?([^|`]+?)`? \|", text.replace("\\|", "|"), re.M)
    checked = 0
    for key, shown in rows:
        if "." in key and re.fullmatch(r"[\w.]+", key):
            value, shown = _value(job, key), shown.strip()
            if isinstance(value, float):
                assert float(shown) == value, (key, shown, value)
            else:
                assert str(value).replace(" ", "") == shown.replace(" ", "").replace("true", "True"), (key, shown, value)
            checked += 1
    assert checked >= 4
