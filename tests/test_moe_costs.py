"""Mixtures of experts costed right (issue 31): the experts' grouped matmuls counted,
every MoE layer's forward FLOPs equal to the closed form computed from its config, the
experts' share, parameters and routed rows filled in, and data-dependent routing
refused in one line."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hetpar.planner.capture import trace_model
from hetpar.planner.capture.measure import grouped_mm_flops, grouped_mm_rows
from hetpar.runtime.graph import TraceError
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
MOE_GPT = ROOT / "examples" / "moe_gpt.py"
HF_MOE = ROOT / "tests" / "models" / "hf_moe_zoo.py"
LOOP_MOE = ROOT / "tests" / "models" / "loop_moe.py"
FP32 = 4


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- closed forms
# Forward FLOPs of one sample, from the config alone: 2 per multiply-add of every matmul;
# attention's scores and weighted sum: every query against every key (2 T^2 per head and
# dimension of q and of v) where the program hands the kernel the model's mask, only the
# keys up to each query (T (T + 1)) where it runs the kernel causal: the Llama-like
# decoders it runs as module stages ([Note: causal masks], [Note: causal attention
# FLOPs]); norms, rotary embeddings, softmax and routing arithmetic are elementwise,
# counted apart.


def pairs(tokens, causal):
    """(query, key) pairs attention computes."""
    return tokens * (tokens + 1) // 2 if causal else tokens**2


def linear(tokens, fan_in, fan_out):
    return 2 * tokens * fan_in * fan_out


def attention(cfg, tokens, causal=False):
    """Projections and scores of a Llama-style attention (grouped-query heads)."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or hidden // heads
    kv = cfg.num_key_value_heads * head
    projections = linear(tokens, hidden, heads * head) + 2 * linear(tokens, hidden, kv) + linear(tokens, heads * head, hidden)
    return projections + 2 * pairs(tokens, causal) * heads * (head + head)


def deepseek_attention(cfg, tokens, causal=False):
    """Multi-head latent attention: low-rank q and kv, a rotary part shared by the heads."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    projections = (linear(tokens, hidden, cfg.q_lora_rank) + linear(tokens, cfg.q_lora_rank, heads * qk)
                   + linear(tokens, hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                   + linear(tokens, cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
                   + linear(tokens, heads * cfg.v_head_dim, hidden))
    return projections + 2 * pairs(tokens, causal) * heads * (qk + cfg.v_head_dim)


def gated_mlp(tokens, hidden, ffn):
    """gate, up and down projections (SwiGLU)."""
    return 3 * linear(tokens, hidden, ffn)


def experts(tokens, top_k, hidden, ffn):
    """Each token runs top_k experts, each a gated MLP: tokens x top_k rows."""
    return gated_mlp(tokens * top_k, hidden, ffn)


def num_experts(cfg):
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or cfg.n_routed_experts


def runs_causal(family) -> bool:
    """Whether the program runs the family as module stages, its attention causal without
    a mask (runtime.module_stage.decoder_layout finds its layout)."""
    from hetpar.runtime.module_stage import decoder_layout

    with torch.device("meta"):
        return decoder_layout(_load(HF_MOE).build_model(family)) is not None


def moe_layer(family, cfg, tokens):
    """(forward FLOPs of a mixture-of-experts layer, of its experts alone)."""
    hidden, count, top_k = cfg.hidden_size, num_experts(cfg), cfg.num_experts_per_tok
    router = linear(tokens, hidden, count)
    if family == "deepseek_v3":
        routed = experts(tokens, top_k, hidden, cfg.moe_intermediate_size)
        shared = gated_mlp(tokens, hidden, cfg.moe_intermediate_size * cfg.n_shared_experts)
        return deepseek_attention(cfg, tokens) + router + routed + shared, routed
    routed = experts(tokens, top_k, hidden, expert_ffn(cfg, family))
    shared = 0
    if family == "qwen2_moe":  # a shared expert, gated per token by a Linear to one logit
        shared = gated_mlp(tokens, hidden, cfg.shared_expert_intermediate_size) + linear(tokens, hidden, 1)
    return attention(cfg, tokens, runs_causal(family)) + router + routed + shared, routed


def dense_layer(family, cfg, tokens):
    """DeepSeek-V3's first_k_dense_replace layers: its attention and a dense MLP."""
    assert family == "deepseek_v3"
    return deepseek_attention(cfg, tokens) + gated_mlp(tokens, cfg.hidden_size, cfg.intermediate_size)


