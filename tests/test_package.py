"""The package's shape: `import jagg` is the estimator core only, and the docs link nowhere outside the repository."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = {p.stem for p in (ROOT / "src" / "jagg").glob("*.py")} - {"__init__", "cli"}


def test_import_jagg_loads_only_the_core():
    code = ("import sys, jagg; print(' '.join(sorted(m for m in sys.modules if m == 'jagg' or m.startswith('jagg.')))); "
            "print(' '.join(m for m in ('diffusers', 'transformers', 'peft', 'yaml', 'matplotlib', 'PIL') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    loaded = {m.removeprefix("jagg.") for m in out[0].split()} - {"jagg"}
    assert loaded, "import jagg loaded no submodule: the public API is empty"
    assert loaded <= CORE, f"import jagg loads more than the core: {sorted(loaded - CORE)}"
    assert "estimator" in loaded and "knots" in loaded
    assert out[1].strip() == "", f"import jagg pulls in heavy dependencies: {out[1]}"


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "src" / "jagg").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top


def test_nothing_in_the_package_imports_the_cli():
    """`jagg.cli` is the entry point only: no module of src/jagg imports it (the shared arguments live in
    jagg.arguments), so there is no import circle through the CLI."""
    import ast

    pkg = ROOT / "src" / "jagg"
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        if path == pkg / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{'.' * node.level}{node.module or ''}"] if isinstance(node, ast.ImportFrom) else [])
            dots = len(path.relative_to(pkg).parts)              # the relative prefix that reaches jagg itself
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "jagg.cli" or n == "." * dots + "cli"]
    assert not offenders, offenders


def test_core_functions_are_at_most_sixty_lines():
    """Every function of the top-level modules src/jagg/*.py (methods and __post_init__ included) is <= 60 lines."""
    import ast

    long = sorted(f"{path.name}:{node.name}" for path in (ROOT / "src" / "jagg").glob("*.py")
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > 60)
    assert not long, long


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_doc_links_stay_inside_the_repository(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue                                   # web links and anchors in the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"
