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
planner.estimate counts them (a stage is one FSDP unit in the generated program, so
they run before and after its compute, not under it); ``epilogue`` is the end-of-step
gradient synchronisation (all-reduce, or ZeRO-1/2's reduce-scatter and all-gather, none
under ZeRO-3) plus the optimizer step over the rank's share of the parameters.
Collective times are read off the collective model as latency + bytes * per-byte cost.

Memory of rank r, which must fit its devices:

    sum over its chunks of (sum memory[l] + [full recompute] max workspace[a, l] + [ZeRO-3] max zero3_buffer[a, l])

``memory`` is the layer's training state under the mode's ZeRO stage plus its
activations times the micro-batches the schedule keeps in flight on the chunk
(``activation_multipliers``); the two maxima are the one-layer buffers of
[Note: activations kept per micro-batch] and [Note: ZeRO stages] (cost_models/memory.py),
with at most ``_RANGE_MAX_LEVELS`` distinct values (larger sets are rounded up). For
the interleaved schedule each chunk counts its own peak of in-flight micro-batches and
its own buffers, an upper bound of the rank's joint peak that planner.estimate plays out.
Everything carries cost_models.memory.FRAGMENTATION_MARGIN.

Ranks follow Megatron's order (tensor-parallel innermost, then data-parallel, then
pipeline) over the devices in the order the cluster lists them; a stage whose ranks
span device types is costed on the slowest of them and the smallest memory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from hetpar.cost_models.collectives import (
    all_gather_time_s, all_reduce_time_s, grad_sync_scale, p2p_time_s, reduce_scatter_time_s, tensor_parallel_pass_s,
)
from hetpar.cost_models.compute import dtype_bytes, layer_timing, optimizer_rates
from hetpar.cost_models.grad_sync import PLAIN, SyncMethod, sync_seconds
from hetpar.cost_models.memory import (
    FRAGMENTATION_MARGIN,
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_GRAD_ACTIVATION_SHARE,
    MemoryBreakdown,
    activation_bytes_per_microbatch,
    recompute_workspace_bytes,
    sharded_state_bytes_per_param,
    state_bytes_per_param,
    training_state_bytes,
)
from hetpar.cost_models.pipeline import linear_step_time_s
from hetpar.planner.trace import ModelGraph
from hetpar.runtime.schedule import Kind, build_schedule

# The size at which a collective's per-byte cost is read off the collective model:
# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
_DP_BUCKET_BYTES = 25 * 2**20

# Distinct values a range maximum (workspace, ZeRO-3 buffers) keeps; see [Note: split objective].
_RANGE_MAX_LEVELS = 4


@dataclass(frozen=True, order=True)
class StageMode:
    """What one stage (chunk) chooses inside the CP-SAT model."""

    recompute: str = "none"  # "none" | "selective" | "full"
    zero_stage: int = 0
    tp: int = 1  # tensor-parallel degree of the stage

    def describe(self) -> str:
        parts = ([f"recompute {self.recompute}"] if self.recompute != "none" else []) + ([f"zero {self.zero_stage}"] if self.zero_stage else [])
        return ", ".join(parts) or "plain"


