"""The search: the fastest plan under the cost model, with proof of optimality.

Outer enumeration covers what the CP-SAT model keeps fixed (data-, tensor- and
pipeline-parallel degrees, micro-batch size, schedule); for each such candidate one
CP-SAT model chooses the cut points of the layer sequence into stages, which may be
uneven and which see each stage's own device type. The objective is
[Note: split objective] in planner.costs.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cost_models.collectives import all_reduce_time_s, p2p_time_s
from cost_models.compute import dtype_bytes, layer_timing
from cost_models.memory import stage_memory, state_bytes_per_param
from cost_models.pipeline import SCHEDULES
from planner.costs import (
    dp_linear,
    Candidate,
    CostTables,
    StageSlot,
    SplitCost,
    build_tables,
    compose_tables,
    evaluate_split,
    stage_memory_breakdown,
    stage_slots,
    tables_by_type,
    type_slots,
)
from planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, Schedule, SolverInfo, StagePlan
from planner.trace import ModelGraph

# Solver resolution: the objective's scale divided into this many ticks.
_TICKS_PER_OBJECTIVE = 1_000_000


class PlanningError(Exception):
    """No plan satisfies the request; the message says why and what to change."""


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the user asked for; ``None`` pins leave the choice to the search."""

    global_batch_size: int
    dtype: str
    optimizer: str = "adamw"
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    recompute: str | None = None  # "none" | "full"; both are searched when None
    stage_layers: tuple[int, ...] | None = None  # layers per stage, pinned
    stage_devices: tuple[str, ...] | None = None  # device type per stage, pinned
    max_tp: int = 8
    time_limit_s: float = 10.0
    gap_limit: float = 0.0  # stop a candidate's solve once proven within this relative gap
    uniform_split: bool = False  # equal layers per stage in Megatron's layout (a baseline, not a search)
    workers: int = 2
    seed: int = 0
    top_k: int = 3


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(model: ModelGraph, cluster, options: SearchOptions) -> list[Candidate]:
    """Every (dp, tp, pp, micro-batch size, schedule) the pins allow.

    Raises:
        PlanningError: the pins or the batch size rule out every candidate; says why.
    """
    world = cluster.world_size
    num_layers = len(model.layers)
    gbs = options.global_batch_size
    _check_pins(model, cluster, options)
    tp_ok = any(l.tp_capable for l in model.layers)
    # GPipe takes the time of 1F1B and more memory ([Note: pipeline step time]), so it
    # can never win; it is searched only when pinned.
    schedules = [options.schedule] if options.schedule else ["1f1b"]
    # Selective recompute costs what no recompute costs under this cost model (attention
    # is measured as a fused kernel holds it), so the search tries none and full.
    recomputes = [options.recompute] if options.recompute else ["none", "full"]
    widths = {g.devices_per_node for g in cluster.groups}
    out = []
    for tp in divisors(world):
        # Tensor parallelism stays inside a node: tp divides every node's device count.
        if tp > 1 and (not tp_ok or tp > options.max_tp or any(w % tp for w in widths)):
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp > num_layers or gbs % dp:
                continue
            pins = ((options.dp, dp), (options.tp, tp), (pinned_pp(options), pp))
            if any(pin is not None and pin != value for pin, value in pins):
                continue
            for mbs in divisors(gbs // dp):
                if options.micro_batch_size and mbs != options.micro_batch_size:
                    continue
                for schedule, recompute in itertools.product(schedules, recomputes):
                    m = gbs // (dp * mbs)
                    out.append(Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule=schedule, recompute=recompute))
    if not out:
        raise PlanningError(
            f"no (dp, tp, pp) fits world_size({world}) with global batch {gbs}"
            + ("" if tp_ok else " (the model has no tensor-parallel layers, so tp is 1)")
            + "; change the pins or --global-batch"
        )
    return out


