"""The estimator's layer time ([Note: layer time]) against hand-derived values."""

import math

import pytest

from hetpar.cost_models.compute import DEFAULT_OP_OVERHEAD_S, HBM_STREAM_EFFICIENCY, layer_timing
from hetpar.cost_models.devices import get_device
from hetpar.cost_models.layers import LayerProfile

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
    launch = 10 * A100.op_overhead_s
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


def test_small_matmuls_run_at_the_measured_row_efficiency():
    from dataclasses import replace
    from hetpar.cost_models.compute import matmul_rows_slowdown, rows_efficiency
    curve = {1: 0.25, 16: 0.5, 256: 1.0}
    # Linear in log rows between measured points, flat beyond them.
    assert rows_efficiency(curve, 4) == pytest.approx(0.375)
    assert rows_efficiency(curve, 64) == pytest.approx(0.75)
    assert rows_efficiency(curve, 1024) == 1.0 and rows_efficiency(curve, 0.5) == 0.25
    cpu = replace(get_device("cpu"), matmul_rows_efficiency={"forward": curve, "backward": {1: 0.5, 256: 0.5}},
                  sources={**get_device("cpu").sources, "matmul_rows_efficiency": "test"})
    # Half the FLOPs in matmuls of one row per sample (4 rows at micro-batch 4), a quarter
    # in attention-like matmuls of 64 rows whatever the batch, a quarter in no matmul.
    layer = replace(block(num_ops=0, saved=0.0), matmul_rows=((1, True, 0.5, 512), (64, False, 0.25, 512)))
    assert matmul_rows_slowdown(layer, cpu, 4, "forward") == pytest.approx(0.25 + 0.5 / 0.375 + 0.25 / 0.75)
    assert matmul_rows_slowdown(layer, cpu, 4, "backward") == pytest.approx(0.25 + 0.75 / 0.5)
    plain = replace(cpu, matmul_rows_efficiency={})
    slow = layer_timing(layer, cpu, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=1.0)
    fast = layer_timing(layer, plain, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=1.0)
    assert slow.fwd_s == pytest.approx(fast.fwd_s * (0.25 + 0.5 / 0.375 + 0.25 / 0.75))
    assert slow.bwd_s == pytest.approx(fast.bwd_s * 1.75)
    assert matmul_rows_slowdown(block(), cpu, 4, "forward") == 1.0  # no rows recorded: the large-matmul rate


def test_narrow_matmuls_run_between_the_two_measured_widths():
    from dataclasses import replace
    from hetpar.cost_models.compute import ROWS_CURVE_WIDTH, matmul_efficiency, matmul_rows_slowdown
    wide, narrow = {1: 0.5, 256: 1.0}, {1: 0.25, 256: 0.5}
    cpu = replace(get_device("cpu"), matmul_rows_efficiency={"forward": wide, "backward": wide},
                  matmul_narrow_efficiency={"forward": narrow, "backward": narrow}, matmul_narrow_width=128,
                  sources={**get_device("cpu").sources, "matmul_rows_efficiency": "test", "matmul_narrow_efficiency": "test",
                           "matmul_narrow_width": "test"})
    # Linear in log width between 128 and the wide curve's width, flat outside.
    middle = round(math.sqrt(128 * ROWS_CURVE_WIDTH))
    assert matmul_efficiency(cpu, "forward", 256, middle) == pytest.approx(0.75, rel=1e-3)
    assert matmul_efficiency(cpu, "forward", 256, 64) == 0.5 and matmul_efficiency(cpu, "forward", 256, 4096) == 1.0
    assert matmul_efficiency(cpu, "forward", 256, None) == 1.0  # no width recorded: a wide matmul
    # A layer whose matmuls are all 128 wide at 256 rows takes twice the FLOP time of a wide one.
    layer = replace(block(num_ops=0, saved=0.0), matmul_rows=((256, False, 1.0, 128),))
    assert matmul_rows_slowdown(layer, cpu, 4, "forward") == pytest.approx(2.0)
    assert matmul_rows_slowdown(replace(layer, matmul_rows=((256, False, 1.0, 512),)), cpu, 4, "forward") == 1.0
    # A profile without the narrow curve runs every width at the rows curve.
    assert matmul_rows_slowdown(layer, replace(cpu, matmul_narrow_efficiency={}, matmul_narrow_width=None), 4, "forward") == 1.0


