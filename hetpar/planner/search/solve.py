"""The search: the fastest plan under the cost model, with proof of optimality.

Outer enumeration covers what the CP-SAT model keeps fixed (data- and
pipeline-parallel degrees, micro-batch size, schedule and its virtual stages, and how
many stages each device type hosts); for each such candidate one CP-SAT model chooses
the cut points of the layer sequence into stages, which may be uneven and which see
each stage's own device type, and each stage's mode: its tensor-parallel degree
([Note: per-stage tensor parallelism] in planner.costs), activation recomputation and
ZeRO stage. The objective is [Note: split objective] in planner.costs.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from hetpar.cost_models.layers import tp_misfit
from hetpar.planner.bounds import budget_may_beat, lower_bound_s, memory_may_fit
from hetpar.planner.costs import (
    Candidate,
    CostTables,
    RankSlots,
    SplitCost,
    StageMode,
    StageSlot,
    build_tables,
    compose_tables,
    evaluate_split,
    pack_stage_ranks,
    ranks_by_type,
    stage_memory_breakdown,
    tables_by_type,
    type_sequence,
    type_width,
)
from hetpar.planner.default_split import default_split
from hetpar.planner.estimate import EstimateConfig, EstimateError, estimate, stage_devices_of
from hetpar.planner.options import PlanningError, SearchOptions, check_pins, cp_solver, divisors, limit_hit, misfit_fix, pinned_pp, to_ticks
from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, Schedule, SolverInfo, StagePlan
from hetpar.planner.split_model import (
    _TICKS_PER_OBJECTIVE,
    SplitModel,
    Unresolved,
    bounds_from_sizes,
    degree_split,
    equal_split,
    greedy_modes,
    may_beat,
    objective_floor,
)
from hetpar.planner.trace import ModelGraph


# [Note: search space]
# Outside the CP-SAT model: dp, pp, the micro-batch size, the schedule and, on a
# cluster with several device types, how many stages each type hosts. When every
# type's device count is a multiple of dp, stages sit on one type each ([Note: stage
# device types]) and choose their tensor-parallel degree inside the model among the
# powers of two that divide their type's node width, up to --max-tp (1 unless a layer
# splits), summing per type to its devices per replica ([Note: per-stage tensor
# parallelism]); a node width's other divisors are offered as one degree for every
# stage. Otherwise (and for --uniform-split's baseline) the layout is Megatron's over
# the mixed devices with one degree tp dividing every node's device count and
# dp = world / (tp pp). Schedules: 1F1B, ZB-H1 ("zb", when pp > 1) and interleaved
# 1F1B with v = 2..max_virtual_stages chunks per rank (pp > 1, tp 1 on every stage,
# m a multiple of pp, pp v <= layers). GPipe has 1F1B's step time and never less
# memory ([Note: linear step time]), so it is searched only when pinned. Inside, every
# stage (every chunk, when interleaved) picks a mode: its degree times recompute none
# or full (selective costs what none costs under this cost model: the tracer measures
# attention as a fused kernel keeps it) times a ZeRO stage, 0, 2 or 3 when dp > 1 under
# 1F1B and GPipe (the runtime shards with FSDP, which neither ZB-H1's split backward
# nor interleaved chunks support), 0 otherwise. ZeRO-1 is searched only when pinned:
# at one micro-batch it costs what ZeRO-2 costs and holds more; with more, ZeRO-2
# reduce-scatters after every micro-batch's backward and ZeRO-1 once, so ZeRO-1 can be
# faster where ZeRO-2's gradient shards are not needed to fit, a plan this search
# leaves to `--zero 1` (a fourth ZeRO stage per mode would cost the search a third more).
def enumerate_candidates(model: ModelGraph, cluster, options: SearchOptions) -> list[Candidate]:
    """Every (dp, pp, micro-batch size, schedule, virtual stages, stages per type) the pins allow,
    with the degrees each stage may take; see [Note: search space].

    Raises:
        PlanningError: the pins or the batch size rule out every candidate; says why.
    """
    num_layers = len(model.layers)
    gbs = options.global_batch_size
    check_pins(model, cluster, options)
    tp_ok = any(l.tp_capable for l in model.layers)
    out = []
    for dp in divisors(cluster.world_size):
        if gbs % dp or (options.dp is not None and options.dp != dp) or dp < options.min_dp:
            continue
        for degrees, tp_sum, per_type in _layouts(model, cluster, options, dp, tp_ok):
            pp = sum(n for _, n in per_type) if per_type else cluster.world_size // (dp * degrees[0])
            if pp > num_layers or (pinned_pp(options) or pp) != pp:
                continue
            for mbs in divisors(gbs // dp):
                if options.micro_batch_size and mbs != options.micro_batch_size:
                    continue
                m = gbs // (dp * mbs)
                for schedule, v in schedules_for(options, tp=degrees[-1], pp=pp, num_microbatches=m, num_layers=num_layers):
                    modes = stage_modes(options, dp=dp, schedule=schedule, degrees=degrees)
                    if modes:
                        out.append(Candidate(dp=dp, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule=schedule,
                                             virtual_stages=v, modes=modes, tp_sum=tp_sum, stages_per_type=per_type,
                                             sync=options.sync))
    if not out:
        raise PlanningError(_no_candidate_reason(model, cluster, options, tp_ok))
    return out


def _layouts(model: ModelGraph, cluster, options: SearchOptions, dp: int, tp_ok: bool):
    """(degrees, tp_sum, stages_per_type) of every layout with ``dp`` replicas; see [Note: search space]."""
    by_type = ranks_by_type(cluster)
    if options.uniform_split or any(len(r) % dp for r in by_type.values()):
        world = cluster.world_size
        widths = {g.devices_per_node for g in cluster.groups}
        for tp in divisors(world // dp):
            if _degree_ok(model, options, tp, tp_ok) and not any(w % tp for w in widths) and not tp_misfit(model.layers, tp):
                yield (tp,), (), ()
        return
    share = {t: len(r) // dp for t, r in by_type.items()}
    width = {t: type_width(cluster, r) for t, r in by_type.items()}
    chain = tuple(d for d in (2**i for i in range(12)) if _degree_ok(model, options, d, tp_ok) and any(w % d == 0 for w in width.values()))
    others = [(d,) for d in sorted({d for w in width.values() for d in divisors(w)} - set(chain))
              if _degree_ok(model, options, d, tp_ok) and all(w % d == 0 for w in width.values()) and not tp_misfit(model.layers, d)]
    if options.tp is not None:
        chain = tuple(d for d in chain if d == options.tp and not tp_misfit(model.layers, d))
    for degrees in ([chain] if chain else []) + others:
        mine = {t: tuple(d for d in degrees if width[t] % d == 0 and d <= share[t]) for t in by_type}
        if not all(mine.values()):
            continue
        for per_type in _stage_counts(share, mine, width, len(model.layers), pinned_pp(options)):
            used = tuple(sorted({d for t, p in per_type for d in degree_split(share[t], p, mine[t])}))
            if options.stage_devices is None or all(options.stage_devices.count(t) == p for t, p in per_type):
                yield used, tuple(sorted(share.items())), per_type


# [Note: stage counts]
# How many stages each type hosts is enumerated outside the model; every count whose
# degrees can sum to the type's share would make the outer loop grow with the share
# (a 192-device share has 24..130 possible counts for a 130-layer model, and three
# types multiply theirs). The search takes, for each offered degree d, the count of the
# uniform layout, ceil(share / d) stages, and, on one device type whose share fits in
# one node, that count plus one: the uniform layouts, a remainder stage where d does
# not divide the share, and within a node one stage's devices split between two stages
# (or a heavy stage given a larger degree than the rest). On larger shares the plus-one
# layouts were near-ties of the uniform ones (the 1T benchmark's 25 stages of degrees 8
# and 4 against 24 of 8, within 1%) that CP-SAT could not settle in its time limit, and
# the search took a minute; on mixed clusters each is solved once per order of the
# types, and they tripled the 512-device benchmark's time. The degrees offered are the two neighbours in the chain around the
# type's average share / stages (``degree_split``; the stages' degrees as even as the
# sum allows, so that their counts are fixed and the CP-SAT model only chooses which
# stages take the larger), or where no two neighbours sum right, the degrees of the
# first split found largest first. Offering every degree that could sum right was
# tried: with 24 modes per stage CP-SAT's relaxation was weak (a bound of a third of
# the optimum after 2 s on the 1T benchmark's candidates), and the search took minutes.
# A pinned pipeline depth (--pp, --stage-layers, --stage-devices) fixes the total, so
# there every split of it over the types whose degrees can sum to their shares is
# taken: few, and the counts above need not reach the pinned depth (on
# 2x4xH100-80GB+2x8xA100-40GB, --pp 4 is 1 + 1 stages on the H100s and 1 + 1 on the
# A100s at dp 4, which none of the uniform counts is).
def _stage_counts(share: dict[str, int], degrees: dict[str, tuple[int, ...]], width: dict[str, int], num_layers: int,
                  pinned: int | None = None):
    """The (device type, stages) tuples of [Note: stage counts]; with a ``pinned`` depth, those that sum to it."""
    if pinned is not None:
        yield from _pinned_stage_counts(share, degrees, pinned)
        return
    seen = set()
    for d in sorted({d for mine in degrees.values() for d in mine}):
        base = {t: -(-share[t] // max((e for e in mine if e <= d), default=min(mine))) for t, mine in degrees.items()}
        for extra in [None, *(t for t in share if share[t] <= width[t] and len(share) == 1)]:
            counts = {t: n + (t == extra) for t, n in base.items()}
            key = tuple(sorted(counts.items()))
            if key in seen or sum(counts.values()) > num_layers:
                continue
            seen.add(key)
            if all(degree_split(share[t], n, degrees[t]) is not None for t, n in counts.items()):
                yield key


def _pinned_stage_counts(share: dict[str, int], degrees: dict[str, tuple[int, ...]], pp: int):
    """Every ((device type, stages), ...) with ``pp`` stages in all whose degrees can sum to each type's share."""
    types = sorted(share)
    for head in itertools.product(range(1, pp + 1), repeat=len(types) - 1):
        counts = (*head, pp - sum(head))
        if counts[-1] >= 1 and all(degree_split(share[t], n, degrees[t]) is not None for t, n in zip(types, counts)):
            yield tuple(zip(types, counts))


