"""What an estimated step costs, piece by piece: each virtual stage's actions on one
micro-batch (compute, tensor-parallel and ZeRO-3 communication), a boundary hand-off,
and each pipeline rank's gradient synchronisation and optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.collectives import (
    EXCHANGES_PER_DISPATCH, all_gather_time_s, all_to_all_time_s, context_exchange_s, grad_sync_scale,
    reduce_scatter_time_s, tensor_parallel_pass_s,
)
from hetpar.cost_models.compute import LayerTime, dtype_bytes, layer_timing, optimizer_rates
from hetpar.cost_models.devices import DeviceProfile
from hetpar.cost_models.grad_sync import collective_over, sync_seconds
from hetpar.cost_models.layers import LayerProfile
from hetpar.cost_models.memory import OPTIMIZER_BYTES_PER_PARAM, zero_runs
from hetpar.cost_models.offload import host_optimizer_s, offload_transfer_s
from hetpar.planner.costing import boundary_seconds
from hetpar.planner.estimate.config import EstimateConfig
from hetpar.planner.estimate.layout import StageLayout
from hetpar.planner.model_graph import ModelGraph
from hetpar.runtime.schedule import Kind
from hetpar.vocabulary import Recompute


@dataclass(frozen=True, kw_only=True)
class ChunkCost:
    """One virtual stage, one micro-batch: compute and communication of each action kind."""

    fwd_compute_s: float
    fwd_tp_s: float
    b_compute_s: float  # input gradient, plus the recomputed forward under full recompute
    b_tp_s: float
    w_compute_s: float
    zero3_fwd_s: float  # ZeRO-3 gathers and reduce-scatters, before and after the compute
    zero3_bwd_s: float
    fwd_ep_s: float = 0.0  # expert-parallel all-to-alls ([Note: expert parallelism costs]), counted in the tp part
    b_ep_s: float = 0.0
    fwd_cp_s: float = 0.0  # context-parallel exchanges ([Note: context parallelism costs]), counted in the tp part
    b_cp_s: float = 0.0
    fwd_host_s: float = 0.0  # an offloaded shard over the host link ([Note: offload costs]), counted in the ZeRO-3 part
    b_host_s: float = 0.0

    def seconds(self, kind: Kind, split_weights: bool) -> tuple[float, float, float]:
        """(compute, tensor-parallel and expert-parallel, exposed ZeRO-3) seconds of one action.

        ZeRO-3's collectives are all counted exposed, the stage's bytes with one
        collective's latency per pass: the program gathers each module it calls on its own
        ([Note: ZeRO through FSDP2] in runtime/data_parallel.py) and FSDP2 prefetches the
        next under the current one's compute, so the bytes' time is an upper bound; the
        latencies of the many small gathers are not counted one by one.
        """
        if kind is Kind.FORWARD:
            compute, tp, gather = self.fwd_compute_s, self.fwd_tp_s + self.fwd_ep_s + self.fwd_cp_s, self.zero3_fwd_s
        elif kind is Kind.WEIGHT:
            return self.w_compute_s, 0.0, 0.0
        else:
            compute = self.b_compute_s + (0.0 if split_weights else self.w_compute_s)
            tp, gather = self.b_tp_s + self.b_ep_s + self.b_cp_s, self.zero3_bwd_s
        return compute, tp, gather

    def ep_seconds(self, kind: Kind) -> float:
        """The expert-parallel part of ``seconds``'s second value."""
        return self.fwd_ep_s if kind is Kind.FORWARD else 0.0 if kind is Kind.WEIGHT else self.b_ep_s

    def cp_seconds(self, kind: Kind) -> float:
        """The context-parallel part of ``seconds``'s second value."""
        return self.fwd_cp_s if kind is Kind.FORWARD else 0.0 if kind is Kind.WEIGHT else self.b_cp_s

    def host_seconds(self, kind: Kind) -> float:
        """The host-link part of ``seconds``'s third value (offload)."""
        return self.fwd_host_s if kind is Kind.FORWARD else 0.0 if kind is Kind.WEIGHT else self.b_host_s


