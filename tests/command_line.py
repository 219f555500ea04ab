"""How the tests run a command line in this process and check how it ends (``jagg`` and ``python -m lab`` alike): a
refusal is one error line naming its culprit (after argparse's usage lines, for a refused option), never a traceback,
and the same refusal whichever path reaches it (``jagg train --print-config`` and a run)."""

from __future__ import annotations

from pathlib import Path


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run(main, argv: list[str], capsys, prog: str = "jagg") -> tuple[int, str, str]:
    """``main(argv)`` of the command ``prog``: (exit code, its error line, stdout). The error is one line (after
    argparse's usage lines, for a refused option) and never a traceback."""
    try:
        code = main(argv)
    except SystemExit as e:                        # argparse: usage lines, then the error line
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    usage = [l for l in lines[:-1] if l.strip()]
    assert all(l.startswith("usage:") or l.startswith(" ") for l in usage), err   # only argparse's usage before it
    if usage:
        assert code == 2 and lines[-1].startswith(prog + " "), err
    return code, lines[-1] if lines else "", out


def refused(main, argv: list[str], capsys, *culprits: str, code: int = 2, prog: str = "jagg") -> str:
    """``main(argv)`` is refused with ``code`` and one error line naming every one of ``culprits``."""
    got, line, _ = run(main, argv, capsys, prog)
    assert got == code, (argv, line)
    assert (": error: " in line) if code == 2 else True, line
    for c in culprits:
        assert c in line, (c, line)
    return line


def one_line_error(capsys, command: str) -> str:
    """What ``jagg <command>`` just printed to stderr: one line ``jagg <command>: error: ...``, never a traceback."""
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jagg {command}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def train_refused_alike(main, sets: list[str], capsys, tmp_path: Path, *culprits: str) -> str:
    """``jagg train`` with ``--set`` ``sets`` refused the same by ``--print-config`` and by a run into
    ``tmp_path/run`` (which writes nothing): one line naming every one of ``culprits``."""
    argv = ["train", *[a for s in sets for a in ("--set", s)]]
    printed = refused(main, [*argv, "--print-config"], capsys, *culprits)
    out = tmp_path / "run"
    assert refused(main, [*argv, "--output-dir", str(out)], capsys, *culprits) == printed
    assert not out.exists()
    return printed
