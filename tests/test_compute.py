"""The estimator's layer time ([Note: layer time]) against hand-derived values."""

import pytest

from cost_models.compute import DEFAULT_OP_OVERHEAD_S, HBM_STREAM_EFFICIENCY, layer_timing
from cost_models.devices import get_device
from cost_models.layers import LayerProfile

A100 = get_device("A100-80GB")


def block(params=1000, fwd=3e12, bwd=6e12, saved=4e8, num_ops=10):
    return LayerProfile(name="b", fwd_flops=fwd, bwd_flops=bwd, params=params, saved_activation_bytes=saved,
                        boundary_bytes=1e6, num_ops=num_ops, tp_split_flops_fraction=1.0, tp_split_params=params,
                        tp_split_saved_bytes=saved / 2)


def test_layer_timing_by_hand():
    t = layer_timing(block(), A100, tp=1, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5)
    flop_rate = 312e12 * 0.869 * 0.5
    byte_rate = 2.039e12 * HBM_STREAM_EFFICIENCY * 0.5
    saved = 4e8 * 2 / 2  # per sample fp32 -> bf16, two samples
    launch = 10 * DEFAULT_OP_OVERHEAD_S
    assert t.fwd_s == pytest.approx(6e12 / flop_rate + saved / byte_rate + launch)
    # W: the forward's matmul FLOPs again; B: the rest of the backward and all its elementwise traffic.
    assert t.bwd_weight_s == pytest.approx(6e12 / flop_rate + launch)
    assert t.bwd_input_s == pytest.approx(6e12 / flop_rate + 2 * saved / byte_rate + launch)
    assert t.bwd_s == pytest.approx(t.bwd_input_s + t.bwd_weight_s)


def test_tensor_parallel_divides_flops_and_split_activations():
    whole = layer_timing(block(num_ops=0), A100, tp=1, micro_batch_size=1, dtype="bf16", kernel_efficiency=1.0)
    half = layer_timing(block(num_ops=0), A100, tp=2, micro_batch_size=1, dtype="bf16", kernel_efficiency=1.0)
    flop_rate = 312e12 * 0.869
    byte_rate = 2.039e12 * HBM_STREAM_EFFICIENCY
    assert half.fwd_s == pytest.approx(1.5e12 / flop_rate + 4e8 * 0.75 / 2 / byte_rate)
    assert half.fwd_s < whole.fwd_s


def test_a_layer_without_parameters_has_no_weight_gradient():
    t = layer_timing(block(params=0, num_ops=0), A100, tp=1, micro_batch_size=1, dtype="bf16")
    assert t.bwd_weight_s == 0.0


def test_efficiency_must_be_positive():
    with pytest.raises(ValueError, match="kernel_efficiency must be positive"):
        layer_timing(block(), A100, tp=1, micro_batch_size=1, dtype="bf16", kernel_efficiency=0)
