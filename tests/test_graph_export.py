"""Exported graphs: layers from export's module stack, and stage cuts that run like the model."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hetpar.runtime.capture import export_graph, module_paths
from hetpar.runtime.graph import TraceError, build_stage, record_values, trace_layers
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
TORCH_ZOO = ROOT / "tests" / "models" / "torch_zoo.py"
HF_ZOO = ROOT / "tests" / "models" / "hf_zoo.py"


def chain(lg, values, inputs):
    """Run the model stage by stage (one layer each), handing each stage's outputs on."""
    received = ()
    for i in range(lg.num_layers):
        stage = build_stage(lg, values, i, i)
        received = stage.module(*[inputs[j] for j in stage.model_inputs], *received)
    return received


def test_module_paths_read_fx_and_export_formats():
    fx_style = SimpleNamespace(op="call_function", meta={"nn_module_stack": {"blocks.0": ("blocks.0", "Block"),
                                                                            "blocks.0.attn@1": ("blocks.0.attn", "Attention")}})
    export_style = SimpleNamespace(op="call_function", meta={"nn_module_stack": {
        "L__self__": ("", "GPT"), "L__self__blocks.0": ("blocks.0", "Block"), "L__self__blocks.0.attn": ("blocks.0.attn", "Attention")}})
    old_style = SimpleNamespace(op="call_function", meta={"nn_module_stack": {"blocks.0": "Block", "blocks.0.attn": "Attention"}})
    param = SimpleNamespace(op="get_attr", target="blocks.0.attn.q.weight", meta={})
    for node in (fx_style, export_style, old_style):
        assert module_paths(node) == ["blocks.0", "blocks.0.attn"]
    assert module_paths(param) == ["blocks.0.attn.q"]


def test_export_drops_input_guard_and_metadata_asserts():
    mf = load_model_file(ROOT / "examples" / "gpt.py", {"n_layers": 1})
    gm = export_graph(mf.build_model(), mf.example_inputs(1))
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert not any("_assert" in str(n.target) for n in gm.graph.nodes)


def test_exported_stages_run_like_the_model_on_cpu():
    mf = load_model_file(TORCH_ZOO, {"kind": "shape_branch"})
    torch.manual_seed(0)
    model = mf.build_model()
    inputs = mf.example_inputs(2)
    lg = trace_layers(model, example_inputs=inputs)
    assert lg.capture == "export"
    values = record_values(lg, inputs)
    out = chain(lg, values, inputs)
    torch.testing.assert_close(out, model(*inputs))  # the last stage returns a tensor, as the model does


def test_exported_llama_stages_run_like_the_model_on_cpu():
    pytest.importorskip("transformers")
    mf = load_model_file(HF_ZOO, {"kind": "llama", "n_layers": 3})
    torch.manual_seed(0)
    model = mf.build_model()
    inputs = mf.example_inputs(2)
    lg = trace_layers(model, example_inputs=inputs)
    assert lg.capture == "export" and lg.num_layers == 5
    out = chain(lg, record_values(lg, inputs), inputs)
    whole = model(*inputs)
    assert type(out) is type(whole) and list(out.keys()) == list(whole.keys()) == ["logits"]  # a CausalLMOutputWithPast
    torch.testing.assert_close(out.logits, whole.logits)


def test_exported_graph_refuses_other_shapes():
    mf = load_model_file(TORCH_ZOO, {"kind": "shape_branch"})
    model = mf.build_model()
    lg = trace_layers(model, example_inputs=mf.example_inputs(2))
    with pytest.raises(TraceError, match="exported for inputs shaped"):
        record_values(lg, mf.example_inputs(3))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_module_stage_cut_hands_over_the_hidden_state_only(family):
    """The exported graph passes the causal mask (and rotary tables) from layer to layer;
    the program's module stages send only the hidden state, and so the planner counts
    ([Note: what a module stage sends] in planner/capture/trace.py)."""
    from hetpar.planner.capture import trace_model

    seq = 64
    graph = trace_model(load_model_file(ROOT / "tests/models/hf_default_zoo.py", {"family": family, "seq": seq}))
    assert graph.capture == "export"
    hidden = 32  # the tiny config's width
    for layer, crossing in zip(graph.layers[:-1], graph.boundaries[:-1]):
        assert [tuple(t.shape) for t in crossing] == [(1, seq, hidden)], layer.name  # no [1, 1, T, T] mask
        assert layer.boundary_bytes == seq * hidden * 4
    assert graph.layers[-1].boundary_bytes == 0
