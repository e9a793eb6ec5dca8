"""Cost tables for one outer candidate (dp, tp, pp, micro-batch size, schedule, virtual stages).

The search's CP-SAT model and the exact evaluator both read these tables, so the
solver and brute force optimise exactly the same function; see [Note: split objective].

[Note: split objective]
The layers are split into C = pp * v chunks in layer order (v virtual stages per
pipeline rank, 1 unless interleaved; chunk c runs on rank c mod pp), and each chunk
picks one stage mode k, a (recompute, ZeRO stage, tensor-parallel degree) triple. For
chunk c holding layers first_c..last_c in mode k_c, with every sum over those layers
and read from the tables' column c and row k_c:

    t_c = sum time[l] + cut[a, b][last_c]               (no cut after the last chunk)
          + gather_fwd_latency + sum gather_fwd[l]
          + gather_bwd_latency + sum gather_bwd[l]
    w_c = sum weight[l]
    e_r = sum over rank r's chunks of (epilogue_latency + sum epilogue[l])

and the objective is [Note: linear step time] (cost_models/pipeline.py) of t, w and e.
The cut is the hand-off of the boundary tensor from chunk c's tensor-parallel degree a
to the next chunk's b ([Note: per-stage tensor parallelism]).
``time`` is one micro-batch's forward and backward with the tensor-parallel all-reduces
and, under full recompute, the forward again; the ``gather`` terms are ZeRO-3's
per-micro-batch parameter gathers (and gradient reduce-scatter), all exposed, as
planner.estimate counts them (an upper bound: the program gathers module by module and
FSDP2 prefetches the next module's under the current one's compute, [Note: ZeRO through
FSDP2] in runtime/data_parallel.py); ``epilogue`` is the end-of-step
gradient synchronisation (all-reduce, or ZeRO-1/2's reduce-scatter and all-gather, none
under ZeRO-3) plus the optimizer step over the rank's share of the parameters.
Collective times are read off the collective model as latency + bytes * per-byte cost.

Memory of rank r, which must fit its devices:

    sum over its chunks of (sum memory[l] + [recompute] max workspace[a, l] + max gradient[a, l]
                            + [ZeRO-3] max zero3_buffer[a, l])

``memory`` is the layer's training state under the mode's ZeRO stage plus its
activations times the micro-batches the schedule keeps in flight on the chunk
(``activation_multipliers``); the three maxima are the one-layer buffers of
[Note: activations kept per micro-batch] (a layer's whole saved activations, for full and, as an upper
bound of what it rebuilds, for selective recompute; the widest activation gradient, in every mode) and
[Note: ZeRO stages] (cost_models/memory.py),
with at most ``_RANGE_MAX_LEVELS`` distinct values (larger sets are rounded up). For
the interleaved schedule each chunk counts its own peak of in-flight micro-batches and
its own buffers, an upper bound of the rank's joint peak that planner.estimate plays out.
Everything carries cost_models.memory.FRAGMENTATION_MARGIN.

Ranks follow Megatron's order (tensor-parallel innermost, then data-parallel, then
pipeline) over the devices in the order the cluster lists them; a stage whose ranks
span device types is costed on the slowest of them and the smallest memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetpar.cost_models.collectives import (EXCHANGES_PER_DISPATCH, all_to_all_time_s, context_exchange_s, grad_sync_scale,
                                            tensor_parallel_pass_s)
from hetpar.cost_models.compute import dtype_bytes, layer_timing, optimizer_rates
from hetpar.cost_models.offload import host_optimizer_s, offload_refusal, offload_transfer_s
from hetpar.cost_models.memory import (
    FRAGMENTATION_MARGIN,
    OPTIMIZER_BYTES_PER_PARAM,
    sharded_state_bytes_per_param,
    state_bytes_per_param,
    zero_runs,
)
from hetpar.planner.costing.cache import memo, model_token, model_variant
from hetpar.planner.costing.candidate import Candidate
from hetpar.planner.costing.communication import boundary_seconds, data_parallel_linear, placement, sync_linear
from hetpar.planner.costing.in_flight import activation_multipliers
from hetpar.planner.costing.slots import RankSlots, StageSlot, stage_slots
from hetpar.planner.model_graph import ModelGraph
from hetpar.vocabulary import Optimizer, Recompute


# Distinct values a range maximum (workspace, ZeRO-3 buffers) keeps; see [Note: split objective].
_RANGE_MAX_LEVELS = 4


@dataclass(frozen=True, kw_only=True, eq=False)
class CostTables:
    """Coefficients of [Note: split objective]; seconds and bytes.

    Shapes: K modes (``candidate.modes``), L layers, C chunks (pp * v), P pipeline ranks,
    T tensor-parallel degrees (``candidate.tp_degrees``). A layer that a mode's degree
    cannot split has infinite time and memory in that mode.
    """

    candidate: Candidate
    slots: list[RankSlots]  # per pipeline rank: tensor-parallel degree -> where it runs
    time_s: np.ndarray  # [K, L, C]
    fwd_s: np.ndarray  # [K, L, C] the forward part of time_s
    weight_s: np.ndarray  # [K, L, C] the weight-gradient (W) part of time_s
    gather_fwd_s: np.ndarray  # [K, L, C] ZeRO-3 per-micro-batch gathers before the forward (per-byte part)
    gather_bwd_s: np.ndarray  # [K, L, C] ... and gathers and reduce-scatters in the backward
    gather_fwd_latency_s: np.ndarray  # [K, C]
    gather_bwd_latency_s: np.ndarray  # [K, C]
    cut_s: np.ndarray  # [T, T, L, C] hand-off of the boundary after layer l from chunk c at degree a to the next at b, both ways
    epilogue_s: np.ndarray  # [K, L, C]
    epilogue_latency_s: np.ndarray  # [K, C] once per rank: nonzero on its first chunk only
    memory_bytes: np.ndarray  # [K, L, C]
    workspace_bytes: np.ndarray  # [T, L] one layer rebuilt under full recompute
    gradient_bytes: np.ndarray  # [T, L] the widest activation gradient of a layer's backward, every mode
    zero3_buffer_bytes: np.ndarray  # [T, L] gathered weights and gradient under ZeRO-3
    capacity_bytes: np.ndarray  # [P]
    tp_time_s: np.ndarray  # [K, L, C] the tensor-parallel part of time_s, for reporting
    device_types: list[str]  # per pipeline rank

    @property
    def num_layers(self) -> int:
        return self.time_s.shape[1]

    @property
    def num_chunks(self) -> int:
        return self.time_s.shape[2]

    def tp_index(self, k: int) -> int:
        """Index in ``candidate.tp_degrees`` of mode k's degree."""
        return self.candidate.tp_degrees.index(self.candidate.modes[k].tp)

    def tp_sum_ok(self, modes: list[int]) -> bool:
        """Whether the pipeline ranks' degrees sum to each type's ``candidate.tp_sum``."""
        cand = self.candidate
        for device_type, total in cand.tp_sum:
            used = sum(cand.modes[modes[r]].tp for r in range(cand.pp) if self.device_types[r] == device_type)
            if used != total:
                return False
        return True


