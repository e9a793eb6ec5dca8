"""Cost tables for one outer candidate (dp, tp, pp, micro-batch size, schedule).

The search's CP-SAT model and the exact evaluator both read these tables, so the
solver and brute force optimise exactly the same function; see [Note: split objective].

[Note: split objective]
For a split of the layers into stages (stage s holds layers first_s..last_s):

    stage_time[s] = sum_{l in s} layer_time[l][s] + cut_time[last_s][s]   (no cut after the last stage)
    dp_sync[s]    = dp_latency[s] + sum_{l in s} dp_time[l][s]
    objective     = sum_s stage_time[s] + (m - 1) * max_s stage_time[s] + max_s dp_sync[s]

layer_time includes tensor-parallel all-reduces; cut_time is the p2p of the boundary
tensors, forward and backward, per micro-batch; see [Note: pipeline step time] for the
first two terms. Memory: sum_{l in s} layer_memory[l][s] <= capacity[s].
Ranks follow Megatron's order (tensor-parallel innermost, then data-parallel, then
pipeline) over the devices in the order the cluster lists them; a stage whose ranks
span device types is costed on the slowest of them and the smallest memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.collectives import all_reduce_time_s, p2p_time_s
from cost_models.compute import dtype_bytes, layer_timing
from cost_models.devices import get_device
from cost_models.memory import MemoryBreakdown, stage_memory, state_bytes_per_param
from cost_models.pipeline import in_flight_microbatches
from planner.trace import ModelGraph

# The size at which the data-parallel all-reduce's per-byte cost is read off the
# collective model: DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel,
# bucket_cap_mb=25).
_DP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """The choices the search enumerates outside the CP-SAT model."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    recompute: str = "none"  # "none" | "full": activation recomputation of every stage

    def describe(self) -> str:
        text = f"dp={self.dp} tp={self.tp} pp={self.pp} micro-batch {self.micro_batch_size}x{self.num_microbatches} {self.schedule}"
        return text + (f" recompute {self.recompute}" if self.recompute != "none" else "")


@dataclass(frozen=True, kw_only=True)
class StageSlot:
    """Where a stage runs: its ranks and the device it is costed on."""

    ranks: list[list[int]]  # [data-parallel replica][tensor-parallel index]
    device_type: str
    memory_bytes: int


@dataclass(frozen=True, kw_only=True)
class CostTables:
    """Per layer x stage coefficients of [Note: split objective]; seconds and bytes."""

    candidate: Candidate
    slots: list[StageSlot]
    layer_time_s: list[list[float]]
    cut_time_s: list[list[float]]
    layer_memory_bytes: list[list[float]]
    capacity_bytes: list[float]
    dp_latency_s: list[float]
    dp_time_s: list[list[float]]
    tp_time_s: list[list[float]]  # the tensor-parallel part of layer_time, for reporting

    @property
    def num_layers(self) -> int:
        return len(self.layer_time_s)


def stage_slots(device_types: list[str], cand: Candidate) -> list[StageSlot]:
    """Megatron's rank layout: rank = s * dp * tp + d * tp + t; see [Note: split objective]."""
    slots = []
    for s in range(cand.pp):
        ranks = [[s * cand.dp * cand.tp + d * cand.tp + t for t in range(cand.tp)] for d in range(cand.dp)]
        types = sorted({device_types[r] for rep in ranks for r in rep})
        profiles = [get_device(t) for t in types]
        slowest = min(profiles, key=_peak)
        smallest = min(p.memory_bytes for p in profiles)
        slots.append(StageSlot(ranks=ranks, device_type=slowest.name, memory_bytes=smallest))
    return slots


def type_slots(cluster, cand: Candidate) -> dict[str, list[StageSlot]] | None:
    """The stage-sized blocks each device type offers; see [Note: stage device types].

    Returns:
        Device type -> its slots in listed order, or None when some type's devices do
        not split into whole slots (the stages then follow Megatron's layout).
    """
    size = cand.dp * cand.tp
    by_type: dict[str, list[int]] = {}
    for rank, device_type in enumerate(cluster.device_types()):
        by_type.setdefault(device_type, []).append(rank)
    if any(len(ranks) % size for ranks in by_type.values()):
        return None
    if any(cluster.devices_per_node_of(ranks[0]) % cand.tp for ranks in by_type.values()):
        return None
    out = {}
    for device_type, ranks in by_type.items():
        memory = cluster.profile(device_type).memory_bytes
        blocks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
        out[device_type] = [
            StageSlot(ranks=[block[d * cand.tp : (d + 1) * cand.tp] for d in range(cand.dp)], device_type=device_type, memory_bytes=memory)
            for block in blocks
        ]
    return out