def _check_pins(model: ModelGraph, cluster, options: SearchOptions) -> None:
    world = cluster.world_size
    gbs = options.global_batch_size
    if gbs < 1:
        raise PlanningError(f"--global-batch must be positive, got {gbs}")
    for name, value in (("dp", options.dp), ("tp", options.tp), ("pp", options.pp)):
        if value is not None and (value < 1 or world % value):
            raise PlanningError(f"--{name} {value} does not divide the cluster's world size ({world})")
    dp, tp, pp = options.dp, options.tp, options.pp
    if dp and tp and pp and dp * tp * pp != world:
        raise PlanningError(f"dp({dp}) * tp({tp}) * pp({pp}) = {dp * tp * pp} != world_size({world})")
    if pp and pp > len(model.layers):
        raise PlanningError(f"--pp {pp} exceeds the model's {len(model.layers)} layers")
    if tp and tp > 1 and not any(l.tp_capable for l in model.layers):
        raise PlanningError(f"--tp {tp}: the model has no layer that tensor parallelism can split")
    if dp and gbs % dp:
        raise PlanningError(f"--global-batch {gbs} is not divisible by dp({dp})")
    mbs = options.micro_batch_size
    if mbs and dp and (gbs // dp) % mbs:
        raise PlanningError(f"--micro-batch-size {mbs} does not divide the per-replica batch {gbs // dp}")
    if mbs and mbs > gbs:
        raise PlanningError(f"--micro-batch-size {mbs} exceeds --global-batch {gbs}")
    _check_stage_pins(model, cluster, options)
    if options.recompute and options.recompute not in ("none", "selective", "full"):
        raise PlanningError(f"unknown --recompute {options.recompute!r}; use none, selective or full")
    if options.schedule and options.schedule not in SCHEDULES:
        raise PlanningError(f"unknown --schedule {options.schedule!r}; use one of {', '.join(SCHEDULES)}")


def _check_stage_pins(model: ModelGraph, cluster, options: SearchOptions) -> None:
    layers, devices, pp = options.stage_layers, options.stage_devices, options.pp
    if layers is not None:
        if any(n < 1 for n in layers) or sum(layers) != len(model.layers):
            raise PlanningError(
                f"--stage-layers {','.join(map(str, layers))} sums to {sum(layers)}; the model has {len(model.layers)} layers "
                "(each stage needs at least one; see hetpar trace)"
            )
        if pp is not None and pp != len(layers):
            raise PlanningError(f"--stage-layers gives {len(layers)} stages but --pp is {pp}")
    if devices is not None:
        stages = pp or (len(layers) if layers else None)
        if stages is not None and len(devices) != stages:
            raise PlanningError(f"--stage-devices names {len(devices)} device types for {stages} stages")
        present = set(cluster.device_types())
        missing = [d for d in devices if d not in present]
        if missing:
            raise PlanningError(f"--stage-devices: {', '.join(missing)} not in the cluster (it has {', '.join(sorted(present))})")
        types = cluster.device_types()
        per_stage, rest = divmod(len(types), len(devices))
        for k in sorted(present):
            if rest or devices.count(k) * per_stage != types.count(k):
                raise PlanningError(
                    f"--stage-devices puts {devices.count(k)} of {len(devices)} stages on {k}: "
                    f"{devices.count(k) * per_stage} devices at {len(types)}/{len(devices)} per stage, the cluster has {types.count(k)}"
                )


def pinned_pp(options: SearchOptions) -> int | None:
    """The pipeline depth the pins imply, if any."""
    if options.pp:
        return options.pp
    if options.stage_layers:
        return len(options.stage_layers)
    return len(options.stage_devices) if options.stage_devices else None


def to_ticks(seconds: float, tick_s: float) -> int:
    """The one place where seconds become integer solver ticks."""
    return int(round(seconds / tick_s))


@dataclass(frozen=True, kw_only=True)
class SplitResult:
    bounds: list[tuple[int, int]]
    cost: SplitCost
    status: str  # "optimal" | "feasible"
    types: list[str] | None = None  # device type per stage, when the search chose them
    bound_s: float = 0.0  # the solver's proven lower bound on the objective


def solve_split(tables: CostTables, options: SearchOptions) -> SplitResult | None:
    """The best split of layers into ``pp`` stages for one candidate, or None if none fits.

    CP-SAT model of [Note: split objective] over the cut positions; see [Note: cut formulation].
    """
    if options.stage_layers is not None:
        return _pinned_split(tables, options.stage_layers)
    L, P, m = tables.num_layers, tables.candidate.pp, tables.candidate.num_microbatches
    hint = equal_split(L, P)
    tick_s = (evaluate_split(tables, hint).objective_s or 1.0) / _TICKS_PER_OBJECTIVE
    model = cp_model.CpModel()

    # Variables
    # start[s] is the first layer of stage s; start[P] = L closes the last stage
    start = [model.new_constant(0)] + [model.new_int_var(s, L - P + s, f"start_{s}") for s in range(1, P)] + [model.new_constant(L)]
    # stage_time[s]: ticks of one micro-batch's forward + backward (+ p2p) on stage s
    # dp_sync[s]: ticks of stage s's gradient all-reduce
    stage_time, dp_sync = [], []

    # Constraints
    for s in range(P):
        model.add(start[s + 1] >= start[s] + 1)  # every stage holds at least one layer
        work, sync, memory = _stage_terms(model, tables, s, start, tick_s)
        model.add(memory <= int(tables.capacity_bytes[s]))
        stage_time.append(work)
        dp_sync.append(sync)
    horizon = sum(to_ticks(max(row) + max(c), tick_s) for row, c in zip(tables.layer_time_s, tables.cut_time_s)) + 1
    slowest = model.new_int_var(0, horizon, "slowest_stage_time")
    model.add_max_equality(slowest, stage_time)
    sync_horizon = to_ticks(sum(map(max, tables.dp_time_s)) + max(tables.dp_latency_s), tick_s) + P + 1
    slowest_sync = model.new_int_var(0, sync_horizon, "slowest_sync")
    model.add_max_equality(slowest_sync, dp_sync)

    # Objective
    model.minimize(sum(stage_time) + (m - 1) * slowest + slowest_sync)

    for s in range(1, P):
        model.add_hint(start[s], hint[s][0])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.workers
    solver.parameters.random_seed = options.seed
    solver.parameters.relative_gap_limit = options.gap_limit
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [solver.value(v) for v in start]
    bounds = [(starts[s], starts[s + 1] - 1) for s in range(P)]
    cost = evaluate_split(tables, bounds)
    optimal = status == cp_model.OPTIMAL
    bound_s = cost.objective_s if optimal else solver.best_objective_bound * tick_s
    return SplitResult(bounds=bounds, cost=cost, status="optimal" if optimal else "feasible", bound_s=bound_s)


def solve_type_orders(tables: dict[str, CostTables], stages_per_type: dict[str, int], options: SearchOptions) -> SplitResult | None:
    """The best split over every order of the device types; see [Note: stage device types] in planner.costs.

    Each type's stages are consecutive, so the pipeline crosses from one type to the
    next once; each of the (at most types!) orders is one CP-SAT split model.

    Args:
        tables: cost columns per device type (``planner.costs.tables_by_type``).
        stages_per_type: how many stages each type hosts.

    Returns:
        The best split, with ``types`` naming each stage's device type, or None if none fits.
    """
    best: SplitResult | None = None
    for order in itertools.permutations(tables):
        types = type_sequence(list(order), stages_per_type)
        split = solve_split(compose_tables(tables, types), options)
        if split is not None and (best is None or split.cost.objective_s < best.cost.objective_s):
            best = SplitResult(bounds=split.bounds, cost=split.cost, status=split.status, types=types, bound_s=split.bound_s)
        elif split is not None and best is not None and split.status != "optimal":
            best = SplitResult(bounds=best.bounds, cost=best.cost, status="feasible", types=best.types, bound_s=min(best.bound_s, split.bound_s))
    return best


def type_sequence(order: list[str], stages_per_type: dict[str, int]) -> list[str]:
    """Stage device types: each type's stages in one block, blocks in ``order``."""
    return [k for k in order for _ in range(stages_per_type[k])]


def _stage_terms(model: cp_model.CpModel, tables: CostTables, s: int, start: list, tick_s: float):
    """(work ticks, gradient-sync ticks, memory bytes) of stage s; see [Note: cut formulation]."""
    L, P = tables.num_layers, tables.candidate.pp
    time_prefix = _prefix([to_ticks(tables.layer_time_s[l][s], tick_s) for l in range(L)])
    cut_cost = [0] + [to_ticks(tables.cut_time_s[l][s], tick_s) if s < P - 1 else 0 for l in range(L)]
    sync_prefix = _prefix([to_ticks(tables.dp_time_s[l][s], tick_s) for l in range(L)])
    memory_prefix = _prefix([math.ceil(tables.layer_memory_bytes[l][s]) for l in range(L)])
    first, end = start[s], start[s + 1]
    work = _read(model, time_prefix, end, f"time_end_{s}") - _read(model, time_prefix, first, f"time_start_{s}")
    work += _read(model, cut_cost, end, f"cut_{s}")
    sync = _read(model, sync_prefix, end, f"sync_end_{s}") - _read(model, sync_prefix, first, f"sync_start_{s}")
    sync += to_ticks(tables.dp_latency_s[s], tick_s)
    memory = _read(model, memory_prefix, end, f"memory_end_{s}") - _read(model, memory_prefix, first, f"memory_start_{s}")
    return work, sync, memory


def _read(model: cp_model.CpModel, values: list[int], index, name: str):
    """A variable equal to values[index]."""
    var = model.new_int_var(min(values), max(values), name)
    model.add_element(index, values, var)
    return var


def _pinned_split(tables: CostTables, stage_layers: tuple[int, ...]) -> SplitResult | None:
    """The split the user pinned, evaluated; None if it does not fit."""
    bounds = bounds_from_sizes(stage_layers)
    cost = evaluate_split(tables, bounds)
    return SplitResult(bounds=bounds, cost=cost, status="optimal", bound_s=cost.objective_s) if cost.fits(tables) else None


# [Note: cut formulation]
# A split is P + 1 increasing layer indices start[0] = 0 < start[1] < ... < start[P] = L.
# Every per-layer quantity of [Note: split objective] is additive, so stage s's share
# is prefix[start[s + 1]] - prefix[start[s]] of a prefix-sum table of that stage's
# column, read with element constraints. The model has O(P) integer variables whatever
# the number of layers, which keeps CP-SAT fast on 100-layer, 64-stage instances
# where a layer x stage boolean model does not finish in seconds.
def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def equal_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layers dealt out as evenly as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return bounds_from_sizes([base + (1 if s < extra else 0) for s in range(num_stages)])


def bounds_from_sizes(sizes) -> list[tuple[int, int]]:
    """Inclusive (first, last) layer of each stage from the number of layers per stage."""
    bounds, first = [], 0
    for size in sizes:
        bounds.append((first, first + size - 1))
        first += size
    return bounds


@dataclass(frozen=True, kw_only=True)
class Solved:
    tables: CostTables
    split: SplitResult


def search(model: ModelGraph, cluster, options: SearchOptions, progress=None) -> ParallelPlan:
    """Find the fastest plan; see the module docstring.

    Args:
        progress: optional callable(done, total, description) for a progress bar.

    Raises:
        PlanningError: nothing fits or the pins are impossible.
    """
    start = time.perf_counter()
    candidates = enumerate_candidates(model, cluster, options)
    cache: dict = {}
    bounds = {cand: lower_bound_s(model, cluster, cand, options.dtype, cache) for cand in candidates}
    candidates.sort(key=bounds.get)
    solved: list[Solved] = []
    misfits: list[tuple[float, CostTables]] = []
    skipped: list[Candidate] = []  # cannot fit in memory whatever the split
    best = math.inf
    for i, cand in enumerate(candidates):
        if progress:
            progress(i, len(candidates), cand.describe())
        if bounds[cand] >= best and len(solved) > options.top_k:
            break  # [Note: candidate bound]: no later candidate can win
        if not memory_may_fit(model, cluster, cand, options):
            skipped.append(cand)
            continue
        tables, split = solve_candidate(model, cluster, cand, options)
        if split is None:
            misfits.append((_overflow(tables), tables))
        else:
            solved.append(Solved(tables=tables, split=split))
            best = min(best, split.cost.objective_s)
    if progress:
        progress(len(candidates), len(candidates), "done")
    if not solved:
        for cand in skipped[: max(0, 8 - len(misfits))]:
            tables = build_tables(model, cluster, cand, options.dtype, options.optimizer)
            misfits.append((_overflow(tables), tables))
        raise PlanningError(_explain_misfit(model, options, min(misfits, key=lambda x: x[0])[1]))
    solved.sort(key=lambda s: s.split.cost.objective_s)
    best = solved[0]
    status = "optimal" if all(s.split.status == "optimal" for s in solved) else "feasible"
    proven = min([best.split.cost.objective_s] + [s.split.bound_s for s in solved if s.split.status != "optimal"])
    gap = max(0.0, 1.0 - proven / best.split.cost.objective_s) if best.split.cost.objective_s > 0 else 0.0
    info = SolverInfo(status=status, wall_time_s=round(time.perf_counter() - start, 3), objective_gap=round(gap, 6), candidates=len(candidates),
                      objective_s=best.split.cost.objective_s)
    alternatives = [
        {**_candidate_dict(s.tables.candidate), "stage_layers": [b - a + 1 for a, b in s.split.bounds], "step_time_s": s.split.cost.objective_s}
        for s in solved[1 : 1 + options.top_k]
    ]
    return assemble_plan(model, cluster, options, best.tables, best.split.bounds, info, alternatives)


# [Note: candidate bound]
# Whatever the split, [Note: split objective] is at least
#     W + (m - 1) * max(W / R, max_l t_l),   W = sum_l t_l,
# where t_l is layer l's micro-batch time (tensor-parallel all-reduces included) on the
# device type that runs it fastest, and
# R = sum over stages of the stage type's relative speed r_k = max_l t_l / t_l(k) (1 for
# the fastest type): the stages together do all the work once, and in the time of the
# slowest stage M a type-k stage does at most M * r_k of it. The slowest gradient
# all-reduce moves at least 1/pp of the gradients, and each of the pp - 1 cuts costs
# at least the cheapest p2p of any boundary to any other device.
# Candidates are solved in order of this bound, and the search stops at the first
# whose bound is no better than the best plan found, so the plan it returns is optimal
# over all of them.
def lower_bound_s(model: ModelGraph, cluster, cand: Candidate, dtype: str, cache: dict | None = None) -> float:
    """A lower bound on the objective of any split of ``cand``; see [Note: candidate bound].

    Args:
        cache: reused across candidates: per-layer times depend only on (tp, micro-batch
            size, recompute, device type, the tensor-parallel group's placement).
    """
    cache = {} if cache is None else cache
    slots = _representative_slots(cluster, cand)
    per_type = {}
    for k, (slot, _) in slots.items():
        key = (cand.tp, cand.micro_batch_size, cand.recompute, k, tuple(cluster.node_of(r) for r in slot.ranks[0]))
        if key not in cache:
            cache[key] = _layer_times(model, cluster, cand, dtype, slot)
        per_type[k] = cache[key]
    fastest = [min(times[l] for times in per_type.values()) for l in range(len(model.layers))]
    speed = sum(n * max(f / t for f, t in zip(fastest, per_type[k]) if t > 0) for k, (_, n) in slots.items())
    work = sum(fastest)
    grad_bytes = sum(l.params_at(cand.tp) for l in model.layers) * state_bytes_per_param(dtype)[1]
    linear = [dp_linear(cluster, [rep[0] for rep in slot.ranks]) for slot, _ in slots.values()]
    sync = min(a for a, _ in linear) + min(b for _, b in linear) * grad_bytes / cand.pp
    cuts = (cand.pp - 1) * min(_cut_floor(model, cluster, cand, dtype, slot) for slot, _ in slots.values())
    return work + cuts + (cand.num_microbatches - 1) * max(work / speed, max(fastest)) + sync


def _cut_floor(model: ModelGraph, cluster, cand: Candidate, dtype: str, slot: StageSlot) -> float:
    """The cheapest p2p of a stage boundary, forward and backward, from ``slot``."""
    if cand.pp == 1:
        return 0.0
    payload = min(l.boundary_bytes for l in model.layers[:-1]) * cand.micro_batch_size * dtype_bytes(dtype) / 4
    src = slot.ranks[0][0]
    return 2 * min(p2p_time_s(payload, src, dst, cluster) for dst in _one_peer_per_place(cluster, src))


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


def _representative_slots(cluster, cand: Candidate) -> dict[str, tuple[StageSlot, int]]:
    """Device type -> (one stage slot of that type, how many stages are costed as that type)."""
    available = type_slots(cluster, cand)
    if available is not None:
        return {k: (v[0], len(v)) for k, v in available.items()}
    out: dict[str, tuple[StageSlot, int]] = {}
    for slot in stage_slots(cluster.device_types(), cand):
        first, n = out.get(slot.device_type, (slot, 0))
        out[slot.device_type] = (first, n + 1)
    return out


def _layer_times(model: ModelGraph, cluster, cand: Candidate, dtype: str, slot: StageSlot) -> list[float]:
    """Per-layer micro-batch seconds on ``slot``'s device, tensor-parallel all-reduces included."""
    device = cluster.profile(slot.device_type)
    scale = dtype_bytes(dtype) / 4
    times = []
    for layer in model.layers:
        t = _layer_seconds(layer, device, cand, dtype)
        if cand.tp > 1 and layer.tp_allreduce_bytes:
            t += 2 * all_reduce_time_s(layer.tp_allreduce_bytes * cand.micro_batch_size * scale, slot.ranks[0], cluster)
        times.append(t)
    return times


def _layer_seconds(layer, device, cand: Candidate, dtype: str) -> float:
    try:
        timing = layer_timing(layer, device, tp=cand.tp, micro_batch_size=cand.micro_batch_size, dtype=dtype)
    except (KeyError, ValueError):
        return math.inf
    return timing.fwd_s * (2 if cand.recompute == "full" else 1) + timing.bwd_s


def solve_candidate(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions) -> tuple[CostTables, SplitResult | None]:
    """Solve one candidate: the split, and the device type of each stage where types can choose.

    Returns:
        The cost tables of the stages' exact ranks, and the split (None if nothing fits).
    """
    if options.uniform_split:
        tables = build_tables(model, cluster, cand, options.dtype, options.optimizer)
        bounds = equal_split(tables.num_layers, cand.pp)
        cost = evaluate_split(tables, bounds)
        return tables, (SplitResult(bounds=bounds, cost=cost, status="optimal", bound_s=cost.objective_s) if cost.fits(tables) else None)
    available = type_slots(cluster, cand)
    if available is None or len(available) == 1:
        tables = build_tables(model, cluster, cand, options.dtype, options.optimizer)
        pinned_ok = options.stage_devices is None or list(options.stage_devices) == [s.device_type for s in tables.slots]
        return tables, (solve_split(tables, options) if pinned_ok else None)
    typed = tables_by_type(model, cluster, cand, options.dtype, available, options.optimizer)
    counts = {k: len(v) for k, v in available.items()}
    if options.stage_devices is not None:
        wanted = list(options.stage_devices)
        if any(wanted.count(k) != n for k, n in counts.items()):
            return compose_tables(typed, type_sequence(list(available), counts)), None
        split = solve_split(compose_tables(typed, wanted), options)
        split = split and SplitResult(bounds=split.bounds, cost=split.cost, status=split.status, types=wanted, bound_s=split.bound_s)
    else:
        split = solve_type_orders(typed, counts, options)
    if split is None:
        return compose_tables(typed, type_sequence(list(available), {k: len(v) for k, v in available.items()})), None
    unused = {k: list(v) for k, v in available.items()}
    slots = [unused[k].pop(0) for k in split.types]
    tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, slots=slots)
    cost = evaluate_split(tables, split.bounds)
    return tables, SplitResult(bounds=split.bounds, cost=cost, status=split.status, types=split.types, bound_s=split.bound_s)