def chunk_cost(model: ModelGraph, cluster: Cluster, config: EstimateConfig, bounds, layout: StageLayout, chunk: int,
                memo: dict) -> ChunkCost:
    """One chunk's action seconds; ``memo`` keeps each layer kind's tensor-parallel collectives over one group for the estimate."""
    first, last = bounds
    layers = model.layers[first : last + 1]
    if config.sp_of(chunk % config.pp):  # [Note: sequence parallelism costs]
        layers = [l.with_sequence_parallel(config.recompute_of(chunk) == Recompute.NONE) for l in layers]
    device = cluster.profile(layout.device_type)
    tp = config.tp_of(chunk % config.pp)
    load = config.expert_imbalance if config.ep > 1 else 1.0  # [Note: expert load]
    kinds = model.layer_kinds[first : last + 1]  # each kind of layer timed once
    by_kind: dict[int, LayerTime] = {}
    for l, kind in zip(layers, kinds):
        if kind not in by_kind:
            by_kind[kind] = layer_timing(l.with_expert_load(load), device, tp=tp, micro_batch_size=config.micro_batch_size,
                                         dtype=config.dtype, kernel_efficiency=config.kernel_efficiency)
    times = [by_kind[kind] for kind in kinds]
    scale = config.micro_batch_size * dtype_bytes(config.dtype) / 4
    group = tuple(layout.ranks[0])

    def pass_s(l: LayerProfile, p: str) -> float:
        key = (l.tp_collectives, p, scale, group)
        if key not in memo:
            memo[key] = tensor_parallel_pass_s(l.tp_collectives, p, scale, layout.ranks[0], cluster)
        return memo[key]

    tp_fwd, tp_bwd = (sum(pass_s(l, p) for l in layers) for p in ("forward", "backward"))
    fwd = sum(t.fwd_s for t in times)
    full = config.recompute_of(chunk) == Recompute.FULL
    replay = config.recompute_of(chunk) != Recompute.NONE  # the forward's collectives run again in backward
    refwd = sum(t.selective_rerun_s for t in times) if config.recompute_of(chunk) == Recompute.SELECTIVE else 0.0
    gather_fwd, gather_bwd = zero3_comm_s(layers, cluster, config, layout, config.zero_of(chunk % config.pp),
                                          config.offload_of(chunk % config.pp))
    host_fwd, host_bwd = offload_host_s(layers, cluster, config, layout, config.zero_of(chunk % config.pp),
                                        config.offload_of(chunk % config.pp))
    ep_fwd, ep_bwd = expert_exchange_s(layers, cluster, config, layout, memo)
    cp_fwd, cp_bwd = context_exchange_total_s(layers, cluster, config, layout, memo)
    return ChunkCost(
        fwd_cp_s=cp_fwd,
        b_cp_s=cp_bwd + (cp_fwd if replay else 0.0),
        fwd_ep_s=ep_fwd,
        b_ep_s=ep_bwd + (ep_fwd if replay else 0.0),
        fwd_compute_s=fwd,
        fwd_tp_s=tp_fwd,
        b_compute_s=sum(t.bwd_input_s for t in times) + (fwd if full else 0.0) + refwd,
        b_tp_s=tp_bwd + (tp_fwd if replay else 0.0),
        w_compute_s=sum(t.bwd_weight_s for t in times),
        zero3_fwd_s=gather_fwd,
        zero3_bwd_s=gather_bwd,
        fwd_host_s=host_fwd,
        b_host_s=host_bwd,
    )


