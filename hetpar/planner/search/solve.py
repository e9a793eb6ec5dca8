"""The search: the fastest plan under the cost model, with proof of optimality.

Outer enumeration covers what the split keeps fixed (data- and pipeline-parallel
degrees, micro-batch size, schedule and its virtual stages, and how many stages each
device type hosts); for each such candidate an exact split solver (a dynamic programme,
or CP-SAT where the schedule interleaves: ``solve_split``) chooses the cut points of the
layer sequence into stages, which may be uneven and which see
each stage's own device type, and each stage's mode: its tensor-parallel degree
([Note: per-stage tensor parallelism] in planner.costing.candidate), activation recomputation and
ZeRO stage. The objective is [Note: split objective] in planner.costing.tables.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from hetpar.cost_models.offload import offload_refusal
from hetpar.planner.costing import (
    Candidate,
    CostTables,
    RankSlots,
    SplitCost,
    StageSlot,
    build_tables,
    compose_tables,
    evaluate_split,
    pack_stage_ranks,
    ranks_by_type,
    tables_by_type,
    type_sequence,
)
from hetpar.planner.errors import PlanningError
from hetpar.planner.estimate import bounds_from_sizes, default_split, equal_split
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import ParallelPlan, SolverInfo
from hetpar.planner.search.assemble import assemble_plan, explain_misfit, overflow
from hetpar.planner.search.bounds import budget_may_beat, lower_bound_s, memory_may_fit
from hetpar.planner.search.candidates import enumerate_candidates
from hetpar.planner.search.split_dp import dp_eligible, dp_relaxes, solve_split_dp
from hetpar.planner.search.split_model import (
    _TICKS_PER_OBJECTIVE,
    SplitModel,
    Unresolved,
    greedy_modes,
    may_beat,
    objective_floor,
)
from hetpar.planner.solver import cp_solver, limit_hit
from hetpar.vocabulary import SplitSolver, Switch

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


@dataclass(frozen=True, kw_only=True)
class SplitResult:
    bounds: list[tuple[int, int]]
    cost: SplitCost
    status: str  # "optimal" | "feasible"
    types: list[str] | None = None  # device type per pipeline rank, when the search chose them
    bound_s: float = 0.0  # the solver's proven lower bound on the objective
    limit: str | None = None  # "work" or "time": the limit that stopped a solve short of a proof

    @property
    def modes(self) -> list[int]:
        return self.cost.modes


def solve_split(tables: CostTables, options: SearchOptions, fixed_sizes: tuple[int, ...] | None = None,
                cutoff_s: float | None = None) -> SplitResult | None:
    """The best split of layers into chunks, and the mode of each, for one candidate; None if none fits.

    [Note: split objective] over the cut positions and the stage modes: solved by dynamic
    programming where each rank holds one chunk ([Note: split by dynamic programming]);
    interleaved, by CP-SAT ([Note: cut formulation]) after the programme's relaxation
    ([Note: interleaved relaxation]), which settles many without it.

    Args:
        fixed_sizes: layers per chunk, when the split is pinned (the modes are still chosen).
        cutoff_s: only splits faster than this are of interest (None also when none is).
    """
    fixed_sizes = fixed_sizes or options.stage_layers
    if not np.isfinite(tables.time_s).any(axis=0).all():
        return None  # a device lacks the training dtype, or no offered degree splits a layer
    relaxed = None
    if options.split_solver == SplitSolver.AUTO and (dp_eligible(tables) or dp_relaxes(tables)):
        # [Note: split by dynamic programming]; interleaved, [Note: interleaved relaxation]
        relaxed = solve_split_dp(tables, cutoff_s, fixed_sizes)
        if relaxed.exact:
            if relaxed.bounds is None:
                return None
            cost = evaluate_split(tables, relaxed.bounds, relaxed.modes)
            return SplitResult(bounds=relaxed.bounds, cost=cost, status="optimal", bound_s=cost.objective_s)
        floor_s = relaxed.lower_s
    else:
        if cutoff_s is not None and not fixed_sizes and not may_beat(tables, cutoff_s):
            return None
        floor_s = objective_floor(tables) if not fixed_sizes and cutoff_s is not None else None
        if floor_s is not None and floor_s >= cutoff_s:
            return None  # [Note: objective floor]
    from ortools.sat.python import cp_model  # here, where CP-SAT runs: its import takes a third of a second

    if relaxed is not None and relaxed.bounds is not None:
        hint_bounds, hint_modes = relaxed.bounds, relaxed.modes  # the relaxation's best fitting split
        # it beats the cutoff already, and CP-SAT proves an optimum faster without one
        cutoff_s = None
    else:
        hint_bounds = bounds_from_sizes(fixed_sizes) if fixed_sizes else equal_split(tables.num_layers, tables.num_chunks)
        hint_modes = greedy_modes(tables, hint_bounds)
    scale_s = evaluate_split(tables, hint_bounds, hint_modes).objective_s
    if not math.isfinite(scale_s):  # the hint holds a layer its degree cannot split: the least micro-batch time, m times
        scale_s = float(np.where(np.isfinite(tables.time_s), tables.time_s, np.inf).min(axis=(0, 2)).sum()) * tables.candidate.num_microbatches
    tick_s = (scale_s or 1.0) / _TICKS_PER_OBJECTIVE
    split, solver, status = _solve_model(tables, options, tick_s, cutoff_s, fixed_sizes, hint_bounds, hint_modes)
    if status == cp_model.UNKNOWN and cutoff_s is not None and scale_s >= cutoff_s:
        # [Note: a hint above the cutoff]: solve again from the hint, without the cutoff
        split, solver, status = _solve_model(tables, options, tick_s, None, fixed_sizes, hint_bounds, hint_modes)
    if status != cp_model.OPTIMAL and floor_s is None and not fixed_sizes:
        floor_s = objective_floor(tables)  # [Note: objective floor]: often far above CP-SAT's bound
    if status in (cp_model.UNKNOWN, cp_model.FEASIBLE) and relaxed is not None and relaxed.bounds is not None:
        # stopped short: the relaxation's split stands where CP-SAT has none better
        cost = evaluate_split(tables, relaxed.bounds, relaxed.modes)
        if cost.objective_s < (cutoff_s or math.inf) and (
                status == cp_model.UNKNOWN or cost.objective_s < evaluate_split(tables, *_solution(split, solver)).objective_s):
            limit = limit_hit(solver, options.time_limit_s)
            bound_s = min(cost.objective_s, max(solver.best_objective_bound * tick_s / split.weights.scale, floor_s or 0.0))
            return SplitResult(bounds=relaxed.bounds, cost=cost, status="feasible", bound_s=bound_s, limit=limit)
    if status == cp_model.UNKNOWN:
        bound_s = max(0.0, solver.best_objective_bound * tick_s / split.weights.scale, floor_s or 0.0)
        raise Unresolved(bound_s, limit_hit(solver, options.time_limit_s))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    bounds, modes = _solution(split, solver)
    cost = evaluate_split(tables, bounds, modes)
    optimal = status == cp_model.OPTIMAL
    bound_s = cost.objective_s if optimal else min(cost.objective_s, max(solver.best_objective_bound * tick_s / split.weights.scale,
                                                                         floor_s or 0.0))
    return SplitResult(bounds=bounds, cost=cost, status="optimal" if optimal else "feasible", bound_s=bound_s,
                       limit=None if optimal else limit_hit(solver, options.time_limit_s))


def _solution(split: SplitModel, solver: cp_model.CpSolver) -> tuple[list[tuple[int, int]], list[int]]:
    """The bounds and modes of the split model's solution."""
    starts = [solver.value(v) for v in split.start]
    return [(starts[c], starts[c + 1] - 1) for c in range(split.tables.num_chunks)], split.modes(solver)


