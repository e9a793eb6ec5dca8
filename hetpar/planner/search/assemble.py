"""A solved split as a ParallelPlan with its prediction, and why nothing fit when nothing did."""

from __future__ import annotations

import math

import numpy as np

from hetpar.cost_models.memory import zero_runs
from hetpar.planner.costing import Candidate, CostTables, SplitCost, evaluate_split, model_variant, stage_memory_breakdown
from hetpar.planner.estimate import EstimateConfig, EstimateError, equal_split, estimate, stage_devices_of
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions, misfit_fix
from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan
from hetpar.vocabulary import Schedule
from hetpar.planner.search.split_model import greedy_modes


def overflow(tables: CostTables) -> float:
    bounds = equal_split(tables.num_layers, tables.num_chunks)
    cost = evaluate_split(tables, bounds, greedy_modes(tables, bounds))
    return max(m / c for m, c in zip(cost.stage_memory_bytes, tables.capacity_bytes))


def explain_misfit(model: ModelGraph, options: SearchOptions, tables: CostTables) -> str:
    cand = tables.candidate
    model = model_variant(model, {}, cp=cand.cp)
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


def stage_sharding(model: ModelGraph, first: int, last: int) -> tuple[dict, dict[str, list[int]]]:
    """The tensor-parallel sharding and fused-projection parts of a stage of layers ``first``..``last``: the union
    of its layers' (``StagePlan.tp_sharding``, ``tp_parts``)."""
    sharding, parts = {}, {}
    for l in range(first, last + 1):
        sharding.update(model.tp_sharding[l])
        parts.update({path: list(p) for path, p in (model.tp_parts[l] if model.tp_parts else {}).items()})
    return sharding, parts


def assemble_plan(model: ModelGraph, cluster, options: SearchOptions, tables: CostTables, bounds, info: SolverInfo, alternatives=(),
                  modes: list[int] | None = None) -> ParallelPlan:
    """Turn a solved split into a ParallelPlan with its predicted cost."""
    cand = tables.candidate
    modes = list(modes) if modes is not None else [0] * len(bounds)
    cost = evaluate_split(tables, bounds, modes)
    stages = []
    for c, (first, last) in enumerate(bounds):
        mode = cand.modes[modes[c]]
        sharding, parts = stage_sharding(model, first, last) if mode.tp > 1 else ({}, {})
        slot = tables.slots[c % cand.pp][mode.tp]
        stages.append(
            StagePlan(
                index=c,
                layers=list(range(first, last + 1)),
                device_type=slot.device_type,
                tensor_parallel=mode.tp,
                ranks=slot.ranks,
                tp_sharding=sharding,
                tp_parts=parts,
                zero_stage=mode.zero_stage if zero_runs(cand.dp, mode.zero_stage, mode.offload) else 0,
                recompute=mode.recompute,
                expert_parallel=cand.ep,
                sequence_parallel=mode.sp,
                context_parallel=cand.cp,
                offload=mode.offload,
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
        data_parallel=cand.data_replicas,
        dtype=options.dtype,
        stages=stages,
        predicted=predicted,
        solver=info,
        alternatives=list(alternatives),
        virtual_stages=cand.virtual_stages,
        expert_imbalance=options.expert_imbalance,
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
        global_batch_size=options.global_batch_size, dp=cand.data_replicas, tp=degrees[0], pp=cand.pp,
        micro_batch_size=cand.micro_batch_size, dtype=options.dtype, schedule=cand.schedule, virtual_stages=cand.virtual_stages,
        optimizer=options.optimizer, stage_layers=tuple(b - a + 1 for a, b in bounds),
        stage_devices=stage_devices_of([s.ranks for s in ranks], cluster.device_types()),
        stage_recompute=tuple(s.recompute for s in stages), stage_zero=tuple(s.zero_stage for s in ranks),
        stage_tp=degrees if len(set(degrees)) > 1 else None, sync=cand.sync, ep=cand.ep,
        expert_imbalance=options.expert_imbalance, cp=cand.cp, stage_sp=tuple(s.sequence_parallel for s in ranks),
        stage_offload=tuple(s.offload for s in ranks),
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