@dataclass(frozen=True)
class LayerColumns:
    """Per-layer numbers of one device type at one (tp, micro-batch size, dtype)."""

    fwd: np.ndarray
    b_input: np.ndarray
    weight: np.ndarray
    saved: np.ndarray  # bytes per micro-batch in the training dtype
    inputs: np.ndarray  # the layer's input bytes per micro-batch (what full recompute keeps)
    params: np.ndarray
    tied: np.ndarray
    scale: float  # bytes per sample in fp32 to bytes per micro-batch in the training dtype
    boundary: np.ndarray  # per micro-batch
    tensors: np.ndarray  # parameter tensors (an optimizer step pays per tensor)
    sharded_tensors: np.ndarray  # ... of which DTensors at this degree (0 at tp 1)
    splits: np.ndarray  # bool: the layer splits this many ways (LayerProfile.splits_at)
    expert_params: np.ndarray  # parameters of the layer's modules of experts (not split by tp)
    kept: np.ndarray  # bytes per micro-batch selective recompute keeps: input and matmul outputs ([Note: selective recompute costs])
    widest: np.ndarray  # bytes per micro-batch of the widest activation gradient of the layer's backward
    refwd: np.ndarray  # seconds selective recompute runs again in backward: the forward's memory-bound part and activation products

    def held(self, ep: int) -> np.ndarray:
        """Parameters a rank holds, steps and keeps state for: 1/ep of the experts' ([Note: expert parallelism costs])."""
        return self.params - self.expert_params * (1.0 - 1.0 / ep)

    def synced(self, dp: int, ep: int) -> np.ndarray:
        """Of ``held``, those whose gradients the replicas synchronise: the experts' are averaged over dp / ep
        replicas, priced as the data-parallel group's (none when dp == ep)."""
        return self.held(ep) if dp > ep else self.held(ep) - self.expert_params / ep


