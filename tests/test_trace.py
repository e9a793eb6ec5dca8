"""Per-layer measurements on the meta device against closed forms and a real run."""

import pytest
import torch

from hetpar.planner.capture import trace_model
from hetpar.vocabulary import Sharding
from hetpar.runtime.model_file import load_model_file


def gpt_closed_form_fwd_flops(n_layers, hidden, seq_len, vocab):
    """Matmul and attention FLOPs of one sample's forward (Narayanan et al. 2021, Eq. 3
    shape), causal attention on the pairs it computes: 4 s^2 h x (s + 1) / 2s."""
    per_block = 24 * seq_len * hidden**2 + 2 * seq_len * (seq_len + 1) * hidden
    return n_layers * per_block + 2 * seq_len * hidden * vocab


@pytest.mark.parametrize("n_layers,hidden,heads,seq_len,vocab", [(2, 64, 4, 16, 128), (3, 128, 8, 64, 512), (1, 256, 4, 32, 1000)])
def test_gpt_flops_match_closed_form(n_layers, hidden, heads, seq_len, vocab):
    args = dict(n_layers=n_layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)
    graph = trace_model(load_model_file("examples/gpt.py", args))
    fwd = sum(l.fwd_flops for l in graph.layers)
    bwd = sum(l.bwd_flops for l in graph.layers)
    expected = gpt_closed_form_fwd_flops(n_layers, hidden, seq_len, vocab)
    assert fwd == pytest.approx(expected, rel=0.02)
    # The embedding has no backward matmul; the rest costs twice its forward.
    assert bwd == pytest.approx(2 * expected, rel=0.02)


def test_parameter_counts_match_the_real_module():
    mf = load_model_file("examples/gpt.py", {"n_layers": 3})
    graph = trace_model(mf)
    assert graph.total_params == sum(p.numel() for p in mf.build_model().parameters())


def test_megatron_pattern_is_found_not_named():
    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 1}))
    assert graph.tp_sharding[1] == {
        "blocks.0.attn.k": Sharding.COLWISE, "blocks.0.attn.o": Sharding.ROWWISE,
        "blocks.0.attn.q": Sharding.COLWISE, "blocks.0.attn.v": Sharding.COLWISE,
        "blocks.0.mlp.fc": Sharding.COLWISE, "blocks.0.mlp.proj": Sharding.ROWWISE,
    }
    # The token embedding and the head split over the vocabulary ([Note: vocab-parallel layers]);
    # the position embedding, indexed by computed positions, stays whole.
    assert graph.tp_sharding[0] == {"tok_emb": Sharding.VOCAB_EMBEDDING}
    assert graph.tp_sharding[2] == {"lm_head": Sharding.VOCAB_HEAD}


def test_saved_activations_match_a_real_cpu_run():
    """Bytes autograd saves for one GPT block, meta measurement vs a real forward on CPU."""
    mf = load_model_file("examples/gpt.py", {"n_layers": 1, "hidden": 64, "seq_len": 16})
    graph = trace_model(mf)
    torch.manual_seed(0)
    block = mf.build_model().blocks[0]
    x = torch.randn(1, 16, 64, requires_grad=True)
    params = {id(p) for p in block.parameters()}
    saved = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[base.untyped_storage().data_ptr()] = base.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    real = sum(saved.values())
    assert graph.layers[1].saved_activation_bytes == pytest.approx(real, rel=0.05)


@pytest.mark.parametrize("heads", [4, 6])
def test_blocks_split_only_where_the_heads_divide(heads):
    # examples/gpt.py views q, k, v as (batch, seq, heads, head_dim): a rank must hold
    # whole heads, and the mlp's 4 * hidden features and the residual must divide too.
    hidden = 16 * heads
    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 1, "hidden": hidden, "heads": heads}))
    block = graph.layers[1]
    expected = tuple(tp for tp in range(2, 17) if heads % tp == 0)
    assert block.tp_degrees == expected
    assert block.tp_sharded_modules == len(graph.tp_sharding[1])
    # the token embedding splits over its 256-token vocabulary: any degree dividing it
    assert graph.layers[0].tp_degrees == tuple(tp for tp in range(2, 17) if 256 % tp == 0)
