"""The layers of ../shared/DESIGN.md hold: cost_models -> planner -> rewriters; runtime alone; profiler on runtime."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"cost_models", "planner", "profiler", "rewriters", "runtime", "hetpar"}
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
            top = name.split(".")[0]
            if top in OURS:
                found.add((top, name))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layers(package):
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for top, name in imported_packages(path):
            if top != package and top not in ALLOWED[package]:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "\n".join(violations)


def test_rewriters_read_only_the_plan():
    for path in sorted((ROOT / "rewriters").rglob("*.py")):
        for top, name in imported_packages(path):
            if top == "planner":
                assert name == "planner.plan", f"{path.relative_to(ROOT)} imports {name}"