def layer_columns(model: ModelGraph, cluster, device_type: str, tp: int, mbs: int, dtype: str, cache: dict,
                  expert_load: float = 1.0) -> LayerColumns:
    """Per-layer columns at one (type, tp, micro-batch, dtype); the layers' times as the busiest
    expert-parallel rank runs them at ``expert_load`` ([Note: expert load])."""
    key = ("layers", model_token(model, cache), device_type, tp, mbs, dtype, expert_load)
    if key not in cache:
        device = cluster.profile(device_type)
        scale = dtype_bytes(dtype) / 4 * mbs
        kinds = model.layer_kinds  # each kind of layer timed once
        by_kind: dict = {}
        for layer, kind in zip(model.layers, kinds):
            if kind not in by_kind:
                try:
                    by_kind[kind] = layer_timing(layer.with_expert_load(expert_load), device, tp=tp, micro_batch_size=mbs,
                                                 dtype=dtype)
                except (KeyError, ValueError):
                    by_kind[kind] = None
        times = [by_kind[kind] for kind in kinds]
        inf = float("inf")
        boundary = np.array([l.boundary_bytes for l in model.layers]) * scale
        cache[key] = LayerColumns(
            fwd=np.array([t.fwd_s if t else inf for t in times]),
            b_input=np.array([t.bwd_input_s if t else inf for t in times]),
            weight=np.array([t.bwd_weight_s if t else inf for t in times]),
            saved=np.array([l.saved_bytes_at(tp) for l in model.layers]) * scale,
            inputs=np.concatenate([[model.input_bytes * scale], boundary[:-1]]),
            params=np.array([l.params_at(tp) for l in model.layers]),
            tied=np.array([l.tied_at(tp) for l in model.layers]),
            scale=scale,
            boundary=boundary,
            tensors=np.array([float(l.param_tensors) for l in model.layers]),
            sharded_tensors=np.array([float(l.tp_sharded_tensors if tp > 1 else 0) for l in model.layers]),
            splits=np.array([l.splits_at(tp) for l in model.layers]),
            expert_params=np.array([float(l.expert_params) for l in model.layers]),
            kept=np.minimum(np.array([l.saved_bytes_at(tp) for l in model.layers]) * scale,
                            np.concatenate([[model.input_bytes * scale], boundary[:-1]])
                            + np.array([l.kept_bytes_at(tp) for l in model.layers]) * scale),
            widest=np.array([l.widest_gradient_at(tp) for l in model.layers]) * scale,
            refwd=np.array([t.selective_rerun_s if t else inf for t in times]),
        )
    return cache[key]


