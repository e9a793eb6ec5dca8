"""The search: the fastest plan under the cost model, with proof of optimality.

Outer enumeration covers what the CP-SAT model keeps fixed (data-, tensor- and
pipeline-parallel degrees, micro-batch size, schedule and its virtual stages); for
each such candidate one CP-SAT model chooses the cut points of the layer sequence
into stages, which may be uneven and which see each stage's own device type, and
each stage's mode: its activation recomputation and ZeRO stage. The objective is
[Note: split objective] in planner.costs.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from cost_models.collectives import p2p_time_s
from cost_models.layers import tp_misfit
from cost_models.compute import dtype_bytes
from cost_models.memory import FRAGMENTATION_MARGIN, OPTIMIZER_BYTES_PER_PARAM, sharded_state_bytes_per_param
from cost_models.pipeline import SCHEDULES, linear_step_weights
from planner.costs import (
    Candidate,
    CostTables,
    SplitCost,
    StageMode,
    StageSlot,
    _data_parallel_linear,
    _layer_columns,
    _sync_linear,
    _tp_all_reduce,
    build_tables,
    compose_tables,
    evaluate_split,
    optimizer_rates,
    stage_memory_breakdown,
    stage_slots,
    tables_by_type,
    type_slots,
)
from planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, Schedule, SolverInfo, StagePlan
from planner.split_model import (
    _TICKS_PER_OBJECTIVE,
    SplitModel,
    Unresolved,
    bounds_from_sizes,
    equal_split,
    greedy_modes,
    may_beat,
    to_ticks,
)
from planner.trace import ModelGraph



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
    virtual_stages: int | None = None  # model chunks per pipeline rank, pinned (interleaved when > 1)
    recompute: str | None = None  # "none" | "selective" | "full" on every stage; none and full are searched per stage when None
    zero: int | None = None  # ZeRO stage of every stage, pinned; searched per stage when None
    stage_layers: tuple[int, ...] | None = None  # layers per stage (pp * virtual stages entries), pinned
    stage_devices: tuple[str, ...] | None = None  # device type per pipeline rank, pinned
    max_tp: int = 8
    max_virtual_stages: int = 4  # the interleaved schedules searched: 2..this many chunks per rank
    time_limit_s: float = 10.0
    gap_limit: float = 0.0  # stop a candidate's solve once proven within this relative gap
    uniform_split: bool = False  # equal layers per stage in Megatron's layout (a baseline, not a search)
    workers: int = 2
    seed: int = 0
    top_k: int = 3


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# [Note: search space]
# Outside the CP-SAT model: tp (dividing every node's device count, and 1 unless a
# layer splits), pp, dp = world / (tp pp), the micro-batch size, and the schedule:
# 1F1B, ZB-H1 ("zb", when pp > 1) and interleaved 1F1B with v = 2..max_virtual_stages
# chunks per rank (pp > 1, tp = 1, m a multiple of pp, pp v <= layers). GPipe has
# 1F1B's step time and never less memory ([Note: linear step time]), so it is searched
# only when pinned. Inside, every stage (every chunk, when interleaved) picks a mode:
# recompute none or full (selective costs what none costs under this cost model: the
# tracer measures attention as a fused kernel keeps it) times a ZeRO stage, 0, 2 or 3
# when dp > 1 under 1F1B and GPipe (the runtime shards with FSDP, which neither ZB-H1's
# split backward nor interleaved chunks support), 0 otherwise. ZeRO-1 costs exactly
# what ZeRO-2 costs here (one reduce-scatter and all-gather per step, the same
# optimizer share) and holds more, so it is searched only when pinned.
def enumerate_candidates(model: ModelGraph, cluster, options: SearchOptions) -> list[Candidate]:
    """Every (dp, tp, pp, micro-batch size, schedule, virtual stages) the pins allow; see [Note: search space].

    Raises:
        PlanningError: the pins or the batch size rule out every candidate; says why.
    """
    world = cluster.world_size
    num_layers = len(model.layers)
    gbs = options.global_batch_size
    _check_pins(model, cluster, options)
    tp_ok = any(l.tp_capable for l in model.layers)
    widths = {g.devices_per_node for g in cluster.groups}
    out = []
    for tp in divisors(world):
        # Tensor parallelism stays inside a node: tp divides every node's device count.
        if tp > 1 and (not tp_ok or tp > options.max_tp or any(w % tp for w in widths) or tp_misfit(model.layers, tp)):
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
                m = gbs // (dp * mbs)
                for schedule, v in schedules_for(options, tp=tp, pp=pp, num_microbatches=m, num_layers=num_layers):
                    modes = stage_modes(options, dp=dp, schedule=schedule)
                    if modes:
                        out.append(Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule=schedule,
                                             virtual_stages=v, modes=modes))
    if not out:
        raise PlanningError(_no_candidate_reason(model, cluster, options, tp_ok))
    return out


def schedules_for(options: SearchOptions, *, tp: int, pp: int, num_microbatches: int, num_layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs searched for one (tp, pp, m); see [Note: search space]."""
    names = [options.schedule] if options.schedule else ["1f1b", "zb", "interleaved"]
    if options.virtual_stages is not None:
        names = [n for n in names if (n == "interleaved") == (options.virtual_stages > 1)]
    out = []
    for name in names:
        if name == "interleaved":
            pinned = options.schedule == "interleaved"
            top = options.virtual_stages or options.max_virtual_stages
            low = options.virtual_stages or 2
            for v in range(low, top + 1):
                if (pp > 1 or pinned) and tp == 1 and num_microbatches % pp == 0 and pp * v <= num_layers:
                    out.append((name, v))
        elif name != "zb" or pp > 1 or options.schedule == "zb":
            out.append((name, 1))
    return out


