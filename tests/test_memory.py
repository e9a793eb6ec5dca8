"""The memory model against hand-derived values: training state, ZeRO, recompute, margin."""

from dataclasses import replace

import pytest

from hetpar.cost_models.layers import LayerProfile
from hetpar.cost_models.memory import (
    FRAGMENTATION_MARGIN,
    MemoryBreakdown,
    activation_bytes_per_microbatch,
    recompute_workspace_bytes,
    stage_memory,
    state_bytes_per_param,
    training_state_bytes,
)


def layer(params=1000, saved=100.0, boundary=10.0, split_params=0, split_saved=0.0):
    return LayerProfile(name="l", fwd_flops=1e6, bwd_flops=2e6, params=params, saved_activation_bytes=saved,
                        boundary_bytes=boundary, num_ops=1, tp_split_params=split_params, tp_split_saved_bytes=split_saved)


@pytest.mark.parametrize("dtype,optimizer,expected", [
    ("fp32", "adamw", (4, 4, 8)),     # weights, grads, two fp32 moments
    ("bf16", "adamw", (2, 2, 12)),    # + fp32 master weights: 16 bytes per parameter (ZeRO paper 3.1)
    ("fp16", "adam", (2, 2, 12)),
    ("bf16", "sgd", (2, 2, 4)),       # master weights only
    ("fp32", "sgd", (4, 4, 0)),
])
def test_state_bytes_per_param(dtype, optimizer, expected):
    assert state_bytes_per_param(dtype, optimizer) == expected


@pytest.mark.parametrize("zero,expected", [
    (0, (20_000, 20_000, 120_000)),
    (1, (20_000, 20_000, 30_000)),              # optimizer state / dp
    (2, (20_000, 5_000, 30_000)),               # + gradients / dp
    (3, (5_000 + 4_000, 5_000 + 2_000, 30_000)),  # + weights / dp, plus two gathered layers and one layer's full grads
])
def test_zero_stages_shard_over_data_parallel(zero, expected):
    ten_layers = [layer(params=1000)] * 10
    assert training_state_bytes(ten_layers, tp=1, dtype="bf16", dp=4, zero_stage=zero) == expected


def test_zero_without_data_parallel_shards_nothing():
    assert training_state_bytes([layer()], tp=1, dtype="bf16", dp=1, zero_stage=3) == (2000, 2000, 12000)


def test_tensor_parallel_divides_the_split_part():
    # 1000 params of which 800 split: at tp=4 a rank holds 200 + 800/4 = 400.
    assert training_state_bytes([layer(split_params=800)], tp=4, dtype="fp32")[0] == 400 * 4


def test_activations_per_recompute_mode():
    layers = [layer(saved=100.0, boundary=10.0)] * 10
    kw = dict(tp=1, micro_batch_size=2, dtype="fp32")
    assert activation_bytes_per_microbatch(layers, recompute="none", **kw) == 10 * 100 * 2
    # selective: each layer's input (5, then 10) and its matmul and attention outputs (40)
    kept = [replace(l, selective_kept_bytes=40.0) for l in layers]
    assert activation_bytes_per_microbatch(kept, recompute="selective", input_bytes=5.0, **kw) == (45 + 9 * 50) * 2
    # never more than recompute none keeps
    assert activation_bytes_per_microbatch([replace(l, selective_kept_bytes=95.0) for l in layers], recompute="selective",
                                           input_bytes=5.0, **kw) == (100 + 9 * 100) * 2
    assert recompute_workspace_bytes(kept, recompute="selective", **kw) == (100 - 40) * 2
    # full: the stage's input (5 bytes per sample) and each later layer's input (the previous boundary).
    assert activation_bytes_per_microbatch(layers, recompute="full", input_bytes=5.0, **kw) == (5 + 9 * 10) * 2
    assert recompute_workspace_bytes(layers, recompute="full", **kw) == 100 * 2
    assert recompute_workspace_bytes(layers, recompute="none", **kw) == 0
    assert activation_bytes_per_microbatch(layers, recompute="none", tp=1, micro_batch_size=2, dtype="bf16") == 1000


def test_stage_memory_defaults_are_the_searchs_model():
    m = stage_memory([layer()], tp=1, micro_batch_size=4, in_flight=3, dtype="bf16")
    assert (m.weights_bytes, m.gradients_bytes, m.optimizer_bytes) == (2000, 2000, 12000)
    assert m.activations_bytes == 100 * 4 * 3 / 2
    assert m.total_bytes == pytest.approx(m.raw_bytes * FRAGMENTATION_MARGIN)
    assert m.fragmentation_bytes == pytest.approx(m.raw_bytes * (FRAGMENTATION_MARGIN - 1))


def test_full_recompute_keeps_inputs_in_flight_and_one_layer_workspace():
    m = stage_memory([layer()] * 4, tp=1, micro_batch_size=1, in_flight=3, dtype="fp32", recompute="full", input_bytes=10)
    assert m.activations_bytes == 4 * 10 * 3 + 100


def test_dominant_term_names_the_largest():
    m = MemoryBreakdown(weights_bytes=1, gradients_bytes=2, optimizer_bytes=3, activations_bytes=10)
    assert m.dominant_term() == "activations"
    assert MemoryBreakdown(weights_bytes=1, gradients_bytes=2, optimizer_bytes=30, activations_bytes=10).dominant_term() == "optimizer state"


@pytest.mark.parametrize("kwargs,message", [
    (dict(zero_stage=4), "unknown ZeRO stage 4"),
    (dict(recompute="some"), "unknown recompute 'some'"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'"),
])
def test_unknown_choices_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stage_memory([layer()], tp=1, micro_batch_size=1, in_flight=1, dtype="fp32", **kwargs)