def build_tables(
    model: ModelGraph,
    cluster,
    cand: Candidate,
    dtype: str,
    optimizer: str = Optimizer.ADAMW,
    slots: list[RankSlots] | None = None,
    cut_to: list[RankSlots] | None = None,
    cache: dict | None = None,
) -> CostTables:
    """Fill the coefficient tables of [Note: split objective] for one candidate.

    Args:
        slots: where each pipeline rank runs at each offered degree; Megatron's layout
            (``stage_slots``) by default. A degree a rank lacks is infinite there.
        cut_to: the slot each rank sends its chunks' outputs to; the next rank's by default.
        cache: reused across candidates (per-layer timings, collective fits).
    """
    cache = {} if cache is None else cache
    model = model_variant(model, cache, cp=cand.cp)  # [Note: context parallelism costs]
    slots = slots or stage_slots(cluster, cand)
    P, C, K, L = cand.pp, cand.num_chunks, len(cand.modes), len(model.layers)
    degrees = cand.tp_degrees
    cut_to = cut_to or [slots[(r + 1) % P] for r in range(P)]
    in_flight = activation_multipliers(cand.schedule, P, cand.num_microbatches, cand.virtual_stages)
    shape = (K, L, C)
    tables = {name: np.zeros(shape) for name in ("time_s", "fwd_s", "weight_s", "gather_fwd_s", "gather_bwd_s", "epilogue_s",
                                                  "memory_bytes", "tp_time_s")}
    lat = {name: np.zeros((K, C)) for name in ("gather_fwd_latency_s", "gather_bwd_latency_s", "epilogue_latency_s")}
    cut = np.zeros((len(degrees), len(degrees), L, C))
    per_slot: dict = {}
    for c in range(C):
        r = c % P
        for i, tp in enumerate(degrees):
            if tp not in slots[r]:
                continue
            for j, to_tp in enumerate(degrees):
                if c + 1 < C and P > 1 and to_tp in cut_to[r]:  # chunks on one rank hand over in place
                    cut[i, j, :, c] = _cut_seconds(model, cluster, cand, dtype, slots[r][tp], cut_to[r][to_tp], cache)
        for k, mode in enumerate(cand.modes):
            if mode.tp not in slots[r] or (mode.offload and offload_refusal(cluster.profile(slots[r][mode.tp].device_type))):
                tables["time_s"][k, :, c] = tables["memory_bytes"][k, :, c] = np.inf
                continue
            _fill_mode(model, cluster, cand, dtype, optimizer, slots[r][mode.tp], c, k, in_flight[c], tables, lat, cache, per_slot)
    workspace, gradient, zero3 = [], [], []
    w, g, _ = state_bytes_per_param(dtype, optimizer)
    for tp in degrees:
        any_cols = layer_columns(model, cluster, next(iter(slots[0].values())).device_type, tp, cand.micro_batch_size, dtype, cache)
        workspace.append(_levels(FRAGMENTATION_MARGIN * any_cols.saved))
        gradient.append(_levels(FRAGMENTATION_MARGIN * any_cols.widest))
        zero3.append(_levels(FRAGMENTATION_MARGIN * any_cols.params * (2 * w + g)))
    return CostTables(
        candidate=cand,
        slots=list(slots),
        **tables,
        **lat,
        cut_s=cut,
        workspace_bytes=np.array(workspace),
        gradient_bytes=np.array(gradient),
        zero3_buffer_bytes=np.array(zero3),
        capacity_bytes=np.array([float(next(iter(s.values())).memory_bytes) if s else 0.0 for s in slots]),
        device_types=[next(iter(s.values())).device_type if s else "" for s in slots],
    )


def _fill_mode(model: ModelGraph, cluster, cand: Candidate, dtype: str, optimizer: str, slot: StageSlot, c: int, k: int,
               in_flight: float, tables: dict, lat: dict, cache: dict, per_slot: dict) -> None:
    """Column c, row k of every per-mode table: chunk c on ``slot`` in mode ``cand.modes[k]``.

    Args:
        per_slot: what the slot's modes and chunks share, filled by the first: (rank, degree) -> the slot's
            columns; (slot, mode, first rank) -> the mode's columns, which chunks on one slot share but for
            their activations in flight (the other chunks of an interleaved rank, the ranks of one type's block).
    """
    r = c % cand.pp
    col = memo(per_slot, ("mode", id(slot), k, r == 0),
               lambda: _mode_columns(model, cluster, cand, dtype, optimizer, slot, r, k, cache, per_slot))
    for name in ("time_s", "fwd_s", "weight_s", "tp_time_s", "gather_fwd_s", "gather_bwd_s", "epilogue_s"):
        tables[name][k, :, c] = col[name]
    lat["gather_fwd_latency_s"][k, c], lat["gather_bwd_latency_s"][k, c] = col["gather_latency_s"]
    if c < cand.pp:
        lat["epilogue_latency_s"][k, c] = col["epilogue_latency_s"]
    tables["memory_bytes"][k, :, c] = FRAGMENTATION_MARGIN * (col["state_bytes"] + in_flight * col["activations"]) + col["unsplit"]