def stage_modes(options: SearchOptions, *, dp: int, schedule: str) -> tuple[StageMode, ...]:
    """The modes each stage may take; empty when the pins leave none; see [Note: search space]."""
    recomputes = [options.recompute] if options.recompute else ["none", "full"]
    shardable = dp > 1 and schedule in ("1f1b", "gpipe")
    if options.zero is not None:
        zeros = [options.zero] if options.zero == 0 or shardable else []
    else:
        zeros = [0, 2, 3] if shardable else [0]
    return tuple(StageMode(recompute=r, zero_stage=z) for z in zeros for r in recomputes)


def _no_candidate_reason(model: ModelGraph, cluster, options: SearchOptions, tp_ok: bool) -> str:
    world, gbs = cluster.world_size, options.global_batch_size
    if options.zero:
        return (f"--zero {options.zero} needs data parallelism (dp > 1) and schedule 1f1b or gpipe; no such (dp, tp, pp) "
                f"fits world_size({world}) with global batch {gbs} and the other pins")
    if options.schedule == "interleaved" or (options.virtual_stages or 1) > 1:
        return (f"the interleaved schedule needs tp 1, micro-batches a multiple of pp and pp * virtual stages <= "
                f"{len(model.layers)} layers; nothing fits world_size({world}) with global batch {gbs} and the other pins")
    return (
        f"no (dp, tp, pp) fits world_size({world}) with global batch {gbs}"
        + ("" if tp_ok else " (the model has no tensor-parallel layers, so tp is 1)")
        + "; change the pins or --global-batch"
    )


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
    misfit = tp_misfit(model.layers, tp) if tp else None
    if misfit is not None:
        degrees = ", ".join(map(str, misfit.tp_degrees or ())) or "no"
        raise PlanningError(f"--tp {tp}: layer {misfit.name} splits only {degrees} ways (heads or features do not divide by {tp}); pick one of those")
    if dp and gbs % dp:
        raise PlanningError(f"--global-batch {gbs} is not divisible by dp({dp})")
    mbs = options.micro_batch_size
    if mbs and dp and (gbs // dp) % mbs:
        raise PlanningError(f"--micro-batch-size {mbs} does not divide the per-replica batch {gbs // dp}")
    if mbs and mbs > gbs:
        raise PlanningError(f"--micro-batch-size {mbs} exceeds --global-batch {gbs}")
    if options.recompute and options.recompute not in ("none", "selective", "full"):
        raise PlanningError(f"unknown --recompute {options.recompute!r}; use none, selective or full")
    if options.schedule and options.schedule not in SCHEDULES:
        raise PlanningError(f"unknown --schedule {options.schedule!r}; use one of {', '.join(SCHEDULES)}")
    _check_schedule_pins(model, options)
    _check_stage_pins(model, cluster, options)


def _check_schedule_pins(model: ModelGraph, options: SearchOptions) -> None:
    v, schedule, zero, dp = options.virtual_stages, options.schedule, options.zero, options.dp
    if zero is not None and zero not in (0, 1, 2, 3):
        raise PlanningError(f"unknown --zero {zero}; use 0, 1, 2 or 3")
    if v is not None:
        if v < 1:
            raise PlanningError(f"--virtual-stages must be at least 1, got {v}")
        if v > 1 and schedule not in (None, "interleaved"):
            raise PlanningError(f"--virtual-stages {v} needs --schedule interleaved, not {schedule}")
        if v > 1 and options.tp not in (None, 1):
            raise PlanningError(f"--virtual-stages {v} runs with tp 1 (the program runs interleaved chunks without tensor parallelism), not --tp {options.tp}")
        if v > 1 and options.pp and options.pp * v > len(model.layers):
            raise PlanningError(f"--pp {options.pp} * --virtual-stages {v} = {options.pp * v} stages, the model has only {len(model.layers)} layers")
    if zero:
        if dp == 1:
            raise PlanningError(f"--zero {zero} shards over data-parallel replicas; --dp 1 has none (use --zero 0)")
        if schedule in ("zb", "interleaved") or (v or 1) > 1:
            what = "interleaved" if (v or 1) > 1 else schedule
            raise PlanningError(f"--zero {zero} runs with schedule 1f1b or gpipe only (FSDP cannot run {what}'s stages); use --zero 0")


def _check_stage_pins(model: ModelGraph, cluster, options: SearchOptions) -> None:
    layers, devices, pp, v = options.stage_layers, options.stage_devices, options.pp, options.virtual_stages or 1
    if layers is not None:
        if any(n < 1 for n in layers) or sum(layers) != len(model.layers):
            raise PlanningError(
                f"--stage-layers {','.join(map(str, layers))} sums to {sum(layers)}; the model has {len(model.layers)} layers "
                "(each stage needs at least one; see hetpar trace)"
            )
        if len(layers) % v:
            raise PlanningError(f"--stage-layers gives {len(layers)} stages, not a multiple of --virtual-stages {v}")
        if pp is not None and pp * v != len(layers):
            what = f"--pp is {pp}" if v == 1 else f"--pp {pp} * --virtual-stages {v} is {pp * v}"
            raise PlanningError(f"--stage-layers gives {len(layers)} stages but {what}")
    if devices is not None:
        stages = pp or (len(layers) // v if layers else None)
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
        return len(options.stage_layers) // (options.virtual_stages or 1)
    return len(options.stage_devices) if options.stage_devices else None


@dataclass(frozen=True, kw_only=True)
class SplitResult:
    bounds: list[tuple[int, int]]
    cost: SplitCost
    status: str  # "optimal" | "feasible"
    types: list[str] | None = None  # device type per pipeline rank, when the search chose them
    bound_s: float = 0.0  # the solver's proven lower bound on the objective

    @property
    def modes(self) -> list[int]:
        return self.cost.modes


def solve_split(tables: CostTables, options: SearchOptions, fixed_sizes: tuple[int, ...] | None = None,
                cutoff_s: float | None = None) -> SplitResult | None:
    """The best split of layers into chunks, and the mode of each, for one candidate; None if none fits.

    CP-SAT model of [Note: split objective] over the cut positions and the stage modes;
    see [Note: cut formulation].

    Args:
        fixed_sizes: layers per chunk, when the split is pinned (the modes are still chosen).
        cutoff_s: only splits faster than this are of interest (None also when none is).
    """
    fixed_sizes = fixed_sizes or options.stage_layers
    if not np.isfinite(tables.time_s).all():
        return None  # a device lacks the training dtype
    if cutoff_s is not None and not fixed_sizes and not may_beat(tables, cutoff_s):
        return None
    hint_bounds = bounds_from_sizes(fixed_sizes) if fixed_sizes else equal_split(tables.num_layers, tables.num_chunks)
    hint_modes = greedy_modes(tables, hint_bounds)
    tick_s = (evaluate_split(tables, hint_bounds, hint_modes).objective_s or 1.0) / _TICKS_PER_OBJECTIVE
    split = SplitModel(tables, tick_s, cutoff_s)
    if fixed_sizes:
        for c, (first, _) in enumerate(hint_bounds):
            split.model.add(split.start[c] == first)
    split.hint(hint_bounds, hint_modes)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.workers
    solver.parameters.random_seed = options.seed
    solver.parameters.relative_gap_limit = options.gap_limit
    solver.parameters.linearization_level = 2  # the envelopes of [Note: cut formulation] give the LP its bound
    status = solver.solve(split.model)
    if status == cp_model.UNKNOWN:
        raise Unresolved(max(0.0, solver.best_objective_bound * tick_s / split.weights.scale))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [solver.value(v) for v in split.start]
    bounds = [(starts[c], starts[c + 1] - 1) for c in range(tables.num_chunks)]
    modes = split.modes(solver)
    cost = evaluate_split(tables, bounds, modes)
    optimal = status == cp_model.OPTIMAL
    bound_s = cost.objective_s if optimal else solver.best_objective_bound * tick_s / split.weights.scale
    return SplitResult(bounds=bounds, cost=cost, status="optimal" if optimal else "feasible", bound_s=bound_s)


def solve_type_orders(tables: dict[str, CostTables], stages_per_type: dict[str, int], options: SearchOptions,
                      cutoff_s: float | None = None) -> SplitResult | None:
    """The best split over every order of the device types; see [Note: stage device types] in planner.costs.

    Each type's stages are consecutive, so the pipeline crosses from one type to the
    next once; each of the (at most types!) orders is one CP-SAT split model.

    Args:
        tables: cost columns per device type (``planner.costs.tables_by_type``).
        stages_per_type: how many pipeline ranks each type hosts.

    Returns:
        The best split, with ``types`` naming each pipeline rank's device type, or None if none fits.
    """
    best: SplitResult | None = None
    unresolved: list[float] = []
    for order in itertools.permutations(tables):
        types = type_sequence(list(order), stages_per_type)
        try:
            split = solve_split(compose_tables(tables, types), options,
                                cutoff_s=cutoff_s if best is None else min(cutoff_s or math.inf, best.cost.objective_s))
        except Unresolved as exc:
            unresolved.append(exc.bound_s)
            continue
        if split is not None and (best is None or split.cost.objective_s < best.cost.objective_s):
            best = SplitResult(bounds=split.bounds, cost=split.cost, status=split.status, types=types, bound_s=split.bound_s)
        elif split is not None and best is not None and split.status != "optimal":
            best = SplitResult(bounds=best.bounds, cost=best.cost, status="feasible", types=best.types, bound_s=min(best.bound_s, split.bound_s))
    if unresolved and best is None:
        raise Unresolved(min(unresolved))
    if unresolved:
        best = SplitResult(bounds=best.bounds, cost=best.cost, status="feasible", types=best.types, bound_s=min([best.bound_s, *unresolved]))
    return best


def type_sequence(order: list[str], stages_per_type: dict[str, int]) -> list[str]:
    """Stage device types: each type's stages in one block, blocks in ``order``."""
    return [k for k in order for _ in range(stages_per_type[k])]


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
    bounds = {cand: lower_bound_s(model, cluster, cand, options.dtype, cache, options.optimizer) for cand in candidates}
    candidates.sort(key=bounds.get)
    solved: list[Solved] = []
    misfits: list[tuple[float, CostTables]] = []
    skipped: list[Candidate] = []  # cannot fit in memory whatever the split
    unresolved: list[float] = []  # lower bounds of candidates the solver did not settle in time
    best = math.inf
    for i, cand in enumerate(candidates):
        if progress:
            progress(i, len(candidates), cand.describe())
        if bounds[cand] >= best and len(solved) > options.top_k:
            break  # [Note: candidate bound]: no later candidate can win
        if not memory_may_fit(model, cluster, cand, options, cache):
            skipped.append(cand)
            continue
        # Once the runners-up are known, only a candidate that beats the best is of interest.
        cutoff = best if len(solved) > options.top_k else None
        try:
            tables, split = solve_candidate(model, cluster, cand, options, cache, cutoff)
        except Unresolved as exc:  # no answer in time: its bound stays open
            unresolved.append(max(bounds[cand], exc.bound_s))
            continue
        if split is None and cutoff is None:
            misfits.append((_overflow(tables), tables))
        elif split is None:
            continue
        else:
            solved.append(Solved(tables=tables, split=split))
            best = min(best, split.cost.objective_s)
    if progress:
        progress(len(candidates), len(candidates), "done")
    if not solved and unresolved:
        raise PlanningError(f"no candidate was solved within --time-limit {options.time_limit_s:g} s; raise it")
    if not solved:
        for cand in skipped[: max(0, 8 - len(misfits))]:
            tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, cache=cache)
            misfits.append((_overflow(tables), tables))
        raise PlanningError(_explain_misfit(model, options, min(misfits, key=lambda x: x[0])[1]))
    solved.sort(key=lambda s: s.split.cost.objective_s)
    best = solved[0]
    status = "optimal" if all(s.split.status == "optimal" for s in solved) and not unresolved else "feasible"
    proven = min([best.split.cost.objective_s] + [s.split.bound_s for s in solved if s.split.status != "optimal"] + unresolved)
    gap = max(0.0, 1.0 - proven / best.split.cost.objective_s) if best.split.cost.objective_s > 0 else 0.0
    info = SolverInfo(status=status, wall_time_s=round(time.perf_counter() - start, 3), objective_gap=round(gap, 6), candidates=len(candidates),
                      objective_s=best.split.cost.objective_s)
    alternatives = [
        {**_candidate_dict(s.tables.candidate), "stage_layers": [b - a + 1 for a, b in s.split.bounds],
         **_mode_lists(s.tables, s.split), "step_time_s": s.split.cost.objective_s}
        for s in solved[1 : 1 + options.top_k]
    ]
    return assemble_plan(model, cluster, options, best.tables, best.split.bounds, info, alternatives, modes=best.split.modes)


# [Note: candidate bound]
# Whatever the split and the stage modes, [Note: linear step time] is at least
#     (A sum_l min_k (t_l(k) - (B/A) w_l(k)) + A (C - 1) cut + G max(W / R, max_l t_l) + H max_l min_k w_l(k)
#      + E (min latency + sum_l min e_l / pp)) / scale
# with A, B, G, H, E, scale the schedule's weights (cost_models.pipeline.linear_step_weights),
# where t_l(k) is layer l's micro-batch time (tensor-parallel all-reduces included,
# recomputation only if every offered mode recomputes) on device type k, t_l = min_k
# t_l(k), W = sum_l t_l, w_l(k) its weight-gradient part, e_l the least epilogue (gradient
# sync and optimizer step) of the layer over the offered modes and types, and
# R = sum over pipeline ranks of the rank type's relative speed r_k = max_l t_l / t_l(k)
# (1 for the fastest type): the ranks together do all the work once, and in the time of
# the slowest (the slowest round, interleaved) M a type-k rank does at most M * r_k of it.
# The slowest epilogue is at least the average one, and each of the C - 1 cuts costs at
# least the cheapest p2p of any boundary to any other device. ZeRO-3's exposed gathers
# and the one-layer buffers are left out (they only add). Candidates are solved in
# order of this bound, and the search stops at the first whose bound is no better than
# the best plan found, so the plan it returns is optimal over all of them.
def lower_bound_s(model: ModelGraph, cluster, cand: Candidate, dtype: str, cache: dict | None = None, optimizer: str = "adamw") -> float:
    """A lower bound on the objective of any split of ``cand``; see [Note: candidate bound].

    Args:
        cache: reused across candidates: per-layer times depend only on (tp, micro-batch
            size, device type, the tensor-parallel group's placement).
    """
    cache = {} if cache is None else cache
    slots = _representative_slots(cluster, cand)
    wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches, virtual_stages=cand.virtual_stages)
    full_only = all(m.recompute == "full" for m in cand.modes)
    times, weights, epilogues, latencies = [], [], [], []
    for k, (slot, _) in slots.items():
        cols = _layer_columns(model, cluster, k, cand.tp, cand.micro_batch_size, dtype, cache)
        tp_ar = _tp_all_reduce(cluster, slot, cols, cand, cache)
        times.append(cols.fwd + cols.b_input + cols.weight + tp_ar * (3 if full_only else 2) + (cols.fwd if full_only else 0.0))
        weights.append(cols.weight)
        e, lat = _least_epilogue(cluster, cand, slot, cols, dtype, optimizer, cache)
        epilogues.append(e)
        latencies.append(lat)
    times, weights = np.array(times), np.array(weights)
    fastest = times.min(axis=0)
    work = float(fastest.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        speed = sum(n * float(np.nanmax(np.where(t > 0, fastest / t, np.nan))) for t, (_, n) in zip(times, slots.values()))
    pace = max(work / speed, float(fastest.max())) if speed > 0 else float(fastest.max())
    sums = float((wt.chunk_sum * times - wt.weight_sum * weights).min(axis=0).sum())
    cuts = (cand.num_chunks - 1) * min(_cut_floor(model, cluster, cand, dtype, slot) for slot, _ in slots.values())
    epilogue = min(latencies) + float(np.min(epilogues, axis=0).sum()) / cand.pp
    total = (sums + wt.chunk_sum * cuts + wt.round_max * pace + wt.weight_max * float(weights.min(axis=0).max())
             + wt.epilogue_max * epilogue)
    return total / wt.scale


def _least_epilogue(cluster, cand: Candidate, slot: StageSlot, cols, dtype: str, optimizer: str, cache: dict) -> tuple[np.ndarray, float]:
    """Per layer, the least epilogue seconds over the offered modes, and the least latency."""
    comm = _data_parallel_linear(cluster, cand, slot, cache)
    rate, per_tensor, overhead = optimizer_rates(cluster.profile(slot.device_type))
    per_layer, latency = [], []
    for zero in {m.zero_stage for m in cand.modes}:
        lat, pb = _sync_linear(comm, cand.dp, zero)
        share = cols.params / cand.dp if cand.dp > 1 and zero > 0 else cols.params
        per_layer.append(pb * cols.params * dtype_bytes(dtype) + share * OPTIMIZER_BYTES_PER_PARAM[optimizer] / rate + cols.tensors * per_tensor)
        latency.append(lat + overhead)
    return np.min(per_layer, axis=0), min(latency)


def _cut_floor(model: ModelGraph, cluster, cand: Candidate, dtype: str, slot: StageSlot) -> float:
    """The cheapest p2p of a stage boundary, forward and backward, from ``slot``."""
    if cand.pp == 1:
        return 0.0  # chunks on one rank hand over in place
    payload = min(l.boundary_bytes for l in model.layers[:-1]) * cand.micro_batch_size * dtype_bytes(dtype) / 4
    if cand.tp > 1:
        payload /= cand.tp
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
    """Device type -> (one stage slot of that type, how many pipeline ranks are costed as that type)."""
    available = type_slots(cluster, cand)
    if available is not None:
        return {k: (v[0], len(v)) for k, v in available.items()}
    out: dict[str, tuple[StageSlot, int]] = {}
    for slot in stage_slots(cluster, cand):
        first, n = out.get(slot.device_type, (slot, 0))
        out[slot.device_type] = (first, n + 1)
    return out


def solve_candidate(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, cache: dict | None = None,
                    cutoff_s: float | None = None) -> tuple[CostTables, SplitResult | None]:
    """Solve one candidate: the split, the stage modes, and the device type of each stage where types can choose.

    Args:
        cutoff_s: only splits faster than this are of interest.

    Returns:
        The cost tables of the stages' exact ranks, and the split (None if nothing fits).
    """
    cache = {} if cache is None else cache
    fixed = tuple(b - a + 1 for a, b in equal_split(len(model.layers), cand.num_chunks)) if options.uniform_split else None
    available = None if options.uniform_split else type_slots(cluster, cand)
    if available is None or len(available) == 1:
        tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, cache=cache)
        pinned_ok = options.stage_devices is None or list(options.stage_devices) == [s.device_type for s in tables.slots]
        return tables, (solve_split(tables, options, fixed, cutoff_s) if pinned_ok else None)
    typed = tables_by_type(model, cluster, cand, options.dtype, available, options.optimizer, cache)
    counts = {k: len(v) for k, v in available.items()}
    if options.stage_devices is not None:
        wanted = list(options.stage_devices)
        if any(wanted.count(k) != n for k, n in counts.items()):
            return compose_tables(typed, type_sequence(list(available), counts)), None
        split = solve_split(compose_tables(typed, wanted), options, cutoff_s=cutoff_s)
        split = split and SplitResult(bounds=split.bounds, cost=split.cost, status=split.status, types=wanted, bound_s=split.bound_s)
    else:
        split = solve_type_orders(typed, counts, options, cutoff_s)
    if split is None:
        return compose_tables(typed, type_sequence(list(available), counts)), None
    unused = {k: list(v) for k, v in available.items()}
    slots = [unused[k].pop(0) for k in split.types]
    tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, slots=slots, cache=cache)
    cost = evaluate_split(tables, split.bounds, split.modes)
    return tables, SplitResult(bounds=split.bounds, cost=cost, status=split.status, types=split.types, bound_s=split.bound_s)


