"""Memory of one pipeline stage on one device: training state, activations, margin.

[Note: training-state bytes per parameter]
fp32 training keeps weights, gradients and Adam's two moments in fp32: 4 + 4 + 8 = 16
bytes per parameter. Mixed precision (bf16/fp16) keeps half-precision weights and
gradients plus fp32 master weights and moments: 2 + 2 + 4 + 8 = 16 bytes (ZeRO paper,
Rajbhandari et al. 2020, section 3.1: "16Ψ bytes"). SGD without momentum drops the
moments: 8 bytes (fp32) or 2 + 2 + 4 = 8 (mixed).

[Note: ZeRO stages]
ZeRO (Rajbhandari et al. 2020, section 5 and Figure 1) shards the training state over
the d data-parallel replicas: stage 1 the optimizer state (master weights and
moments), stage 2 the gradients too, stage 3 the weights too. A stage-3 rank rebuilds
each layer's full weights before using it and frees them after (DeepSpeed ZeRO-3,
PyTorch FSDP FULL_SHARD); it holds two layers' gathered weights at a time (the one
running and the one prefetched) and, in backward, the full gradient of one layer
before its reduce-scatter.

[Note: activations kept per micro-batch]
A layer keeps, per micro-batch, what autograd saves for its backward (measured on the
meta device, planner.capture):
- no recompute: every saved tensor;
- selective recompute: each layer's input and the outputs of its matmuls and attention
  ([Note: selective recompute costs] in planner/capture/measure.py), never more than
  none keeps; while a layer is rebuilt in backward, what it did not keep (the workspace);
- full recompute: only each layer's input, plus, while a layer is rebuilt in backward,
  that one layer's saved tensors for one micro-batch (the workspace).
Whatever the mode, a layer's backward also holds the gradient of an activation beside
the saved tensors, the widest at most (``LayerProfile.widest_gradient_bytes``: in a
transformer block the MLP's hidden activation, [b, s, 4h/tp]); its largest over the
stage's layers is added once, for one micro-batch, like the workspace.
A schedule keeps several micro-batches in flight on a rank; the peak comes from its
action list (runtime/schedule.py); with zero-bubble schedules a W still needs the
inputs of the layer's matmuls after B is done ([Note: zero-bubble split]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetpar.cost_models.compute import dtype_bytes
from hetpar.cost_models.layers import LayerProfile
from hetpar.vocabulary import Optimizer, Recompute, ZeroStage

# Allocator fragmentation and workspace margin on top of the tensors we count: a
# documented conservative choice (PyTorch's caching allocator typically reserves
# 5-15% above allocated bytes), not a measured constant.
FRAGMENTATION_MARGIN = 1.10


# Of a transformer layer's saved activations, the share its weight gradients (W) need
# once the input gradient (B) is done: the inputs of the four matmuls, 2sbh (QKV) +
# 2sbh (projection) + 2sbh (fc1) + 8sbh (fc2) = 14sbh of the 34sbh that Korthikanti et
# al. 2022 (section 4.1, eq. 1) count per layer without the attention matrix.
WEIGHT_GRAD_ACTIVATION_SHARE = 14 / 34

# Bytes an optimizer step moves per parameter it updates: Adam reads the gradient (2 in
# mixed precision, 4 in fp32), reads and writes the fp32 master weight (8) and both fp32
# moments (16), and writes the working copy (2; none in fp32, the master is it): 28
# either way. SGD without momentum: gradient, master read and write, copy: 12.
OPTIMIZER_BYTES_PER_PARAM = {Optimizer.ADAMW: 28, Optimizer.ADAM: 28, Optimizer.SGD: 12}


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one device of a stage needs, by term; ``total_bytes`` adds the fragmentation margin."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def raw_bytes(self) -> float:
        """The tensors counted, before the margin."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    @property
    def fragmentation_bytes(self) -> float:
        """What the caching allocator reserves on top (FRAGMENTATION_MARGIN)."""
        return self.raw_bytes * (FRAGMENTATION_MARGIN - 1)

    @property
    def total_bytes(self) -> float:
        return self.raw_bytes * FRAGMENTATION_MARGIN

    def terms(self) -> dict[str, float]:
        """Each term by name, as the misfit message and the JSON breakdown name them."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": self.optimizer_bytes,
            "activations": self.activations_bytes,
        }

    def dominant_term(self) -> str:
        """The name of the largest term."""
        terms = self.terms()
        return max(terms, key=terms.get)


def check_choices(*, optimizer: str = Optimizer.ADAMW, zero_stage: int = 0, recompute: str = Recompute.NONE) -> None:
    """Raise ValueError naming a choice this module does not know.

    Raises:
        ValueError: unknown optimizer, ZeRO stage or recompute mode; the message lists the known ones.
    """
    if optimizer not in tuple(Optimizer):
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(Optimizer)}")
    if zero_stage not in tuple(ZeroStage):
        raise ValueError(f"unknown ZeRO stage {zero_stage!r}; use one of 0, 1, 2, 3")
    if recompute not in tuple(Recompute):
        raise ValueError(f"unknown recompute {recompute!r}; use one of {', '.join(Recompute)}")


def state_bytes_per_param(dtype: str, optimizer: str = Optimizer.ADAMW) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter; see [Note: training-state bytes per parameter]."""
    w = dtype_bytes(dtype)
    master = 4 if w < 4 else 0
    moments = 0 if optimizer == Optimizer.SGD else 8
    return float(w), float(w), float(master + moments)