def _mode_columns(model: ModelGraph, cluster, cand: Candidate, dtype: str, optimizer: str, slot: StageSlot, r: int, k: int,
                  cache: dict, per_slot: dict) -> dict:
    """``_fill_mode``'s columns of mode ``cand.modes[k]`` on ``slot`` for pipeline rank r, but for the activations'
    multiplier: per layer, the tables' terms, the state's bytes and the activations' bytes per micro-batch."""
    mode, elem = cand.modes[k], dtype_bytes(dtype)
    whole = model
    regather = mode.recompute == Recompute.NONE
    model = model_variant(model, cache, sequence_parallel=mode.sp, regather=regather)  # [Note: sequence parallelism costs]
    cols, (tp_fwd, tp_bwd), (ep_fwd, ep_bwd), comm, rates = memo(per_slot, (r, mode.tp, mode.sp, mode.sp and regather), lambda: (
        cols := layer_columns(model, cluster, slot.device_type, mode.tp, cand.micro_batch_size, dtype, cache,
                              cand.expert_load if cand.ep > 1 else 1.0),
        tp_collectives(model, cluster, slot, cols, mode.tp, cache),
        expert_exchanges(model, cluster, slot, cols, cand.ep, cache, cand.expert_load),
        data_parallel_linear(cluster, cand.dp, mode.tp, slot, cache),
        optimizer_rates(cluster.profile(slot.device_type)),
    ))
    cp_fwd, cp_bwd = memo(per_slot, (r, mode.tp, "cp"), lambda: context_exchanges(whole, cluster, slot, cols, cand.cp, cache))
    tp_fwd, tp_bwd = tp_fwd + cp_fwd, tp_bwd + cp_bwd  # [Note: context parallelism costs]: with the tp collectives
    # [Note: expert parallelism costs]: a rank holds, syncs and steps 1/ep of the experts;
    # a tied copy lives on every rank but the first
    held = cols.held(cand.ep) + (cols.tied if r != 0 else 0.0)
    synced = held - (cols.held(cand.ep) - cols.synced(cand.dp, cand.ep))  # the experts unsynced at dp == ep
    full, selective = mode.recompute == Recompute.FULL, mode.recompute == Recompute.SELECTIVE
    replay = full or selective  # both run the forward's collectives again in backward
    fwd = cols.fwd + tp_fwd + ep_fwd
    bwd = (cols.b_input + cols.weight + (cols.fwd if full else 0.0) + tp_bwd + (tp_fwd if replay else 0.0)
           + ep_bwd + (ep_fwd if replay else 0.0) + (cols.refwd if selective else 0.0))
    unsplit = np.where(cols.splits, 0.0, np.inf)  # a layer this degree cannot split: [Note: per-stage tensor parallelism]
    L = len(model.layers)
    out = {"time_s": fwd + bwd + unsplit, "fwd_s": fwd, "weight_s": cols.weight, "tp_time_s": tp_fwd * (2 if replay else 1) + tp_bwd,
           "gather_fwd_s": np.zeros(L), "gather_bwd_s": np.zeros(L), "gather_latency_s": (0.0, 0.0), "unsplit": unsplit}
    sharded = zero_runs(cand.dp, mode.zero_stage, mode.offload)
    if sharded and mode.zero_stage == 3:
        if cand.dp > 1:  # over one row (offload) FSDP2's gathers cross no link
            scale = grad_sync_scale(cluster.profile(slot.device_type))
            (ag_lat, ag_pb), (rs_lat, rs_pb) = ((a * scale, b * scale) for a, b in (comm["all_gather"], comm["reduce_scatter"]))
            out["gather_fwd_s"] = ag_pb * cols.params * elem
            out["gather_bwd_s"] = (ag_pb + rs_pb) * cols.params * elem
            out["gather_latency_s"] = (ag_lat, ag_lat + rs_lat)
        if mode.offload:  # [Note: offload costs]: the shard crosses the host link around each gather
            to_device, both_ways = offload_transfer_s(held / cand.dp, dtype, cluster.profile(slot.device_type))
            out["gather_fwd_s"] = out["gather_fwd_s"] + to_device
            out["gather_bwd_s"] = out["gather_bwd_s"] + both_ways
    sync_lat, sync_pb = sync_linear(comm, cand.dp, mode.zero_stage, cluster.profile(slot.device_type), cand.num_microbatches,
                                     cand.sync, elem)
    share = held / cand.dp if sharded else held
    step = host_optimizer_s(share, optimizer, cluster.profile(slot.device_type)) if mode.offload else \
        rates.seconds(share * OPTIMIZER_BYTES_PER_PARAM[optimizer], cols.tensors, cols.sharded_tensors)
    out["epilogue_s"] = sync_pb * synced * elem + step
    out["epilogue_latency_s"] = sync_lat + rates.fixed_s
    state = sum(sharded_state_bytes_per_param(dtype, optimizer, dp=cand.dp, zero_stage=mode.zero_stage, offload=mode.offload))
    out["state_bytes"] = held * state
    out["activations"] = cols.inputs if full else cols.kept if selective else cols.saved
    return out