def solve_type_orders(tables: dict[str, CostTables], stages_per_type: dict[str, int], options: SearchOptions,
                      cutoff_s: float | None = None, fixed_sizes: tuple[int, ...] | None = None) -> SplitResult | None:
    """The best split over every order of the device types; see [Note: stage device types] in planner.costing.by_type.

    Each type's stages are consecutive, so the pipeline crosses from one type to the
    next once; each of the (at most types!) orders is one CP-SAT split model.

    Args:
        tables: cost columns per device type (``planner.costing.tables_by_type``).
        stages_per_type: how many pipeline ranks each type hosts.
        fixed_sizes: layers per chunk, when the split is pinned.

    Returns:
        The best split, with ``types`` naming each pipeline rank's device type, or None if none fits.
    """
    best: SplitResult | None = None
    open_bounds: list[float] = []  # lower bounds of the orders a limit stopped short of a proof
    limits: list[str] = []  # and the limits that stopped them
    for order in itertools.permutations(tables):
        types = type_sequence(list(order), stages_per_type)
        try:
            split = solve_split(compose_tables(tables, types), options, fixed_sizes,
                                cutoff_s=cutoff_s if best is None else min(cutoff_s or math.inf, best.cost.objective_s))
        except Unresolved as exc:
            open_bounds.append(exc.bound_s)
            limits.append(exc.limit)
            continue
        if split is not None and split.limit is not None:
            open_bounds.append(split.bound_s)
            limits.append(split.limit)
        if split is not None and (best is None or split.cost.objective_s < best.cost.objective_s):
            best = SplitResult(bounds=split.bounds, cost=split.cost, status=split.status, types=types, bound_s=split.bound_s)
    limit = "time" if "time" in limits else "work" if limits else None
    if best is None and limit is not None:
        raise Unresolved(min(open_bounds), limit)
    if best is not None and limit is not None:
        best = replace(best, status="feasible", limit=limit, bound_s=min([best.bound_s, *open_bounds]))
    return best


