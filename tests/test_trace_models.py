"""Every model family traces on the meta device, groups into its blocks, and gets a plan."""

from pathlib import Path

import pytest
import torch

from cli_helpers import hetpar
from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.capture import trace_model
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import search
from hetpar.runtime import model_file as model_file_module
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
TORCH_ZOO = ROOT / "tests" / "models" / "torch_zoo.py"
HF_ZOO = ROOT / "tests" / "models" / "hf_zoo.py"
GPT = ROOT / "examples" / "gpt.py"


def plan_for(graph):
    return search(graph, parse_cluster("1x2xcpu"), SearchOptions(global_batch_size=4, dtype="fp32", time_limit_s=10))


def assert_traces_and_plans(path, args, layer_names, capture):
    mf = load_model_file(path, args)
    graph = trace_model(mf)
    assert graph.capture == capture
    assert graph.layer_names == layer_names
    assert graph.total_params == sum(p.numel() for p in mf.build_model().parameters())
    assert all(l.fwd_flops >= 0 and l.saved_activation_bytes >= 0 for l in graph.layers)
    assert all(l.boundary_bytes > 0 for l in graph.layers[:-1]), "every cut carries the activations"
    plan = plan_for(graph)
    covered = [l for stage in plan.stages for l in stage.layers]
    assert covered == list(range(len(layer_names)))
    return graph


TORCH_CASES = {
    # blocks in an nn.Sequential: the children of the repeated class
    "sequential": (["0", "1", "2", "3", "4"], "fx"),
    # blocks in an nn.ModuleDict, iterated with .values()
    "moduledict": (["embed", "blocks.b0", "blocks.b1", "blocks.b2", "norm+head"], "fx"),
    # nn.MultiheadAttention stays one call (torch.fx keeps torch.nn modules opaque)
    "mha": (["embed", "blocks.0", "blocks.1", "blocks.2", "norm+head"], "fx"),
    # two ModuleLists; scaled_dot_product_attention; iterating chunk() defeats torch.fx
    "encdec": (["embed", "encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "decoder.2", "head"], "export"),
    # a branch on a shape: torch.fx fails, torch.export follows it
    "shape_branch": (["embed", "blocks.0", "blocks.1", "blocks.2", "norm+head"], "export"),
}


@pytest.mark.parametrize("kind", sorted(TORCH_CASES))
def test_plain_torch_models_trace_and_plan(kind):
    names, capture = TORCH_CASES[kind]
    assert_traces_and_plans(TORCH_ZOO, {"kind": kind}, names, capture)


def test_gpt_example_with_sdpa_traces_with_fx_and_plans():
    assert_traces_and_plans(GPT, {"n_layers": 2}, ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+lm_head"], "fx")


HF_CASES = {
    "gpt2": ["transformer.wte+transformer.wpe+transformer.drop", "transformer.h.0", "transformer.h.1", "transformer.ln_f+lm_head"],
    "llama": ["model.embed_tokens+model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm+lm_head"],
    "mistral": ["model.embed_tokens+model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm+lm_head"],
    "qwen2": ["model.embed_tokens+model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm+lm_head"],
    "bert": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
    # encoder and decoder blocks are both layers; between them, the encoder's final
    # norm and the decoder's embedding ride with the last encoder block
    "t5": ["encoder.embed_tokens+encoder.dropout", "encoder.block.0", "encoder.block.1", "decoder.block.0",
           "decoder.block.1", "decoder.final_layer_norm+decoder.dropout+lm_head"],
    "vit": ["vit.embeddings", "vit.layers.0", "vit.layers.1", "vit.layernorm+classifier"],
    # the four stages of the encoder are the blocks
    "resnet": ["resnet.embedder", "resnet.encoder.stages.0", "resnet.encoder.stages.1", "resnet.encoder.stages.2",
               "resnet.encoder.stages.3", "resnet.pooler+classifier"],
}


@pytest.mark.parametrize("kind", sorted(HF_CASES))
def test_transformers_models_trace_with_export_and_plan(kind):
    pytest.importorskip("transformers")
    graph = assert_traces_and_plans(HF_ZOO, {"kind": kind}, HF_CASES[kind], "export")
    # blocks of one structure are measured once (T5's first blocks carry the relative
    # position bias, its last encoder block the decoder's embedding; ResNet's stages differ)
    assert graph.measured_layers < len(graph.layers) or kind in ("resnet", "t5")


def test_tied_embeddings_are_counted_once_and_flagged():
    pytest.importorskip("transformers")
    graph = trace_model(load_model_file(HF_ZOO, {"kind": "gpt2"}))
    head = graph.layers[-1]
    assert head.tied_params == 128 * 64  # lm_head.weight is transformer.wte.weight
    assert graph.layers[0].tied_params == 0


def test_resnet_stage_boundaries_are_feature_maps():
    pytest.importorskip("transformers")
    graph = trace_model(load_model_file(HF_ZOO, {"kind": "resnet"}))
    shapes = [[t.shape for t in b] for b in graph.boundaries]
    assert shapes[1:5] == [[(1, 16, 16, 16)], [(1, 32, 8, 8)], [(1, 64, 4, 4)], [(1, 128, 2, 2)]]
    assert torch.Size(shapes[0][0]) == torch.Size((1, 16, 16, 16))


# Causal LMs as users write them: default configs (use_cache True), only sizes shrunk.
HF_DEFAULT_CONFIGS = """
import torch
import transformers as tf


def build_model(kind="llama"):
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128))


def example_inputs(batch_size, **_):
    return (torch.randint(0, 128, (batch_size, 16)),)
"""
NO_CACHE_LINE = "config.use_cache set to False (training keeps no KV cache)"


@pytest.mark.parametrize("kind,model_class", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_default_config_causal_lms_trace_and_plan_without_kv_cache(tmp_path, capfd, monkeypatch, kind, model_class):
    pytest.importorskip("transformers")
    monkeypatch.setattr(model_file_module, "_SAID_NO_CACHE", set())  # as in a fresh process
    path = tmp_path / "hf_default.py"
    path.write_text(HF_DEFAULT_CONFIGS)
    assert load_model_file(path, {"kind": kind}).build_model().config.use_cache is False
    plan = plan_model(path, parse_cluster("1x2xcpu"), SearchOptions(global_batch_size=4, dtype="fp32", time_limit_s=10),
                      model_args={"kind": kind})
    assert [l for s in plan.stages for l in s.layers] == list(range(4))
    said = [line for line in capfd.readouterr().err.splitlines() if NO_CACHE_LINE in line]
    assert said == [f"hetpar: {model_class}: {NO_CACHE_LINE}"]  # once per process, however often it is built

    result = hetpar("trace", str(path), "--model-arg", f"kind={kind}", "--json")
    assert result.returncode == 0, result.stderr
    assert '"capture": "export"' in result.stdout
    assert result.stderr.count(NO_CACHE_LINE) == 1