def _degree_ok(model: ModelGraph, options: SearchOptions, tp: int, tp_ok: bool) -> bool:
    """Whether ``tp`` may be offered: 1, or a layer splits and --max-tp and --tp allow it."""
    if options.tp is not None and tp != options.tp:
        return False
    return tp == 1 or (tp_ok and tp <= options.max_tp)


def schedules_for(options: SearchOptions, *, tp: int, pp: int, num_microbatches: int, num_layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs searched for one (tp, pp, m); see [Note: search space]."""
    names = [options.schedule] if options.schedule else ["1f1b", "zb", "interleaved"]
    # --stage-layers without --virtual-stages gives one chunk per pipeline rank (pinned_pp counts them so).
    virtual = options.virtual_stages or (1 if options.stage_layers is not None else None)
    if virtual is not None:
        names = [n for n in names if (n == "interleaved") == (virtual > 1)]
    out = []
    for name in names:
        if name == "interleaved":
            pinned = options.schedule == "interleaved"
            top = virtual or options.max_virtual_stages
            low = virtual or 2
            for v in range(low, top + 1):
                if (pp > 1 or pinned) and tp == 1 and num_microbatches % pp == 0 and pp * v <= num_layers:
                    out.append((name, v))
        elif name != "zb" or pp > 1 or options.schedule == "zb":
            out.append((name, 1))
    return out


def stage_modes(options: SearchOptions, *, dp: int, schedule: str, degrees: tuple[int, ...] = (1,)) -> tuple[StageMode, ...]:
    """The modes each stage may take; empty when the pins leave none; see [Note: search space]."""
    recomputes = [options.recompute] if options.recompute else ["none", "full"]
    shardable = dp > 1 and schedule in ("1f1b", "gpipe")
    if options.zero is not None:
        zeros = [options.zero] if options.zero == 0 or shardable else []
    else:
        zeros = [0, 2, 3] if shardable else [0]
    return tuple(StageMode(recompute=r, zero_stage=z, tp=tp) for tp in degrees for z in zeros for r in recomputes)


def _no_candidate_reason(model: ModelGraph, cluster, options: SearchOptions, tp_ok: bool) -> str:
    world, gbs = cluster.world_size, options.global_batch_size
    if options.zero:
        return (f"--zero {options.zero} needs data parallelism (dp > 1) and schedule 1f1b or gpipe; no such (dp, tp, pp) "
                f"fits world_size({world}) with global batch {gbs} and the other pins")
    if options.schedule == "interleaved" or (options.virtual_stages or 1) > 1:
        return (f"the interleaved schedule needs tp 1, micro-batches a multiple of pp and pp * virtual stages <= "
                f"{len(model.layers)} layers; nothing fits world_size({world}) with global batch {gbs} and the other pins")
    return (
        f"no (dp, tp, pp) fits world_size({world}) with global batch {gbs}: dp must divide the batch, tp every node's "
        f"devices, and pp is at most the model's {len(model.layers)} layers"
        + ("" if tp_ok else " (and tp is 1: the model has no tensor-parallel layers)")
        + "; change the pins, --global-batch or the cluster"
    )


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

    CP-SAT model of [Note: split objective] over the cut positions and the stage modes;
    see [Note: cut formulation].

    Args:
        fixed_sizes: layers per chunk, when the split is pinned (the modes are still chosen).
        cutoff_s: only splits faster than this are of interest (None also when none is).
    """
    fixed_sizes = fixed_sizes or options.stage_layers
    if not np.isfinite(tables.time_s).any(axis=0).all():
        return None  # a device lacks the training dtype, or no offered degree splits a layer
    if cutoff_s is not None and not fixed_sizes and not may_beat(tables, cutoff_s):
        return None
    floor_s = objective_floor(tables) if not fixed_sizes and cutoff_s is not None else None
    if floor_s is not None and floor_s >= cutoff_s:
        return None  # [Note: objective floor]
    hint_bounds = bounds_from_sizes(fixed_sizes) if fixed_sizes else equal_split(tables.num_layers, tables.num_chunks)
    hint_modes = greedy_modes(tables, hint_bounds)
    scale_s = evaluate_split(tables, hint_bounds, hint_modes).objective_s
    if not math.isfinite(scale_s):  # the hint holds a layer its degree cannot split: the least micro-batch time, m times
        scale_s = float(np.where(np.isfinite(tables.time_s), tables.time_s, np.inf).min(axis=(0, 2)).sum()) * tables.candidate.num_microbatches
    tick_s = (scale_s or 1.0) / _TICKS_PER_OBJECTIVE
    split = SplitModel(tables, tick_s, cutoff_s)
    if fixed_sizes:
        for c, (first, _) in enumerate(hint_bounds):
            split.model.add(split.start[c] == first)
    split.hint(hint_bounds, hint_modes)
    solver = cp_solver(work_limit_s=options.work_limit_s, workers=options.workers, seed=options.seed, time_limit_s=options.time_limit_s)
    solver.parameters.relative_gap_limit = options.gap_limit
    solver.parameters.linearization_level = 2  # the envelopes of [Note: cut formulation] give the LP its bound
    status = solver.solve(split.model)
    if status != cp_model.OPTIMAL and floor_s is None and not fixed_sizes:
        floor_s = objective_floor(tables)  # [Note: objective floor]: often far above CP-SAT's bound
    if status == cp_model.UNKNOWN:
        bound_s = max(0.0, solver.best_objective_bound * tick_s / split.weights.scale, floor_s or 0.0)
        raise Unresolved(bound_s, limit_hit(solver, options.time_limit_s))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [solver.value(v) for v in split.start]
    bounds = [(starts[c], starts[c + 1] - 1) for c in range(tables.num_chunks)]
    modes = split.modes(solver)
    cost = evaluate_split(tables, bounds, modes)
    optimal = status == cp_model.OPTIMAL
    bound_s = cost.objective_s if optimal else min(cost.objective_s, max(solver.best_objective_bound * tick_s / split.weights.scale,
                                                                         floor_s or 0.0))
    return SplitResult(bounds=bounds, cost=cost, status="optimal" if optimal else "feasible", bound_s=bound_s,
                       limit=None if optimal else limit_hit(solver, options.time_limit_s))


def solve_type_orders(tables: dict[str, CostTables], stages_per_type: dict[str, int], options: SearchOptions,
                      cutoff_s: float | None = None, fixed_sizes: tuple[int, ...] | None = None) -> SplitResult | None:
    """The best split over every order of the device types; see [Note: stage device types] in planner.costs.

    Each type's stages are consecutive, so the pipeline crosses from one type to the
    next once; each of the (at most types!) orders is one CP-SAT split model.

    Args:
        tables: cost columns per device type (``planner.costs.tables_by_type``).
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
    # One degree for every stage first: those candidates solve fast and give a cutoff that
    # spares the rest ([Note: stage counts]); each pass in order of its bounds.
    candidates.sort(key=lambda c: (c.tp is None, bounds[c]))
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
            misfits.append((_overflow(tables), tables))
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
            misfits.append((_overflow(tables), tables))
        raise PlanningError(_explain_misfit(model, options, min(misfits, key=lambda x: x[0])[1]))
    solved.sort(key=lambda s: s.split.cost.objective_s)
    best = solved[0]
    status = "optimal" if all(s.split.status == "optimal" for s in solved) and not unresolved else "feasible"
    proven = min([best.split.cost.objective_s] + [s.split.bound_s for s in solved if s.split.status != "optimal"] + unresolved)
    gap = max(0.0, 1.0 - proven / best.split.cost.objective_s) if best.split.cost.objective_s > 0 else 0.0
    info = SolverInfo(status=status, reason=_limit_reason(limits, options, gap), search_time_s=round(time.perf_counter() - start, 3),
                      objective_gap=round(gap, 6), candidates=len(candidates), objective_s=best.split.cost.objective_s)
    alternatives = [
        {**_candidate_dict(s.tables.candidate), "stage_layers": [b - a + 1 for a, b in s.split.bounds],
         **_mode_lists(s.tables, s.split), "step_time_s": s.split.cost.objective_s}
        for s in solved[1 : 1 + options.top_k]
    ]
    return assemble_plan(model, cluster, options, best.tables, best.split.bounds, info, alternatives, modes=best.split.modes)


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
    ([Note: deterministic search] in planner.options); empty when nothing stopped short."""
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
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "micro_batch_size": c.micro_batch_size, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages}