def memory_may_fit(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, cache: dict | None = None) -> bool:
    """False when no split of ``cand`` can fit: the layers' memory, each at its smallest
    (one micro-batch in flight, the most frugal mode), exceeds all ranks' memory together."""
    cache = {} if cache is None else cache
    slots = _representative_slots(cluster, cand)
    capacity = sum(slot.memory_bytes * n for slot, n in slots.values())
    cols = _layer_columns(model, cluster, next(iter(slots)), cand.tp, cand.micro_batch_size, options.dtype, cache)
    need = np.full(len(model.layers), np.inf)
    for mode in cand.modes:
        state = sum(sharded_state_bytes_per_param(options.dtype, options.optimizer, dp=cand.dp, zero_stage=mode.zero_stage))
        activations = cols.inputs if mode.recompute == "full" else cols.saved
        need = np.minimum(need, cols.params * state + activations)
    return FRAGMENTATION_MARGIN * float(need.sum()) <= capacity


def _candidate_dict(c: Candidate) -> dict:
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "micro_batch_size": c.micro_batch_size, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages}


def _mode_lists(tables: CostTables, split: SplitResult) -> dict:
    modes = [tables.candidate.modes[k] for k in split.modes]
    return {"recompute": [m.recompute for m in modes], "zero_stage": [m.zero_stage for m in modes]}