def expert_ffn(cfg, family):
    """An expert's hidden width: Mixtral's and OLMoE's configs call it intermediate_size."""
    return cfg.intermediate_size if family in ("mixtral", "olmoe") else cfg.moe_intermediate_size


def expert_params(cfg, family):
    ffn = expert_ffn(cfg, family)
    return num_experts(cfg) * 3 * cfg.hidden_size * ffn


# ----------------------------------------------------------------------------- traced models

_GRAPHS: dict = {}


def traced(path: Path, **args):
    key = (path, tuple(sorted(args.items())))
    if key not in _GRAPHS:
        _GRAPHS[key] = trace_model(load_model_file(path, args))
    return _GRAPHS[key]


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_moe_layers_match_the_closed_form(family):
    pytest.importorskip("transformers")
    zoo = _load(HF_MOE)
    cfg, tokens = zoo.config(family), zoo.SEQ
    graph = traced(HF_MOE, family=family)
    blocks = graph.layers[1:-1]
    assert len(blocks) == cfg.num_hidden_layers
    dense = getattr(cfg, "first_k_dense_replace", 0)
    for index, layer in enumerate(blocks):
        if index < dense:
            assert layer.fwd_flops == pytest.approx(dense_layer(family, cfg, tokens), rel=0.01)
            assert (layer.num_experts, layer.expert_params, layer.routed_bytes, layer.expert_flops_fraction) == (0, 0, 0, 0)
            continue
        whole, routed = moe_layer(family, cfg, tokens)
        assert layer.fwd_flops == pytest.approx(whole, rel=0.01)
        assert layer.bwd_flops == pytest.approx(2 * whole, rel=0.01)  # every matmul's two gradients
        # the experts' own share: their forward and backward, 3 x their forward FLOPs
        experts_flops = layer.expert_flops_fraction * (layer.fwd_flops + layer.bwd_flops)
        assert experts_flops == pytest.approx(3 * routed, rel=0.01)
        assert layer.num_experts == num_experts(cfg)
        assert layer.expert_params == expert_params(cfg, family)
        assert layer.routed_bytes == tokens * cfg.num_experts_per_tok * cfg.hidden_size * FP32
    head = graph.layers[-1]
    assert head.fwd_flops == linear(tokens, cfg.hidden_size, cfg.vocab_size)
    assert head.num_experts == 0


def test_batched_mm_experts_cost_the_same_flops_and_save_the_gathered_weights():
    """transformers' batched_mm gathers each row's expert weights and multiplies them
    with bmm: the same FLOPs, counted by torch's own bmm formula; what it saves for the
    backward (the gathered weights among it) equals what a CPU run of the module saves."""
    pytest.importorskip("transformers")
    zoo = _load(HF_MOE)
    cfg, tokens = zoo.config("mixtral"), zoo.SEQ
    grouped = traced(HF_MOE, family="mixtral").layers[1]
    batched = traced(HF_MOE, family="mixtral", experts="batched_mm").layers[1]
    whole, _ = moe_layer("mixtral", cfg, tokens)
    assert batched.fwd_flops == pytest.approx(whole, rel=0.01)
    assert batched.expert_flops_fraction == pytest.approx(grouped.expert_flops_fraction)
    for implementation in ("grouped_mm", "batched_mm"):
        graph = traced(HF_MOE, family="mixtral", **({} if implementation == "grouped_mm" else {"experts": implementation}))
        meta = sum(n.saved_activation_bytes for n in graph.nodes if n.layer == 1 and ".mlp.experts" in n.module)
        model = zoo.build_model("mixtral", experts=implementation)
        cpu = _cpu_saved_bytes(model, model.model.layers[0].mlp.experts, cfg.hidden_size, tokens, cfg.num_experts_per_tok)
        assert meta == pytest.approx(cpu, rel=0.01)
    # what batched_mm saves beyond grouped_mm: each row's gathered gate, up and down weights
    gathered = tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.intermediate_size * FP32
    assert batched.saved_activation_bytes - grouped.saved_activation_bytes == pytest.approx(gathered, rel=0.01)