def expert_exchanges(model: ModelGraph, cluster, slot: StageSlot, cols: LayerColumns, ep: int, cache: dict,
                     expert_load: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each layer's expert-parallel all-to-alls per micro-batch over the
    stage's first ``ep`` replicas, (forward, backward): the rows there and back in each
    pass, and the forward's small exchanges of counts and expert numbers
    ([Note: expert parallelism costs] in cost_models.collectives); the busiest rank's rows at
    ``expert_load`` times the uniform share ([Note: expert load])."""
    if ep == 1 or not any(l.routed_bytes for l in model.layers):
        return np.zeros(len(model.layers)), np.zeros(len(model.layers))
    group = [rep[0] for rep in slot.ranks[:ep]]
    tp = len(slot.ranks[0])
    place = placement(cluster, group)
    small = EXCHANGES_PER_DISPATCH * all_to_all_time_s(8.0 * ep, group, cluster, concurrent=tp)
    rows = memo(cache, ("ep layers", model_token(model, cache), cols.scale, place, tp, expert_load), lambda: np.array([
        2 * memo(cache, ("a2a", l.routed_bytes * expert_load, cols.scale, place, tp),
                 lambda l=l: all_to_all_time_s(l.routed_bytes * expert_load * cols.scale, group, cluster, concurrent=tp))
        for l in model.layers
    ]))
    return rows + np.where(rows > 0, small, 0.0), rows


def context_exchanges(model: ModelGraph, cluster, slot: StageSlot, cols: LayerColumns, cp: int, cache: dict
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each layer's context-parallel key and value exchange per micro-batch over the stage's
    first ``cp`` rows, (forward, backward) ([Note: context parallelism costs] in cost_models.collectives)."""
    if cp == 1:
        return np.zeros(len(model.layers)), np.zeros(len(model.layers))
    group = [rep[0] for rep in slot.ranks[:cp]]
    tp = len(slot.ranks[0])
    place = placement(cluster, group)
    pairs = [memo(cache, ("cp", l.attention_kv_bytes, l.tp_capable, cols.scale, place, tp),
                  lambda l=l: context_exchange_s(l.attention_kv_bytes * cols.scale / (tp if l.tp_capable else 1), group,
                                                 cluster, concurrent=tp))
             for l in model.layers]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _levels(values: np.ndarray) -> np.ndarray:
    """``values`` with at most _RANGE_MAX_LEVELS distinct ones, each rounded up to the next kept level."""
    distinct = np.unique(values)[::-1]
    if len(distinct) <= _RANGE_MAX_LEVELS:
        return values.copy()
    kept = np.sort(distinct[: _RANGE_MAX_LEVELS])
    return kept[np.searchsorted(kept, values)]


def tp_collectives(model: ModelGraph, cluster, slot: StageSlot, cols: LayerColumns, tp: int, cache: dict
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each layer's tensor-parallel collectives in the forward and in the backward."""
    if tp == 1:
        return np.zeros(len(model.layers)), np.zeros(len(model.layers))
    place = placement(cluster, slot.ranks[0])
    return memo(cache, ("tp layers", model_token(model, cache), cols.scale, place), lambda: tuple(np.array([
        memo(cache, ("tp", l.tp_collectives, p, cols.scale, place),
              lambda l=l, p=p: tensor_parallel_pass_s(l.tp_collectives, p, cols.scale, slot.ranks[0], cluster))
        for l in model.layers
    ]) for p in ("forward", "backward")))


def _cut_seconds(model: ModelGraph, cluster, cand: Candidate, dtype: str, src: StageSlot, dst: StageSlot, cache: dict) -> np.ndarray:
    """Forward and backward hand-off of each layer's boundary tensor from ``src`` to ``dst``, as planner.estimate sends it."""
    a, b = src.ranks[0], dst.ranks[0]
    key_place = (cluster.node_of(a[0]) == cluster.node_of(b[0]), id(cluster.group_of(a[0])), id(cluster.group_of(b[0])),
                 len(a), placement(cluster, b))
    scale = dtype_bytes(dtype) / 4 * cand.micro_batch_size

    def seconds() -> np.ndarray:
        boundary = np.array([l.boundary_bytes for l in model.layers]) * scale
        return np.array([memo(cache, ("cut", n, key_place), lambda n=n: 2 * boundary_seconds(n, a, b, cluster)) for n in boundary])

    return memo(cache, ("cut layers", model_token(model, cache), scale, key_place), seconds)
