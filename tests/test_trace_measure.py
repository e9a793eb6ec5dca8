"""Node-by-node meta measurement: consistent with itself, with torch's counter, with closed
forms and with real CPU runs; repeated blocks measured once."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hetpar.planner.capture import trace_model
from hetpar.planner.capture.measure import causal_fraction, measure
from hetpar.planner.capture.trace import differentiable_values
from hetpar.runtime.graph import boundary_values, build_stage, record_values, trace_layers
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
TORCH_ZOO = ROOT / "tests" / "models" / "torch_zoo.py"
HF_ZOO = ROOT / "tests" / "models" / "hf_zoo.py"


def test_node_counts_add_up_to_layer_counts():
    graph = trace_model(load_model_file(GPT, {"n_layers": 2}))
    for index, layer in enumerate(graph.layers):
        nodes = [n for n in graph.nodes if n.layer == index]
        assert sum(n.fwd_flops for n in nodes) == layer.fwd_flops
        assert sum(n.saved_activation_bytes for n in nodes) == layer.saved_activation_bytes
        assert sum(n.fwd_bytes_accessed for n in nodes) == layer.fwd_bytes_accessed
        # backward kernels are charged to their forward node, except gradient accumulation
        assert sum(n.bwd_flops for n in nodes) == pytest.approx(layer.bwd_flops)
        assert sum(n.param_bytes for n in nodes) == 4 * (layer.params + layer.tied_params)


def _sdpa_flops(shape, *, causal: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs torch's counter gives one attention call of q, k, v ``shape``."""
    q, k, v = (torch.empty(shape, device="meta", requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as forward:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with FlopCounterMode(display=False) as backward:
        out.backward(torch.ones_like(out))
    return forward.get_total_flops(), backward.get_total_flops()


def test_totals_are_torch_flop_counters_with_causal_attention_on_its_unmasked_pairs():
    """torch's counter charges a causal attention every (query, key) pair; a causal kernel
    computes those of j <= i, (T + 1) / 2T of them ([Note: causal attention FLOPs])."""
    mf = load_model_file(GPT, {"n_layers": 1, "hidden": 64, "seq_len": 16})
    with torch.device("meta"):
        model = mf.build_model()
    lg = trace_layers(model)
    values = record_values(lg, mf.example_inputs(1))
    stage = build_stage(lg, values, 1, 1)
    x = torch.empty(stage.recv[0].shape, device="meta", requires_grad=True)
    m = measure(stage.module, [x])
    with FlopCounterMode(display=False) as counter:
        out = stage.module(x)[0]
        out.backward(torch.ones_like(out))
    fwd, bwd = _sdpa_flops((1, 4, 16, 16), causal=True)  # examples/gpt.py's 4 heads of 16
    assert fwd == 4 * 16 * 16 * 64 and bwd == 2 * fwd  # every pair: Q K^T and P V, twice that backward
    masked = (fwd + bwd) * (1 - 17 / 32)
    assert m.total("fwd_flops") + m.total("bwd_flops") == counter.get_total_flops() - masked
    attention = next(c for name, c in m.nodes.items() if "scaled_dot_product" in name)
    assert (attention.fwd_flops, attention.bwd_flops) == (fwd * 17 / 32, bwd * 17 / 32)
    linear = m.nodes["blocks_0_attn_q"]
    assert linear.fwd_flops == 2 * 16 * 64 * 64
    assert linear.bwd_flops == 2 * linear.fwd_flops  # input and weight gradients
    assert linear.fwd_bytes == 4 * (16 * 64 + 64 * 64 + 16 * 64)  # reads input and weight, writes output


def _measured_node(model: torch.nn.Module, inputs: list[torch.Tensor], op: str):
    gm = torch.fx.symbolic_trace(model)
    return next(c for name, c in measure(gm, inputs).nodes.items() if op in name)


@pytest.mark.parametrize("causal,keywords", [(False, False), (True, False), (True, True)])
def test_an_attention_call_moves_the_bytes_of_one_fused_kernel(causal, keywords):
    """[Note: fused attention bytes]: q, k, v read and the output and its row log-sum-exp
    written; backward, those and the output's gradient read, q's, k's and v's gradients
    written. The math path's s x s scores move nothing; its FLOPs stay counted."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            if keywords:
                return F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=causal)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    batch, heads, length, dim = 2, 4, 256, 16
    qkv = [torch.empty(batch, heads, length, dim, device="meta", requires_grad=True) for _ in range(3)]
    node = _measured_node(Attend(), qkv, "scaled_dot_product")
    tensor = 4 * batch * heads * length * dim  # fp32 bytes of q, k, v or the output
    lse = 4 * batch * heads * length
    assert node.fwd_bytes == 3 * tensor + tensor + lse
    assert node.bwd_bytes == (3 * tensor + tensor + lse) + tensor + 3 * tensor
    assert node.fwd_bytes < 4 * batch * heads * length * length  # not even one s x s matrix of scores
    share = causal_fraction(length, length) if causal else 1.0
    assert node.fwd_flops == pytest.approx(4 * batch * heads * length * length * dim * share)


def test_an_embedding_lookup_moves_its_rows_not_its_table():
    """An embedding of 50,000 rows looked up 64 times reads 64 rows and writes them, and reads
    the indices; backward reads their gradients and adds them into the table's."""
    table = torch.nn.Embedding(50_000, 32, device="meta")
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    node = _measured_node(torch.nn.Sequential(table), [tokens], "_0")
    rows = 4 * 2 * 32 * 32
    assert node.fwd_bytes == 2 * rows + 8 * 2 * 32
    assert node.bwd_bytes == 2 * rows + 8 * 2 * 32


def test_causal_fraction_counts_the_pairs_a_top_left_causal_mask_lets_through():
    for queries, keys in ((1, 1), (16, 16), (5, 9), (9, 5), (4096, 4096)):
        mask = torch.ones(queries, keys, dtype=torch.bool).tril()  # torch's is_causal: query i sees keys 0..i
        assert causal_fraction(queries, keys) == mask.sum().item() / mask.numel()


def test_repeated_blocks_are_measured_once_and_match_a_fresh_measurement():
    mf = load_model_file(GPT, {"n_layers": 8, "hidden": 64, "seq_len": 16})
    graph = trace_model(mf)
    assert graph.measured_layers == 3  # embeddings, one block, head
    blocks = graph.layers[1:-1]
    assert all(b.fwd_flops == blocks[0].fwd_flops and b.saved_activation_bytes == blocks[0].saved_activation_bytes
               for b in blocks)
    assert graph.tp_sharding[6]["blocks.5.attn.o"].value == "rowwise"
    with torch.device("meta"):
        model = mf.build_model()
    lg = trace_layers(model)
    values = record_values(lg, mf.example_inputs(1))
    stage = build_stage(lg, values, 6, 6)
    fresh = measure(stage.module, [torch.empty(stage.recv[0].shape, device="meta", requires_grad=True)])
    assert graph.layers[6].fwd_flops == fresh.total("fwd_flops")
    assert graph.layers[6].saved_activation_bytes == fresh.total("saved_bytes")


def test_skip_tensor_counts_as_boundary_traffic_at_every_cut_it_crosses():
    from tests.test_graph import SkipNet

    model = SkipNet()
    lg = trace_layers(model)
    values = record_values(lg, (torch.randn(1, 4), torch.ones(1, 4)))
    # h leaves the first layer once (block 0 and the skip read the same tensor); after
    # that each cut carries the block output and the skip
    assert [len(boundary_values(lg, values, cut)) for cut in range(lg.num_layers - 1)] == [1, 2, 2, 2]


def real_saved_bytes(model, inputs, block):
    """Bytes autograd saves inside ``block`` during a real CPU forward, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, recording = {}, [False]

    def pack(t):
        storage = t.untyped_storage()
        if recording[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = [block.register_forward_pre_hook(lambda *_: recording.__setitem__(0, True)),
             block.register_forward_hook(lambda *_: recording.__setitem__(0, False))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    for h in hooks:
        h.remove()
    return sum(saved.values())


def compare_saved(path, args, block):
    mf = load_model_file(path, args)
    graph = trace_model(mf)
    torch.manual_seed(0)
    model = mf.build_model()
    real = real_saved_bytes(model, mf.example_inputs(1), model.get_submodule(block))
    return graph.layers[graph.layer_names.index(block)].saved_activation_bytes, real


def test_saved_bytes_of_a_multihead_attention_block_match_a_cpu_run():
    measured, real = compare_saved(TORCH_ZOO, {"kind": "mha"}, "blocks.1")
    assert measured == pytest.approx(real, rel=0.05)


@pytest.mark.parametrize("kind,block", [("gpt2", "transformer.h.0"), ("bert", "bert.encoder.layer.0"),
                                        ("vit", "vit.layers.0")])
def test_saved_bytes_of_transformers_blocks_match_a_cpu_run(kind, block):
    pytest.importorskip("transformers")
    measured, real = compare_saved(HF_ZOO, {"kind": kind}, block)
    assert measured == pytest.approx(real, rel=0.05)


def test_rotary_tables_and_masks_do_not_require_gradients():
    pytest.importorskip("transformers")
    mf = load_model_file(HF_ZOO, {"kind": "llama"})
    with torch.device("meta"):
        model = mf.build_model()
    example = mf.example_inputs(1)
    lg = trace_layers(model, example_inputs=tuple(t.to("meta") for t in example))
    values = record_values(lg, example)
    flags = differentiable_values(lg, values)
    crossing = boundary_values(lg, values, 0)
    hidden = [n for n in crossing if tuple(values[n].shape) == (1, 16, 64)]
    assert [flags[n] for n in hidden] == [True]
    assert not any(flags[n] for n in crossing if n not in hidden)  # mask, cos, sin


def transformer_fwd_flops(n_layers, hidden, seq, vocab, ffn, kv_hidden=None, gated=False):
    """Matmul and attention FLOPs of one sample's forward (Narayanan et al. 2021, Eq. 3
    shape), causal attention on the (query, key) pairs it computes: 4 s^2 h x (s + 1) / 2s."""
    kv = hidden if kv_hidden is None else kv_hidden
    attn = 2 * seq * hidden * (2 * hidden + 2 * kv) + 2 * seq * (seq + 1) * hidden
    mlp = 2 * seq * hidden * ffn * (3 if gated else 2)
    return n_layers * (attn + mlp) + 2 * seq * hidden * vocab


@pytest.mark.parametrize("kind,expected", [
    ("gpt2", transformer_fwd_flops(2, 64, 16, 128, 256)),
    ("llama", transformer_fwd_flops(2, 64, 16, 128, 128, kv_hidden=32, gated=True)),
])
def test_transformers_flops_match_closed_form(kind, expected):
    pytest.importorskip("transformers")
    graph = trace_model(load_model_file(HF_ZOO, {"kind": kind}))
    assert sum(l.fwd_flops for l in graph.layers) == pytest.approx(expected, rel=0.02)
    assert sum(l.bwd_flops for l in graph.layers) == pytest.approx(2 * expected, rel=0.02)


def test_matmul_rows_of_a_gpt_block_separate_linears_from_attention():
    # [Note: matmul rows]: Linears run T rows per sample (growing with the batch), the
    # attention matmuls T rows per head whatever the batch. Per block at batch 1 the
    # Linears cost 24 T H^2 FLOPs (q, k, v, o and a 4H MLP) and causal attention
    # 4 T^2 H x (T + 1) / 2T = 2 T (T + 1) H.
    # Each records its width sqrt(K N): the Linears' inputs by outputs (H x H for q, k, v
    # and o; H x 4H and 4H x H for the MLP), attention's head size by key length.
    seq, hidden, heads = 16, 64, 4
    graph = trace_model(load_model_file(GPT, {"n_layers": 1, "hidden": hidden, "seq_len": seq, "heads": heads}))
    block = graph.layers[1]
    rows: dict[tuple[int, bool], float] = {}
    for r, grows, share, _ in block.matmul_rows:
        rows[(r, grows)] = rows.get((r, grows), 0.0) + share
    assert set(rows) == {(seq, True), (seq, False)}
    assert rows[(seq, False)] == pytest.approx((seq + 1) / (12 * hidden + seq + 1))
    assert sum(rows.values()) == pytest.approx(1.0)
    widths = {width for r, grows, _, width in block.matmul_rows if grows}
    assert widths == {hidden, round(math.sqrt(hidden * 4 * hidden))}
    assert {width for _, grows, _, width in block.matmul_rows if not grows} == {round(math.sqrt(hidden // heads * seq))}
    assert graph.layers[0].matmul_rows == ()  # embeddings: gathers, no matmul


def test_matmul_rows_of_each_kernel_kind():
    from hetpar.planner.capture.measure import matmul_rows
    meta = lambda *shape: torch.empty(shape, device="meta")
    assert matmul_rows("mm", (meta(12, 8), meta(8, 2)), meta(12, 2)) == (12, True, 4)
    assert matmul_rows("addmm", (meta(2), meta(12, 8), meta(8, 2)), meta(12, 2)) == (12, True, 4)
    assert matmul_rows("bmm", (meta(6, 12, 8), meta(6, 8, 18)), meta(6, 12, 18)) == (12, False, 12)
    # A convolution's inner dimension is its input channels times the kernel's area.
    assert matmul_rows("convolution", (meta(1, 3, 9, 9), meta(12, 3, 3, 3)), meta(1, 12, 7, 7)) == (49, True, 18)
    assert matmul_rows("add", (meta(3), meta(3)), meta(3)) is None