def _cpu_saved_bytes(model, module, hidden_size: int, tokens: int, top_k: int) -> int:
    """Bytes the module of experts ``module`` of ``model`` saves for backward on a CPU run
    with random routing, each storage once, parameters excluded (as the meta measurement
    counts them; the total does not depend on the routing)."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    index = torch.stack([torch.randperm(module.num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, requires_grad=True)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    sizes: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            sizes.setdefault(storage._cdata, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(hidden, index, weights)
    return sum(sizes.values())


def test_moe_gpt_example_matches_the_closed_form_and_its_experts_save_what_a_cpu_run_saves():
    example = _load(MOE_GPT)
    d = example.DEFAULTS
    tokens, hidden, count, top_k, ffn = d["seq_len"], d["hidden"], d["experts"], d["top_k"], d["ffn"]
    graph = traced(MOE_GPT)
    routed = experts(tokens, top_k, hidden, ffn)
    whole = 4 * linear(tokens, hidden, hidden) + 2 * tokens * (tokens + 1) * hidden + linear(tokens, hidden, count) + routed
    for layer in graph.layers[1:-1]:
        assert layer.fwd_flops == pytest.approx(whole, rel=0.01)
        assert layer.bwd_flops == pytest.approx(2 * whole, rel=0.01)
        assert layer.expert_flops_fraction * (layer.fwd_flops + layer.bwd_flops) == pytest.approx(3 * routed, rel=0.01)
        assert (layer.num_experts, layer.expert_params) == (count, count * 3 * hidden * ffn)
        assert layer.routed_bytes == tokens * top_k * hidden * FP32
        # the experts' grouped matmuls run tokens x top_k / E rows per expert, growing with the batch
        grouped = [(rows, grows) for rows, grows, _, _ in layer.matmul_rows if rows == tokens * top_k // count]
        assert grouped and all(grows for _, grows in grouped)
    node = next(n for n in graph.nodes if n.layer == 1 and n.op.endswith(".experts"))
    model = example.build_model()
    cpu = _cpu_saved_bytes(model, model.blocks[0].moe.experts, hidden, tokens, top_k)
    assert node.saved_activation_bytes == pytest.approx(cpu, rel=0.01)


def test_default_mixtral_8x7b_on_meta():
    """The issue's numbers: Mixtral 8x7B (default config), 4096 tokens: the experts' forward
    2 x 4096 tokens x top-2 x 3 x 4096 x 14336 FLOPs per layer per sample (2.9 TFLOP), the
    whole layer within 1% of the closed form."""
    pytest.importorskip("transformers")
    zoo = _load(HF_MOE)
    cfg, tokens = zoo.config("mixtral", "default"), zoo.DEFAULT_SEQ
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok) == (4096, 14336, 8, 2)
    graph = traced(HF_MOE, family="mixtral", size="default")
    assert len(graph.layers) == 34 and graph.measured_layers == 3
    layer = graph.layers[1]
    whole, routed = moe_layer("mixtral", cfg, tokens)
    assert routed == 2 * 4096 * 2 * 3 * 4096 * 14336
    assert layer.fwd_flops == pytest.approx(whole, rel=0.01)
    assert layer.expert_flops_fraction * (layer.fwd_flops + layer.bwd_flops) == pytest.approx(3 * routed, rel=0.01)
    assert layer.expert_params == 8 * 3 * 4096 * 14336
    assert layer.routed_bytes == 4096 * 2 * 4096 * FP32


# ----------------------------------------------------------------------------- grouped matmuls


def _meta(*shape):
    return torch.empty(shape, device="meta")


@pytest.mark.parametrize("a,b,groups", [  # dimensions of 16 bytes, as the CPU kernel asks
    ((12, 8), (3, 8, 4), 3),  # rows grouped: the experts' forward and their input gradient
    ((3, 8, 8), (8, 12), 3),  # columns of b grouped
    ((8, 12), (12, 4), 3),  # the shared dimension grouped: the experts' weight gradient
    ((3, 8, 8), (3, 8, 4), None),  # a batch of products
])
def test_grouped_mm_flops_equal_the_matmuls_of_its_groups_in_every_layout(a, b, groups):
    """Each layout's FLOPs equal torch's count of the same products done one group at a
    time, and the real CPU kernel agrees with those products."""
    torch.manual_seed(0)
    mat_a, mat_b = torch.randn(a), torch.randn(b)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32) if groups else None
    with FlopCounterMode(display=False) as counter:
        pieces = _group_by_group(mat_a, mat_b, offs)
    stacked = groups is None or (len(a) == 2 and len(b) == 2)  # one product per group, stacked
    expected = torch.stack(pieces) if stacked else torch.cat(pieces, dim=1 if len(a) == 3 else 0)
    torch.testing.assert_close(F.grouped_mm(mat_a, mat_b, offs=offs), expected)
    args = (_meta(*a), _meta(*b), offs)
    assert grouped_mm_flops("aten::_grouped_mm", args) == counter.get_total_flops()


def _group_by_group(a, b, offs):
    if offs is None:
        return [a[g] @ b[g] for g in range(a.shape[0])]
    bounds = [0, *offs.tolist()]
    spans = list(zip(bounds, bounds[1:]))
    if a.dim() == 2 and b.dim() == 3:
        return [a[s:e] @ b[g] for g, (s, e) in enumerate(spans)]
    if a.dim() == 3:
        return [a[g] @ b[:, s:e] for g, (s, e) in enumerate(spans)]
    return [a[:, s:e] @ b[s:e] for s, e in spans]


def test_hugging_face_fallback_ops_count_one_product_forward_and_two_backward():
    s, k, n, e = 10, 8, 6, 4
    forward = grouped_mm_flops("transformers::grouped_mm_fallback", (_meta(s, k), _meta(e, k, n), _meta(e)))
    backward = grouped_mm_flops("transformers::grouped_mm_fallback_backward",
                                (_meta(s, k), _meta(e, k, n), _meta(e), _meta(s, n)))
    assert (forward, backward) == (2 * s * k * n, 4 * s * k * n)
    # a group's rows: S rows over E experts, growing with the batch; width sqrt(K N)
    assert grouped_mm_rows("transformers::grouped_mm_fallback", (_meta(s, k), _meta(e, k, n))) == (
        round(s / e), True, round(math.sqrt(k * n)))


def test_a_dense_model_has_no_experts():
    layer = traced(ROOT / "examples" / "gpt.py", n_layers=1).layers[1]
    assert (layer.expert_params, layer.num_experts, layer.routed_bytes, layer.expert_flops_fraction) == (0, 0, 0.0, 0.0)


# ----------------------------------------------------------------------------- data-dependent routing


@pytest.mark.parametrize("select,capture,named", [
    ("where", "fx", "calls torch.where(condition)"),
    ("where", "export", "calls torch.where(condition)"),
    ("nonzero", "fx", "calls torch.nonzero"),
    ("mask", "fx", "indexes a tensor with a boolean mask"),
    ("mask", "export", "indexes a tensor with a boolean mask"),
    ("masked_select", "fx", "calls torch.masked_select"),
    ("masked_select", "export", "calls torch.masked_select"),
    ("tolist", "fx", "calls .tolist()"),
    ("item", "fx", "calls .item()"),
])
def test_a_data_dependent_op_is_named_with_its_module_and_the_fix(select, capture, named):
    with pytest.raises(TraceError) as info:
        trace_model(load_model_file(LOOP_MOE, {"select": select, "capture": capture}))
    message = str(info.value)
    assert "\n" not in message
    assert f"blocks.0.moe {named}" in message
    assert "depends on the data" in message and "meta device" in message
    assert "experts(hidden, top_k_index, top_k_weights)" in message and "Mixtures of experts" in message


def test_the_cli_stops_a_plainly_written_moe_with_one_line():
    result = subprocess.run([sys.executable, "-m", "hetpar", "trace", str(LOOP_MOE)], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hetpar: error:")]
    assert lines == [("hetpar: error: blocks.0.moe calls torch.where(condition), whose output size depends on the data, "
                      "so hetpar cannot measure it on the meta device: write the experts as one module called "
                      "experts(hidden, top_k_index, top_k_weights) (docs/model-file.md, 'Mixtures of experts')")]


def test_hugging_face_eager_experts_are_named_with_the_implementations_that_trace():
    pytest.importorskip("transformers")
    with pytest.raises(TraceError) as info:
        trace_model(load_model_file(HF_MOE, {"family": "mixtral", "experts": "eager"}))
    message = str(info.value)
    assert "\n" not in message
    assert "model.layers.0.mlp.experts is a module of experts" in message and "'grouped_mm'" in message