@dataclass(frozen=True, kw_only=True)
class Solved:
    tables: CostTables
    split: SplitResult


class MemoryMisfit(PlanningError):
    """No candidate fits in memory (the message names the closest)."""


# [Note: offload search]
# Offloading a ZeRO-3 shard to host memory ([Note: offload costs] in cost_models/offload.py)
# frees device memory and costs host-link transfers on every micro-batch and a CPU
# optimizer step; it pays where memory binds. Under --offload auto the search first runs
# without offload modes; only if nothing fits in memory does it run again with each
# stage also offered ZeRO-3 with offload (on the device types whose profiles state a
# host), and then the proof covers plans with and without offload. A plan found in the
# first pass is optimal among plans without offload: one with offload could only win by
# trading its transfers for a larger micro-batch or less recompute, and is not searched
# (--offload on offers only offloading stages). This keeps every search that fits, the
# common case, at the size it had.
def search(model: ModelGraph, cluster, options: SearchOptions, progress=None) -> ParallelPlan:
    """Find the fastest plan; see the module docstring and [Note: offload search].

    Args:
        progress: optional callable(done, total, description) for a progress bar.

    Raises:
        PlanningError: nothing fits or the pins are impossible.
    """
    try:
        return _search_pass(model, cluster, options, progress)
    except MemoryMisfit:
        if options.offload != Switch.AUTO or options.offload_offered or not any(
                offload_refusal(cluster.profile(t)) is None for t in cluster.count_by_type()):
            raise
    return _search_pass(model, cluster, replace(options, offload_offered=True), progress)


