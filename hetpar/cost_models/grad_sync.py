"""What one step's data-parallel synchronisation costs under each way replicas agree.

[Note: sync method costs]
``sync_seconds`` prices the methods runtime.data_parallel runs (runtime/sync_spec.py
names them), for ``params`` gradient elements of one stage over its ``dp`` replicas.
Each is the collective it actually sends plus the memory traffic of its encoding, where
the encoding's traffic is counted from the runtime's operations (bytes each reads and
writes per element, constants below), at the device's memory bandwidth:

| method | collective (bytes per element and replica) | encoding |
|---|---|---|
| none | all-reduce, training dtype | none |
| bf16, fp16 | all-reduce, 2 | cast in and out |
| powersgd:R | all-reduce of P and Q, 4 * R * (m + n) / (m n) ~ 8 R / w | 6 R FLOPs (P = M Q, Q = M^T P, M ~ P Q^T) and error feedback |
| topk:F | all-gather, 8 F (4-byte value, 4-byte index) | select, residual; decode every replica's payload |
| sign | all-gather, 1/8 | signs, scale, residual; decode every replica's bits |
| trimmed-mean, median | all-gather, training dtype | sort dp values per element |
| krum:F | all-gather + all-reduce, training dtype | dp (dp - 1) / 2 squared distances per element |
| local SGD K | all-reduce of parameters and optimizer state (fp32), once per K steps; scope "node": plus a gradient all-reduce inside the node every step | none |

``w`` is the model's typical weight-matrix width (the FLOP-weighted sqrt(K N) of its
matmuls): PowerSGD compresses each m x n gradient to r (m + n) numbers, about 2 r / w
of it for a near-square matrix; vectors (biases, norms) go uncompressed, and an
embedding with no matmul is counted uncompressed too (an upper bound).
An all-gather's time is that of its gathered output, dp payloads. Gradients are
charged in the training dtype, as the plain all-reduce is (Megatron's convention),
so the methods compare on one footing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hetpar.cost_models.collectives import all_gather_time_s, all_reduce_time_s
from hetpar.vocabulary import AggregationKind, CompressionKind, DType, Optimizer, SyncScope

# Memory traffic of each encoding, in bytes per gradient element, counted from the
# runtime's tensor operations (each reads its inputs and writes its output once):
CAST_BYTES = 12.0  # fp32 -> 16-bit (read 4, write 2), after the reduce 16-bit -> fp32 (read 2, write 4)
POWERSGD_FEEDBACK_BYTES = 28.0  # gradient + error (read 8, write 4), new error (read 8, write 4), decompressed (write 4)
TOPK_ENCODE_BYTES = 36.0  # + residual (12), |.| (8), selection (read 4), gather values (4), zero the sent in the residual (8)
TOPK_DECODE_BYTES_PER_SENT = 16.0  # index_add: read index and value (8), read-modify-write the element (8)
SIGN_ENCODE_BYTES = 45.0  # + residual (12), mean |.| (4), >= 0 (5), +-s (9), new residual (12), bit packing (3)
SIGN_DECODE_BYTES_PER_REPLICA = 24.0  # unpack to int32 bits (read 1/8, write 4), +-s (8), accumulate (12)
SORT_BYTES_PER_VALUE = 24.0  # a sort along dp reads and writes each gathered value and its index, then the kept ones are summed
DISTANCE_BYTES_PER_PAIR = 24.0  # two rows read as float64 (16), the squared difference written and summed (8)
OPTIMIZER_STATE_BYTES = {Optimizer.SGD: 0.0, Optimizer.ADAMW: 8.0}  # float32 state per parameter local SGD averages (AdamW's moments)


@dataclass(frozen=True, kw_only=True)
class SyncMethod:
    """How a stage's replicas agree, as the cost model sees it (planner.strategies builds it
    from the plan's options)."""

    name: str = CompressionKind.NONE  # as the plan or the user writes it, for reports
    kind: str = CompressionKind.NONE  # none | cast | powersgd | topk | sign | coordinate | krum | local_sgd
    rank: int = 1  # powersgd: approximation rank
    fraction: float = 1.0  # topk: share of the elements sent
    width: float = 1.0  # powersgd: the model's typical weight-matrix width
    every: int = 1  # local SGD: steps between syncs
    inside_node: bool = False  # local SGD with sync_scope "node": gradients all-reduced inside the node every step
    state_bytes: float = 0.0  # local SGD: optimizer state bytes per parameter averaged with it

    @property
    def plain(self) -> bool:
        return self.kind == CompressionKind.NONE