def expert_exchange_s(layers, cluster: Cluster, config: EstimateConfig, layout: StageLayout, memo: dict
                      ) -> tuple[float, float]:
    """The expert-parallel all-to-alls of ``layers`` per micro-batch over the stage's first ``ep`` replicas,
    (forward, backward): each layer's rows there and back in each pass, and the forward's small exchanges of
    counts and expert numbers ([Note: expert parallelism costs])."""
    if config.ep == 1:
        return 0.0, 0.0
    group = [replica[0] for replica in layout.ranks[: config.ep]]
    scale = config.micro_batch_size * dtype_bytes(config.dtype) / 4
    tp = len(layout.ranks[0])
    small = EXCHANGES_PER_DISPATCH * all_to_all_time_s(8.0 * config.ep, group, cluster, concurrent=tp)
    rows = 0.0
    moe_layers = 0
    for l in layers:
        if l.routed_bytes:
            nbytes = l.routed_bytes * config.expert_imbalance * scale  # the busiest rank's rows ([Note: expert load])
            key = ("a2a", nbytes, tuple(group), tp)
            if key not in memo:
                memo[key] = all_to_all_time_s(nbytes, group, cluster, concurrent=tp)
            rows += 2 * memo[key]
            moe_layers += 1
    return rows + moe_layers * small, rows


def context_exchange_total_s(layers, cluster: Cluster, config: EstimateConfig, layout: StageLayout, memo: dict
                             ) -> tuple[float, float]:
    """The context-parallel key and value exchanges of ``layers`` per micro-batch over the stage's
    first ``cp`` rows, (forward, backward) ([Note: context parallelism costs] in cost_models/collectives.py)."""
    if config.cp == 1:
        return 0.0, 0.0
    group = [replica[0] for replica in layout.ranks[: config.cp]]
    tp = len(layout.ranks[0])
    scale = config.micro_batch_size * dtype_bytes(config.dtype) / 4
    fwd = bwd = 0.0
    for l in layers:
        nbytes = l.attention_kv_bytes * scale / (tp if l.tp_capable else 1)
        key = ("cp", nbytes, tuple(group), tp)
        if key not in memo:
            memo[key] = context_exchange_s(nbytes, group, cluster, concurrent=tp)
        fwd, bwd = fwd + memo[key][0], bwd + memo[key][1]
    return fwd, bwd


def zero3_comm_s(layers, cluster: Cluster, config: EstimateConfig, layout: StageLayout, zero_stage: int,
                 offload: bool = False) -> tuple[float, float]:
    """ZeRO-3, per micro-batch: gather the weights for forward; gather again and reduce-scatter the gradients in
    backward; data-parallel synchronisation inside the step, so times the device's ``grad_sync_scale``."""
    if zero_stage < 3 or not zero_runs(config.replica_rows, zero_stage, offload):
        return 0.0, 0.0
    tp = len(layout.ranks[0])
    fwd = bwd = 0.0
    if config.replica_rows > 1:  # over one row (offload) FSDP2's gathers cross no link
        nbytes = sum(l.params_at(tp) for l in layers) * dtype_bytes(config.dtype)
        group = [replica[0] for replica in layout.ranks]
        scale = grad_sync_scale(cluster.profile(layout.device_type))
        gather = all_gather_time_s(nbytes, group, cluster, concurrent=tp) * scale
        fwd, bwd = gather, gather + reduce_scatter_time_s(nbytes, group, cluster, concurrent=tp) * scale
    to_device, both_ways = offload_host_s(layers, cluster, config, layout, zero_stage, offload)
    return fwd + to_device, bwd + both_ways


def offload_host_s(layers, cluster: Cluster, config: EstimateConfig, layout: StageLayout, zero_stage: int,
                   offload: bool) -> tuple[float, float]:
    """Of ``zero3_comm_s``, the seconds an offloaded shard spends on the host link per micro-batch, (forward,
    backward); see [Note: offload costs]."""
    if not offload or zero_stage < 3:
        return 0.0, 0.0
    tp = len(layout.ranks[0])
    return offload_transfer_s(sum(l.params_at(tp) for l in layers) / config.replica_rows, config.dtype,
                              cluster.profile(layout.device_type))