def _overflow(tables: CostTables) -> float:
    bounds = equal_split(tables.num_layers, tables.num_chunks)
    cost = evaluate_split(tables, bounds, greedy_modes(tables, bounds))
    return max(m / c for m, c in zip(cost.stage_memory_bytes, tables.capacity_bytes))


def _explain_misfit(model: ModelGraph, options: SearchOptions, tables: CostTables) -> str:
    cand = tables.candidate
    bounds = equal_split(tables.num_layers, tables.num_chunks)
    modes = greedy_modes(tables, bounds)
    cost = evaluate_split(tables, bounds, modes)
    r = max(range(cand.pp), key=lambda i: cost.stage_memory_bytes[i] / tables.capacity_bytes[i])
    mode = cand.modes[modes[r]]
    breakdown = stage_memory_breakdown(model, tables, r, *bounds[r], options.dtype, options.optimizer, mode=mode)
    gib = 2**30
    return (
        f"no plan fits in memory: the closest ({cand.describe()}, {mode.describe()}) needs "
        f"{cost.stage_memory_bytes[r] / gib:.1f} GiB on stage {r}, {tables.slots[r].device_type} has "
        f"{tables.capacity_bytes[r] / gib:.1f} GiB (mostly {breakdown.dominant_term()}); "
        "add devices, lower --global-batch or use --dtype bf16"
    )


