"""The vocabulary split over tensor-parallel ranks ([Note: vocab-parallel layers] in
planner/tensor_parallel.py, [Note: vocab-parallel loss] in runtime/executor.py): found
by the trace, costed, planned, and run by the program like one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.options import SearchOptions
from hetpar.vocabulary import Sharding
from hetpar.runtime.model_file import load_model_file

GPT = {"n_layers": 2, "hidden": 64, "heads": 4, "vocab": 512, "seq_len": 16}

TIED = '''
import torch.nn as nn
import torch.nn.functional as F


class Tied(nn.Module):
    def __init__(self, vocab=64, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.mlp(x))


def build_model():
    return Tied()


def example_inputs(batch_size):
    import torch
    return (torch.randint(0, 64, (batch_size, 8)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''


@pytest.fixture(scope="module")
def graph():
    return trace_model(load_model_file("examples/gpt.py", GPT))


def test_the_vocabulary_splits_with_its_work_parameters_and_collectives(graph):
    first, head = graph.layers[0], graph.layers[-1]
    vocab, hidden, tokens = GPT["vocab"], GPT["hidden"], GPT["seq_len"]
    assert graph.tp_sharding[0] == {"tok_emb": Sharding.VOCAB_EMBEDDING}  # pos_emb, indexed by positions, stays whole
    assert graph.tp_sharding[-1] == {"lm_head": Sharding.VOCAB_HEAD}
    assert first.tp_split_params == vocab * hidden and head.tp_split_params == vocab * hidden
    assert head.params_at(4) == head.params - vocab * hidden * 3 / 4
    # the lookups' partial outputs all-reduced: (seq, hidden) fp32 per sample
    assert first.tp_collectives == (("forward", "all_reduce", 4.0 * tokens * hidden),)
    # cross-entropy's max, sum of exponentials and target logit per token; the head's input gradient
    assert sorted(head.tp_collectives) == sorted([("forward", "all_reduce", 4.0 * tokens)] * 3
                                                 + [("backward", "all_reduce", 4.0 * tokens * hidden)])
    assert head.tp_split_flops_fraction > 0.9  # the head's matmul; ln_f is the rest
    assert 2 in head.tp_degrees and 3 not in head.tp_degrees  # 512 splits 2 ways, not 3


def test_a_tied_embedding_and_head_split_together_and_count_the_weight_once(tmp_path):
    """[Note: tied vocab-parallel weights]: the head's layer holds the embedding's weight,
    counted by the embedding's layer and split there as here."""
    (tmp_path / "tied.py").write_text(TIED)
    tied = trace_model(load_model_file(tmp_path / "tied.py", {}))
    first, head = tied.layers[0], tied.layers[-1]
    assert tied.tp_sharding[0] == {"emb": Sharding.VOCAB_EMBEDDING} and tied.tp_sharding[-1] == {"head": Sharding.VOCAB_HEAD}
    vocab_hidden = 64 * 32
    assert first.params == first.tp_split_params == vocab_hidden
    assert head.params == 0 and head.tied_params == head.tp_split_tied_params == vocab_hidden
    assert head.tied_at(4) == vocab_hidden / 4 and head.tied_at(1) == vocab_hidden
    assert head.tp_capable and head.tp_split_flops_fraction == 1.0


def test_a_weight_also_read_as_an_attribute_stays_whole(tmp_path):
    """``F.linear(x, emb.weight)`` uses the embedding's weight outside any split module."""
    functional = TIED.replace("return self.head(x + self.mlp(x))", "return F.linear(x + self.mlp(x), self.emb.weight)")
    (tmp_path / "tied.py").write_text(functional)
    (tmp_path / "functional.py").write_text(functional.replace("        self.head.weight = self.emb.weight\n", "")
                                            .replace("        self.head = nn.Linear(hidden, vocab, bias=False)\n", ""))
    for name in ("tied.py", "functional.py"):  # with and without a head module that holds it too
        tied = trace_model(load_model_file(tmp_path / name, {}))
        assert all(how not in (Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD)
                   for layer in tied.tp_sharding for how in layer.values()), name
        assert tied.layers[-1].tied_params == 64 * 32 and tied.layers[-1].tp_split_tied_params == 0


