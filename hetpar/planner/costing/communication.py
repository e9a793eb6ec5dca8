"""Communication as the cost tables price it: a collective as latency plus seconds per byte,
the hand-off of a boundary tensor between stages, and a step's gradient synchronisation."""

from __future__ import annotations

import numpy as np

from hetpar.cost_models.collectives import all_gather_time_s, all_reduce_time_s, grad_sync_scale, p2p_time_s, reduce_scatter_time_s
from hetpar.cost_models.grad_sync import PLAIN, SyncMethod, sync_seconds
from hetpar.planner.costing.cache import memo
from hetpar.planner.costing.slots import StageSlot
from hetpar.vocabulary import SyncScope


# The size at which a collective's per-byte cost is read off the collective model:
# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
_DP_BUCKET_BYTES = 25 * 2**20


def collective_linear(time_s, ranks: list[int], cluster, concurrent: int = 1) -> tuple[float, float]:
    """(latency s, s per byte) of a collective ``time_s(nbytes, ranks, cluster, concurrent=...)`` among ``ranks``."""
    if len(ranks) < 2:
        return 0.0, 0.0
    latency = time_s(1, ranks, cluster, concurrent=concurrent)
    per_byte = (time_s(_DP_BUCKET_BYTES, ranks, cluster, concurrent=concurrent) - latency) / _DP_BUCKET_BYTES
    return latency, max(per_byte, 0.0)


def placement(cluster, ranks: list[int]) -> tuple:
    """How ranks sit in the cluster: groups that agree on this cost the same collectives."""
    groups, nodes = cluster.nodes_of(ranks)
    return tuple(id(cluster.groups[g]) for g in np.unique(groups)), groups.tobytes(), (nodes - nodes[0]).tobytes()


def boundary_seconds(nbytes: float, src: list[int], dst: list[int], cluster, scatter_gather: bool = True) -> float:
    """One hand-off of a ``nbytes`` boundary tensor from the tensor-parallel group ``src`` to ``dst``, one way;
    see [Note: per-stage tensor parallelism]."""
    a, b = len(src), len(dst)
    if a == b and a > 1 and scatter_gather:
        return p2p_time_s(nbytes / a, src[0], dst[0], cluster) + all_gather_time_s(nbytes, dst, cluster)
    return -(-b // a) * p2p_time_s(nbytes, src[0], dst[0], cluster)


def data_parallel_linear(cluster, dp: int, tp: int, slot: StageSlot, cache: dict) -> dict[str, tuple[float, float]]:
    """(latency, per byte) of all-reduce, reduce-scatter and all-gather over the stage's replicas, and
    (``node_all_reduce``) of an all-reduce over those on the first replica's node."""
    group = [rep[0] for rep in slot.ranks]
    key = ("dp", tp, placement(cluster, group))

    def fit() -> dict[str, tuple[float, float]]:
        fns = {"all_reduce": all_reduce_time_s, "reduce_scatter": reduce_scatter_time_s, "all_gather": all_gather_time_s}
        fits = {name: collective_linear(fn, group, cluster, tp) for name, fn in fns.items()}
        inside = [r for r in group if cluster.node_of(r) == cluster.node_of(group[0])]
        return {**fits, "node_all_reduce": collective_linear(all_reduce_time_s, inside, cluster, tp)}

    return memo(cache, key, fit)


def sync_linear(comm: dict[str, tuple[float, float]], dp: int, zero_stage: int, device, microbatches: int,
                 sync: SyncMethod = PLAIN, elem_bytes: float = 4.0) -> tuple[float, float]:
    """(latency, seconds per byte of gradient in the training dtype) of the gradient
    synchronisation of a step on ``device``: an all-reduce, or the replicas' ``sync``
    method ([Note: sync method costs]); ZeRO-1's reduce-scatter and all-gather; ZeRO-2's
    reduce-scatter after every micro-batch's backward ([Note: ZeRO through FSDP2] in
    runtime/data_parallel.py) and all-gather; none under ZeRO-3 (per micro-batch,
    elsewhere). Times the device's ``grad_sync_scale``."""
    if dp == 1 or zero_stage == 3:
        return 0.0, 0.0
    scale = grad_sync_scale(device)
    if zero_stage == 0 and not sync.plain:
        def linear(kind: str, nbytes: float, scope: str) -> float:
            a, b = comm["node_all_reduce" if scope == SyncScope.NODE else kind]
            return a + b * nbytes
        latency = sync_seconds(sync, 0.0, elem_bytes, dp, device, linear)
        per_param = sync_seconds(sync, 1.0, elem_bytes, dp, device, linear) - latency
        return latency * scale, per_param / elem_bytes * scale
    if zero_stage == 0:
        a, b = comm["all_reduce"]
        return a * scale, b * scale
    scatters = microbatches if zero_stage == 2 else 1
    (a, b), (c, d) = comm["reduce_scatter"], comm["all_gather"]
    return (scatters * a + c) * scale, (scatters * b + d) * scale