# [Note: finalists re-ranked]
# CP-SAT proves the best split of every candidate for the linear step time of [Note:
# split objective]; the plan prints planner.estimate's simulation of its schedule, which
# on mixed clusters lets fast stages run ahead of the slowest one's pace and so comes out
# up to about 9% lower (docs/benchmarks/proof-scope_*.md). On a cluster of more than one
# device type the search therefore simulates its finalists, the 1 + --top-k best
# candidates by the linear objective, and returns the fastest by the simulation (ties:
# the linear order). On a cluster of one type the linear objective is the schedule's
# makespan (the two agree within 0.4% on every such cluster of that benchmark), and only
# the best is simulated: simulating 4 finalists of a 1T model costs seconds. The others stay the
# plan's alternatives with both numbers (``step_time_s`` the linear one,
# ``simulated_step_s``). The proof still bounds the linear objective, over every
# candidate; the plan says so where the two differ ([Note: what the proof bounds] in
# planner/plan.py). A candidate outside the finalists is never simulated: the
# re-ranking is exact among them, not over the whole space.
def _search_pass(model: ModelGraph, cluster, options: SearchOptions, progress=None) -> ParallelPlan:
    start = time.perf_counter()
    candidates = enumerate_candidates(model, cluster, options)
    cache: dict = {}
    bounds = {cand: lower_bound_s(model, cluster, cand, options.dtype, cache, options.optimizer, options.stage_devices)
              for cand in candidates}
    # One degree for every stage first: those candidates solve fast and give a cutoff that
    # spares the rest ([Note: stage counts]); within each, one chunk per rank before interleaved
    # candidates, whose relaxation rules most of them out against a cutoff but leaves them to
    # CP-SAT without one ([Note: interleaved relaxation]); each pass in order of its bounds.
    candidates.sort(key=lambda c: (c.tp is None, c.virtual_stages > 1, bounds[c]))
    solved: list[Solved] = []
    misfits: list[tuple[float, CostTables]] = []
    skipped: list[Candidate] = []  # cannot fit in memory whatever the split
    unresolved: list[float] = []  # lower bounds of candidates a limit stopped before any split was found
    limits: list[str] = []  # the limit that stopped each candidate short of a proof
    best = math.inf
    for i, cand in enumerate(candidates):
        if progress:
            progress(i, len(candidates), cand.describe())
        if bounds[cand] >= best and len(solved) > options.top_k:
            continue  # [Note: candidate bound]: no later candidate of this pass can win
        if not memory_may_fit(model, cluster, cand, options, cache):
            skipped.append(cand)
            continue
        # Once the runners-up are known, only a candidate that beats the best is of interest.
        cutoff = best if len(solved) > options.top_k else None
        if cutoff is not None and not budget_may_beat(model, cluster, cand, options, cache, cutoff):
            continue
        try:
            tables, split = solve_candidate(model, cluster, cand, options, cache, cutoff)
        except Unresolved as exc:  # no answer within the limits: its bound stays open
            unresolved.append(max(bounds[cand], exc.bound_s))
            limits.append(exc.limit)
            continue
        if split is not None and split.limit is not None:
            limits.append(split.limit)
        if split is None and cutoff is None:
            misfits.append((overflow(tables), tables))
        elif split is None:
            continue
        else:
            solved.append(Solved(tables=tables, split=split))
            best = min(best, split.cost.objective_s)
    if progress:
        progress(len(candidates), len(candidates), "done")
    if not solved and unresolved:
        raise PlanningError(f"no candidate was solved within {_limit_names(limits, options)}; raise it")
    if not solved:
        for cand in skipped[: max(0, 8 - len(misfits))]:
            tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, cache=cache)
            misfits.append((overflow(tables), tables))
        raise MemoryMisfit(explain_misfit(model, options, min(misfits, key=lambda x: x[0])[1]))
    solved.sort(key=lambda s: s.split.cost.objective_s)
    best = solved[0]
    status = "optimal" if all(s.split.status == "optimal" for s in solved) and not unresolved else "feasible"
    proven = min([best.split.cost.objective_s] + [s.split.bound_s for s in solved if s.split.status != "optimal"] + unresolved)
    gap = max(0.0, 1.0 - proven / best.split.cost.objective_s) if best.split.cost.objective_s > 0 else 0.0
    mixed = len(cluster.count_by_type()) > 1  # [Note: finalists re-ranked]: one type's objective is its makespan
    finalists = solved[: 1 + options.top_k] if mixed else solved[:1]
    info = SolverInfo(status=status, reason=_limit_reason(limits, options, gap), search_time_s=0.0,
                      objective_gap=round(gap, 6), candidates=len(candidates), objective_s=best.split.cost.objective_s,
                      best_objective_s=best.split.cost.objective_s, finalists=len(finalists))
    # [Note: finalists re-ranked]: each finalist simulated; the fastest by the simulation is the plan
    plans = [assemble_plan(model, cluster, options, s.tables, s.split.bounds,
                           replace(info, objective_s=s.split.cost.objective_s), modes=s.split.modes) for s in finalists]
    chosen = min(range(len(plans)), key=lambda i: (plans[i].predicted.step_time_s, i))
    alternatives = [
        {**_candidate_dict(s.tables.candidate), "stage_layers": [b - a + 1 for a, b in s.split.bounds],
         **_mode_lists(s.tables, s.split), "step_time_s": s.split.cost.objective_s,
         "simulated_step_s": plans[i].predicted.step_time_s}
        for i, s in enumerate(finalists) if i != chosen
    ]
    alternatives += [
        {**_candidate_dict(s.tables.candidate), "stage_layers": [b - a + 1 for a, b in s.split.bounds],
         **_mode_lists(s.tables, s.split), "step_time_s": s.split.cost.objective_s}
        for s in solved[len(finalists) : 1 + options.top_k]
    ]
    plan = plans[chosen]
    return replace(plan, alternatives=alternatives,
                   solver=replace(plan.solver, search_time_s=round(time.perf_counter() - start, 3)))


