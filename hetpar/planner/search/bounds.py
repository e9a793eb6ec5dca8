"""Bounds that spare the search's CP-SAT solves: on a candidate's objective before its
tables are built ([Note: candidate bound]), on the pace its degrees allow ([Note: degree
budget bound]), and on whether it can fit in memory at all.

planner.search.solve orders and prunes its candidates with them; planner.search.split_model holds
the bound that reads a candidate's tables ([Note: pace bound]).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
import numpy as np

from hetpar.cost_models.collectives import p2p_time_s
from hetpar.cost_models.compute import dtype_bytes, optimizer_rates
from hetpar.cost_models.memory import FRAGMENTATION_MARGIN, OPTIMIZER_BYTES_PER_PARAM, sharded_state_bytes_per_param
from hetpar.cost_models.pipeline import linear_step_weights
from hetpar.planner.costing import (
    Candidate,
    StageSlot,
    activation_multipliers,
    data_parallel_linear,
    layer_columns,
    memo,
    model_token,
    model_variant,
    stage_slots,
    sync_linear,
    tp_collectives,
    type_sequence,
    type_slots,
)
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions
from hetpar.planner.search.split_model import budget_reaches
from hetpar.vocabulary import Optimizer, Recompute


# [Note: candidate bound]
# Whatever the split and the stage modes, [Note: linear step time] is at least
#     (A sum_l min_k (t_l(k) - (B/A) w_l(k)) + A (C - 1) cut + G pace + H max_l min_k w_l(k)
#      + E (min latency + sum_l min e_l / pp)) / scale
# with A, B, G, H, E, scale the schedule's weights (cost_models.pipeline.linear_step_weights),
# where k runs over device types and offered degrees, t_l(k) is layer l's micro-batch
# time (tensor-parallel all-reduces included, or sequence parallelism's collectives where
# they are offered and cost less; recomputation only if every offered mode
# recomputes), t_l = min_k t_l(k), w_l(k) its weight-gradient part, e_l the least epilogue
# (gradient sync and optimizer step) of the layer over the offered modes and types. The
# pace (the slowest chunk, or round) is at least max_l t_l and two averages: W / R, with
# W = sum_l t_l and R = sum over pipeline ranks of the rank type's relative speed
# r = max_l t_l / min over degrees t_l(type) (the ranks together do all the work once,
# and in the time M of the slowest a rank does at most M r of it); and the same in
# device-seconds, D / S, with d_l = min over types and degrees of tp t_l, D = sum_l d_l and
# S = sum over types of (devices per replica) * max_l d_l / min over degrees tp t_l(type)
# (a stage of degree tp runs its layers on tp devices: it is what bounds a plan whose
# stages must take small degrees; [Note: per-stage tensor parallelism]); with one chunk
# per rank, also the bottleneck split of whole layers ([Note: partition pace]). The slowest
# epilogue is at least the average one, and each of the C - 1 cuts costs at least the
# cheapest p2p of any boundary, split the most ways, to any other device. ZeRO-3's
# exposed gathers and the one-layer buffers are left out (they only add). Candidates
# are solved in order of this bound, and the search stops at the first whose bound is
# no better than the best plan found, so the plan it returns is optimal over all of them.
def lower_bound_s(model: ModelGraph, cluster, cand: Candidate, dtype: str, cache: dict | None = None, optimizer: str = Optimizer.ADAMW,
                  stage_devices: tuple[str, ...] | None = None) -> float:
    """A lower bound on the objective of any split of ``cand``; see [Note: candidate bound].

    Args:
        cache: reused across candidates: per-layer times depend only on (tp, micro-batch
            size, device type, the tensor-parallel group's placement).
        stage_devices: the device type of each pipeline rank, where the search's options pin them.
    """
    cache = {} if cache is None else cache
    rest, pace, wt = _bound_terms(model_variant(model, cache, cp=cand.cp), cluster, cand, dtype, cache, optimizer, stage_devices)
    return (rest + wt.round_max * pace) / wt.scale


def _bound_terms(model: ModelGraph, cluster, cand: Candidate, dtype: str, cache: dict, optimizer: str,
                 stage_devices: tuple[str, ...] | None = None):
    """(every term of [Note: candidate bound] but the pace's, weighted; the pace bound; the schedule's weights)."""
    shares = memo(cache, ("shares", cand.dp, cand.tp_degrees, cand.stages_per_type, cand.tp_sum), lambda: _type_shares(cluster, cand))
    wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches, virtual_stages=cand.virtual_stages)
    layers = {t: _bound_layers(model, cluster, cand, t, slots, dtype, optimizer, cache) for t, (slots, _, _) in shares.items()}
    times = np.concatenate([b.times for b in layers.values()])
    weights = np.concatenate([b.weights for b in layers.values()])
    fastest = times.min(axis=0)
    device_s = np.concatenate([b.device_s for b in layers.values()]).min(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        speed = sum(n * float(np.nanmax(fastest / b.times.min(axis=0))) for b, (_, n, _) in zip(layers.values(), shares.values()))
        device_speed = sum(d * float(np.nanmax(device_s / b.device_s.min(axis=0))) for b, (_, _, d) in zip(layers.values(), shares.values()))
    pace = max(float(fastest.max()), float(fastest.sum()) / speed if speed > 0 else 0.0,
               float(device_s.sum()) / device_speed if device_speed > 0 else 0.0,
               _partition_pace(cluster, cand, layers, stage_devices, cache))
    sums = float((wt.chunk_sum * times - wt.weight_sum * weights).min(axis=0).sum())
    cuts = (cand.num_chunks - 1) * min(_cut_floor(model, cluster, cand, dtype, next(iter(slots.values()))) for slots, _, _ in shares.values())
    epilogues = np.min([b.epilogue for b in layers.values()], axis=0)
    epilogue = min(b.latency for b in layers.values()) + float(epilogues.sum()) / cand.pp
    rest = sums + wt.chunk_sum * cuts + wt.weight_max * float(weights.min(axis=0).max()) + wt.epilogue_max * epilogue
    return rest, pace, wt


# [Note: partition pace]
# With one chunk per pipeline rank, the pace of [Note: candidate bound] is the slowest
# chunk, and a chunk is a run of whole layers on its rank's device type: so the pace is at
# least the least, over the ranks' possible type sequences, of the bottleneck partition of
# the layers into pp runs (each at least one layer), each run's time the sum of its layers'
# least times on its rank's type (over the offered degrees; no cut, no memory). The
# sequences are those the search solves: each order of the types' blocks
# ([Note: stage device types]), the pinned --stage-devices, or Megatron's ranks of one
# degree. A dynamic programme over the ranks (the least slowest run covering the first j
# layers) gives it exactly in O(pp L^2); it depends only on the per-layer times and the
# sequence, so candidates that differ in schedule or micro-batch count share it. Unlike
# the averages W / R and D / S it sees that layers are indivisible: with few layers per
# stage the slowest stage carries a whole layer more than the average.
def _partition_pace(cluster, cand: Candidate, layers: dict[str, "_BoundLayers"], stage_devices: tuple[str, ...] | None,
                    cache: dict) -> float:
    """The bound of [Note: partition pace]; 0 where it does not apply (interleaved, several degrees on Megatron's ranks)."""
    if cand.virtual_stages != 1 or cand.pp < 2:
        return 0.0
    if cand.stages_per_type:
        counts = dict(cand.stages_per_type)
        sequences = [list(stage_devices)] if stage_devices is not None else [
            type_sequence(list(order), counts) for order in itertools.permutations(counts)]
    elif len(cand.tp_degrees) == 1:
        tp = cand.tp_degrees[0]
        sequences = [[slots[tp].device_type for slots in stage_slots(cluster, cand)]]
    else:
        return 0.0
    key = ("partition pace", tuple(tuple(seq) for seq in sequences), tuple((t, id(b)) for t, b in layers.items()))
    if key in cache:
        return cache[key]
    segments = {}
    for device_type, bound in layers.items():
        least = bound.times.min(axis=0)
        held = np.isfinite(least)  # a layer the type cannot hold makes every run through it infinite, and only those
        prefix = np.concatenate([[0.0], np.cumsum(np.where(held, least, 0.0))])
        missing = np.concatenate([[0], np.cumsum(~held)])
        seg = prefix[None, :] - prefix[:, None]  # seg[i, j]: layers i .. j - 1
        seg[(missing[None, :] - missing[:, None]) > 0] = np.inf
        seg[np.tril_indices(len(prefix))] = np.inf  # a run holds one layer at least
        segments[device_type] = seg
    L = len(next(iter(layers.values())).times[0])
    best = np.inf
    for seq in sequences:
        if len(seq) > L or any(t not in segments for t in seq):
            continue
        reach = np.full(L + 1, np.inf)
        reach[0] = 0.0
        for device_type in seq:
            reach = np.maximum(reach[:, None], segments[device_type]).min(axis=0)
        best = min(best, float(reach[L]))
    # prefix differences round: a hair below, so the bound never exceeds a split's own sum
    cache[key] = out = best * (1 - 1e-12) if np.isfinite(best) else 0.0
    return out


# [Note: degree budget bound]
# Before a candidate with several offered degrees is solved under a cutoff, the pace
# its other bound terms leave (cutoff * scale - rest) / G must be reachable by pp
# chunks whose degrees sum to the type's share: each chunk holds a run of layers
# whose times at its degree (the cheapest offered mode, no cut) stay within the pace
# and whose memory (its rank's micro-batches in flight, each layer in its most frugal
# mode, no one-layer buffers) fits one device.
# A dynamic programme over the chunks keeps, per number of devices used, the furthest
# layer reached; a chunk starting later reaches no less far, so this is exact for
# the relaxation. It sees what the averages of [Note: candidate bound] do not: a
# pipeline with more stages than devices in big degrees must put some layers on small
# ones.
def budget_may_beat(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, cache: dict, cutoff_s: float) -> bool:
    """False when no split of ``cand`` can beat ``cutoff_s``; see [Note: degree budget bound]. True when it does not apply."""
    if len(cand.tp_degrees) == 1 or not cand.tp_sum or cand.virtual_stages > 1:
        return True
    model = model_variant(model, cache, cp=cand.cp)
    rest, _, wt = _bound_terms(model, cluster, cand, options.dtype, cache, options.optimizer, options.stage_devices)
    if wt.round_max == 0:
        return True
    pace = (cutoff_s * wt.scale - rest) / wt.round_max * (1 + 1e-9)
    if pace <= 0:
        return False
    in_flight = activation_multipliers(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages)
    shares = _type_shares(cluster, cand)
    counts = dict(cand.stages_per_type)
    orders = [list(order) for order in itertools.permutations(counts)] if options.stage_devices is None else [None]
    for order in orders:
        types = type_sequence(order, counts) if order else list(options.stage_devices)
        steps = [[(tp, _reach(model, cluster, cand, options, types[c], tp, slot, pace, in_flight[c], cache))
                  for tp, slot in shares[types[c]][0].items()] for c in range(cand.pp)]
        if budget_reaches(steps, types, dict(cand.tp_sum), len(model.layers)):
            return True
    return False


def _reach(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, device_type: str, tp: int, slot: StageSlot,
           pace_s: float, in_flight: float, cache: dict) -> np.ndarray:
    """ahead[i]: the end of the longest run of layers from i within ``pace_s`` and one device's memory at degree ``tp``,
    ``in_flight`` micro-batches' activations kept."""
    cols = layer_columns(model, cluster, device_type, tp, cand.micro_batch_size, options.dtype, cache)
    tp_fwd, tp_bwd = tp_collectives(model, cluster, slot, cols, tp, cache)
    time_s = np.full(len(model.layers), np.inf)
    memory = np.full(len(model.layers), np.inf)
    for mode in cand.modes:
        if mode.tp != tp:
            continue
        full, selective = mode.recompute == Recompute.FULL, mode.recompute == Recompute.SELECTIVE
        # each mode as the tables cost it: sequence parallelism holds less and runs other collectives and less
        # elementwise work ([Note: sequence parallelism costs])
        held, (mode_fwd, mode_bwd) = cols, (tp_fwd, tp_bwd)
        if mode.sp:
            variant = model_variant(model, cache, sequence_parallel=True, regather=mode.recompute == Recompute.NONE)
            held = layer_columns(variant, cluster, device_type, tp, cand.micro_batch_size, options.dtype, cache)
            mode_fwd, mode_bwd = tp_collectives(variant, cluster, slot, held, tp, cache)
        time_s = np.minimum(time_s, (held.fwd + mode_fwd) * (2 if full else 1) + held.b_input + held.weight + mode_bwd
                            + (held.refwd if selective else 0.0))
        state = sum(sharded_state_bytes_per_param(options.dtype, options.optimizer, dp=cand.dp, zero_stage=mode.zero_stage,
                                                    offload=mode.offload))
        memory = np.minimum(memory, FRAGMENTATION_MARGIN * (held.held(cand.ep) * state + in_flight * (held.inputs if full else held.kept if selective else held.saved)))
    ok = cols.splits & np.isfinite(time_s)
    time = np.concatenate([[0.0], np.cumsum(np.where(ok, time_s, 0.0))])
    mem = np.concatenate([[0.0], np.cumsum(np.where(ok, memory, 0.0))])
    bad = np.append(np.flatnonzero(~ok), len(model.layers))
    by_layers = bad[np.searchsorted(bad, np.arange(len(model.layers) + 1))]  # the first layer at or after i it cannot hold
    by_time = np.searchsorted(time, time + pace_s, side="right") - 1
    by_memory = np.searchsorted(mem, mem + slot.memory_bytes, side="right") - 1
    return np.minimum(np.minimum(by_time, by_memory), by_layers)


@dataclass(frozen=True)
class _BoundLayers:
    """Per-layer numbers of one device type for [Note: candidate bound]; rows are the offered degrees."""

    times: np.ndarray  # [T, L] micro-batch seconds (infinite where the degree does not split the layer)
    weights: np.ndarray  # [T, L] weight-gradient seconds
    device_s: np.ndarray  # [T, L] times * degree
    epilogue: np.ndarray  # [L] least over the offered modes and degrees
    latency: float  # least epilogue latency


def _bound_layers(model: ModelGraph, cluster, cand: Candidate, device_type: str, slots: dict[int, StageSlot], dtype: str,
                  optimizer: str, cache: dict) -> _BoundLayers:
    full_only = all(m.recompute == Recompute.FULL for m in cand.modes)
    zeros = tuple(sorted({m.zero_stage for m in cand.modes}))
    sp = any(m.sp for m in cand.modes)
    key = ("bound", model_token(model, cache), device_type, cand.dp, cand.micro_batch_size, tuple(sorted((tp, id(s)) for tp, s in slots.items())), full_only, zeros,
           dtype, optimizer, sp)
    if key in cache:
        return cache[key]
    times, weights, device_s, epilogues, latencies = [], [], [], [], []
    for tp, slot in sorted(slots.items()):
        cols = layer_columns(model, cluster, device_type, tp, cand.micro_batch_size, dtype, cache)
        tp_fwd, tp_bwd = tp_collectives(model, cluster, slot, cols, tp, cache)
        t = (cols.fwd + tp_fwd) * (2 if full_only else 1) + cols.b_input + cols.weight + tp_bwd
        if sp and tp > 1:  # a stage under sequence parallelism runs other collectives: the least of either
            for regather in (True, False):
                variant = model_variant(model, cache, sequence_parallel=True, regather=regather)
                sp_cols = layer_columns(variant, cluster, device_type, tp, cand.micro_batch_size, dtype, cache)
                sp_fwd, sp_bwd = tp_collectives(variant, cluster, slot, sp_cols, tp, cache)
                t = np.minimum(t, (sp_cols.fwd + sp_fwd) * (2 if full_only else 1) + sp_cols.b_input + sp_cols.weight + sp_bwd)
        t = np.where(cols.splits, t, np.inf)
        times.append(t)
        weights.append(cols.weight)
        device_s.append(t * tp)
        e, lat = _least_epilogue(cluster, cand, slot, cols, tp, zeros, dtype, optimizer, cache)
        epilogues.append(e)
        latencies.append(lat)
    cache[key] = _BoundLayers(times=np.array(times), weights=np.array(weights), device_s=np.array(device_s),
                              epilogue=np.min(epilogues, axis=0), latency=min(latencies))
    return cache[key]


def _least_epilogue(cluster, cand: Candidate, slot: StageSlot, cols, tp: int, zeros: tuple[int, ...], dtype: str, optimizer: str,
                    cache: dict) -> tuple[np.ndarray, float]:
    """Per layer, the least epilogue seconds over the offered ZeRO stages at degree ``tp``, and the least latency."""
    comm = data_parallel_linear(cluster, cand.dp, tp, slot, cache)
    rates = optimizer_rates(cluster.profile(slot.device_type))
    per_layer, latency = [], []
    for zero in zeros:
        lat, pb = sync_linear(comm, cand.dp, zero, cluster.profile(slot.device_type), cand.num_microbatches, cand.sync,
                               dtype_bytes(dtype))
        held = cols.held(cand.ep)
        share = held / cand.dp if cand.dp > 1 and zero > 0 else held
        per_layer.append(pb * cols.synced(cand.dp, cand.ep) * dtype_bytes(dtype)
                         + rates.seconds(share * OPTIMIZER_BYTES_PER_PARAM[optimizer], cols.tensors, cols.sharded_tensors))
        latency.append(lat + rates.fixed_s)
    return np.min(per_layer, axis=0), min(latency)


def _cut_floor(model: ModelGraph, cluster, cand: Candidate, dtype: str, slot: StageSlot) -> float:
    """The cheapest p2p of a stage boundary, forward and backward, from ``slot``, split the most ways offered."""
    if cand.pp == 1:
        return 0.0  # chunks on one rank hand over in place
    payload = min(l.boundary_bytes for l in model.layers[:-1]) * cand.micro_batch_size * dtype_bytes(dtype) / 4
    payload /= cand.tp_degrees[-1]
    srcs = [slot.ranks[0][0]]
    if len(cluster.zone_names) > 1:  # a cut between two nodes far from ``slot`` may be cheaper than any from it (across a WAN)
        srcs += list(itertools.accumulate((g.num_devices for g in cluster.groups[:-1]), initial=0))
    return 2 * min(p2p_time_s(payload, src, dst, cluster) for src in srcs for dst in _one_peer_per_place(cluster, src))


def _one_peer_per_place(cluster, src: int) -> list[int]:
    """One other rank in src's node and one in each other node group: p2p costs differ only by place."""
    peers = [r for r in cluster.ranks_of_node(cluster.node_of(src)) if r != src][:1]
    first = 0
    for group in cluster.groups:
        for node in range(group.num_nodes):
            rank = first + node * group.devices_per_node
            if cluster.node_of(rank) != cluster.node_of(src):
                peers.append(rank)
                break
        first += group.num_devices
    return peers or [src]


def _type_shares(cluster, cand: Candidate) -> dict[str, tuple[dict[int, StageSlot], int, int]]:
    """Device type -> (one slot per offered degree, pipeline ranks costed as that type, its devices per replica)."""
    if cand.stages_per_type:
        out = {}
        devices = dict(cand.tp_sum)
        for device_type, ranks in cand.stages_per_type:
            slots = {}
            for tp in cand.tp_degrees:
                blocks = type_slots(cluster, cand.dp, tp)[device_type]
                if blocks:  # a block inside one zone syncs cheapest (across zones, the first may straddle two)
                    slots[tp] = next((b for b in blocks if len({cluster.zone_of(r) for rep in b.ranks for r in rep}) == 1), blocks[0])
            out[device_type] = (slots, ranks, devices[device_type])
        return out
    out = {}
    tp = cand.tp_degrees[0]
    for rank_slots in stage_slots(cluster, cand):
        slot = rank_slots[tp]
        first, n, d = out.get(slot.device_type, ({tp: slot}, 0, 0))
        out[slot.device_type] = (first, n + 1, d + tp)
    return out


def memory_may_fit(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, cache: dict | None = None) -> bool:
    """False when no split of ``cand`` can fit: the layers' memory, each at its smallest (one micro-batch
    in flight, the most frugal mode, over the devices of its degree), exceeds all devices' memory together."""
    cache = {} if cache is None else cache
    model = model_variant(model, cache, cp=cand.cp)
    shares = _type_shares(cluster, cand)
    capacity = sum(next(iter(slots.values())).memory_bytes * devices for slots, _, devices in shares.values() if slots)
    device_type = next(iter(shares))
    need = np.full(len(model.layers), np.inf)
    for mode in cand.modes:
        cols = layer_columns(model_variant(model, cache, sequence_parallel=mode.sp), cluster, device_type, mode.tp,
                             cand.micro_batch_size, options.dtype, cache)
        state = sum(sharded_state_bytes_per_param(options.dtype, options.optimizer, dp=cand.dp, zero_stage=mode.zero_stage,
                                                    offload=mode.offload))
        activations = {Recompute.FULL: cols.inputs, Recompute.SELECTIVE: cols.kept}.get(mode.recompute, cols.saved)
        need = np.minimum(need, np.where(cols.splits, mode.tp * (cols.held(cand.ep) * state + activations), np.inf))
    return FRAGMENTATION_MARGIN * float(need.sum()) <= capacity
