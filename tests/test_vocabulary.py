"""One word per idea (hetpar/vocabulary.py): each name is defined there once, no other module
spells one of its values as a string literal, and the command line offers exactly its values."""

from __future__ import annotations

import ast
import enum
import inspect
import re
import typing
from pathlib import Path

import pytest
import typer

from hetpar import vocabulary
from hetpar.cli import app

PACKAGE = Path(__file__).resolve().parent.parent / "hetpar"
VOCABULARY = [v for v in vars(vocabulary).values() if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == vocabulary.__name__]
STRING_VALUES = {m.value for e in VOCABULARY for m in e if isinstance(m.value, str)}
# Values that are also plain English or mean something else elsewhere ("none" as a collective
# algorithm, reduction="mean", a "node" of a graph): a literal of one of these is flagged only
# where it is compared with, or is the default of, something named after the idea.
GENERIC = {"none", "full", "mean", "all", "node", "auto", "on", "off", "time", "cost", "energy", "sign", "median"}
IDEA_WORDS = re.compile(r"recompute|compression|aggregation|sync_scope|objective|hetero_dp|compile")


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "vocabulary.py")


def docstring_ids(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def stray_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of each string literal in ``source`` that spells a vocabulary value."""
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    docs |= {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == "__all__" for n in ast.walk(a.value)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in STRING_VALUES - GENERIC:
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = any(IDEA_WORDS.search(ast.unparse(o)) for o in operands)
            for o in operands:
                for c in ast.walk(o):
                    if named and isinstance(c, ast.Constant) and c.value in GENERIC & STRING_VALUES:
                        found.append((c.lineno, c.value))
        elif isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args]
            pairs = [*zip(args[len(args) - len(node.defaults):], node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]
            for arg, default in pairs:
                if IDEA_WORDS.search(arg.arg) and isinstance(default, ast.Constant) and default.value in GENERIC:
                    found.append((default.lineno, default.value))
    return found


def listed_again(values: list, name: type[enum.Enum]) -> bool:
    """Whether a literal collection spells values of ``name``: any strings of a string-valued
    name, or every value of a number-valued one (``(0, 1, 2, 3)`` is ZeroStage)."""
    members = {m.value for m in name}
    if all(isinstance(m, str) for m in members):
        return set(values) <= members
    return set(values) == members


def second_definitions(source: str) -> list[tuple[int, str]]:
    """(line, what) of each Enum class or literal tuple/list/set in ``source`` that lists vocabulary values again."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Enum") for b in node.bases):
            values = {s.value.value for s in node.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)}
            if values & STRING_VALUES:
                found.append((node.lineno, f"enum {node.name}"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) == len(node.elts) and any(listed_again(values, e) for e in VOCABULARY):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_spells_a_vocabulary_value():
    problems = [f"{p.relative_to(PACKAGE.parent)}:{line}: {value!r}" for p in modules() for line, value in stray_literals(p.read_text())]
    assert not problems, "use hetpar.vocabulary instead of:\n" + "\n".join(problems)


def test_no_module_defines_a_vocabulary_item_again():
    problems = [f"{p.relative_to(PACKAGE.parent)}:{line}: {what}" for p in modules() for line, what in second_definitions(p.read_text())]
    assert not problems, "defined in hetpar.vocabulary already:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ('x = "zb"\n', [(1, "zb")]),
    ('if recompute == "full":\n    pass\n', [(1, "full")]),
    ('def f(*, sync_scope="all"):\n    pass\n', [(1, "all")]),
    ('def f():\n    """Runs "zb"."""\n', []),
    ('loss = F.cross_entropy(x, y, reduction="mean")\n', []),
])
def test_the_literal_check_sees_what_it_must(source, expected):
    assert stray_literals(source) == expected


def test_the_definition_check_sees_enums_and_lists():
    source = ('class S(str, Enum):\n    A = "1f1b"\nMODES = ("none", "selective", "full")\nOK = ("a", "b")\n'
              'ZERO = (0, 1, 2, 3)\nSHAPE = (1, 2)\n')
    assert [line for line, _ in second_definitions(source)] == [1, 3, 5]


def test_values_are_unique_within_each_name_and_members_are_their_values():
    for e in VOCABULARY:
        assert len({m.value for m in e}) == len(e), e
        assert all(f"{m}" == str(m.value) for m in e), e


CLI_OPTIONS = {  # (command, parameter) -> the vocabulary name its choices must be
    ("plan", "schedule"): vocabulary.Schedule,
    ("plan", "recompute"): vocabulary.Recompute,
    ("plan", "dtype"): vocabulary.DType,
    ("plan", "objective"): vocabulary.ObjectiveKind,
    ("plan", "hetero_dp"): vocabulary.Switch,
    ("plan", "split_solver"): vocabulary.SplitSolver,
    ("estimate", "schedule"): vocabulary.Schedule,
    ("estimate", "recompute"): vocabulary.Recompute,
    ("estimate", "dtype"): vocabulary.DType,
    ("estimate", "optimizer"): vocabulary.Optimizer,
    ("validate", "compile"): vocabulary.Switch,
}


def enums_in(annotation) -> set[type]:
    """The Enum classes an annotation names (inside Annotated, Optional, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {annotation}
    return {e for arg in typing.get_args(annotation) for e in enums_in(arg)}


@pytest.mark.parametrize("command, parameter", sorted(CLI_OPTIONS))
def test_cli_choices_are_the_vocabulary(command, parameter):
    callback = typer.main.get_command(app).commands[command].callback
    hints = typing.get_type_hints(inspect.unwrap(callback), include_extras=True)
    assert enums_in(hints[parameter]) == {CLI_OPTIONS[command, parameter]}
