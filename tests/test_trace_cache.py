"""The trace cache ([Note: the trace cache] in hetpar/planner/trace_cache.py): a model is
traced once and planned again from disk, until something it was made from changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from hetpar.planner import trace_cache
from hetpar.planner.trace_cache import traced_model

MODEL = """
import json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.nn as nn
from {helper} import WIDTH


def build_model(depth=2, config=None):
    width = WIDTH if config is None else json.load(open(config))["width"]
    return nn.Sequential(nn.Linear(8, width), *[nn.Linear(width, width) for _ in range(depth)], nn.Linear(width, 2))


def example_inputs(batch_size, **_):
    return (torch.randn(batch_size, 8),)
"""


@pytest.fixture
def model(tmp_path, request):
    """A model file importing its width from a module beside it (named per test: the
    import system keeps a module once loaded)."""
    helper = "widths_" + request.node.name.replace("[", "_").replace("]", "_").replace("-", "_")
    (tmp_path / f"{helper}.py").write_text("WIDTH = 16\n")
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(helper=helper))
    yield path, tmp_path / f"{helper}.py"
    sys.modules.pop(helper, None)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(trace_cache.ENVIRONMENT, str(directory))
    return directory


def params(graph) -> int:
    return sum(layer.params for layer in graph.layers)


def test_a_second_trace_of_the_same_model_comes_from_the_cache_and_equals_the_first(model, cache):
    path, _ = model
    first = traced_model(path, {"depth": 2})
    second = traced_model(path, {"depth": 2})
    assert (first.cached, second.cached) == (False, True)
    assert second.graph == first.graph
    assert oct(cache.stat().st_mode & 0o777) == "0o700"


def test_other_arguments_or_leaf_modules_are_other_entries(model, cache):
    path, _ = model
    two = traced_model(path, {"depth": 2}).graph
    three = traced_model(path, {"depth": 3})
    assert not three.cached and params(three.graph) == params(two) + 16 * 16 + 16
    assert not traced_model(path, {"depth": 2}, ("1",)).cached
    assert traced_model(path, {"depth": 3}).cached


def test_an_edited_model_file_misses(model, cache):
    path, _ = model
    traced_model(path, {})
    path.write_text(path.read_text() + "\n# edited\n")
    assert not traced_model(path, {}).cached


def test_an_edited_module_the_model_imports_misses(model, cache):
    path, helper = model
    traced_model(path, {})
    helper.write_text("WIDTH = 32\n")
    assert not traced_model(path, {}).cached


def test_an_edited_file_an_argument_names_misses(model, cache, tmp_path):
    path, _ = model
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"width": 24}))
    before = traced_model(path, {"config": str(config)})
    config.write_text(json.dumps({"width": 40}))
    after = traced_model(path, {"config": str(config)})
    assert not after.cached and params(after.graph) > params(before.graph)


def test_a_refresh_traces_again_and_keeps_what_it_traced(model, cache):
    path, _ = model
    traced_model(path, {})
    again = traced_model(path, {}, refresh=True)
    assert not again.cached
    assert traced_model(path, {}).cached


def test_off_writes_nothing(model, tmp_path, monkeypatch):
    path, _ = model
    monkeypatch.setenv(trace_cache.ENVIRONMENT, "off")
    assert trace_cache.cache_dir() is None
    assert not traced_model(path, {}).cached and not traced_model(path, {}).cached


def test_a_damaged_entry_is_traced_again_and_replaced(model, cache):
    path, _ = model
    first = traced_model(path, {})
    (entry,) = cache.glob("*.pickle")
    entry.write_bytes(b"not a pickle")
    again = traced_model(path, {})
    assert not again.cached and again.graph == first.graph
    assert traced_model(path, {}).cached


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_a_directory_others_may_write_is_not_read(model, cache):
    path, _ = model
    traced_model(path, {})
    cache.chmod(0o777)
    assert not traced_model(path, {}).cached
    cache.chmod(0o700)
    assert traced_model(path, {}).cached


def test_the_least_recently_used_entries_go_past_the_limit(model, cache, monkeypatch):
    path, _ = model
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 2)
    for depth in (1, 2, 3):
        traced_model(path, {"depth": depth})
    assert len(list(cache.glob("*.pickle"))) == 2
    assert not traced_model(path, {"depth": 1}).cached  # dropped
    assert traced_model(path, {"depth": 3}).cached


def test_plan_from_the_cache_imports_no_torch_and_writes_the_same_plan(model, tmp_path):
    """Through the CLI: the second `hetpar plan` says where its trace came from, plans
    the same, and never imports torch."""
    path, _ = model
    env = {**os.environ, trace_cache.ENVIRONMENT: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom hetpar.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    plans = []
    for run in range(2):
        out = tmp_path / f"plan{run}.json"
        done = subprocess.run([sys.executable, "-c", code, "plan", str(path), "-c", "1x2xcpu", "-b", "8", "-o", str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        plans.append(json.loads(out.read_text()))
        said = done.stdout + done.stderr  # the report goes to stderr, rich wrapping its lines
        assert bool(re.search(r"trace\s+cached", said)) == (run == 1), said
        assert f"torch imported: {run == 0}" in done.stdout
    first, second = ({k: v for k, v in p.items() if k != "solver"} for p in plans)
    assert first == second
    assert plans[1]["solver"]["trace_cached"] and not plans[0]["solver"]["trace_cached"]