def assemble_plan(model: ModelGraph, cluster, options: SearchOptions, tables: CostTables, bounds, info: SolverInfo, alternatives=(),
                  modes: list[int] | None = None) -> ParallelPlan:
    """Turn a solved split into a ParallelPlan with its predicted cost."""
    cand = tables.candidate
    modes = list(modes) if modes is not None else [0] * len(bounds)
    cost = evaluate_split(tables, bounds, modes)
    stages = []
    for c, (first, last) in enumerate(bounds):
        sharding = {}
        if cand.tp > 1:
            for l in range(first, last + 1):
                sharding.update(model.tp_sharding[l])
        slot = tables.slots[c % cand.pp]
        mode = cand.modes[modes[c]]
        stages.append(
            StagePlan(
                index=c,
                layers=list(range(first, last + 1)),
                device_type=slot.device_type,
                tensor_parallel=cand.tp,
                ranks=slot.ranks,
                tp_sharding=sharding,
                zero_stage=mode.zero_stage if cand.dp > 1 else 0,
                recompute=mode.recompute,
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
        virtual_stages=cand.virtual_stages,
    )


# [Note: plan prediction]
# The search ranks candidates by the linear objective of [Note: split objective],
# which CP-SAT can optimise exactly. The plan it returns carries the fuller
# prediction of planner.estimate for the chosen configuration: the schedule
# simulated action by action, the optimizer step, Megatron's p2p scatter/gather. The
# linear objective is the fallback when the estimator cannot express a plan.
def _simulated_prediction(model: ModelGraph, cluster, options: SearchOptions, cand: Candidate, bounds, stages: list[StagePlan]) -> Predicted | None:
    from planner.estimate import EstimateConfig, EstimateError, estimate

    ranks = stages[: cand.pp]
    config = EstimateConfig(
        global_batch_size=options.global_batch_size, dp=cand.dp, tp=cand.tp, pp=cand.pp,
        micro_batch_size=cand.micro_batch_size, dtype=options.dtype, schedule=cand.schedule, virtual_stages=cand.virtual_stages,
        optimizer=options.optimizer, stage_layers=tuple(b - a + 1 for a, b in bounds),
        stage_devices=tuple(s.device_type for s in ranks) if len(set(cluster.device_types())) > 1 else None,
        stage_recompute=tuple(s.recompute for s in stages), stage_zero=tuple(s.zero_stage for s in ranks),
    )
    try:
        result = estimate(model, cluster, config)
    except (EstimateError, ValueError):
        return None
    if [e.ranks for e in result.stages] != [s.ranks for s in ranks]:
        return None
    return result.predicted


def _linear_prediction(options: SearchOptions, tables: CostTables, bounds, cost: SplitCost) -> Predicted:
    cand = tables.candidate
    step = cost.objective_s
    slowest = max(cost.stage_time_s)
    m = cand.num_microbatches
    tp_comm = max(float(tables.tp_time_s[first : last + 1, c].sum()) for c, (first, last) in enumerate(bounds)) * m
    return Predicted(
        step_time_s=step,
        throughput_samples_per_s=options.global_batch_size / step if step > 0 else 0.0,
        peak_memory_bytes=[int(b) for b in cost.stage_memory_bytes],
        compute_time_s=m * slowest,
        bubble_time_s=sum(cost.stage_time_s) - slowest,
        dp_comm_time_s=max(cost.dp_sync_s),
        pp_comm_time_s=sum(float(tables.cut_s[last, c]) for c, (_, last) in enumerate(bounds[:-1])) * m,
        tp_comm_time_s=tp_comm,
    )


__all__ = ["search", "SearchOptions", "PlanningError", "solve_split", "equal_split", "enumerate_candidates", "to_ticks"]