# [Note: stage device types]
# On a cluster whose device types each split into whole stage-sized blocks of
# dp * tp devices, every block hosts one stage, and the search chooses the order of
# the device types along the pipeline jointly with the layer split. A type's stages
# are consecutive, so the pipeline crosses each type boundary once (one slow
# inter-type link instead of several); every order of the types (at most 3! = 6 for
# three types) is solved exactly, which keeps the search exact within that space
# and fast. (A CP-SAT model over every stage-by-stage type sequence was tried: its
# bounds were weak and 12-stage instances did not close in 10 s.) Each type
# gets its own cost columns, built as if every stage ran on that type's first blocks;
# a stage that chooses a type reads that type's column. The p2p cost of a cut is the
# one between the sending type's own blocks, an approximation when neighbouring
# stages are of different types. After solving, each stage takes the next unused
# block of its type, and the plan's prediction is recomputed on those exact ranks.
def tables_by_type(model: ModelGraph, cluster, cand: Candidate, dtype: str, available: dict[str, list[StageSlot]], optimizer: str = "adamw") -> dict[str, "CostTables"]:
    """One set of cost columns per device type, each as if every stage ran on that type."""
    out = {}
    for device_type, blocks in available.items():
        same = blocks[: min(len(blocks), 2)]
        slots = [same[s % len(same)] for s in range(cand.pp)]
        if len(blocks) > 1:
            cut_to = [blocks[1 - s % 2].ranks[0][0] for s in range(cand.pp - 1)]
        else:  # a single block hosts one stage at most: its cuts go to another type
            peers = [b[0].ranks[0][0] for t, b in available.items() if t != device_type]
            cut_to = [peers[0] for _ in range(cand.pp - 1)] if peers else []
        out[device_type] = build_tables(model, cluster, cand, dtype, optimizer, slots=slots, cut_to=cut_to)
    return out


def compose_tables(tables_by_type: dict[str, "CostTables"], types: list[str]) -> "CostTables":
    """The cost tables of a split whose stage s runs on device type ``types[s]``."""
    first = next(iter(tables_by_type.values()))
    pick = lambda rows_of: [[rows_of(tables_by_type[t])[l][s] for s, t in enumerate(types)] for l in range(first.num_layers)]
    return CostTables(
        candidate=first.candidate,
        slots=[tables_by_type[t].slots[s] for s, t in enumerate(types)],
        layer_time_s=pick(lambda t: t.layer_time_s),
        cut_time_s=pick(lambda t: t.cut_time_s),
        layer_memory_bytes=pick(lambda t: t.layer_memory_bytes),
        capacity_bytes=[tables_by_type[t].capacity_bytes[s] for s, t in enumerate(types)],
        dp_latency_s=[tables_by_type[t].dp_latency_s[s] for s, t in enumerate(types)],
        dp_time_s=pick(lambda t: t.dp_time_s),
        tp_time_s=pick(lambda t: t.tp_time_s),
    )


def _peak(profile) -> float:
    for dtype in ("bf16", "fp16", "fp32"):
        try:
            return profile.peak_flops(dtype)
        except (KeyError, ValueError):
            continue
    return 0.0