# [Note: per-stage tensor parallelism]
# Each stage chooses its tensor-parallel degree inside the CP-SAT model, as part of its
# mode. A candidate fixes dp, pp, the micro-batch, the schedule and, on a cluster whose
# device types host whole stages, how many stages each type hosts; the stages on type t
# then have tensor-parallel degrees that sum to n_t / dp (n_t: the type's devices), so
# every device runs exactly one stage replica. The degrees offered are the divisors of
# the node width up to --max-tp that form a chain (each divides the next: powers of
# two), so the stages' blocks pack every node exactly (largest first, each block
# aligned to its size; ``pack_stage_ranks``) and a tensor-parallel group never leaves
# its node; a candidate offers two neighbours of that chain, or the few degrees that
# can sum right ([Note: stage counts] in planner.search). A layer that does not split a
# stage's degree forbids that degree to any
# chunk that holds it (its time is infinite; the CP-SAT model excludes the pair). A
# stage's degree changes its layers' time, memory and all-reduces, its data-parallel
# collectives and the hand-off to the next stage: between equal degrees Megatron's
# scatter/gather (p2p of 1/a of the tensor, then an all-gather), between different
# degrees what the runtime runs (receiver t reads the whole tensor from sender t mod a,
# so a sender sends ceil(b / a) whole tensors, one after another). The tables are
# costed on representative ranks per (type, degree); the plan's exact ranks are costed
# again after the solve ([Note: stage device types]).
@dataclass(frozen=True, kw_only=True)
class Candidate:
    """The choices the search enumerates outside the CP-SAT model, and the stage modes it offers inside."""

    dp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int = 1
    modes: tuple[StageMode, ...] = (StageMode(),)
    # Device type -> the sum of its stages' tensor-parallel degrees (n_t / dp), on
    # clusters whose types host whole stages; empty when the layout is Megatron's over
    # mixed devices (one degree for all). See [Note: per-stage tensor parallelism].
    tp_sum: tuple[tuple[str, int], ...] = ()
    stages_per_type: tuple[tuple[str, int], ...] = ()  # device type -> pipeline ranks it hosts (when typed)
    sync: SyncMethod = PLAIN  # how the replicas agree ([Note: sync method costs] in cost_models.grad_sync)

    @property
    def num_chunks(self) -> int:
        """Stages of the plan: pp * virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees the modes offer, ascending."""
        return tuple(sorted({m.tp for m in self.modes}))

    @property
    def tp(self) -> int | None:
        """The one tensor-parallel degree of every stage, or None when stages choose among several."""
        degrees = self.tp_degrees
        return degrees[0] if len(degrees) == 1 else None

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        tp = f"tp={self.tp}" if self.tp is not None else "tp=" + "|".join(map(str, self.tp_degrees))
        return f"dp={self.dp} {tp} pp={self.pp} micro-batch {self.micro_batch_size}x{self.num_microbatches} {self.schedule}{v}"


@dataclass(frozen=True, kw_only=True)
class StageSlot:
    """Where a stage runs: its ranks and the device it is costed on."""

    ranks: list[list[int]]  # [data-parallel replica][tensor-parallel index]
    device_type: str
    memory_bytes: int


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


def _slot(ranks: list[list[int]], device_types: list[str], cluster) -> StageSlot:
    types = sorted({device_types[r] for rep in ranks for r in rep})
    profiles = [cluster.profile(t) for t in types]
    slowest = min(profiles, key=_peak)
    return StageSlot(ranks=ranks, device_type=slowest.name, memory_bytes=min(p.memory_bytes for p in profiles))


# Per pipeline rank: tensor-parallel degree -> where a stage of that degree is costed.
RankSlots = dict[int, StageSlot]


def _block(first: int, dp: int, tp: int) -> list[list[int]]:
    """Ranks of a stage block starting at ``first``: replica d, tensor-parallel index t at first + d tp + t."""
    return [[first + d * tp + t for t in range(tp)] for d in range(dp)]


def stage_slots(cluster, cand: Candidate) -> list[RankSlots]:
    """Megatron's rank layout, rank = s * dp * tp + d * tp + t, per offered degree; see [Note: split objective].

    With several degrees, rank s of degree tp is costed on the s-th block of dp * tp
    devices (cyclically): exact when every stage has that degree, representative
    otherwise ([Note: per-stage tensor parallelism]).
    """
    types = cluster.device_types()
    out: list[RankSlots] = [{} for _ in range(cand.pp)]
    for tp in cand.tp_degrees:
        size = cand.dp * tp
        blocks = cluster.world_size // size
        for s in range(cand.pp):
            if blocks:
                out[s][tp] = _slot(_block((s % blocks) * size, cand.dp, tp), types, cluster)
    return out