# [Note: a hint above the cutoff]
# Under a cutoff (the best plan so far) the split model only admits faster splits, so a
# hint slower than the cutoff (the equal split with greedy modes) gives CP-SAT no
# feasible start; on a large candidate it can then spend its whole work limit without a
# split, and the candidate stays unresolved even where a split far below the cutoff
# exists (Korthikanti's 530B on 280 A100s: the paper's shape, 40.5 s against a cutoff of
# 48.7 s, found in 2 s without the cutoff). Such a solve runs once more from the hint
# with no cutoff: it costs one more work limit only for the candidates that stopped.
def _solve_model(tables: CostTables, options: SearchOptions, tick_s: float, cutoff_s: float | None,
                 fixed_sizes, hint_bounds, hint_modes):
    split = SplitModel(tables, tick_s, cutoff_s)
    if fixed_sizes:
        for c, (first, _) in enumerate(hint_bounds):
            split.model.add(split.start[c] == first)
    split.hint(hint_bounds, hint_modes)
    solver = cp_solver(work_limit_s=options.work_limit_s, workers=options.workers, seed=options.seed, time_limit_s=options.time_limit_s)
    solver.parameters.relative_gap_limit = options.gap_limit
    solver.parameters.linearization_level = 2  # the envelopes of [Note: cut formulation] give the LP its bound
    return split, solver, solver.solve(split.model)