def test_a_measured_host_pays_each_pass_its_weight_traffic():
    from dataclasses import replace
    cpu = get_device("cpu")
    streaming = replace(cpu, weight_stream_bytes_per_s=cpu.mem_bw_bytes_per_s / 2,
                        sources={**cpu.sources, "weight_stream_bytes_per_s": "test"})
    layer = block(params=1_000_000, num_ops=0)
    base = layer_timing(layer, cpu, tp=1, micro_batch_size=1, dtype="fp32", kernel_efficiency=0.5)
    paid = layer_timing(layer, streaming, tp=1, micro_batch_size=1, dtype="fp32", kernel_efficiency=0.5)
    read = 4e6 / (cpu.mem_bw_bytes_per_s / 2 * HBM_STREAM_EFFICIENCY * 0.5)  # fp32 weights, at the stream rate
    assert paid.fwd_s - base.fwd_s == pytest.approx(read)
    assert paid.bwd_input_s - base.bwd_input_s == pytest.approx(read)
    assert paid.bwd_weight_s - base.bwd_weight_s == pytest.approx(2 * read)
    half = layer_timing(layer, streaming, tp=2, micro_batch_size=1, dtype="fp32", kernel_efficiency=0.5)
    assert half.fwd_s - layer_timing(layer, cpu, tp=2, micro_batch_size=1, dtype="fp32", kernel_efficiency=0.5).fwd_s == pytest.approx(read / 2)


@pytest.mark.parametrize("name", ["A100-80GB", "H200-141GB", "V100-32GB", "MI300X"])
def test_gpu_profiles_charge_a_sourced_launch_per_op_in_every_pass(name, tmp_path):
    """A datasheet GPU profile states its per-op cost, and the layer model charges it
    once per op in the forward, the input gradient and the weight gradient."""
    import json

    from hetpar.cost_models.devices import dump_profile, load_profile, profile_to_dict

    gpu = get_device(name)
    assert gpu.op_overhead_s > 0 and gpu.op_overhead_s != DEFAULT_OP_OVERHEAD_S and gpu.sources["op_overhead_s"]
    none, ten, thirty = (layer_timing(block(num_ops=n), gpu, tp=1, micro_batch_size=2, dtype="fp16") for n in (0, 10, 30))
    for part in ("fwd_s", "bwd_input_s", "bwd_weight_s"):
        assert getattr(ten, part) - getattr(none, part) == pytest.approx(10 * gpu.op_overhead_s)
        assert getattr(thirty, part) - getattr(none, part) == pytest.approx(30 * gpu.op_overhead_s)
    for path, text in ((tmp_path / "gpu.toml", dump_profile(gpu)), (tmp_path / "gpu.json", json.dumps(profile_to_dict(gpu)))):
        path.write_text(text)
        assert load_profile(path) == gpu


def test_a_compiled_layer_launches_a_kernel_per_matmul_and_one_per_gap_between_them():
    """[Note: compiled stages]: 8 matmuls and 24 eager ops compile to 2 * 8 + 1 = 17
    kernels; a layer with fewer eager ops than that keeps its own count."""
    from dataclasses import replace

    from hetpar.cost_models.compute import compiled_layer

    layer = replace(block(num_ops=24), matmul_ops=8)
    assert compiled_layer(layer).num_ops == 17
    assert compiled_layer(replace(block(num_ops=5), matmul_ops=8)).num_ops == 5
    assert compiled_layer(replace(block(num_ops=7), matmul_ops=0)).num_ops == 1  # all pointwise: one fused kernel
    eager = layer_timing(layer, A100, tp=1, micro_batch_size=2, dtype="bf16")
    compiled = layer_timing(compiled_layer(layer), A100, tp=1, micro_batch_size=2, dtype="bf16")
    saved = 7 * A100.op_overhead_s  # per pass: forward, input gradient, weight gradient
    assert eager.fwd_s - compiled.fwd_s == pytest.approx(saved)
    assert eager.bwd_s - compiled.bwd_s == pytest.approx(2 * saved)