def training_state_bytes(
    layers: Sequence[LayerProfile], *, tp: int, dtype: str, optimizer: str = Optimizer.ADAMW, dp: int = 1, zero_stage: int = 0,
    extra_params: float = 0.0, offload: bool = False,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes one rank holds in device memory for ``layers``; see
    [Note: ZeRO stages] (and [Note: offload costs] for ``offload``: the gathered buffers only).

    Args:
        layers: the stage's layers.
        tp: tensor-parallel degree (the stage's parameters are divided by it first).
        dtype: training precision.
        optimizer: "adamw", "adam" or "sgd".
        dp: data-parallel degree, over which ZeRO shards.
        zero_stage: 0 (none) to 3.
        extra_params: parameters held besides the layers' own (a tied copy, e.g. the
            output layer's copy of the embedding on the last pipeline stage).

    Returns:
        Bytes of weights, gradients and optimizer state (master weights included).
    """
    check_choices(optimizer=optimizer, zero_stage=zero_stage)
    params = sum(l.params_at(tp) for l in layers) + extra_params
    w, g, o = sharded_state_bytes_per_param(dtype, optimizer, dp=dp, zero_stage=zero_stage, offload=offload)
    weights, grads, opt = params * w, params * g, params * o
    if zero_stage == 3 and zero_runs(dp, zero_stage, offload) and layers:
        largest = max(l.params_at(tp) for l in layers)
        w_full, g_full, _ = state_bytes_per_param(dtype, optimizer)
        weights += 2 * largest * w_full
        grads += largest * g_full
    return weights, grads, opt


def zero_runs(dp: int, zero_stage: int, offload: bool = False) -> bool:
    """Whether a stage over ``dp`` data-parallel rows runs its ZeRO stage: over two or more it
    shards; over one only ZeRO-3 with offload runs, its one shard (the whole state) in host
    memory and each module gathered from there ([Note: offload costs] in cost_models/offload.py)."""
    return zero_stage > 0 and (dp > 1 or (offload and zero_stage == 3))


def sharded_state_bytes_per_param(dtype: str, optimizer: str = Optimizer.ADAMW, *, dp: int = 1, zero_stage: int = 0,
                                  offload: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes one rank keeps in device memory per parameter of
    its stage under ZeRO ``zero_stage`` over ``dp`` replicas, between steps; see [Note: ZeRO
    stages]. None with ``offload``: the shard lives in host memory ([Note: offload costs] in
    cost_models/offload.py).

    ZeRO-3's gathered working buffers come on top (``zero3_buffer_bytes``).
    """
    if offload:
        return 0.0, 0.0, 0.0
    w, g, o = state_bytes_per_param(dtype, optimizer)
    shard = [1 / dp if zero_stage >= level else 1.0 for level in (3, 2, 1)]
    return w * shard[0], g * shard[1], o * shard[2]


def zero3_buffer_bytes(layer: LayerProfile, *, tp: int, dtype: str, optimizer: str = Optimizer.ADAMW) -> float:
    """What a ZeRO-3 rank holds gathered when ``layer`` is its stage's largest: two layers'
    full weights (running and prefetched) and one layer's full gradient; see [Note: ZeRO stages]."""
    w, g, _ = state_bytes_per_param(dtype, optimizer)
    return layer.params_at(tp) * (2 * w + g)


def activation_bytes_per_microbatch(
    layers: Sequence[LayerProfile], *, tp: int, micro_batch_size: int, dtype: str, recompute: str = Recompute.NONE,
    input_bytes: float = 0.0,
) -> float:
    """Bytes one rank keeps between the forward and backward of one micro-batch; see
    [Note: activations kept per micro-batch].

    Args:
        layers: the stage's layers, in order.
        tp: tensor-parallel degree.
        micro_batch_size: samples per micro-batch.
        dtype: training precision (measured fp32 bytes scale by its width).
        recompute: "none", "selective" or "full".
        input_bytes: per sample, fp32, what the stage's first layer receives (for full recompute).
    """
    check_choices(recompute=recompute)
    scale = dtype_bytes(dtype) / 4 * micro_batch_size
    if recompute == Recompute.NONE:
        return sum(l.saved_bytes_at(tp) for l in layers) * scale
    inputs = [input_bytes] + [l.boundary_bytes for l in layers[:-1]]
    if recompute == Recompute.SELECTIVE:
        return sum(min(l.saved_bytes_at(tp), i + l.kept_bytes_at(tp)) for l, i in zip(layers, inputs)) * scale
    return sum(inputs) * scale


def recompute_workspace_bytes(layers: Sequence[LayerProfile], *, tp: int, micro_batch_size: int, dtype: str, recompute: str) -> float:
    """Bytes a rank needs while recompute rebuilds one layer (the largest) for backward: all its saved
    tensors under full recompute, those selective recompute does not keep under selective; 0 otherwise."""
    if recompute == Recompute.NONE or not layers:
        return 0.0
    if recompute == Recompute.SELECTIVE:
        return max(l.saved_bytes_at(tp) - l.kept_bytes_at(tp) for l in layers) * dtype_bytes(dtype) / 4 * micro_batch_size
    return max(l.saved_bytes_at(tp) for l in layers) * dtype_bytes(dtype) / 4 * micro_batch_size


def backward_gradient_bytes(layers: Sequence[LayerProfile], *, tp: int, micro_batch_size: int, dtype: str) -> float:
    """Bytes of the widest activation gradient a rank holds while one of ``layers`` runs its
    backward; see [Note: activations kept per micro-batch]."""
    return max((l.widest_gradient_at(tp) for l in layers), default=0.0) * dtype_bytes(dtype) / 4 * micro_batch_size


def stage_memory(
    layers: list[LayerProfile],
    *,
    tp: int,
    micro_batch_size: int,
    in_flight: float,
    dtype: str,
    optimizer: str = Optimizer.ADAMW,
    dp: int = 1,
    zero_stage: int = 0,
    recompute: str = Recompute.NONE,
    input_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Memory of a stage holding ``layers`` on one rank, with ``in_flight`` micro-batches' activations.

    With the defaults (no ZeRO, no recompute) this is what the search has always used.

    Args:
        layers: the stage's layers.
        tp: tensor-parallel degree.
        micro_batch_size: samples per micro-batch.
        in_flight: micro-batches whose activations the schedule keeps at once on this stage.
        dtype: training precision.
        optimizer: "adamw", "adam" or "sgd".
        dp: data-parallel degree (ZeRO shards over it).
        zero_stage: 0 to 3; see [Note: ZeRO stages].
        recompute: "none", "selective" or "full"; see [Note: activations kept per micro-batch].
        input_bytes: per sample, fp32, the stage's input (full recompute keeps it).
    """
    weights, grads, opt = training_state_bytes(layers, tp=tp, dtype=dtype, optimizer=optimizer, dp=dp, zero_stage=zero_stage)
    per_mb = activation_bytes_per_microbatch(
        layers, tp=tp, micro_batch_size=micro_batch_size, dtype=dtype, recompute=recompute, input_bytes=input_bytes
    )
    workspace = recompute_workspace_bytes(layers, tp=tp, micro_batch_size=micro_batch_size, dtype=dtype, recompute=recompute)
    workspace += backward_gradient_bytes(layers, tp=tp, micro_batch_size=micro_batch_size, dtype=dtype)
    return MemoryBreakdown(
        weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=per_mb * in_flight + workspace
    )