def _mode_lists(tables: CostTables, split: SplitResult) -> dict:
    modes = [tables.candidate.modes[k] for k in split.modes]
    return {"recompute": [m.recompute for m in modes], "zero_stage": [m.zero_stage for m in modes],
            "tensor_parallel": [m.tp for m in modes]}


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
    if not math.isfinite(cost.stage_memory_bytes[r]):  # not memory: the closest layout has a layer on a degree it cannot split
        return _explain_degree_misfit(model, tables, bounds, modes)
    mode = cand.modes[modes[r]]
    breakdown = stage_memory_breakdown(model, tables, r, *bounds[r], options.dtype, options.optimizer, mode=mode)
    gib = 2**30
    what = mode.describe() + (f", tp {mode.tp}" if cand.tp is None else "")
    return (
        f"no plan fits in memory: the closest ({cand.describe()}, {what}) needs "
        f"{cost.stage_memory_bytes[r] / gib:.1f} GiB on stage {r}, {tables.device_types[r]} has "
        f"{tables.capacity_bytes[r] / gib:.1f} GiB (mostly {breakdown.dominant_term()}); {misfit_fix(options.dtype)}"
    )


def _explain_degree_misfit(model: ModelGraph, tables: CostTables, bounds, modes: list[int]) -> str:
    """Why the closest candidate fails when it is a layer's tensor-parallel splits, not memory."""
    cand = tables.candidate
    c, l = next((c, l) for c, (first, last) in enumerate(bounds) for l in range(first, last + 1)
                if not np.isfinite(tables.memory_bytes[modes[c], l, c]))
    layer = model.layers[l]
    ways = ", ".join(map(str, layer.tp_degrees or ())) or "no"
    return (
        f"no plan: layer {layer.name} splits only {ways} ways, and every layout of the cluster's devices the search "
        f"tries needs a larger tensor-parallel degree somewhere (the closest: {cand.describe()}, tp {cand.modes[modes[c]].tp} "
        "on its stage); pin --dp, --pp or --tp, or change the cluster or --global-batch"
    )


