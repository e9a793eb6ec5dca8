"""Time of a layer's forward and backward on one device (``layer_timing``).

The search and the estimator both use it. FLOPs and bytes come from a LayerProfile
(measured on the meta device); peak, efficiency and bandwidth from the device profile.

[Note: layer time]
A training layer runs matmuls, which are bound by the tensor cores, and elementwise
kernels (norms, activations, softmax, dropout, residual adds), which are bound by
memory bandwidth; the two do not overlap within one stream, so their times add:

    fwd = matmul FLOPs / (peak * matmul_efficiency * kernel_efficiency)
          + activation bytes / (HBM bandwidth * HBM_STREAM_EFFICIENCY * kernel_efficiency)
          + ops * launch overhead
    bwd = the same with the backward's FLOPs, twice the bytes and twice the launches

"activation bytes" is what the layer saves for backward (measured, scaled to the
dtype and micro-batch): every saved byte is written by a forward kernel and read, with
its gradient written, by a backward kernel, so this is a floor on the elementwise
traffic, not a guess. ``matmul_efficiency`` is the device profile's best-case matmul
(MAMF) measurement. ``kernel_efficiency`` is the one global constant fitted to
published end-to-end measurements: what real training kernels reach of those
microbenchmark rates (shapes that are not the best one, the attention matmuls, launch
gaps, the data loader); see TRAINING_KERNEL_EFFICIENCY and docs/cost-model.md for the
data it was fitted on. The launch overhead is the profile's ``op_overhead_s`` (a
public per-op measurement in the GPU datasheet profiles, docs/devices.md; what
``hetpar profile`` measured in a measured one), else DEFAULT_OP_OVERHEAD_S: every op of
the layer pays it in the forward, in the input gradient and in the weight gradient, so
work made of many small kernels costs what its launches cost.

[Note: bytes bound]
The floor above is what fused kernels move. An eager layer runs each op as its own
kernel, which reads its operands from memory and writes its outputs back: the trace
counts those bytes per pass (``fwd_bytes_accessed``, ``bwd_bytes_accessed``; [Note: what
a kernel costs] in planner/capture/measure.py, an attention call as one fused kernel),
and the layer takes no less than they take to move at the rate above. So the forward is
the larger of its floor time and its bytes' time, and the backward's excess over its
bytes' time falls on B. It binds where kernels are bound by memory: elementwise chains
in fp32, an attention written out (the scale, the mask and the softmax each reading and
writing the s x s scores; the batched matmuls over narrow heads), small hidden sizes;
for matmul-heavy layers in half precision the floor binds. Tensor parallelism splits the
bytes of activations as it splits the saved ones; the weights' bytes are moved once per
micro-batch, not once per sample (``LayerProfile.bytes_at``). A compiled layer drops the bound ([Note:
compiled stages]), and so does a CPU worker (the ``cpu`` profile and those `hetpar
profile` measures from it): the layers a CPU trains are small enough for its caches to
hold what one kernel hands the next, so the copy bandwidth its profile states would
overprice them (it would make the README's CPU plan 17% slower), and a measured host's layer
timings carry what the floor misses ([Note: measured layers]). Sailor's GH200 runs
(TF32, attention written out in fp32, eager) and hetpar's own eager programs on an H100
and an H200 are the data it was checked on: docs/benchmarks/sailor-dev_cpu-2core_2026-12-07.md.
On a GPU the bound still prices every byte as if it left the L2 cache, which overprices
layers small enough to stay in it when run eager (a 256-wide GPT on an A100 and two
V100s: 4% slower with the bound, enough to change its plan; NVIDIA GPUs plan compiled by
default).

Zero-bubble schedules need the backward in two parts ([Note: zero-bubble split] in
runtime/schedule.py): W, the weight gradients, costs as many FLOPs as the layer's
forward matmuls (each weight is used once per token either way); B, the input
gradient, is the rest of the backward, its elementwise traffic included. A layer
without parameters has no W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hetpar.cost_models.layers import LayerProfile
from hetpar.vocabulary import DType

DTYPE_BYTES = {DType.FP32: 4, DType.TF32: 4, DType.BF16: 2, DType.FP16: 2}

# Per-op launch/dispatch cost when a profile does not state one (the built-in cpu
# profile; a measured one and the GPU datasheet profiles state ``op_overhead_s``, charged
# per op in each pass: [Note: layer time]). 5 us is the usual order of a CUDA kernel
# launch plus PyTorch dispatch (NVIDIA CUDA C++ Best Practices Guide, "kernel launch
# overhead ... a few microseconds").
DEFAULT_OP_OVERHEAD_S = 5e-6

# K = N of the matmuls of a profile's rows curve (``DeviceProfile.matmul_rows_efficiency``,
# profiler/micro.py ``matmul_row_times``); wider matmuls take that curve as it is.
ROWS_CURVE_WIDTH = 512


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype name ("fp32", "tf32", "bf16", "fp16").

    Raises:
        ValueError: unknown dtype name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


# Achievable fraction of peak HBM bandwidth for streaming kernels: STREAM triad 1.70 of
# 2.039 TB/s on A100-SXM4-80GB (83%) and 4.15 of 4.8 TB/s on H200 (86%),
# Azure/AI-benchmarking-guide ND A100 v4 and ND H200 v5 results (hardware.md section 1.1).
HBM_STREAM_EFFICIENCY = 0.83

# What end-to-end training kernels reach of the microbenchmark rates above; the one
# fitted constant of the estimator ([Note: layer time]). Fitted (0.752, rounded) by
# `benchmarks/cost_model_published.py --fit` on 15 published A100 runs: every other
# row of Narayanan et al. 2021 Tables 1 and 2 (Megatron-LM, PTD-P) and of MosaicML
# llm-foundry's A100-80GB MPT table; tested on the other rows (a refit on today's
# rows, the Megatron ones typed as they ran, attention written out and their fused
# kernels as compiled stages, gives 0.769; the constant is kept, the reason beside the
# rows). The rows, the measured and predicted step times and the errors:
# docs/benchmarks/cost-model-published_cpu-2core_2026-12-07.md.
TRAINING_KERNEL_EFFICIENCY = 0.75


@dataclass(frozen=True, kw_only=True)
class LayerTime:
    """Seconds of one micro-batch of one layer on one rank, without communication."""

    fwd_s: float
    bwd_input_s: float  # B: the gradient of the layer's input, elementwise backward included
    bwd_weight_s: float  # W: the gradients of the layer's weights
    # What selective recompute runs again in backward: of fwd_s, the memory-bound part and
    # launches, and the products of two activations ([Note: selective recompute costs]).
    selective_rerun_s: float = 0.0

    @property
    def bwd_s(self) -> float:
        """The whole backward, B + W."""
        return self.bwd_input_s + self.bwd_weight_s


# [Note: compiled stages]
# torch.compile (Inductor) keeps each matmul an extern kernel and fuses every chain of
# pointwise and reduction ops between two matmuls into one generated kernel, so a
# compiled layer launches about one kernel per matmul plus one per gap between them:
# 2 * matmuls + 1 per pass, never more than the eager ops. The launch term of
# [Note: layer time] then counts those kernels instead of the eager ops; the
# elementwise traffic is already charged at its floor (the saved activations), which
# fusion does not lower, and the eager kernels' bytes no longer bound it ([Note: bytes
# bound]): fusion keeps what passes between the fused ops on chip. The saving this
# predicts against a compiled program's measured step:
# docs/benchmarks/gpu-validate_h200_2026-12-04.md.
def compiled_layer(layer: LayerProfile) -> LayerProfile:
    """``layer`` as a compiled stage runs it: its kernel count after fusion, and no eager
    kernels' bytes to bound it ([Note: compiled stages], [Note: bytes bound])."""
    kernels = 2 * layer.matmul_ops + 1
    return replace(layer, num_ops=min(layer.num_ops, kernels), fwd_bytes_accessed=0.0, bwd_bytes_accessed=0.0)


