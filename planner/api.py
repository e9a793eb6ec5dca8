"""The planner as one library call: model file + cluster -> ParallelPlan. ``hetpar plan`` wraps it."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from cost_models.cluster import Cluster
from cost_models.compute import compiled_layer
from planner.hetero_dp import hetero_dp_plan
from planner.objective import Objective, cheapest_plan
from planner.plan import ParallelPlan
from planner.options import PlanningError, SearchOptions
from planner.search import search
from planner.trace import ModelGraph, trace_model
from runtime.model_file import load_model_file

HETERO_DP_CHOICES = ("auto", "on", "off")  # consider heterogeneous data parallelism on mixed clusters; force it; never


def plan_model(
    model_path: str | Path,
    cluster: Cluster,
    options: SearchOptions,
    *,
    model_args: dict[str, Any] | None = None,
    leaf_modules: tuple[str, ...] = (),
    objective: Objective | None = None,
    hetero_dp: str = "auto",
    on_traced: Callable[[ModelGraph], None] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """Trace the model of ``model_path`` on the meta device and plan it on ``cluster``.

    Args:
        objective: fastest on all devices (default), or cheapest per step over sub-clusters;
            either with a throughput target (planner.objective).
        hetero_dp: "auto" also tries replicas of one device type each on a mixed cluster
            and keeps the faster plan; "on" plans only that way; "off" never.
        on_traced: called with the ModelGraph once tracing is done (for progress display).
        progress: called as (done, total, description) while candidates are solved.

    Raises:
        runtime.model_file.ModelFileError, runtime.graph.TraceError, planner.search.PlanningError.
    """
    start = time.perf_counter()
    graph = trace_model(load_model_file(model_path, model_args or {}), tuple(leaf_modules))
    trace_time_s = round(time.perf_counter() - start, 3)
    if on_traced:
        on_traced(graph)
    plan = plan_graph(graph, cluster, options, objective=objective, hetero_dp=hetero_dp, progress=progress)
    return replace(plan, model=replace(plan.model, leaf_modules=list(leaf_modules)),
                   solver=replace(plan.solver, trace_time_s=trace_time_s))


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
    hetero_dp: str = "auto",
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """``plan_model`` on a traced model.

    Raises:
        PlanningError: nothing fits, the pins are impossible, or the objective cannot be met; says why.
    """
    objective = objective or Objective()
    if options.compiled:
        graph = compiled_graph(graph)
    if hetero_dp not in HETERO_DP_CHOICES:
        raise PlanningError(f"unknown --hetero-dp {hetero_dp!r}; use one of {', '.join(HETERO_DP_CHOICES)}")

    def solve(model: ModelGraph, on: Cluster, opts: SearchOptions, progress=None) -> ParallelPlan:
        return fastest_plan(model, on, opts, hetero_dp=hetero_dp, progress=progress)

    if objective.kind == "cost":
        plan = cheapest_plan(graph, cluster, options, objective, solve=solve, hetero_dp=hetero_dp, progress=progress)
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
    hetero_dp: str = "auto",
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """The faster of the search's plan and the heterogeneous data-parallel plan (planner.hetero_dp).

    The other one, when there is one, is recorded first among the plan's ``alternatives``.

    Raises:
        PlanningError: neither kind of plan fits (the search's reason), or ``hetero_dp`` is
            "on" and heterogeneous data parallelism does not apply (its reason).
    """
    if hetero_dp == "on":
        return hetero_dp_plan(graph, cluster, options)
    if hetero_dp == "off" or len(cluster.count_by_type()) < 2:
        return search(graph, cluster, options, progress=progress)
    try:
        searched = search(graph, cluster, options, progress=progress)
    except PlanningError as exc:
        try:
            return hetero_dp_plan(graph, cluster, options)
        except PlanningError:
            raise exc from None
    try:
        hetero = hetero_dp_plan(graph, cluster, options)
    except PlanningError:
        return searched
    faster, other = (hetero, searched) if hetero.predicted.step_time_s < searched.predicted.step_time_s else (searched, hetero)
    return replace(faster, alternatives=[plan_summary(other), *faster.alternatives])


def plan_summary(plan: ParallelPlan) -> dict[str, Any]:
    """A plan as one entry of another plan's ``alternatives``: its degrees, split and predicted step."""
    kind = "hetero_dp" if plan.replica_batch_shares is not None else "pipeline"
    out = {
        "kind": kind, "dp": plan.data_parallel, "tp": plan.stages[0].tensor_parallel, "pp": plan.pipeline_parallel,
        "micro_batch_size": plan.micro_batch_size, "schedule": plan.schedule.value, "recompute": plan.stages[0].recompute,
        "stage_layers": [len(s.layers) for s in plan.stages], "stage_devices": [s.device_type for s in plan.stages],
        "step_time_s": plan.predicted.step_time_s,
    }
    if plan.replica_batch_shares is not None:
        out["replica_batch_shares"] = list(plan.replica_batch_shares)
    return out
