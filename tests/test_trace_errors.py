"""Models that do not trace fail with one line naming the module, the source line and the fix."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hetpar.planner.capture import trace_model
from hetpar.runtime.graph import TraceError, trace_layers
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
TORCH_ZOO = ROOT / "tests" / "models" / "torch_zoo.py"
BRANCH_LINE = next(i for i, line in enumerate(TORCH_ZOO.read_text().splitlines(), 1) if "if x.mean() > 0:" in line)


def test_data_dependent_branch_names_module_and_line_and_says_why():
    with pytest.raises(TraceError) as info:
        trace_model(load_model_file(TORCH_ZOO, {"kind": "data_branch"}))
    message = str(info.value)
    assert "\n" not in message
    assert "blocks.0" in message and f"torch_zoo.py:{BRANCH_LINE}" in message
    assert "torch.fx failed" in message and "torch.export failed" in message
    assert "branches on tensor values" in message and "--leaf-module" in message


def test_leaf_module_that_reads_values_fails_on_meta_with_one_line():
    leaves = ("blocks.0", "blocks.1", "blocks.2")
    with pytest.raises(TraceError) as info:
        trace_model(load_model_file(TORCH_ZOO, {"kind": "data_branch"}), leaves)
    message = str(info.value)
    assert "\n" not in message
    assert "meta device" in message and "blocks.0" in message and f"torch_zoo.py:{BRANCH_LINE}" in message


def test_fx_only_failure_suggests_leaf_module():
    model = load_model_file(TORCH_ZOO, {"kind": "shape_branch"}).build_model()
    with pytest.raises(TraceError) as info:
        trace_layers(model)  # no example inputs: torch.fx only, as the runtime traces
    message = str(info.value)
    assert "torch.fx failed in blocks.0 at torch_zoo.py:" in message
    assert "--leaf-module blocks.0" in message


def test_leaf_modules_make_fx_work_and_agree_with_export():
    mf = load_model_file(TORCH_ZOO, {"kind": "shape_branch"})
    exported = trace_model(mf)
    leafed = trace_model(mf, ("blocks.0", "blocks.1", "blocks.2"))
    assert exported.capture == "export" and leafed.capture == "fx"
    assert leafed.layer_names == exported.layer_names
    for a, b in zip(leafed.layers, exported.layers):
        assert a.params == b.params
        assert a.fwd_flops == b.fwd_flops and a.bwd_flops == b.bwd_flops
        assert a.saved_activation_bytes == pytest.approx(b.saved_activation_bytes, rel=0.05)


def test_unknown_leaf_module_is_named():
    model = load_model_file(TORCH_ZOO, {"kind": "mha"}).build_model()
    with pytest.raises(TraceError, match="--leaf-module 'blocks.9' is not a module of Tokens"):
        trace_layers(model, ("blocks.9",))


def test_cli_prints_one_line_and_exits_1(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hetpar", "trace", str(TORCH_ZOO), "--model-arg", "kind=data_branch"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hetpar: error: cannot trace Tokens"), result.stderr
    assert "Traceback" not in result.stderr and "def forward" not in result.stderr


class NoExport(nn.Module):
    """Returns a plain object, which torch.export rejects; torch.fx fails on the loop."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        for row in x:  # iterating a proxy
            x = x + row
        return {"out": self.lin(x), "tag": object()}


def test_both_failures_are_reported_when_neither_tracer_works_export_first():
    with pytest.raises(TraceError) as info:
        trace_layers(NoExport(), example_inputs=(torch.randn(2, 4),))
    message = str(info.value)
    # the cause first: what torch.export could not return
    assert message.startswith("cannot trace NoExport: forward's output holds a value of type object, "
                              "which torch.export cannot return")
    assert message.index("torch.export failed") < message.index("torch.fx failed") and "\n" not in message


class ShapeBranchNoExport(nn.Module):
    """torch.fx fails on the branch on a shape; torch.export on the numpy round trip."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 1:
            x = torch.from_numpy(x.numpy())
        return self.inner(x)


def test_export_failure_comes_before_the_fx_one():
    with pytest.raises(TraceError) as info:
        trace_layers(ShapeBranchNoExport(), example_inputs=(torch.randn(2, 4),))
    message = str(info.value)
    assert message.startswith("cannot trace ShapeBranchNoExport: torch.export failed"), message
    assert "test_trace_errors.py" in message and "; torch.fx failed" in message and "\n" not in message


def test_a_returned_kv_cache_is_named_with_its_fix():
    tf = pytest.importorskip("transformers")
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, use_cache=True))
    with pytest.raises(TraceError) as info:  # built outside a model file, so nobody turned the cache off
        trace_layers(model, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    message = str(info.value)
    assert message.startswith("cannot trace GPT2LMHeadModel: forward's output holds a value of type DynamicCache")
    assert "use_cache=False" in message.split(";")[0] and "--leaf-module" not in message