def type_slots(cluster, dp: int, tp: int) -> dict[str, list[StageSlot]]:
    """The stage-sized blocks of ``dp * tp`` devices each device type offers; see [Note: stage device types].

    Returns:
        Device type -> its blocks in listed order: as many whole blocks as fit, none
        where ``tp`` does not divide the type's node width.
    """
    return _type_slots(cluster, dp, tp)


@functools.lru_cache(maxsize=256)
def _type_slots(cluster, dp: int, tp: int) -> dict[str, list[StageSlot]]:
    size = dp * tp
    out = {}
    for device_type, ranks in ranks_by_type(cluster).items():
        if type_width(cluster, ranks) % tp:
            out[device_type] = []
            continue
        memory = cluster.profile(device_type).memory_bytes
        out[device_type] = [
            StageSlot(ranks=[ranks[i + d * tp : i + (d + 1) * tp] for d in range(dp)], device_type=device_type, memory_bytes=memory)
            for i in range(0, len(ranks) - size + 1, size)
        ]
    return out


def type_width(cluster, ranks: list[int]) -> int:
    """The largest tensor-parallel degree that tiles every node of these ranks: the gcd of their nodes' widths."""
    return math.gcd(*{cluster.devices_per_node_of(r) for r in ranks})


def ranks_by_type(cluster) -> dict[str, list[int]]:
    """Device type -> its global ranks, in the order the cluster lists them."""
    out: dict[str, list[int]] = {}
    for rank, device_type in enumerate(cluster.device_types()):
        out.setdefault(device_type, []).append(rank)
    return out


def pack_stage_ranks(ranks: list[int], dp: int, tps: list[int]) -> list[list[list[int]]]:
    """The ranks of stages of tensor-parallel degrees ``tps`` on the devices ``ranks`` of one type.

    Blocks of dp * tp devices are laid out largest degree first (ties in stage order),
    each starting where the last ended: with degrees that form a divisor chain every
    block starts at a multiple of its size, so a tensor-parallel group never crosses a
    node; see [Note: per-stage tensor parallelism]. One degree gives Megatron's layout.

    Returns:
        Per stage, in the order of ``tps``: ranks[d][t].
    """
    out: list[list[list[int]] | None] = [None] * len(tps)
    first = 0
    for s in sorted(range(len(tps)), key=lambda s: -tps[s]):
        out[s] = [ranks[first + d * tps[s] : first + (d + 1) * tps[s]] for d in range(dp)]
        first += dp * tps[s]
    return out


# [Note: stage device types]
# On a cluster whose device types each host whole stages (every type's device count a
# multiple of dp), the search chooses the order of the device types along the pipeline
# jointly with the layer split; how many stages each type hosts is part of the outer
# candidate. A type's stages are consecutive, so the pipeline crosses each type
# boundary once (one slow inter-type link instead of several); every order of the types
# (at most 3! = 6 for three types) is solved exactly, which keeps the search exact
# within that space and fast. (A CP-SAT model over every stage-by-stage type sequence
# was tried: its bounds were weak and 12-stage instances did not close in 10 s.) Each
# type gets its own cost columns, built as if every stage ran on that type's first
# blocks of its degree; a stage that chooses a type reads that type's column. The p2p
# cost of a cut is the one between the sending type's own blocks, an approximation
# when neighbouring stages are of different types. After solving, each stage takes its
# block of its type (``pack_stage_ranks``), and the plan's prediction is recomputed on
# those exact ranks.
def tables_by_type(model: ModelGraph, cluster, cand: Candidate, dtype: str, optimizer: str = "adamw",
                   cache: dict | None = None) -> dict[str, "CostTables"]:
    """One set of cost columns per device type of ``cand.stages_per_type``, each as if every stage ran on that type."""
    out = {}
    blocks = {tp: type_slots(cluster, cand.dp, tp) for tp in cand.tp_degrees}
    for device_type, _ in cand.stages_per_type:
        slots: list[RankSlots] = [{} for _ in range(cand.pp)]
        cut_to: list[RankSlots] = [{} for _ in range(cand.pp)]
        for tp, available in blocks.items():
            mine = available.get(device_type, [])
            if not mine:
                continue
            peers = [b[0] for t, b in available.items() if t != device_type and b]
            for s in range(cand.pp):
                slots[s][tp] = mine[s % min(len(mine), 2)]
                # a single block hosts one stage of this degree at most: its cuts go to another type
                cut_to[s][tp] = mine[1 - s % 2] if len(mine) > 1 else (peers[0] if peers else mine[0])
        out[device_type] = build_tables(model, cluster, cand, dtype, optimizer, slots=slots, cut_to=cut_to, cache=cache)
    return out