def layer_timing(
    layer: LayerProfile, device, *, tp: int, micro_batch_size: int, dtype: str,
    kernel_efficiency: float | None = None,
) -> LayerTime:
    """Forward, input-gradient and weight-gradient seconds of one micro-batch; see [Note: layer time].

    Args:
        layer: the measured layer (per sample, fp32).
        device: a cost_models.devices.DeviceProfile.
        tp: tensor-parallel degree of the stage.
        micro_batch_size: samples per micro-batch.
        dtype: training precision, which sets peak FLOP/s and activation bytes.
        kernel_efficiency: fraction of the microbenchmark rates reached in training;
            None takes the device's own (a measured profile's) or else
            TRAINING_KERNEL_EFFICIENCY.

    Raises:
        ValueError: unknown dtype, or a non-positive efficiency.
    """
    explicit = kernel_efficiency is not None
    if kernel_efficiency is None:
        kernel_efficiency = training_efficiency(device)
    if not kernel_efficiency > 0:
        raise ValueError(f"kernel_efficiency must be positive, got {kernel_efficiency}")
    flop_rate = device.peak_flops(dtype) * device.matmul_efficiency * kernel_efficiency
    byte_rate = device.mem_bw_bytes_per_s * HBM_STREAM_EFFICIENCY * kernel_efficiency
    # A measured profile may know its backward apart ([Note: calibrated fits]); an
    # explicit kernel_efficiency (hetpar estimate --kernel-efficiency) sets both.
    own_bwd = getattr(device, "backward_kernel_efficiency", None)
    bwd_scale = own_bwd / training_efficiency(device) if own_bwd is not None and not explicit else 1.0
    bwd_flop_rate, bwd_byte_rate = flop_rate * bwd_scale, byte_rate * bwd_scale
    fwd_flops, bwd_flops = (f * micro_batch_size for f in layer.flops_at(tp))
    # [Note: matmul rows]: a measured profile knows how small matmuls fall short.
    flop_rate /= matmul_rows_slowdown(layer, device, micro_batch_size, "forward")
    bwd_flop_rate /= matmul_rows_slowdown(layer, device, micro_batch_size, "backward")
    saved = layer.saved_bytes_at(tp) * micro_batch_size * dtype_bytes(dtype) / 4
    # [Note: bytes bound]; none on a CPU worker
    moved_fwd, moved_bwd = (0.0, 0.0) if getattr(device, "cpu_host", False) else (
        b * dtype_bytes(dtype) / 4 for b in layer.bytes_at(tp, micro_batch_size))
    launch = (getattr(device, "op_overhead_s", None) or DEFAULT_OP_OVERHEAD_S) * layer.num_ops
    weight_flops = min(fwd_flops, bwd_flops / 2) if layer.params_at(tp) > 0 else 0.0
    # [Note: tensor-parallel dispatch]: a third forward, two thirds input gradient.
    sharded = (getattr(device, "tp_module_overhead_s", None) or 0.0) * layer.tp_sharded_modules if tp > 1 else 0.0
    # [Note: weight traffic]: each pass reads the weights (the weight gradient writes them).
    stream = getattr(device, "weight_stream_bytes_per_s", None)
    weights = layer.params_at(tp) * 4.0 / (stream * byte_rate / device.mem_bw_bytes_per_s) if stream else 0.0
    bwd_weights = weights / bwd_scale
    fwd_ratio, bwd_ratio = (1.0, 1.0) if explicit or tp > 1 else layer_correction(layer, device, micro_batch_size)
    rerun_flops = layer.selective_rerun_flops * micro_batch_size * (fwd_flops / (layer.fwd_flops * micro_batch_size) if layer.fwd_flops else 0.0)
    fwd = fwd_flops / flop_rate + weights + saved / byte_rate
    bwd_input = (bwd_flops - weight_flops) / bwd_flop_rate + bwd_weights + 2 * saved / bwd_byte_rate
    bwd_weight = weight_flops / bwd_flop_rate + 2 * bwd_weights
    # [Note: bytes bound]: no faster than its kernels' bytes move; the backward's excess falls on B
    fwd = max(fwd, moved_fwd / byte_rate)
    bwd_input += max(0.0, moved_bwd / bwd_byte_rate - bwd_input - bwd_weight)
    return LayerTime(
        fwd_s=(fwd + launch + sharded / 3) * fwd_ratio,
        selective_rerun_s=(rerun_flops / flop_rate + saved / byte_rate + launch) * fwd_ratio,
        bwd_input_s=(bwd_input + launch + 2 * sharded / 3) * bwd_ratio,
        bwd_weight_s=(bwd_weight + launch) * bwd_ratio,
    )


