"""Weights tied across pipeline stages: found where the stages are cut, and the ranks
that sum their gradients ([Note: tied weights across stages] in runtime/tied.py)."""

import pytest
import torch

from hetpar.runtime.distributed import StageSpec
from hetpar.runtime.graph import build_stage, record_values, trace_layers
from hetpar.runtime.tied import TiedWeight, TiedWeightError, find_tied, held_parameters, model_names, sync_groups

W = "transformer.wte.weight"


def stage(ranks, tp_sharding=None):
    return StageSpec(layers=(0, 0), device_type="cpu", tensor_parallel=len(ranks[0]), ranks=ranks,
                     tp_sharding=tp_sharding or {})


def test_gpt2_embedding_and_head_are_found_tied_across_two_stages():
    tf = pytest.importorskip("transformers")
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, use_cache=False))
    inputs = (torch.zeros(1, 8, dtype=torch.long),)
    lg = trace_layers(model, example_inputs=inputs)  # torch.export; layers: embeddings, h.0, h.1, ln_f+lm_head
    values, names = record_values(lg, inputs), model_names(model)
    held = {s: held_parameters(names, build_stage(lg, values, first, last).module)
            for s, (first, last) in enumerate([(0, 1), (2, 3)])}
    assert names[id(model.lm_head.weight)] == W  # the tied weight goes by its first name
    assert find_tied(held) == [TiedWeight(name=W, stages=(0, 1))]
    held_one_stage = {0: held_parameters(names, build_stage(lg, values, 0, 3).module)}
    assert find_tied(held_one_stage) == []


def test_groups_per_replica_and_tp_index():
    tied = [TiedWeight(name=W, stages=(0, 1))]
    # dp 2 x pp 2: stage 0 on ranks 0 and 2, stage 1 on 1 and 3
    assert sync_groups(tied, [stage([[0], [2]]), stage([[1], [3]])]) == {(0, 1): [W], (2, 3): [W]}
    # tp 2 x pp 2, the weight replicated over the tp ranks: index t sums with index t
    assert sync_groups(tied, [stage([[0, 1]]), stage([[2, 3]])]) == {(0, 2): [W], (1, 3): [W]}
    # interleaved: stages 0 and 2 on one rank share the parameter itself; stage 3 is on rank 1
    pp2_chunks = [stage([[0]]), stage([[1]]), stage([[0]]), stage([[1]])]
    assert sync_groups([TiedWeight(name=W, stages=(0, 2))], pp2_chunks) == {}
    assert sync_groups([TiedWeight(name=W, stages=(0, 2, 3))], pp2_chunks) == {(0, 1): [W]}


def test_tied_weights_that_cannot_stay_equal_are_refused():
    tied = [TiedWeight(name=W, stages=(0, 1))]
    with pytest.raises(TiedWeightError, match=r"stage 0 \(dp 1, tp 1\), stage 1 \(dp 1, tp 2\)"):
        sync_groups(tied, [stage([[0]]), stage([[1, 2]])])
    split = [stage([[0, 1]]), stage([[2, 3]], {"lm_head": "colwise"})]
    with pytest.raises(TiedWeightError, match="tensor parallelism splits lm_head"):
        sync_groups(tied, split, {W: [W, "lm_head.weight"]})
    whole_copy = [stage([[0, 1]]), stage([[2, 3]], {"lm_head": "vocab_head"})]
    with pytest.raises(TiedWeightError, match="tensor parallelism splits lm_head \\(vocab_head\\).*but not every copy"):
        sync_groups(tied, whole_copy, {W: [W, "lm_head.weight"]})


def test_copies_split_alike_over_the_vocabulary_sum_shard_by_shard():
    """[Note: tied vocab-parallel weights]: rank t of each stage holds the same rows."""
    tied = [TiedWeight(name=W, stages=(0, 1))]
    split = [stage([[0, 1]], {"transformer.wte": "vocab_embedding"}), stage([[2, 3]], {"lm_head": "vocab_head"})]
    assert sync_groups(tied, split, {W: [W, "lm_head.weight"]}) == {(0, 2): [W], (1, 3): [W]}