def memory_may_fit(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions) -> bool:
    """False when no split of ``cand`` can fit: the layers' memory, each at its smallest
    (one micro-batch in flight, the roomiest stage type), exceeds all stages' memory together."""
    slots = _representative_slots(cluster, cand)
    capacity = sum(slot.memory_bytes * n for slot, n in slots.values())
    need = 0.0
    for layer in model.layers:
        need += stage_memory([layer], tp=cand.tp, micro_batch_size=cand.micro_batch_size, in_flight=1, dtype=options.dtype,
                             optimizer=options.optimizer, recompute=cand.recompute).total_bytes
        if need > capacity:
            return False
    return True


def _candidate_dict(c: Candidate) -> dict:
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "micro_batch_size": c.micro_batch_size, "schedule": c.schedule, "recompute": c.recompute}


def _overflow(tables: CostTables) -> float:
    cost = evaluate_split(tables, equal_split(tables.num_layers, tables.candidate.pp))
    return max(m / c for m, c in zip(cost.stage_memory_bytes, tables.capacity_bytes))


def _explain_misfit(model: ModelGraph, options: SearchOptions, tables: CostTables) -> str:
    bounds = equal_split(tables.num_layers, tables.candidate.pp)
    cost = evaluate_split(tables, bounds)
    s = max(range(len(bounds)), key=lambda i: cost.stage_memory_bytes[i] / tables.capacity_bytes[i])
    breakdown = stage_memory_breakdown(model, tables, s, *bounds[s], options.dtype, options.optimizer)
    gib = 2**30
    return (
        f"no plan fits in memory: the closest ({tables.candidate.describe()}) needs "
        f"{breakdown.total_bytes / gib:.1f} GiB on stage {s}, {tables.slots[s].device_type} has "
        f"{tables.capacity_bytes[s] / gib:.1f} GiB (mostly {breakdown.dominant_term()}); "
        "add devices, lower --global-batch or use --dtype bf16"
    )