def assemble_plan(model: ModelGraph, cluster, options: SearchOptions, tables: CostTables, bounds, info: SolverInfo, alternatives=(),
                  modes: list[int] | None = None) -> ParallelPlan:
    """Turn a solved split into a ParallelPlan with its predicted cost."""
    cand = tables.candidate
    modes = list(modes) if modes is not None else [0] * len(bounds)
    cost = evaluate_split(tables, bounds, modes)
    stages = []
    for c, (first, last) in enumerate(bounds):
        mode = cand.modes[modes[c]]
        sharding = {}
        if mode.tp > 1:
            for l in range(first, last + 1):
                sharding.update(model.tp_sharding[l])
        slot = tables.slots[c % cand.pp][mode.tp]
        stages.append(
            StagePlan(
                index=c,
                layers=list(range(first, last + 1)),
                device_type=slot.device_type,
                tensor_parallel=mode.tp,
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
    ranks = stages[: cand.pp]
    degrees = tuple(s.tensor_parallel for s in ranks)
    config = EstimateConfig(
        global_batch_size=options.global_batch_size, dp=cand.dp, tp=degrees[0], pp=cand.pp,
        micro_batch_size=cand.micro_batch_size, dtype=options.dtype, schedule=cand.schedule, virtual_stages=cand.virtual_stages,
        optimizer=options.optimizer, stage_layers=tuple(b - a + 1 for a, b in bounds),
        stage_devices=stage_devices_of([s.ranks for s in ranks], cluster.device_types()),
        stage_recompute=tuple(s.recompute for s in stages), stage_zero=tuple(s.zero_stage for s in ranks),
        stage_tp=degrees if len(set(degrees)) > 1 else None, sync=cand.sync,
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
    k = cost.modes
    tp_comm = max(float(tables.tp_time_s[k[c], first : last + 1, c].sum()) for c, (first, last) in enumerate(bounds)) * m
    cuts = sum(float(tables.cut_s[tables.tp_index(k[c]), tables.tp_index(k[c + 1]), last, c]) for c, (_, last) in enumerate(bounds[:-1]))
    return Predicted(
        step_time_s=step,
        throughput_samples_per_s=options.global_batch_size / step if step > 0 else 0.0,
        peak_memory_bytes=[int(b) for b in cost.stage_memory_bytes],
        compute_time_s=m * slowest,
        bubble_time_s=sum(cost.stage_time_s) - slowest,
        dp_comm_time_s=max(cost.dp_sync_s),
        pp_comm_time_s=cuts * m,
        tp_comm_time_s=tp_comm,
    )


__all__ = ["search", "SearchOptions", "PlanningError", "solve_split", "equal_split", "enumerate_candidates", "lower_bound_s", "may_beat",
           "to_ticks", "type_sequence"]
