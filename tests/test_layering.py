"""The layers of ../shared/DESIGN.md hold: cost_models -> planner -> rewriters; runtime alone; profiler on runtime."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hetpar"
OURS = {"cost_models", "planner", "profiler", "rewriters", "runtime", "hetpar"}
PACKAGES = OURS - {"hetpar"}
# What each package may import of ours. planner reuses runtime's graph capture and
# model-file loading so that planned layers are exactly the layers the program builds.
ALLOWED = {
    "cost_models": set(),
    "runtime": set(),
    "profiler": {"runtime"},  # hetpar profile's benchmarks run the program's runtime, never the cost models
    "planner": {"cost_models", "runtime"},
    "rewriters": {"planner"},
    "hetpar": OURS,
}


def imported_packages(path: Path) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "hetpar":
                top = parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "hetpar"
                found.add((top, ".".join(parts[1:]) if top != "hetpar" else name))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layers(package):
    violations = []
    paths = (ROOT / package).rglob("*.py") if package != "hetpar" else [*ROOT.glob("*.py"), *(ROOT / "commands").rglob("*.py")]
    for path in sorted(paths):
        for top, name in imported_packages(path):
            if top != package and top not in ALLOWED[package]:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "\n".join(violations)


def test_rewriters_read_only_the_plan():
    for path in sorted((ROOT / "rewriters").rglob("*.py")):
        for top, name in imported_packages(path):
            if top == "planner":
                assert name == "planner.plan", f"{path.relative_to(ROOT)} imports {name}"


def package_modules(package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (its ``__init__`` under the package's name)."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py") if package != "hetpar" else ROOT.rglob("*.py")):
        parts = ("hetpar", *path.relative_to(ROOT).with_suffix("").parts) if package != "hetpar" else ("hetpar", *path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere, function-local imports included
    (``from a import b`` names ``a.b`` when that is a module, else ``a``), but for ``if TYPE_CHECKING:``
    blocks: annotations only, never run."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
               for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports) as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every module below it is

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other, path + [other])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


@pytest.mark.parametrize("package", sorted(OURS))
def test_no_import_cycle_inside_a_package(package):
    """Shared types live in a leaf module and the package's top module composes (../shared/DESIGN.md):
    no module imports, even inside a function, a module that imports it back."""
    modules = package_modules(package)
    graph = {name: module_imports(path, modules) - {name} for name, path in modules.items()}
    cycle = import_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_function_local_imports(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py", "c": tmp_path / "c.py"}
    graph = {name: module_imports(path, modules) for name, path in modules.items()}
    assert import_cycle(graph) == ["a", "b", "a"] and graph["c"] == set()


def test_one_list_of_schedule_names():
    """runtime stands alone, so it keeps its own copy of the names; it must be cost_models' list, the plan's enum."""
    from hetpar.cost_models.pipeline import SCHEDULES
    from hetpar.planner.plan import Schedule
    from hetpar.runtime import schedule

    assert schedule.SCHEDULES == SCHEDULES and sorted(s.value for s in Schedule) == sorted(SCHEDULES)