def assemble_plan(model: ModelGraph, cluster, options: SearchOptions, tables: CostTables, bounds, info: SolverInfo, alternatives=()) -> ParallelPlan:
    """Turn a solved split into a ParallelPlan with its predicted cost."""
    cand = tables.candidate
    cost = evaluate_split(tables, bounds)
    stages = []
    for s, (first, last) in enumerate(bounds):
        sharding = {}
        if cand.tp > 1:
            for l in range(first, last + 1):
                sharding.update(model.tp_sharding[l])
        stages.append(
            StagePlan(
                index=s,
                layers=list(range(first, last + 1)),
                device_type=tables.slots[s].device_type,
                tensor_parallel=cand.tp,
                ranks=tables.slots[s].ranks,
                tp_sharding=sharding,
                recompute=cand.recompute,
            )
        )
    predicted = _simulated_prediction(model, cluster, options, cand, bounds, stages) or _linear_prediction(options, tables, bounds, cost)
    return ParallelPlan(
        model=ModelRef(file=model.file, args=dict(model.args), fingerprint=model.fingerprint, layer_names=model.layer_names),
        cluster=ClusterRef(spec=cluster.spec, world_size=cluster.world_size, device_types=cluster.device_types()),
        global_batch_size=options.global_batch_size,
        micro_batch_size=cand.micro_batch_size,
        num_microbatches=cand.num_microbatches,
        schedule=Schedule(cand.schedule),
        data_parallel=cand.dp,
        dtype=options.dtype,
        stages=stages,
        predicted=predicted,
        solver=info,
        alternatives=list(alternatives),
    )


