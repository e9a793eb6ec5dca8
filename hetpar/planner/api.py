"""The planner as one library call: model file + cluster -> ParallelPlan. ``hetpar plan`` wraps it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.compute import compiled_layer
from hetpar.planner.errors import PlanningError
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import ParallelPlan
from hetpar.planner.search import search
from hetpar.planner.trace_cache import traced_model
from hetpar.planner.strategies import (
    LOSSY_MIN_GAIN, DataParallelSync, Objective, cheapest_plan, cost_method, hetero_dp_plan, least_energy_plan, matrix_width,
)
from hetpar.runtime.sync_spec import parse_aggregation
from hetpar.vocabulary import AggregationKind, CompressionKind, ObjectiveKind, Switch


def plan_model(
    model_path: str | Path,
    cluster: Cluster,
    options: SearchOptions,
    *,
    model_args: dict[str, Any] | None = None,
    leaf_modules: tuple[str, ...] = (),
    objective: Objective | None = None,
    hetero_dp: str = Switch.AUTO,
    sync: DataParallelSync | None = None,
    on_traced: Callable[[ModelGraph], None] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """Trace the model of ``model_path`` on the meta device and plan it on ``cluster``.

    Args:
        objective: fastest on all devices (default), or cheapest per step over sub-clusters;
            either with a throughput target (planner.strategies.objective).
        hetero_dp: "auto" also tries replicas of one device type each on a mixed cluster
            and keeps the faster plan; "on" plans only that way; "off" never.
        sync: how data-parallel replicas agree: compression (pinned, or chosen under
            ``allow_lossy``), robust aggregation, local SGD, rebalancing (planner.strategies.sync_methods).
        on_traced: called with the ModelGraph once tracing is done (for progress display).
        progress: called as (done, total, description) while candidates are solved.

    Raises:
        runtime.model_file.ModelFileError, runtime.graph.TraceError, planner.search.PlanningError.
    """
    if sync is not None and sync != DataParallelSync():  # a request no layout meets fails before tracing
        options_now, _ = _sync_pins(options, hetero_dp, sync)
        for compression in sync.compressions:
            if compression != CompressionKind.NONE or not sync.exact:
                _zero_0(options_now, compression, sync)
    traced = traced_model(model_path, model_args or {}, tuple(leaf_modules))  # [Note: the trace cache]
    if on_traced:
        on_traced(traced.graph)
    plan = plan_graph(traced.graph, cluster, options, objective=objective, hetero_dp=hetero_dp, sync=sync, progress=progress)
    return replace(plan, model=replace(plan.model, leaf_modules=list(leaf_modules)),
                   solver=replace(plan.solver, trace_time_s=round(traced.seconds, 3), trace_cached=traced.cached))


def compiled_graph(graph: ModelGraph) -> ModelGraph:
    """``graph`` as compiled stages run it: each layer's kernels after fusion
    ([Note: compiled stages] in cost_models.compute)."""
    return replace(graph, layers=[compiled_layer(layer) for layer in graph.layers])


def plan_graph(
    graph: ModelGraph,
    cluster: Cluster,
    options: SearchOptions,
    *,
    objective: Objective | None = None,
    hetero_dp: str = Switch.AUTO,
    sync: DataParallelSync | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """``plan_model`` on a traced model.

    Raises:
        PlanningError: nothing fits, the pins are impossible, or the objective cannot be met; says why.
    """
    objective = objective or Objective()
    if options.compiled:
        graph = compiled_graph(graph)
    if hetero_dp not in tuple(Switch):
        raise PlanningError(f"unknown --hetero-dp {hetero_dp!r}; use one of {', '.join(Switch)}")
    sync = sync or DataParallelSync()
    if sync == DataParallelSync():
        return _with_work(_plan_graph(graph, cluster, options, objective, hetero_dp, progress), graph, cluster, options)
    options, hetero_dp = _sync_pins(options, hetero_dp, sync)
    plans = []
    for compression in sync.compressions:  # [Note: lossy sync choice] in planner.strategies.sync_methods
        method = cost_method(compression, sync.aggregation, sync.sync_every, sync.sync_scope, optimizer=options.optimizer,
                             width=matrix_width(graph.layers))
        pinned = options if method.plain else _zero_0(options, compression, sync)
        plan = _plan_graph(graph, cluster, replace(pinned, sync=method), objective, hetero_dp, progress)
        plans.append(replace(plan, grad_compression=compression, aggregation=sync.aggregation, sync_every=sync.sync_every,
                             sync_scope=sync.sync_scope, rebalance_every=sync.rebalance_every))
    return _with_work(_with_sync_alternatives(plans), graph, cluster, options)


def _with_work(plan: ParallelPlan, graph: ModelGraph, cluster: Cluster, options: SearchOptions) -> ParallelPlan:
    """``plan`` with the model's FLOPs per step and its devices' summed peak, from which a
    program reports MFU (``Predicted.model_flops_per_step``, ``peak_flops_per_s``)."""
    flops = sum(l.fwd_flops + l.bwd_flops for l in graph.layers) * options.global_batch_size
    try:
        peak = sum(cluster.profile(t).peak_flops(options.dtype) for t in plan.cluster.device_types)
    except (KeyError, ValueError):
        peak = 0.0
    return replace(plan, predicted=replace(plan.predicted, model_flops_per_step=float(flops), peak_flops_per_s=float(peak)))


def _sync_pins(options: SearchOptions, hetero_dp: str, sync: DataParallelSync) -> tuple[SearchOptions, str]:
    """What the sync options require of the layout: enough replicas for a robust rule or local
    SGD (and equal shares, so no heterogeneous data parallelism), one pipeline stage to rebalance."""
    replicas = parse_aggregation(sync.aggregation).min_replicas() if sync.aggregation != AggregationKind.MEAN else 2
    if sync.aggregation != AggregationKind.MEAN or sync.sync_every > 1:
        what = f"--aggregation {sync.aggregation}" if sync.aggregation != AggregationKind.MEAN else f"--sync-every {sync.sync_every}"
        if options.dp is not None and options.dp < replicas:
            raise PlanningError(f"{what} needs at least {replicas} data-parallel replicas; raise --dp {options.dp}")
        if hetero_dp == Switch.ON:
            raise PlanningError(f"{what} needs equal replica shares; drop --hetero-dp on")
        return replace(options, min_dp=replicas), Switch.OFF
    if sync.rebalance_every:
        if options.pp not in (None, 1):
            raise PlanningError(f"--rebalance-every needs one pipeline stage; drop --pp {options.pp}")
        if options.dp == 1:
            raise PlanningError("--rebalance-every moves samples between replicas; it needs --dp 2 or more")
        return replace(options, pp=1, min_dp=2), hetero_dp
    return options, hetero_dp


def _zero_0(options: SearchOptions, compression: str, sync: DataParallelSync) -> SearchOptions:
    """``options`` with ZeRO pinned to 0, which every sync but the plain all-reduce needs."""
    if options.zero not in (None, 0):
        what = f"--grad-compression {compression}" if compression != CompressionKind.NONE else (
            f"--aggregation {sync.aggregation}" if sync.aggregation != AggregationKind.MEAN else f"--sync-every {sync.sync_every}")
        raise PlanningError(f"{what} needs ZeRO 0 (FSDP reduces its own gradients); drop --zero {options.zero}")
    return replace(options, zero=0)


def _with_sync_alternatives(plans: list[ParallelPlan]) -> ParallelPlan:
    """The fastest of one plan per compression (the first is exact when the search chose among
    them): a lossy one must beat the first by LOSSY_MIN_GAIN; the others become alternatives."""
    first = plans[0]
    best = min(plans, key=lambda p: p.predicted.step_time_s)
    if best is not first and first.grad_compression == CompressionKind.NONE and \
            best.predicted.step_time_s > (1 - LOSSY_MIN_GAIN) * first.predicted.step_time_s:
        best = first
    others = [plan_summary(p) for p in plans if p is not best]
    return replace(best, alternatives=[*others, *best.alternatives])


def _plan_graph(graph: ModelGraph, cluster: Cluster, options: SearchOptions, objective: Objective, hetero_dp: str,
                progress: Callable[[int, int, str], None] | None) -> ParallelPlan:

    def solve(model: ModelGraph, on: Cluster, opts: SearchOptions, progress=None) -> ParallelPlan:
        return fastest_plan(model, on, opts, hetero_dp=hetero_dp, progress=progress)

    if objective.kind == ObjectiveKind.COST:
        plan = cheapest_plan(graph, cluster, options, objective, solve=solve, hetero_dp=hetero_dp, progress=progress)
        return replace(plan, compiled=options.compiled)
    if objective.kind == ObjectiveKind.ENERGY:
        plan = least_energy_plan(graph, cluster, options, objective, solve=solve, hetero_dp=hetero_dp, progress=progress)
        return replace(plan, compiled=options.compiled)
    plan = replace(solve(graph, cluster, options, progress), compiled=options.compiled)
    target = objective.min_throughput_samples_per_s
    if plan.predicted.throughput_samples_per_s < target:
        raise PlanningError(
            f"the fastest plan on {cluster.spec} reaches {plan.predicted.throughput_samples_per_s:.4g} samples/s, "
            f"below --min-throughput {target:g}; add devices or lower the target"
        )
    return plan


def fastest_plan(
    graph: ModelGraph,
    cluster: Cluster,
    options: SearchOptions,
    *,
    hetero_dp: str = Switch.AUTO,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """The faster of the search's plan and the heterogeneous data-parallel plan (planner.strategies.hetero_dp).

    The other one, when there is one, is recorded first among the plan's ``alternatives``.

    Raises:
        PlanningError: neither kind of plan fits (the search's reason), or ``hetero_dp`` is
            "on" and heterogeneous data parallelism does not apply (its reason).
    """
    if hetero_dp == Switch.ON:
        return hetero_dp_plan(graph, cluster, options)
    if hetero_dp == Switch.OFF or len(cluster.count_by_type()) < 2:
        return search(graph, cluster, options, progress=progress)
    with _beside(_hetero_dp_or_error, graph, cluster, options) as other:
        try:
            searched = search(graph, cluster, options, progress=progress)
        except PlanningError as exc:
            searched = exc
        hetero = other()
    if isinstance(searched, PlanningError):
        if isinstance(hetero, PlanningError):
            raise searched
        return hetero
    if isinstance(hetero, PlanningError):
        return searched
    faster, other = (hetero, searched) if hetero.predicted.step_time_s < searched.predicted.step_time_s else (searched, hetero)
    return replace(faster, alternatives=[plan_summary(other), *faster.alternatives])


def _hetero_dp_or_error(graph: ModelGraph, cluster: Cluster, options: SearchOptions) -> ParallelPlan | PlanningError:
    try:
        return hetero_dp_plan(graph, cluster, options)
    except PlanningError as exc:
        return exc


# [Note: both cores]
# On a mixed cluster the search and the heterogeneous data-parallel plan are independent
# and each deterministic, so the second runs in a forked process beside the first when
# the machine has a core to spare, and the faster is kept exactly as if they had run one
# after the other: the plan does not depend on how many cores there are, only the wall time.
# A daemonic process (a multiprocessing.Pool worker calling the planner) may not start
# children, so there the two run one after the other.
@contextlib.contextmanager
def _beside(fn: Callable, *args: Any):
    """Start ``fn(*args)`` in another process where a core is free; yields a call that returns its result."""
    if (os.cpu_count() or 1) < 2 or "fork" not in multiprocessing.get_all_start_methods() \
            or multiprocessing.current_process().daemon:
        yield lambda: fn(*args)
        return
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        future = pool.submit(fn, *args)
        yield future.result


def plan_summary(plan: ParallelPlan) -> dict[str, Any]:
    """A plan as one entry of another plan's ``alternatives``: its degrees, split and predicted step."""
    kind = "hetero_dp" if plan.replica_batch_shares is not None else "pipeline"
    out = {
        "kind": kind, "dp": plan.data_parallel, "tp": plan.stages[0].tensor_parallel, "pp": plan.pipeline_parallel,
        "micro_batch_size": plan.micro_batch_size, "schedule": plan.schedule.value, "recompute": plan.stages[0].recompute,
        "stage_layers": [len(s.layers) for s in plan.stages], "stage_devices": [s.device_type for s in plan.stages],
        "grad_compression": plan.grad_compression, "step_time_s": plan.predicted.step_time_s,
    }
    if plan.replica_batch_shares is not None:
        out["replica_batch_shares"] = list(plan.replica_batch_shares)
    if any(s.mixed_degrees for s in plan.stages):  # each replica's degree ([Note: replicas of different degrees])
        out["tp"], out["replica_tp"] = None, plan.stages[0].replica_degrees
    return out