def solve_candidate(model: ModelGraph, cluster, cand: Candidate, options: SearchOptions, cache: dict | None = None,
                    cutoff_s: float | None = None) -> tuple[CostTables, SplitResult | None]:
    """Solve one candidate: the split, the stage modes (degrees included), and the device type of each stage where types can choose.

    Args:
        cutoff_s: only splits faster than this are of interest.

    Returns:
        The cost tables of the stages' exact ranks, and the split (None if nothing fits).
    """
    cache = {} if cache is None else cache
    fixed = None
    if options.uniform_split:
        fixed = tuple(b - a + 1 for a, b in equal_split(len(model.layers), cand.num_chunks))
    elif options.megatron_split and options.stage_layers is None:
        fixed = tuple(b - a + 1 for a, b in default_split(model.layers, cand.num_chunks).bounds)
    if len(cand.stages_per_type) <= 1:
        tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, cache=cache)
        pinned_ok = options.stage_devices is None or list(options.stage_devices) == tables.device_types
        split = solve_split(tables, options, fixed, cutoff_s) if pinned_ok else None
        if split is None or cand.tp is not None:  # one degree: the tables' ranks are Megatron's, the plan's
            return tables, split
        types = tables.device_types
    else:
        typed = tables_by_type(model, cluster, cand, options.dtype, options.optimizer, cache)
        counts = dict(cand.stages_per_type)
        if options.stage_devices is not None:
            types = list(options.stage_devices)
            split = solve_split(compose_tables(typed, types), options, fixed, cutoff_s=cutoff_s)
        else:
            split = solve_type_orders(typed, counts, options, cutoff_s, fixed)
            types = split.types if split is not None else None
        if split is None:
            return compose_tables(typed, type_sequence(list(typed), counts)), None
    degrees = [cand.modes[k].tp for k in split.modes[: cand.pp]]
    tables = build_tables(model, cluster, cand, options.dtype, options.optimizer, cache=cache,
                          **exact_slots(cluster, cand, types, degrees))
    cost = evaluate_split(tables, split.bounds, split.modes)
    return tables, replace(split, cost=cost, types=types)


def exact_slots(cluster, cand: Candidate, types: list[str], degrees: list[int]) -> dict[str, list[RankSlots]]:
    """``slots`` and ``cut_to`` of ``build_tables`` for pipeline ranks of these device types and degrees,
    on the ranks ``pack_stage_ranks`` gives them."""
    by_type = ranks_by_type(cluster)
    slots: list[RankSlots] = [{} for _ in types]
    for device_type in dict.fromkeys(types):
        mine = [r for r, t in enumerate(types) if t == device_type]
        memory = cluster.profile(device_type).memory_bytes
        for r, ranks in zip(mine, pack_stage_ranks(by_type[device_type], cand.dp, [degrees[r] for r in mine])):
            slots[r] = {degrees[r]: StageSlot(ranks=ranks, device_type=device_type, memory_bytes=memory)}
    return {"slots": slots, "cut_to": [slots[(r + 1) % len(types)] for r in range(len(types))]}


def _limit_names(limits: list[str], options: SearchOptions) -> str:
    names = []
    if "work" in limits:
        names.append(f"--work-limit {options.work_limit_s:g} deterministic s")
    if "time" in limits:
        names.append(f"--time-limit {options.time_limit_s:g} s of wall clock")
    return " or ".join(names)


def _limit_reason(limits: list[str], options: SearchOptions, gap: float) -> str:
    """Why a plan is only feasible: which limits stopped how many candidates, and the gap left
    ([Note: deterministic search] in planner.solver); empty when nothing stopped short."""
    if not limits:
        return ""
    parts = []
    for limit, what in (("work", f"the work limit of {options.work_limit_s:g} deterministic s"),
                        ("time", f"the wall-clock time limit of {options.time_limit_s or 0:g} s (the result depends on the machine)")):
        n = limits.count(limit)
        if n:
            parts.append(f"{n} candidate{'s' if n > 1 else ''} hit {what}")
    return f"{' and '.join(parts)}; proven gap {gap:.1%}"


def _candidate_dict(c: Candidate) -> dict:
    return {"dp": c.data_replicas, **({"cp": c.cp} if c.cp > 1 else {}), "tp": c.tp, "pp": c.pp, "micro_batch_size": c.micro_batch_size, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages}


def _mode_lists(tables: CostTables, split: SplitResult) -> dict:
    modes = [tables.candidate.modes[k] for k in split.modes]
    return {"recompute": [m.recompute for m in modes], "zero_stage": [m.zero_stage for m in modes],
            "tensor_parallel": [m.tp for m in modes],
            **({"sequence_parallel": [m.sp for m in modes]} if any(m.sp for m in modes) else {}),
            **({"offload": [m.offload for m in modes]} if any(m.offload for m in modes) else {})}
