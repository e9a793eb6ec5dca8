"""The layers of docs/architecture.md hold: who may import whom, only public names across a
boundary, and no import cycle, counting every import: top-level, inside functions and under
``if TYPE_CHECKING:`` (an annotation-only import still ties two modules together)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hetpar"
# A top-level part of hetpar: a package, the vocabulary leaf, or the command line ("cli":
# hetpar/__init__.py, __main__.py, cli.py and commands/).
PARTS = ("cost_models", "runtime", "profiler", "planner", "rewriters", "vocabulary", "models", "cli")
ALLOWED = {  # what each part may import of ours
    "vocabulary": set(),
    "models": set(),  # the model files hetpar ships: user code, written against torch and transformers alone
    "cost_models": {"vocabulary"},
    "runtime": {"vocabulary"},  # a generated program needs only torch, runtime and the model file
    "profiler": {"runtime", "vocabulary"},  # hetpar profile's benchmarks run the program's runtime, never the cost models
    "planner": {"cost_models", "runtime", "vocabulary"},  # the planned layers are the layers the program builds
    "rewriters": {"planner", "vocabulary"},  # the ParallelPlan only (test_rewriters_read_only_the_plan)
    "cli": set(PARTS),
}


def module_name(path: Path) -> str:
    parts = ("hetpar", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {module_name(p) for p in PACKAGE.rglob("__init__.py")}


def part_of(module: str) -> str:
    second = module.split(".")[1] if "." in module else ""
    return second if second in PARTS and second != "cli" else "cli"


def imports(path: Path) -> list[tuple[str, str, int]]:
    """(module imported, name taken from it or "", line) for each import of ours in ``path``,
    wherever it stands; ``from a import b`` names module ``a.b`` when that is a module of ours."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "hetpar"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "hetpar":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (node.module, a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(("<relative>", "", node.lineno))
    return found


def edges() -> list[tuple[str, str, str, int]]:
    """(importer, imported module, name, line) over the whole package."""
    return [(name, module, taken, line) for name, path in MODULES.items() for module, taken, line in imports(path)]


def test_no_relative_imports():
    assert not [f"{a}:{line}" for a, b, _, line in edges() if b == "<relative>"]


@pytest.mark.parametrize("part", PARTS)
def test_imports_follow_the_layers(part):
    violations = [f"{a}:{line} imports {b}" for a, b, _, line in edges()
                  if part_of(a) == part and b != "<relative>" and part_of(b) not in ALLOWED[part] | {part}]
    assert not violations, "\n".join(violations)


def test_rewriters_read_only_the_plan():
    bad = [f"{a}:{line} imports {b}.{n}" for a, b, n, line in edges()
           if part_of(a) == "rewriters" and part_of(b) == "planner" and b not in ("hetpar.planner", "hetpar.planner.plan")]
    assert not bad, "\n".join(bad)


def boundary(module: str) -> str:
    """The unit whose public face ``module`` sits behind: for the planner its sub-package
    (``hetpar.planner.search``) or the planner itself for its top modules; else the part."""
    parts = module.split(".")
    if part_of(module) == "planner" and len(parts) > 3 and ".".join(parts[:3]) in PACKAGES:
        return ".".join(parts[:3])
    if part_of(module) == "planner":
        return "hetpar.planner" if module not in PACKAGES or module == "hetpar.planner" else module
    return ".".join(parts[:2])


def test_only_public_names_cross_a_boundary():
    """Across parts and between the planner's sub-packages, an import names a sub-package's
    ``__init__`` (its contract) or a leaf module, and never a name that starts with ``_``."""
    bad = []
    for a, b, name, line in edges():
        if b == "<relative>" or boundary(a) == boundary(b):
            continue
        if name.startswith("_") and not name.startswith("__"):
            bad.append(f"{a}:{line} takes private {b}.{name}")
        deep = part_of(b) == "planner" and b not in PACKAGES and boundary(b) != "hetpar.planner"
        if deep:
            bad.append(f"{a}:{line} reaches inside {boundary(b)} for {b} (import it from {boundary(b)})")
    assert not bad, "\n".join(bad)


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (node -> nodes it imports) as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every node below it is

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for other in sorted(graph.get(node, ())):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other, path + [other])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycle_between_modules():
    """Shared types live in a leaf module and a package's top module composes: no module
    imports, even inside a function or for type checking, a module that imports it back.
    A package's ``__init__`` that re-exports its modules is the one edge allowed back up."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges():
        if b in MODULES and a != b and not (a in PACKAGES and b.startswith(a + ".")):
            graph.setdefault(a, set()).add(b)
    cycle = import_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_planners_sub_packages_form_a_dag():
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges():
        if part_of(a) == part_of(b) == "planner" and boundary(a) != boundary(b):
            graph.setdefault(boundary(a), set()).add(boundary(b))
    graph.get("hetpar.planner", set()).clear()  # the planner's top modules compose the sub-packages
    cycle = import_cycle(graph)
    assert cycle is None, "sub-package cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_and_function_local_imports_are_seen(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hetpar.planner import ModelGraph\n"
                    "def f():\n    from hetpar.runtime import _private\n")
    assert [(b, n) for b, n, _ in imports(path)] == [("hetpar.planner", "ModelGraph"), ("hetpar.runtime", "_private")]


def test_one_top_level_package_installs():
    """What pyproject's package finder installs is hetpar and its sub-packages, and every
    folder of hetpar that holds code is among them (a folder without ``__init__.py`` would
    be left out of an install)."""
    from setuptools import find_packages

    finder = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = set(find_packages(where=str(PACKAGE.parent), include=finder["include"]))
    assert {name.split(".")[0] for name in installed} == {"hetpar"}
    with_code = {".".join(("hetpar", *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("*.py")}
    assert with_code <= installed, f"not installed: {sorted(with_code - installed)}"