PLAIN = SyncMethod()

# collective(kind, nbytes, scope) -> seconds: "all_reduce" or "all_gather" (nbytes: the
# gathered output) over the data-parallel group (scope "all") or its ranks on one node ("node").
Collective = Callable[[str, float, str], float]


def collective_over(group: Sequence[int], cluster, *, concurrent: int = 1) -> Collective:
    """The ``Collective`` of the data-parallel ``group`` (first ranks of the replicas) on ``cluster``."""
    inside = [r for r in group if cluster.node_of(r) == cluster.node_of(group[0])]
    times = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s}

    def seconds(kind: str, nbytes: float, scope: str) -> float:
        return times[kind](nbytes, inside if scope == SyncScope.NODE else list(group), cluster, concurrent=concurrent)

    return seconds


def sync_seconds(method: SyncMethod, params: float, elem_bytes: float, dp: int, device, collective: Collective) -> float:
    """Seconds of one step's synchronisation of ``params`` gradient elements over ``dp``
    replicas; see [Note: sync method costs].

    Args:
        elem_bytes: bytes of one element in the training dtype.
        device: the stage's DeviceProfile (memory bandwidth, FP32 peak).
    """
    if dp == 1:
        return 0.0
    memory_s = params / device.mem_bw_bytes_per_s  # seconds per byte of traffic per element, times params
    k = method.kind
    if k == CompressionKind.NONE:
        return collective("all_reduce", params * elem_bytes, SyncScope.ALL)
    if k == "cast":
        return collective("all_reduce", params * 2, SyncScope.ALL) + CAST_BYTES * memory_s
    if k == CompressionKind.POWERSGD:
        share = min(1.0, 2 * method.rank / method.width)
        flops_s = 6 * method.rank * params / device.peak_flops(DType.FP32)
        return collective("all_reduce", params * 4 * share, SyncScope.ALL) + flops_s + POWERSGD_FEEDBACK_BYTES * memory_s
    if k == CompressionKind.TOPK:
        sent = method.fraction * dp
        return (collective("all_gather", dp * params * 8 * method.fraction, SyncScope.ALL)
                + (TOPK_ENCODE_BYTES + 4 + TOPK_DECODE_BYTES_PER_SENT * sent) * memory_s)
    if k == CompressionKind.SIGN:
        return collective("all_gather", dp * params / 8, SyncScope.ALL) + (SIGN_ENCODE_BYTES + SIGN_DECODE_BYTES_PER_REPLICA * dp) * memory_s
    if k == "coordinate":
        return collective("all_gather", dp * params * elem_bytes, SyncScope.ALL) + SORT_BYTES_PER_VALUE * dp * memory_s
    if k == AggregationKind.KRUM:
        pairs = dp * (dp - 1) / 2
        return (collective("all_gather", dp * params * elem_bytes, SyncScope.ALL) + collective("all_reduce", params * elem_bytes, SyncScope.ALL)
                + DISTANCE_BYTES_PER_PAIR * pairs * memory_s)
    if k == "local_sgd":
        inside = collective("all_reduce", params * elem_bytes, SyncScope.NODE) if method.inside_node else 0.0
        return inside + collective("all_reduce", params * (4 + method.state_bytes), SyncScope.ALL) / method.every
    raise ValueError(f"unknown sync method kind {k!r}")


__all__ = ["Collective", "OPTIMIZER_STATE_BYTES", "PLAIN", "SyncMethod", "collective_over", "sync_seconds"]