# [Note: measured layers]
# `hetpar profile --model FILE` times each layer of that model on the host, forward and
# backward, at several micro-batch sizes, in every worker at once and cut as the
# generated program cuts stages (profiler/layers.py ``layer_times``).
# cost_models/calibrate.py stores, per layer cost (LayerProfile.cost_key, so the blocks
# of a transformer share one entry and any model with the same layer reuses it), the
# ratio of the measured seconds to what ``layer_timing`` models at tp 1 on the same
# profile. ``layer_timing`` multiplies its forward by the forward ratio and both parts
# of the backward by the backward ratio: interpolated linearly in log micro-batch
# between the measured sizes and held flat beyond them. Only at tp 1, where they were
# measured: a tensor-parallel rank runs other matmul shapes, and its DTensor dispatch
# and collectives are fitted from the tensor-parallel reference step against the layer
# model itself ([Note: calibrated fits]), so a ratio measured on the whole layer does not
# carry over (docs/benchmarks/validate_cpu-2core_2026-12-03.md, "What the runs found").
# The layer model keeps what a measurement cannot see (dtype, tensor-parallel degree,
# the B/W split); the measurement is there for what the model misses on some layers
# (the shapes of small matmuls, framework time per op) that the reference workload's
# fits average away. On a host whose speed moves more within minutes than the layers'
# error it does not beat the layer model (docs/profiling.md). An explicit
# ``kernel_efficiency`` (hetpar estimate --kernel-efficiency) turns it off.
def layer_correction(layer: LayerProfile, device, micro_batch_size: int) -> tuple[float, float]:
    """(forward, backward) factors on the modelled time of ``layer`` from the device's
    measured layers; (1, 1) for a layer the profile did not measure. See [Note: measured layers]."""
    timed = getattr(device, "layer_corrections", None)
    entry = timed.get(layer.cost_key) if timed else None
    if entry is None:
        return 1.0, 1.0
    return log_interpolate(entry["forward"], micro_batch_size), log_interpolate(entry["backward"], micro_batch_size)