def compose_tables(tables_by_type: dict[str, "CostTables"], types: list[str]) -> "CostTables":
    """The cost tables of a split whose pipeline rank r runs on device type ``types[r]``."""
    first = next(iter(tables_by_type.values()))
    P, C = len(types), first.num_chunks
    chunk_types = [types[c % P] for c in range(C)]

    def pick(name: str, axis: int) -> np.ndarray:
        cols = [np.take(getattr(tables_by_type[t], name), [c], axis=axis) for c, t in enumerate(chunk_types)]
        return np.concatenate(cols, axis=axis)

    per_chunk3 = ("time_s", "fwd_s", "weight_s", "gather_fwd_s", "gather_bwd_s", "epilogue_s", "memory_bytes", "tp_time_s")
    return CostTables(
        candidate=first.candidate,
        slots=[tables_by_type[t].slots[r] for r, t in enumerate(types)],
        **{name: pick(name, 2) for name in per_chunk3},
        **{name: pick(name, 1) for name in ("gather_fwd_latency_s", "gather_bwd_latency_s", "epilogue_latency_s")},
        cut_s=pick("cut_s", 3),
        workspace_bytes=first.workspace_bytes,
        zero3_buffer_bytes=first.zero3_buffer_bytes,
        capacity_bytes=np.array([tables_by_type[t].capacity_bytes[r] for r, t in enumerate(types)], dtype=float),
        device_types=list(types),
    )

def type_sequence(order: list[str], stages_per_type: dict[str, int]) -> list[str]:
    """Stage device types: each type's stages in one block, blocks in ``order``."""
    return [k for k in order for _ in range(stages_per_type[k])]


def _peak(profile) -> float:
    for dtype in ("bf16", "fp16", "fp32"):
        try:
            return profile.peak_flops(dtype)
        except (KeyError, ValueError):
            continue
    return 0.0