def test_an_eager_layer_takes_no_less_than_its_kernels_bytes_take_to_move():
    """[Note: bytes bound]: where the kernels' bytes take longer to move than the floor
    (FLOPs, the saved activations once forward, twice backward), the layer takes that long,
    the backward's excess on B; where they take less, nothing changes; a compiled layer and
    a CPU worker have no bound; tensor parallelism splits the bytes as it splits the saved
    activations."""
    from dataclasses import replace

    from hetpar.cost_models.compute import compiled_layer

    byte_rate = 2.039e12 * HBM_STREAM_EFFICIENCY * 0.5
    base = block(num_ops=0)
    floor = layer_timing(base, A100, tp=1, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5)
    light = replace(base, fwd_bytes_accessed=1e6, bwd_bytes_accessed=2e6)
    assert layer_timing(light, A100, tp=1, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5) == floor
    heavy = replace(base, fwd_bytes_accessed=1e12, bwd_bytes_accessed=3e12)  # per sample, fp32
    t = layer_timing(heavy, A100, tp=1, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5)
    assert t.fwd_s == pytest.approx(1e12 * 2 / 2 / byte_rate)  # two samples, bf16 halves the bytes
    assert t.bwd_s == pytest.approx(3e12 * 2 / 2 / byte_rate)
    assert t.bwd_weight_s == floor.bwd_weight_s and t.bwd_input_s > floor.bwd_input_s
    assert layer_timing(compiled_layer(heavy), A100, tp=1, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5) == floor
    half = layer_timing(heavy, A100, tp=2, micro_batch_size=2, dtype="bf16", kernel_efficiency=0.5)
    keep = base.saved_bytes_at(2) / base.saved_activation_bytes  # block() splits half its saved bytes
    assert half.fwd_s == pytest.approx(1e12 * keep / byte_rate)
    cpu = get_device("cpu")  # a CPU worker's caches hold what small layers' kernels hand on: no bound
    assert layer_timing(heavy, cpu, tp=1, micro_batch_size=2, dtype="fp32") == layer_timing(base, cpu, tp=1, micro_batch_size=2, dtype="fp32")


def test_the_bytes_bound_moves_the_weights_once_per_micro_batch():
    """The trace counts one sample with the weights it reads ([Note: bytes bound]): at a
    micro-batch of 8 the activations' bytes are moved 8 times, the weights' once (read
    forward; read and their gradients written backward)."""
    from dataclasses import replace

    byte_rate = 2.039e12 * HBM_STREAM_EFFICIENCY * 0.5
    weights = 4.0 * 1e9  # fp32 bytes of a billion parameters
    layer = replace(block(params=10**9, fwd=1e6, bwd=2e6, saved=1e3, num_ops=0),
                    fwd_bytes_accessed=weights + 1e6, bwd_bytes_accessed=2 * weights + 3e6)
    t = layer_timing(layer, A100, tp=1, micro_batch_size=8, dtype="fp32", kernel_efficiency=0.5)
    assert t.fwd_s == pytest.approx((weights + 8 * 1e6) / byte_rate)
    assert t.bwd_s == pytest.approx((2 * weights + 8 * 3e6) / byte_rate)


def test_tf32_runs_matmuls_at_the_tf32_rate_on_float32_bytes():
    """[Note: TF32]: a tf32 layer is an fp32 layer on a device whose fp32 rate is its TF32
    tensor-core rate (A100: 156 against 19.5 TFLOP/s); without TF32 (V100) it is fp32."""
    from dataclasses import replace

    tf32 = layer_timing(block(), A100, tp=1, micro_batch_size=2, dtype="tf32", kernel_efficiency=0.5)
    fp32 = layer_timing(block(), A100, tp=1, micro_batch_size=2, dtype="fp32", kernel_efficiency=0.5)
    tensor_cores = replace(A100, peak_flops_per_s={**A100.peak_flops_per_s, "fp32": 156e12})
    assert tf32 == layer_timing(block(), tensor_cores, tp=1, micro_batch_size=2, dtype="fp32", kernel_efficiency=0.5)
    assert tf32.fwd_s < fp32.fwd_s / 4
    v100 = get_device("V100-32GB")
    assert "tf32" not in v100.peak_flops_per_s
    assert layer_timing(block(), v100, tp=1, micro_batch_size=2, dtype="tf32") == \
        layer_timing(block(), v100, tp=1, micro_batch_size=2, dtype="fp32")