# [Note: plan prediction]
# The search ranks candidates by the linear objective of [Note: split objective],
# which CP-SAT can optimise exactly. The plan it returns carries the fuller
# prediction of planner.estimate for the chosen configuration: the schedule
# simulated action by action, the optimizer step, Megatron's p2p scatter/gather. The
# linear objective is the fallback when the estimator cannot express a plan.
def _simulated_prediction(model: ModelGraph, cluster, options: SearchOptions, cand: Candidate, bounds, stages: list[StagePlan]) -> Predicted | None:
    from planner.estimate import EstimateConfig, EstimateError, estimate

    types = [s.device_type for s in stages]
    config = EstimateConfig(
        global_batch_size=options.global_batch_size, dp=cand.dp, tp=cand.tp, pp=cand.pp,
        micro_batch_size=cand.micro_batch_size, dtype=options.dtype, schedule=cand.schedule, recompute=cand.recompute,
        optimizer=options.optimizer, stage_layers=tuple(b - a + 1 for a, b in bounds),
        stage_devices=tuple(types) if len(set(cluster.device_types())) > 1 else None,
    )
    try:
        result = estimate(model, cluster, config)
    except (EstimateError, ValueError):
        return None
    if [e.ranks for e in result.stages] != [s.ranks for s in stages]:
        return None
    return result.predicted


def _linear_prediction(options: SearchOptions, tables: CostTables, bounds, cost: SplitCost) -> Predicted:
    cand = tables.candidate
    step = cost.objective_s
    slowest = max(cost.stage_time_s)
    m = cand.num_microbatches
    tp_comm = max(
        sum(tables.tp_time_s[l][s] for l in range(first, last + 1)) for s, (first, last) in enumerate(bounds)
    ) * m
    return Predicted(
        step_time_s=step,
        throughput_samples_per_s=options.global_batch_size / step if step > 0 else 0.0,
        peak_memory_bytes=[int(b) for b in cost.stage_memory_bytes],
        compute_time_s=m * slowest,
        bubble_time_s=sum(cost.stage_time_s) - slowest,
        dp_comm_time_s=max(cost.dp_sync_s),
        pp_comm_time_s=sum(tables.cut_time_s[last][s] for s, (_, last) in enumerate(bounds[:-1])) * m,
        tp_comm_time_s=tp_comm,
    )


__all__ = ["search", "SearchOptions", "PlanningError", "solve_split", "equal_split", "enumerate_candidates", "to_ticks"]