def build_tables(
    model: ModelGraph,
    cluster,
    cand: Candidate,
    dtype: str,
    optimizer: str = "adamw",
    slots: list[StageSlot] | None = None,
    cut_to: list[int] | None = None,
) -> CostTables:
    """Fill the coefficient tables of [Note: split objective] for one candidate.

    Args:
        slots: where each stage runs; Megatron's layout (``stage_slots``) by default.
        cut_to: the rank each stage sends its output to; the next slot's first rank by default.
    """
    slots = slots or stage_slots(cluster.device_types(), cand)
    cut_to = cut_to or [slots[s + 1].ranks[0][0] for s in range(cand.pp - 1)]
    scale = dtype_bytes(dtype) / 4
    grad_bytes = state_bytes_per_param(dtype, optimizer)[1]
    lt, ct, mem, dpt, tpt = [], [], [], [], []
    dp_lines = [dp_linear(cluster, [rep[0] for rep in slot.ranks]) for slot in slots]
    # Stages of one device type and placement share their cells: compute each once.
    memo: dict = {}

    def cached(key, compute):
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    # How a stage's tensor-parallel group and its p2p peer sit in the cluster: stages that
    # agree on this cost the same.
    tp_place = []
    for slot in slots:
        nodes = [cluster.node_of(r) for r in slot.ranks[0]]
        tp_place.append((slot.device_type, tuple(n - nodes[0] for n in nodes)))
    cut_place = [
        (cluster.node_of(slots[s].ranks[0][0]) == cluster.node_of(cut_to[s]),
         id(cluster.group_of(slots[s].ranks[0][0])), id(cluster.group_of(cut_to[s])))
        for s in range(cand.pp - 1)
    ]

    for l, layer in enumerate(model.layers):
        row_t, row_c, row_m, row_d, row_tp = [], [], [], [], []
        for s, slot in enumerate(slots):
            timing = cached(("time", l, slot.device_type), lambda: layer_timing(
                layer, cluster.profile(slot.device_type), tp=cand.tp, micro_batch_size=cand.micro_batch_size, dtype=dtype))
            bwd = timing.bwd_s + (timing.fwd_s if cand.recompute == "full" else 0.0)  # full recompute runs the forward again
            tp_comm = 0.0
            if cand.tp > 1 and layer.tp_allreduce_bytes:
                payload = layer.tp_allreduce_bytes * cand.micro_batch_size * scale
                tp_comm = cached(("tp", payload, tp_place[s]),
                                 lambda: 2 * all_reduce_time_s(payload, slot.ranks[0], cluster))
            row_t.append(timing.fwd_s + bwd + tp_comm)
            row_tp.append(tp_comm)
            cut = 0.0
            if s + 1 < cand.pp:
                payload = layer.boundary_bytes * cand.micro_batch_size * scale
                cut = cached(("cut", payload, cut_place[s]),
                             lambda: 2 * p2p_time_s(payload, slot.ranks[0][0], cut_to[s], cluster))
            row_c.append(cut)
            in_flight = in_flight_microbatches(cand.schedule, s, cand.pp, cand.num_microbatches)
            row_m.append(cached(("memory", l, in_flight), lambda: stage_memory(
                [layer], tp=cand.tp, micro_batch_size=cand.micro_batch_size, in_flight=in_flight, dtype=dtype,
                optimizer=optimizer, recompute=cand.recompute).total_bytes))
            row_d.append(layer.params_at(cand.tp) * grad_bytes * dp_lines[s][1])
        lt.append(row_t)
        ct.append(row_c)
        mem.append(row_m)
        dpt.append(row_d)
        tpt.append(row_tp)
    return CostTables(
        candidate=cand,
        slots=slots,
        layer_time_s=lt,
        cut_time_s=ct,
        layer_memory_bytes=mem,
        capacity_bytes=[float(s.memory_bytes) for s in slots],
        dp_latency_s=[latency for latency, _ in dp_lines],
        dp_time_s=dpt,
        tp_time_s=tpt,
    )


def dp_linear(cluster, ranks: list[int]) -> tuple[float, float]:
    """(latency s, s per byte) of the gradient all-reduce among ``ranks``, read off the collective model."""
    if len(ranks) < 2:
        return 0.0, 0.0
    latency = all_reduce_time_s(1, ranks, cluster)
    per_byte = (all_reduce_time_s(_DP_BUCKET_BYTES, ranks, cluster) - latency) / _DP_BUCKET_BYTES
    return latency, max(per_byte, 0.0)


@dataclass(frozen=True, kw_only=True)
class SplitCost:
    """The exact value of [Note: split objective] for one split, with its parts."""

    objective_s: float
    stage_time_s: list[float]
    dp_sync_s: list[float]
    stage_memory_bytes: list[float]

    def fits(self, tables: CostTables) -> bool:
        return all(m <= c for m, c in zip(self.stage_memory_bytes, tables.capacity_bytes))


def evaluate_split(tables: CostTables, bounds: list[tuple[int, int]]) -> SplitCost:
    """Evaluate a split given as inclusive (first, last) layer ranges per stage."""
    m = tables.candidate.num_microbatches
    stage_time, sync, memory = [], [], []
    for s, (first, last) in enumerate(bounds):
        layers = range(first, last + 1)
        t = sum(tables.layer_time_s[l][s] for l in layers)
        if s + 1 < len(bounds):
            t += tables.cut_time_s[last][s]
        stage_time.append(t)
        sync.append(tables.dp_latency_s[s] + sum(tables.dp_time_s[l][s] for l in layers))
        memory.append(sum(tables.layer_memory_bytes[l][s] for l in layers))
    objective = sum(stage_time) + (m - 1) * max(stage_time) + max(sync)
    return SplitCost(objective_s=objective, stage_time_s=stage_time, dp_sync_s=sync, stage_memory_bytes=memory)


def stage_memory_breakdown(model: ModelGraph, tables: CostTables, s: int, first: int, last: int, dtype: str, optimizer: str = "adamw") -> MemoryBreakdown:
    """The memory terms of stage ``s`` holding layers ``first..last``."""
    cand = tables.candidate
    in_flight = in_flight_microbatches(cand.schedule, s, cand.pp, cand.num_microbatches)
    return stage_memory(
        model.layers[first : last + 1], tp=cand.tp, micro_batch_size=cand.micro_batch_size, in_flight=in_flight, dtype=dtype,
        optimizer=optimizer, recompute=cand.recompute,
    )