def boundary_s(model: ModelGraph, cluster: Cluster, config: EstimateConfig, last_layer: int,
                src: StageLayout, dst: StageLayout) -> float:
    """Seconds to hand one micro-batch's boundary tensor from ``src`` to ``dst`` (either direction)."""
    nbytes = model.layers[last_layer].boundary_bytes * config.micro_batch_size * dtype_bytes(config.dtype) / 4
    return boundary_seconds(nbytes, src.ranks[0], dst.ranks[0], cluster, config.scatter_gather)


def stage_params(model: ModelGraph, tp: int, chunks: list[tuple[int, int]], ep: int = 1) -> float:
    """Parameters a rank of these chunks holds and updates, a tied copy included ([Note: ZeRO stages]);
    1/ep of the experts' ([Note: expert parallelism costs])."""
    layers = [l for first, last in chunks for l in range(first, last + 1)]
    params = sum(model.layers[l].params_at(tp) - model.layers[l].expert_params * (1 - 1 / ep) for l in layers)
    if 0 not in layers:
        params += sum(model.layers[l].tied_at(tp) for l in layers)
    return params


def synced_params(model: ModelGraph, tp: int, chunks: list[tuple[int, int]], dp: int, ep: int) -> float:
    """Of ``stage_params``, those whose gradients the replicas synchronise: the experts' are averaged over
    dp / ep replicas, priced as the data-parallel group's (none when dp == ep)."""
    held = stage_params(model, tp, chunks, ep)
    if dp > ep:
        return held
    return held - sum(model.layers[l].expert_params / ep for first, last in chunks for l in range(first, last + 1))


def dp_sync_s(params: float, cluster: Cluster, config: EstimateConfig, layout: StageLayout, zero_stage: int) -> float:
    """The gradient synchronisation of one pipeline rank in a step: an all-reduce; ZeRO-1's reduce-scatter and
    all-gather; ZeRO-2's reduce-scatter after every micro-batch's backward ([Note: ZeRO through FSDP2] in
    runtime/data_parallel.py) and all-gather (ZeRO-3 synchronises per micro-batch, in ``zero3_comm_s``)."""
    if config.replica_rows == 1 or zero_stage == 3:
        return 0.0
    nbytes = params * dtype_bytes(config.dtype)
    group, kw = [replica[0] for replica in layout.ranks], {"concurrent": len(layout.ranks[0])}
    scale = grad_sync_scale(cluster.profile(layout.device_type))
    if zero_stage == 0:
        return sync_seconds(config.sync, params, dtype_bytes(config.dtype), config.replica_rows, cluster.profile(layout.device_type),
                            collective_over(group, cluster, **kw)) * scale
    scatters = config.num_microbatches if zero_stage == 2 else 1
    return (scatters * reduce_scatter_time_s(nbytes, group, cluster, **kw) + all_gather_time_s(nbytes, group, cluster, **kw)) * scale


def optimizer_s(params: float, tensors: int, sharded_tensors: int, device: DeviceProfile, config: EstimateConfig,
                 zero_stage: int, offload: bool = False) -> float:
    """One optimizer step over this rank's share of the parameters: bound by memory traffic.

    A measured profile has the traffic rate an optimizer step reaches and its cost per
    parameter tensor (more for a DTensor one), and adds its ``step_overhead_s``: what a training step costs
    besides the layers and the gradient sync (docs/profiling.md); datasheet profiles
    have none of these.
    """
    share = params / config.replica_rows if zero_stage >= 1 else params
    if offload:  # stepped by the host CPUs ([Note: offload costs])
        return host_optimizer_s(share, config.optimizer, device)
    rates = optimizer_rates(device, config.kernel_efficiency)
    return rates.seconds(share * OPTIMIZER_BYTES_PER_PARAM[config.optimizer], tensors, sharded_tensors) + rates.fixed_s
