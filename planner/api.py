"""The planner as one library call: model file + cluster -> ParallelPlan. ``hetpar plan`` wraps it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from cost_models.cluster import Cluster
from planner.plan import ParallelPlan
from planner.search import SearchOptions, search
from planner.trace import ModelGraph, trace_model
from runtime.model_file import load_model_file


def plan_model(
    model_path: str | Path,
    cluster: Cluster,
    options: SearchOptions,
    *,
    model_args: dict[str, Any] | None = None,
    leaf_modules: tuple[str, ...] = (),
    on_traced: Callable[[ModelGraph], None] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """Trace the model of ``model_path`` on the meta device and search for the fastest plan.

    Args:
        on_traced: called with the ModelGraph once tracing is done (for progress display).
        progress: called as (done, total, description) while candidates are solved.

    Raises:
        runtime.model_file.ModelFileError, runtime.graph.TraceError, planner.search.PlanningError.
    """
    graph = trace_model(load_model_file(model_path, model_args or {}), tuple(leaf_modules))
    if on_traced:
        on_traced(graph)
    plan = search(graph, cluster, options, progress=progress)
    return replace(plan, model=replace(plan.model, leaf_modules=list(leaf_modules)))