@functools.lru_cache(maxsize=256)
def activation_multipliers(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[float, ...]:
    """Per chunk, the most micro-batches' activations it keeps at once, as its rank's action
    list plays out (a W keeps WEIGHT_GRAD_ACTIVATION_SHARE of one after its B; [Note: zero-bubble split]).

    GPipe keeps m; 1F1B min(m, pp - s); ZB-H1, with w = min(pp - s - 1, m) warm-up forwards
    and each W s backwards late, w + 1 + share * min(m - w - 1, s) (m when m <= w). The
    interleaved schedule's are counted on its action lists; they stop growing once m
    reaches pp (v + 2) (Megatron's warm-up is at most 2 (pp - 1) + (v - 1) pp forwards),
    so larger m are counted there (tests/test_search_space.py checks both against the lists).
    """
    m = num_microbatches
    if schedule == "gpipe":
        return tuple(float(m) for _ in range(pp))
    if schedule in ("1f1b", "zb"):
        share = WEIGHT_GRAD_ACTIVATION_SHARE if schedule == "zb" else 0.0
        out = []
        for s in range(pp):
            w = min(pp - s - 1, m)
            out.append(float(m) if m <= w else w + 1 + share * min(m - w - 1, s))
        return tuple(out)
    return _counted_multipliers(schedule, pp, min(m, pp * (virtual_stages + 2)), virtual_stages)


def _counted_multipliers(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """``activation_multipliers`` counted on the schedule's action lists."""
    plan = build_schedule(schedule, pp, num_microbatches, virtual_stages)
    kept_for_w = WEIGHT_GRAD_ACTIVATION_SHARE if schedule == "zb" else 0.0
    peak = [0.0] * (pp * virtual_stages)
    for actions in plan:
        live: dict[int, float] = {}
        for a in actions:
            step = {Kind.FORWARD: 1.0, Kind.BACKWARD: -(1 - kept_for_w), Kind.WEIGHT: -kept_for_w}[a.kind]
            live[a.stage] = live.get(a.stage, 0.0) + step
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return tuple(peak)


def collective_linear(time_s, ranks: list[int], cluster, concurrent: int = 1) -> tuple[float, float]:
    """(latency s, s per byte) of a collective ``time_s(nbytes, ranks, cluster, concurrent=...)`` among ``ranks``."""
    if len(ranks) < 2:
        return 0.0, 0.0
    latency = time_s(1, ranks, cluster, concurrent=concurrent)
    per_byte = (time_s(_DP_BUCKET_BYTES, ranks, cluster, concurrent=concurrent) - latency) / _DP_BUCKET_BYTES
    return latency, max(per_byte, 0.0)


@dataclass(frozen=True)
class _LayerColumns:
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


def _layer_columns(model: ModelGraph, cluster, device_type: str, tp: int, mbs: int, dtype: str, cache: dict) -> _LayerColumns:
    key = ("layers", device_type, tp, mbs, dtype)
    if key not in cache:
        device = cluster.profile(device_type)
        scale = dtype_bytes(dtype) / 4 * mbs
        times = []
        for layer in model.layers:
            try:
                times.append(layer_timing(layer, device, tp=tp, micro_batch_size=mbs, dtype=dtype))
            except (KeyError, ValueError):
                times.append(None)
        inf = float("inf")
        boundary = np.array([l.boundary_bytes for l in model.layers]) * scale
        cache[key] = _LayerColumns(
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
        )
    return cache[key]


def _memo(cache: dict, key, compute):
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _place(cluster, ranks: list[int]) -> tuple:
    """How ranks sit in the cluster: groups that agree on this cost the same collectives."""
    groups, nodes = cluster.nodes_of(ranks)
    return tuple(id(cluster.groups[g]) for g in np.unique(groups)), groups.tobytes(), (nodes - nodes[0]).tobytes()


def build_tables(
    model: ModelGraph,
    cluster,
    cand: Candidate,
    dtype: str,
    optimizer: str = "adamw",
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
            if mode.tp not in slots[r]:
                tables["time_s"][k, :, c] = tables["memory_bytes"][k, :, c] = np.inf
                continue
            _fill_mode(model, cluster, cand, dtype, optimizer, slots[r][mode.tp], c, k, in_flight[c], tables, lat, cache, per_slot)
    workspace, zero3 = [], []
    w, g, _ = state_bytes_per_param(dtype, optimizer)
    for tp in degrees:
        any_cols = _layer_columns(model, cluster, next(iter(slots[0].values())).device_type, tp, cand.micro_batch_size, dtype, cache)
        workspace.append(_levels(FRAGMENTATION_MARGIN * any_cols.saved))
        zero3.append(_levels(FRAGMENTATION_MARGIN * any_cols.params * (2 * w + g)))
    return CostTables(
        candidate=cand,
        slots=list(slots),
        **tables,
        **lat,
        cut_s=cut,
        workspace_bytes=np.array(workspace),
        zero3_buffer_bytes=np.array(zero3),
        capacity_bytes=np.array([float(next(iter(s.values())).memory_bytes) if s else 0.0 for s in slots]),
        device_types=[next(iter(s.values())).device_type if s else "" for s in slots],
    )


def _fill_mode(model: ModelGraph, cluster, cand: Candidate, dtype: str, optimizer: str, slot: StageSlot, c: int, k: int,
               in_flight: float, tables: dict, lat: dict, cache: dict, per_slot: dict) -> None:
    """Column c, row k of every per-mode table: chunk c on ``slot`` in mode ``cand.modes[k]``.

    Args:
        per_slot: (rank, degree) -> what the slot's modes share, filled by the first.
    """
    mode, P, elem = cand.modes[k], cand.pp, dtype_bytes(dtype)
    r = c % P
    cols, (tp_fwd, tp_bwd), comm, rates = _memo(per_slot, (r, mode.tp), lambda: (
        cols := _layer_columns(model, cluster, slot.device_type, mode.tp, cand.micro_batch_size, dtype, cache),
        _tp_collectives(model, cluster, slot, cols, mode.tp, cache),
        _data_parallel_linear(cluster, cand.dp, mode.tp, slot, cache),
        optimizer_rates(cluster.profile(slot.device_type)),
    ))
    params = cols.params + (cols.tied if r != 0 else 0.0)  # a tied copy lives on every rank but the first
    full = mode.recompute == "full"
    fwd = cols.fwd + tp_fwd
    bwd = cols.b_input + cols.weight + (cols.fwd if full else 0.0) + tp_bwd + (tp_fwd if full else 0.0)
    unsplit = np.where(cols.splits, 0.0, np.inf)  # a layer this degree cannot split: [Note: per-stage tensor parallelism]
    tables["time_s"][k, :, c] = fwd + bwd + unsplit
    tables["fwd_s"][k, :, c] = fwd
    tables["weight_s"][k, :, c] = cols.weight
    tables["tp_time_s"][k, :, c] = tp_fwd * (2 if full else 1) + tp_bwd
    sharded = cand.dp > 1 and mode.zero_stage > 0
    if sharded and mode.zero_stage == 3:
        scale = grad_sync_scale(cluster.profile(slot.device_type))
        (ag_lat, ag_pb), (rs_lat, rs_pb) = ((a * scale, b * scale) for a, b in (comm["all_gather"], comm["reduce_scatter"]))
        tables["gather_fwd_s"][k, :, c] = ag_pb * cols.params * elem
        tables["gather_bwd_s"][k, :, c] = (ag_pb + rs_pb) * cols.params * elem
        lat["gather_fwd_latency_s"][k, c] = ag_lat
        lat["gather_bwd_latency_s"][k, c] = ag_lat + rs_lat
    sync_lat, sync_pb = _sync_linear(comm, cand.dp, mode.zero_stage, cluster.profile(slot.device_type), cand.num_microbatches,
                                     cand.sync, elem)
    share = params / cand.dp if sharded else params
    tables["epilogue_s"][k, :, c] = (sync_pb * params * elem
                                     + rates.seconds(share * OPTIMIZER_BYTES_PER_PARAM[optimizer], cols.tensors, cols.sharded_tensors))
    if c < P:
        lat["epilogue_latency_s"][k, c] = sync_lat + rates.fixed_s
    state = sum(sharded_state_bytes_per_param(dtype, optimizer, dp=cand.dp, zero_stage=mode.zero_stage))
    activations = cols.inputs if full else cols.saved
    tables["memory_bytes"][k, :, c] = FRAGMENTATION_MARGIN * (params * state + in_flight * activations) + unsplit


def _levels(values: np.ndarray) -> np.ndarray:
    """``values`` with at most _RANGE_MAX_LEVELS distinct ones, each rounded up to the next kept level."""
    distinct = np.unique(values)[::-1]
    if len(distinct) <= _RANGE_MAX_LEVELS:
        return values.copy()
    kept = np.sort(distinct[: _RANGE_MAX_LEVELS])
    return kept[np.searchsorted(kept, values)]


def _tp_collectives(model: ModelGraph, cluster, slot: StageSlot, cols: _LayerColumns, tp: int, cache: dict
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each layer's tensor-parallel collectives in the forward and in the backward."""
    if tp == 1:
        return np.zeros(len(model.layers)), np.zeros(len(model.layers))
    place = _place(cluster, slot.ranks[0])
    return _memo(cache, ("tp layers", _model_token(model, cache), cols.scale, place), lambda: tuple(np.array([
        _memo(cache, ("tp", l.tp_collectives, p, cols.scale, place),
              lambda l=l, p=p: tensor_parallel_pass_s(l.tp_collectives, p, cols.scale, slot.ranks[0], cluster))
        for l in model.layers
    ]) for p in ("forward", "backward")))


def _model_token(model: ModelGraph, cache: dict) -> int:
    """A number that names ``model`` in ``cache`` (which keeps the model, so that its id is not reused)."""
    return _memo(cache, ("model", id(model)), lambda: (model, len(cache)))[1]


def boundary_seconds(nbytes: float, src: list[int], dst: list[int], cluster, scatter_gather: bool = True) -> float:
    """One hand-off of a ``nbytes`` boundary tensor from the tensor-parallel group ``src`` to ``dst``, one way;
    see [Note: per-stage tensor parallelism]."""
    a, b = len(src), len(dst)
    if a == b and a > 1 and scatter_gather:
        return p2p_time_s(nbytes / a, src[0], dst[0], cluster) + all_gather_time_s(nbytes, dst, cluster)
    return -(-b // a) * p2p_time_s(nbytes, src[0], dst[0], cluster)


def _cut_seconds(model: ModelGraph, cluster, cand: Candidate, dtype: str, src: StageSlot, dst: StageSlot, cache: dict) -> np.ndarray:
    """Forward and backward hand-off of each layer's boundary tensor from ``src`` to ``dst``, as planner.estimate sends it."""
    a, b = src.ranks[0], dst.ranks[0]
    key_place = (cluster.node_of(a[0]) == cluster.node_of(b[0]), id(cluster.group_of(a[0])), id(cluster.group_of(b[0])),
                 len(a), _place(cluster, b))
    scale = dtype_bytes(dtype) / 4 * cand.micro_batch_size

    def seconds() -> np.ndarray:
        boundary = np.array([l.boundary_bytes for l in model.layers]) * scale
        return np.array([_memo(cache, ("cut", n, key_place), lambda n=n: 2 * boundary_seconds(n, a, b, cluster)) for n in boundary])

    return _memo(cache, ("cut layers", _model_token(model, cache), scale, key_place), seconds)


def _data_parallel_linear(cluster, dp: int, tp: int, slot: StageSlot, cache: dict) -> dict[str, tuple[float, float]]:
    """(latency, per byte) of all-reduce, reduce-scatter and all-gather over the stage's replicas, and
    (``node_all_reduce``) of an all-reduce over those on the first replica's node."""
    group = [rep[0] for rep in slot.ranks]
    key = ("dp", tp, _place(cluster, group))

    def fit() -> dict[str, tuple[float, float]]:
        fns = {"all_reduce": all_reduce_time_s, "reduce_scatter": reduce_scatter_time_s, "all_gather": all_gather_time_s}
        fits = {name: collective_linear(fn, group, cluster, tp) for name, fn in fns.items()}
        inside = [r for r in group if cluster.node_of(r) == cluster.node_of(group[0])]
        return {**fits, "node_all_reduce": collective_linear(all_reduce_time_s, inside, cluster, tp)}

    return _memo(cache, key, fit)


def _sync_linear(comm: dict[str, tuple[float, float]], dp: int, zero_stage: int, device, microbatches: int,
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
            a, b = comm["node_all_reduce" if scope == "node" else kind]
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


@dataclass(frozen=True, kw_only=True)
class SplitCost:
    """The exact value of [Note: split objective] for one split, with its parts."""

    objective_s: float
    stage_time_s: list[float]  # t_c per chunk
    dp_sync_s: list[float]  # e_r per rank: gradient synchronisation and optimizer step
    stage_memory_bytes: list[float]  # per rank
    modes: list[int]  # the mode index of each chunk

    def fits(self, tables: CostTables) -> bool:
        """Every rank within its memory, and the degrees summing to each type's devices."""
        return all(m <= c for m, c in zip(self.stage_memory_bytes, tables.capacity_bytes)) and tables.tp_sum_ok(self.modes)


def chunk_terms(tables: CostTables, c: int, first: int, last: int, k: int, next_k: int | None = None) -> tuple[float, float, float, float]:
    """(t_c, w_c, epilogue, memory) of chunk c holding layers first..last in mode k, the next chunk in mode
    ``next_k`` (k's degree when None); see [Note: split objective]."""
    rows = slice(first, last + 1)
    time = tables.time_s[k, rows, c].sum()
    a = tables.tp_index(k)
    b = a if next_k is None else tables.tp_index(next_k)
    t = time + (tables.cut_s[a, b, last, c] if c + 1 < tables.num_chunks else 0.0)
    t += tables.gather_fwd_latency_s[k, c] + tables.gather_fwd_s[k, rows, c].sum()
    t += tables.gather_bwd_latency_s[k, c] + tables.gather_bwd_s[k, rows, c].sum()
    epilogue = tables.epilogue_latency_s[k, c] + tables.epilogue_s[k, rows, c].sum()
    memory = tables.memory_bytes[k, rows, c].sum()
    mode = tables.candidate.modes[k]
    if mode.recompute == "full":
        memory += tables.workspace_bytes[a, rows].max()
    if mode.zero_stage == 3 and tables.candidate.dp > 1:
        memory += tables.zero3_buffer_bytes[a, rows].max()
    return float(t), float(tables.weight_s[k, rows, c].sum()), float(epilogue), float(memory)


def evaluate_split(tables: CostTables, bounds: list[tuple[int, int]], modes: list[int] | None = None) -> SplitCost:
    """Evaluate a split given as inclusive (first, last) layer ranges per chunk, each chunk in mode ``modes[c]`` (0 by default)."""
    cand = tables.candidate
    modes = list(modes) if modes is not None else [0] * len(bounds)
    P = cand.pp
    times, weights = [], []
    epilogue, memory = [0.0] * P, [0.0] * P
    for c, ((first, last), k) in enumerate(zip(bounds, modes)):
        t, w, e, mem = chunk_terms(tables, c, first, last, k, modes[c + 1] if c + 1 < len(modes) else None)
        times.append(t)
        weights.append(w)
        epilogue[c % P] += e
        memory[c % P] += mem
    objective = linear_step_time_s(cand.schedule, num_stages=P, num_microbatches=cand.num_microbatches, chunk_time_s=times,
                                   rank_epilogue_s=epilogue, chunk_weight_s=weights, virtual_stages=cand.virtual_stages)
    return SplitCost(objective_s=objective, stage_time_s=times, dp_sync_s=epilogue, stage_memory_bytes=memory, modes=modes)


def stage_memory_breakdown(model: ModelGraph, tables: CostTables, s: int, first: int, last: int, dtype: str, optimizer: str = "adamw",
                           mode: StageMode | None = None) -> MemoryBreakdown:
    """The memory terms of stage ``s`` holding layers ``first..last`` in ``mode`` (the first offered by default)."""
    cand = tables.candidate
    mode = mode or cand.modes[0]
    in_flight = activation_multipliers(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages)[s]
    layers = model.layers[first : last + 1]
    c = dict(tp=mode.tp, micro_batch_size=cand.micro_batch_size, dtype=dtype)
    weights, grads, opt = training_state_bytes(layers, tp=mode.tp, dtype=dtype, optimizer=optimizer, dp=cand.dp, zero_stage=mode.zero_stage)
    inputs = model.layers[first - 1].boundary_bytes if first > 0 else model.input_bytes
    per_mb = activation_bytes_per_microbatch(layers, recompute=mode.recompute, input_bytes=inputs, **c)
    workspace = recompute_workspace_bytes(layers, recompute=mode.recompute, **c)
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=per_mb * in_flight + workspace)