def matmul_rows_slowdown(layer: LayerProfile, device, micro_batch_size: int, curve: str) -> float:
    """How many times longer the layer's FLOPs take than at the device's large-matmul rate.

    Each forward matmul's share of the FLOPs runs at the device's efficiency for its
    row count and width (``matmul_efficiency``; [Note: matmul rows] in planner.capture);
    the backward's matmuls take the shares of their forward ones. 1.0 when the device
    has no such curve. The widths are the unsharded layer's: a tensor-parallel rank's
    matmuls are narrower, which the tensor-parallel fits absorb ([Note: calibrated fits]).
    """
    if not getattr(device, "matmul_rows_efficiency", {}).get(curve) or not layer.matmul_rows:
        return 1.0
    covered, slowdown = 0.0, 0.0
    for rows, grows, share, width in layer.matmul_rows:
        covered += share
        slowdown += share / matmul_efficiency(device, curve, rows * micro_batch_size if grows else rows, width)
    return max(0.0, 1.0 - covered) + slowdown


def matmul_efficiency(device, curve: str, rows: float, width: float | None) -> float:
    """The fraction of the device's peak that a matmul of ``rows`` rows and ``width`` (sqrt(K N))
    reaches: the rows curve (measured at width ``ROWS_CURVE_WIDTH``), and for a narrower
    matmul on a device that measured a narrow curve too, linear in log width between the
    two curves at those rows, flat below the narrow one ([Note: matmul rows] in planner.capture)."""
    wide = rows_efficiency(device.matmul_rows_efficiency[curve], rows)
    narrow_points = getattr(device, "matmul_narrow_efficiency", {}).get(curve)
    narrow_width = getattr(device, "matmul_narrow_width", None)
    if width is None or not narrow_points or not narrow_width or width >= ROWS_CURVE_WIDTH:
        return wide
    narrow = rows_efficiency(narrow_points, rows)
    if width <= narrow_width:
        return narrow
    t = math.log(width / narrow_width) / math.log(ROWS_CURVE_WIDTH / narrow_width)
    return narrow + t * (wide - narrow)


def rows_efficiency(points: dict[int, float], rows: float) -> float:
    """The efficiency at ``rows``: linear in log(rows) between measured row counts, flat beyond them."""
    return log_interpolate(points, rows)