def test_planned_tensor_parallel_stages_carry_the_vocab_split(graph):
    plan = plan_graph(graph, parse_cluster("1x4xA100-80GB"), SearchOptions(global_batch_size=8, dtype="bf16", tp=2, pp=2))
    first, last = plan.stages[0], plan.stages[-1]
    assert first.tp_sharding["tok_emb"] is Sharding.VOCAB_EMBEDDING and last.tp_sharding["lm_head"] is Sharding.VOCAB_HEAD
    unsplit = plan_graph(graph, parse_cluster("1x4xA100-80GB"), SearchOptions(global_batch_size=8, dtype="bf16", tp=1, pp=2))
    assert "lm_head" not in unsplit.stages[-1].tp_sharding


@pytest.mark.slow
@pytest.mark.parametrize("pp,optimizer", [(1, "sgd"), (2, "adamw")])
def test_a_planned_vocab_parallel_program_trains_like_one_process(tmp_path, pp, optimizer):
    """tp 2 (embedding and head on one stage) and tp 2 x pp 2 (the embedding's stage and
    the head's apart), as the planner lays them out."""
    from dataclasses import replace

    from test_distributed import assert_trains_like_one_process

    args = {**GPT, "vocab": 64}
    small = trace_model(load_model_file("examples/gpt.py", args))
    options = SearchOptions(global_batch_size=4, dtype="fp32", tp=2, pp=pp, dp=1, micro_batch_size=2, zero=0,
                            recompute="none", schedule="1f1b")
    plan = plan_graph(small, parse_cluster(f"1x{2 * pp}xcpu"), options, hetero_dp="off")
    plan = replace(plan, model=replace(plan.model, file=str(Path("examples/gpt.py").resolve())))
    assert plan.stages[0].tp_sharding["tok_emb"] is Sharding.VOCAB_EMBEDDING
    assert plan.stages[-1].tp_sharding["lm_head"] is Sharding.VOCAB_HEAD
    assert_trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("pp,optimizer", [(1, "adamw"), (2, "sgd")])
def test_a_planned_tied_vocab_parallel_program_trains_like_one_process(tmp_path, pp, optimizer):
    """The tied embedding and head split over the vocabulary: in one stage, one DTensor
    both modules hold (tp 2); on two stages, copies whose local shards' gradients are
    summed (tp 2 x pp 2). The tied weights end equal on every rank (the helper checks
    every rank's parameters against the reference)."""
    from dataclasses import replace

    import torch
    from test_distributed import STEPS, assert_matches_reference, run_compiled

    path = tmp_path / "tied.py"
    path.write_text(TIED)
    graph = trace_model(load_model_file(path, {}))
    options = SearchOptions(global_batch_size=4, dtype="fp32", tp=2, pp=pp, dp=1, micro_batch_size=2, zero=0,
                            recompute="none", schedule="1f1b")
    plan = plan_graph(graph, parse_cluster(f"1x{2 * pp}xcpu"), options, hetero_dp="off")
    plan = replace(plan, model=replace(plan.model, file=str(path.resolve())))
    assert plan.stages[0].tp_sharding["emb"] is Sharding.VOCAB_EMBEDDING
    assert plan.stages[-1].tp_sharding["head"] is Sharding.VOCAB_HEAD
    run = run_compiled(plan, tmp_path, optimizer)
    assert not torch.equal(run.final["head.weight"], run.init_state["head.weight"])  # trained
    assert torch.equal(run.final["emb.weight"], run.final["head.weight"])  # each stage saves its copy
    assert_matches_reference(plan, run.init_state, optimizer, STEPS, run.losses, run.final, run.ref_state)


def test_a_vocabulary_sixteen_does_not_divide_stays_whole_and_rules_no_degree_out(tmp_path):
    """GPT-2's 50257 rows: split, they would allow no tensor-parallel degree at all."""
    odd = trace_model(load_model_file("examples/gpt.py", {**GPT, "vocab": 50257}))
    assert all(how not in (Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD)
               for layer in odd.tp_sharding for how in layer.values())
    assert all(layer.splits_at(2) and layer.splits_at(4) for layer in odd.layers)
    (tmp_path / "tied.py").write_text(TIED.replace("vocab=64", "vocab=72").replace("0, 64", "0, 72"))
    tied = trace_model(load_model_file(tmp_path / "tied.py", {}))
    assert tied.layers[-1].tp_split_tied_params == 0 and not tied.tp_sharding[0]
