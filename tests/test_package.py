"""The package's shape: `import jagg` is the estimator core only, and the docs link nowhere outside the repository."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "jagg"
# the estimator core: the top-level modules and the checks every layer shares (cli is the entry point, not core)
CORE = {p.stem for p in PKG.glob("*.py")} - {"__init__", "cli"} | {"checks"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``jagg`` (or ``lab``) modules that ``path`` imports, absolute names, relative imports resolved."""
    import ast

    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else [])
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}      # `from . import x` imports module x
    ancestors = {".".join(here[:i]) for i in range(1, len(here))}   # loaded before the module anyway
    return {m for m in out if m.split(".")[0] in ("jagg", "lab") and m not in ancestors}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_import_jagg_loads_only_the_core():
    code = ("import sys, jagg; print(' '.join(sorted(m for m in sys.modules if m == 'jagg' or m.startswith('jagg.')))); "
            "print(' '.join(m for m in ('diffusers', 'transformers', 'peft', 'yaml', 'matplotlib', 'PIL') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    loaded = {m.removeprefix("jagg.").split(".")[0] for m in out[0].split()} - {"jagg"}
    assert loaded, "import jagg loaded no submodule: the public API is empty"
    assert loaded <= CORE, f"import jagg loads more than the core: {sorted(loaded - CORE)}"
    assert "estimator" in loaded and "knots" in loaded
    assert out[1].strip() == "", f"import jagg pulls in heavy dependencies: {out[1]}"


def test_the_package_imports_have_no_circle():
    """Module by module (package faces included), the imports inside src/jagg form no loop: every module can be read
    knowing only what it imports."""
    graph, state, stack = _graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_core_imports_no_trainer_model_reward_or_tool():
    """The estimator core (jagg/*.py and jagg.checks) imports none of the layers built on it: trainers, model
    families (integrations, the shapes world), rewards, run infrastructure, the benches, the CLI."""
    upper = ("jagg.trainers", "jagg.integrations", "jagg.shapes", "jagg.rewards", "jagg.infra", "jagg.bench",
             "jagg.cli", "jagg.arguments")
    offenders = [f"{m} -> {n}" for m, targets in _graph().items() if m.split(".")[1:2] and m.split(".")[1] in CORE
                 and m != "jagg.arguments" for n in targets if n.startswith(upper)]
    assert not offenders, offenders


@pytest.mark.parametrize("layer,above", [
    ("infra", ("trainers", "bench", "integrations", "shapes")),
    ("rewards", ("trainers", "bench", "integrations", "shapes", "infra")),
    ("integrations", ("trainers", "bench", "shapes")),
    ("shapes", ("trainers", "bench", "integrations")),
    ("trainers", ("bench",)),
])
def test_each_layer_imports_only_the_layers_below(layer, above):
    """The layers of docs/architecture.md, bottom up: core, infra, rewards, the model families (integrations, shapes),
    trainers, benches, the command line. A layer imports none of the ones above it (nor its sibling family)."""
    forbidden = tuple(f"jagg.{a}" for a in above) + ("jagg.cli", "jagg.arguments")
    offenders = [f"{m} -> {n}" for m, targets in _graph().items() if m.startswith(f"jagg.{layer}")
                 for n in targets if n.startswith(forbidden)]
    assert not offenders, offenders


def test_the_loop_stands_below_the_two_trainers():
    """Inside jagg.trainers the rooms both trainers share stand below them: the loop (loop), the data it passes along
    (rollout) and the resume checks (resume) import neither trainer, nor a trainer's config, auto or the side-by-side
    measurement; rollout and resume import no other room of the loop."""
    graph = _graph()
    trainers = tuple(f"jagg.trainers.{m}" for m in ("shapes_trainer", "shapes_config", "diffusers_trainer",
                                                    "diffusers_config", "auto", "side_by_side"))
    below = {"jagg.trainers.loop": trainers,
             "jagg.trainers.rollout": trainers + ("jagg.trainers.loop", "jagg.trainers.resume"),
             "jagg.trainers.resume": trainers + ("jagg.trainers.loop", "jagg.trainers.rollout")}
    assert set(below) <= set(graph), sorted(set(below) - set(graph))
    offenders = [f"{m} -> {n}" for m, forbidden in below.items() for n in graph[m] if n.startswith(forbidden)]
    assert not offenders, offenders
    assert "jagg.trainers.rollout" in graph["jagg.trainers.loop"]            # the rule sees the imports


def test_nothing_in_the_package_imports_the_cli_or_the_lab():
    """`jagg.cli` is the entry point only (the shared arguments live in jagg.arguments), and the lab (lab/, not
    installed) imports the package, never the reverse."""
    offenders = [f"{m} -> {n}" for m, targets in ((_module_name(p), _imports(p)) for p in PKG.rglob("*.py"))
                 for n in targets if n == "jagg.cli" or n.split(".")[0] == "lab"]
    assert not offenders, offenders


def test_the_lab_is_not_installed():
    """`pip install .` installs the package under src/ only: the lab (lab/, run as `python -m lab` from the checkout)
    is no package of the distribution, and `jagg --help` offers none of its tools."""
    import tomllib

    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = find_packages(where=str(ROOT / found["where"][0]))
    assert installed and all(p == "jagg" or p.startswith("jagg.") for p in installed), installed
    from jagg.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    bench = commands["bench"]._subparsers._group_actions[0].choices
    assert set(commands) == {"train", "pretrain", "sample", "eval", "bench"} and set(bench) == {"meter", "speed"}


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