def log_interpolate(points: dict[int, float], x: float) -> float:
    """The value at ``x`` of a table measured at some sizes: linear in log(x) between them, flat beyond."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    lo_x, hi_x = xs[hi - 1], xs[hi]
    t = (math.log(x) - math.log(lo_x)) / (math.log(hi_x) - math.log(lo_x))
    return points[lo_x] + t * (points[hi_x] - points[lo_x])


# [Note: weight traffic]
# Every forward reads a layer's weights, the input-gradient backward reads them again
# and the weight-gradient backward writes their gradients and accumulates them (two
# weights' worth): on a host whose cache does not hold the model from one micro-batch
# to the next, that is memory traffic on top of the FLOPs, and at small micro-batches
# it is most of a Linear's time. A measured profile sets ``weight_stream_bytes_per_s``
# to its copy bandwidth and the layer pays the weights' fp32 bytes at that rate, less
# the same kernel and stream efficiencies as its activation traffic.
# benchmarks/layer_bench.py compares the layers, with it and the row curves, against
# the same layers timed on the host (docs/benchmarks/layer-model_cpu-2core_2026-12-02.md).
# Datasheet profiles leave it unset: on a GPU at training sizes a matmul's
# weight reads hide under its FLOPs, and TRAINING_KERNEL_EFFICIENCY was fitted without
# them.
@dataclass(frozen=True)
class OptimizerRates:
    """What an optimizer step costs on a device; see ``optimizer_rates``."""

    bytes_per_s: float  # the traffic rate of the step (OPTIMIZER_BYTES_PER_PARAM per parameter)
    per_tensor_s: float  # per parameter tensor
    per_sharded_tensor_s: float  # more per tensor-parallel (DTensor) parameter tensor
    fixed_s: float  # per step: data, zero_grad, the loss report, the optimizer's calls

    def seconds(self, param_bytes: float, tensors: float, sharded_tensors: float = 0.0) -> float:
        """One step over ``param_bytes`` of optimizer traffic and that many tensors, without ``fixed_s``."""
        return param_bytes / self.bytes_per_s + tensors * self.per_tensor_s + sharded_tensors * self.per_sharded_tensor_s


def optimizer_rates(device, kernel_efficiency: float | None = None) -> OptimizerRates:
    """What an optimizer step costs on ``device``.

    A measured profile has the traffic rate an optimizer step reaches, its cost per
    parameter tensor (and per DTensor one, under tensor parallelism) and its
    ``step_overhead_s`` (what a training step costs besides the layers and the gradient
    sync; docs/profiling.md); a datasheet profile streams at the HBM rate times the
    kernel efficiency (``kernel_efficiency``, else the device's own) and has none of the
    fixed costs. planner.estimate, planner.costing, planner.search and
    cost_models.calibrate all charge the optimizer step through this.
    """
    efficiency = kernel_efficiency if kernel_efficiency is not None else training_efficiency(device)
    return OptimizerRates(
        bytes_per_s=getattr(device, "optimizer_bytes_per_s", None) or device.mem_bw_bytes_per_s * HBM_STREAM_EFFICIENCY * efficiency,
        per_tensor_s=getattr(device, "optimizer_tensor_overhead_s", None) or 0.0,
        per_sharded_tensor_s=getattr(device, "tp_optimizer_tensor_overhead_s", None) or 0.0,
        fixed_s=getattr(device, "step_overhead_s", None) or 0.0,
    )


def training_efficiency(device) -> float:
    """The fraction of ``device``'s microbenchmark rates training kernels reach.

    A measured profile carries its own (``hetpar profile`` measures the rates reached
    on the host); datasheet profiles take TRAINING_KERNEL_EFFICIENCY.
    """
    own = getattr(device, "kernel_efficiency", None)
    return own if own is not None else TRAINING_KERNEL_EFFICIENCY


# [Note: tensor-parallel dispatch]
# The generated program shards a module with DTensor (runtime/shard.py): every call
# checks and redistributes its input, runs the op on distributed tensors (sharding
# propagation in Python) and unwraps the output, in the forward and again in the
# backward. On a GPU this hides behind the kernels; on a CPU it is milliseconds per
# module. `hetpar profile` measures it (profiler/reference.py, a tiny colwise/rowwise
# block whose kernels cost nothing) and cost_models/calibrate.py fits
# ``tp_module_overhead_s`` per sharded module and micro-batch, forward plus backward;
# datasheet profiles leave it unset (zero). It is charged where the DTensor work runs:
# the forward once, the input-gradient backward twice (its redistribution and the
# gradient's); the weight gradient is a plain local matmul.
