"""Explain a plan: re-trace its model, estimate it, and draw its schedule timeline.

``hetpar explain`` wraps ``explain_plan`` and ``timeline_svg``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from html import escape
from pathlib import Path

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import compiled_layer
from hetpar.planner.errors import PlanFileError
from hetpar.planner.estimate import Estimate, EstimateConfig, EstimateError, estimate, stage_devices_of
from hetpar.planner.plan import ParallelPlan
from hetpar.planner.strategies import cost_method, estimate_shares, matrix_width
from hetpar.planner.trace_cache import traced_model
from hetpar.runtime.model_file import file_fingerprint
from hetpar.runtime.schedule import Kind, TimedRun
from hetpar.vocabulary import CompressionKind, Optimizer


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """A plan with the estimate of its configuration (breakdowns and the simulated schedule)."""

    plan: ParallelPlan
    estimate: Estimate
    plain_dp_comm_s: float  # the same plan's data-parallel communication under a plain all-reduce


def explain_plan(plan: ParallelPlan, profiles: dict | None = None) -> Explanation:
    """Estimate ``plan`` again from its model file and cluster (with ``profiles``, device
    name -> profile, in place of the built-in ones, as ``parse_cluster`` takes them).

    Raises:
        PlanFileError: the plan's model file is gone or changed since planning.
    """
    graph = plan_graph_of(plan)
    cluster = parse_cluster(plan.cluster.spec, profiles=profiles)
    config = estimate_config(plan, graph)
    # replicas of different device types or tensor-parallel degrees: planner.strategies.hetero_dp
    predict = estimate if config.replica_batch_shares is None and config.replica_tp is None else estimate_shares
    result = predict(graph, cluster, config)
    plain = result if config.sync.plain else predict(graph, cluster, replace(config, sync=replace(config.sync, kind=CompressionKind.NONE)))
    return Explanation(plan=plan, estimate=result, plain_dp_comm_s=plain.time.dp_comm_s)


def plan_graph_of(plan: ParallelPlan):
    """The ModelGraph ``plan`` was costed on: its model file traced again (compiled stages'
    layers where the plan compiles them).

    Raises:
        PlanFileError: the plan's model file is gone or changed since planning.
    """
    path = Path(plan.model.file)
    if not path.is_file():
        raise PlanFileError(f"the plan's model file {str(path)!r} is gone; re-run hetpar plan")
    if file_fingerprint(path) != plan.model.fingerprint:
        raise PlanFileError(f"model file {str(path)!r} changed since planning; re-run hetpar plan")
    graph = traced_model(path, plan.model.args, tuple(plan.model.leaf_modules)).graph
    if plan.compiled:  # costed as the plan was: compiled stages' fused kernels ([Note: compiled stages])
        graph = replace(graph, layers=[compiled_layer(layer) for layer in graph.layers])
    return graph


def estimate_config(plan: ParallelPlan, graph) -> EstimateConfig:
    """``plan``'s configuration as ``estimate`` takes it (``graph``: the plan's model, traced)."""
    ranks = plan.stages[: plan.pipeline_parallel]  # with virtual stages, stages[s] runs on ranks[s % pp]
    if any(s.replica_degrees != ranks[0].replica_degrees for s in ranks) and any(s.mixed_degrees for s in ranks):
        raise EstimateError(f"the replicas' tensor-parallel degrees differ from stage to stage "
                            f"({[s.replica_degrees for s in ranks]}): hetpar estimates replicas of different degrees "
                            f"where each replica has one degree on every stage")
    return EstimateConfig(
        global_batch_size=plan.global_batch_size,
        dp=plan.data_parallel,
        tp=ranks[0].tensor_parallel,
        pp=plan.pipeline_parallel,
        micro_batch_size=plan.micro_batch_size,
        dtype=plan.dtype,
        schedule=plan.schedule.value,
        virtual_stages=plan.virtual_stages,
        stage_layers=tuple(len(s.layers) for s in plan.stages),
        stage_devices=stage_devices_of([s.ranks for s in ranks], plan.cluster.device_types),
        stage_recompute=tuple(s.recompute for s in plan.stages),
        stage_zero=tuple(s.zero_stage for s in ranks),
        stage_tp=tuple(s.tensor_parallel for s in ranks) if len({s.tensor_parallel for s in ranks}) > 1 else None,
        replica_batch_shares=tuple(plan.replica_batch_shares) if plan.replica_batch_shares is not None else None,
        replica_tp=tuple(ranks[0].replica_degrees) if any(s.mixed_degrees for s in ranks) else None,
        sync=cost_method(plan.grad_compression, plan.aggregation, plan.sync_every, plan.sync_scope, optimizer=Optimizer.ADAMW,
                         width=matrix_width(graph.layers)),
        ep=max(s.expert_parallel for s in plan.stages),
        expert_imbalance=plan.expert_imbalance,
        cp=plan.context_parallel,
        stage_sp=tuple(s.sequence_parallel for s in ranks),
        stage_offload=tuple(s.offload for s in ranks),
    )


_COLOURS = {Kind.FORWARD: "#4e79a7", Kind.BACKWARD: "#59a14f", Kind.WEIGHT: "#8cd17d"}
_ROW_PX, _LABEL_PX, _WIDTH_PX = 28, 90, 900


def timeline_svg(run: TimedRun, stage_labels: list[str], title: str) -> str:
    """An SVG picture of a simulated schedule: one row per stage, F and B blocks, bubbles blank.

    Forward blocks are blue, backward green, weight-gradient (zero-bubble W) light green;
    each block is labelled with its micro-batch.
    """
    span = run.makespan_s or 1.0
    scale = (_WIDTH_PX - _LABEL_PX - 10) / span
    height = 40 + _ROW_PX * len(run.ranks) + 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH_PX}" height="{height}" font-family="sans-serif" font-size="11">',
        f'<text x="8" y="18" font-size="13">{escape(title)}</text>',
    ]
    for row, timed in enumerate(run.ranks):
        y = 30 + row * _ROW_PX
        parts.append(f'<text x="8" y="{y + 17}">{escape(stage_labels[row])}</text>')
        parts.append(f'<rect x="{_LABEL_PX}" y="{y}" width="{span * scale:.1f}" height="{_ROW_PX - 4}" fill="#f2f2f2"/>')
        for t in timed:
            x, w = _LABEL_PX + t.start_s * scale, max((t.end_s - t.start_s) * scale, 0.5)
            colour = _COLOURS[t.action.kind]
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_ROW_PX - 4}" fill="{colour}" stroke="white" stroke-width="0.5">'
                f"<title>{escape(str(t.action))} {t.start_s * 1e3:.3f}-{t.end_s * 1e3:.3f} ms</title></rect>"
            )
            if w > 12:
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 16}" fill="white" text-anchor="middle">{t.action.microbatch}</text>')
    axis_y = 30 + _ROW_PX * len(run.ranks) + 14
    parts.append(f'<text x="{_LABEL_PX}" y="{axis_y}">0</text>')
    parts.append(f'<text x="{_WIDTH_PX - 10}" y="{axis_y}" text-anchor="end">{span * 1e3:.2f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
