"""Time of a layer's forward and backward on one device: a roofline plus launch overhead.

time = max(FLOPs / (peak * efficiency), bytes moved / memory bandwidth) + ops * overhead

FLOPs and bytes come from a LayerProfile (measured on the meta device); peak,
efficiency and bandwidth from the device profile. Backward launches about twice the
kernels of forward.
"""

from __future__ import annotations

from cost_models.layers import LayerProfile

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Per-op launch/dispatch cost when a profile does not state one. 5 us is the usual
# order of a CUDA kernel launch plus PyTorch dispatch (NVIDIA CUDA C++ Best Practices
# Guide, "kernel launch overhead ... a few microseconds"); a calibrated profile replaces it.
DEFAULT_OP_OVERHEAD_S = 5e-6


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype name ("fp32", "bf16", "fp16").

    Raises:
        ValueError: unknown dtype name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def layer_time_s(layer: LayerProfile, device, *, tp: int, micro_batch_size: int, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of ``layer`` on one rank of ``device``.

    Args:
        layer: the measured layer (per sample, fp32).
        device: a cost_models.devices.DeviceProfile.
        tp: tensor-parallel degree of the stage.
        micro_batch_size: samples per micro-batch.
        dtype: training precision, which sets peak FLOP/s and activation bytes.
    """
    scale = dtype_bytes(dtype) / 4
    fwd_flops, bwd_flops = layer.flops_at(tp)
    rate = device.peak_flops(dtype) * device.matmul_efficiency
    weight_bytes = layer.params_at(tp) * dtype_bytes(dtype)
    act_bytes = (layer.saved_bytes_at(tp) + layer.boundary_bytes) * micro_batch_size * scale
    bw = device.mem_bw_bytes_per_s
    overhead = getattr(device, "op_overhead_s", DEFAULT_OP_OVERHEAD_S) * layer.num_ops
    fwd = max(fwd_flops * micro_batch_size / rate, (weight_bytes + act_bytes) / bw) + overhead
    bwd = max(bwd_flops * micro_batch_size / rate, (2 * weight_bytes + 2 * act_bytes) / bw) + 2 * overhead
    return fwd, bwd
