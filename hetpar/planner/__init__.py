"""planner: model file -> ModelGraph -> search -> ParallelPlan. Imports cost_models and runtime's graph capture.

The data flow, one sub-package per step (each ``__init__`` names what others may import):

    capture      model file -> ModelGraph: measured layers and their tensor-parallel shardings
    costing      ModelGraph + one search candidate -> cost tables, communication priced
    estimate     one configuration -> step time, memory per stage, throughput (no search)
    search       candidates, bounds and the CP-SAT split model -> the fastest ParallelPlan
    strategies   plans over the search: heterogeneous data parallelism, cost and energy
                 objectives over sub-clusters, data-parallel sync methods

and the leaves they share: plan (ParallelPlan, the plan format the rewriters read),
model_graph (ModelGraph), options (SearchOptions and their checks), errors, solver
(CP-SAT helpers). api composes them (``plan_model``: what ``hetpar plan`` runs),
explain re-estimates a plan, resume reads a checkpoint to plan from.

The names below are the planner's public API. They load on first use, so that
importing the plan format (``hetpar.planner.plan``, all the rewriters read) pulls in
neither torch nor the solver, and ``find_resume_point`` (torch.distributed.checkpoint)
only where a command resumes.
"""

from __future__ import annotations

import importlib
from typing import Any


# Public name -> the module that defines it.
_HOMES = {
    "ClusterRef": "hetpar.planner.plan",
    "ModelRef": "hetpar.planner.plan",
    "ParallelPlan": "hetpar.planner.plan",
    "Predicted": "hetpar.planner.plan",
    "SolverInfo": "hetpar.planner.plan",
    "StagePlan": "hetpar.planner.plan",
    "write_text_atomic": "hetpar.planner.plan",
    "proof_scope": "hetpar.planner.plan",
    "PlanFileError": "hetpar.planner.errors",
    "PlanningError": "hetpar.planner.errors",
    "ModelGraph": "hetpar.planner.model_graph",
    "SearchOptions": "hetpar.planner.options",
    "trace_model": "hetpar.planner.capture",
    "Traced": "hetpar.planner.trace_cache",
    "traced_model": "hetpar.planner.trace_cache",
    "Estimate": "hetpar.planner.estimate",
    "EstimateConfig": "hetpar.planner.estimate",
    "EstimateError": "hetpar.planner.estimate",
    "default_split": "hetpar.planner.estimate",
    "DataParallelSync": "hetpar.planner.strategies",
    "Objective": "hetpar.planner.strategies",
    "resolve_prices": "hetpar.planner.strategies",
    "usd_per_step": "hetpar.planner.strategies",
    "compiled_graph": "hetpar.planner.api",
    "fastest_plan": "hetpar.planner.api",
    "plan_graph": "hetpar.planner.api",
    "plan_model": "hetpar.planner.api",
    "explain_plan": "hetpar.planner.explain",
    "timeline_svg": "hetpar.planner.explain",
    "find_resume_point": "hetpar.planner.resume",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hetpar.planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
