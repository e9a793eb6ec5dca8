"""Estimate a plan the user gives: step time, memory per stage, throughput and MFU.

``estimate(model, cluster, config)`` scores one configuration (what-if: "what would my
hand-tuned Megatron setting do?") without searching. It lays ranks out, costs every
layer on its stage's device ([Note: layer time] in cost_models/compute.py), plays the
pipeline schedule action by action (``runtime.schedule.simulate_timed``) with
point-to-point transfers between stages, adds the data-parallel gradient
synchronisation that the schedule does not hide and the optimizer step, and counts
memory per stage with ZeRO, recompute and the schedule's in-flight micro-batches
(cost_models/memory.py). ``hetpar estimate`` wraps it.

The pieces: config (``EstimateConfig``), layout ([Note: estimate rank layout]),
step_costs, schedule_play, memory, report ([Note: estimate time breakdown]).
"""

from __future__ import annotations

from dataclasses import fields

from hetpar.cost_models.cluster import Cluster
from hetpar.planner.estimate.config import EstimateConfig, EstimateError
from hetpar.planner.estimate.layer_split import StageSplit
from hetpar.planner.estimate.layout import check_against, stage_layout, stage_split
from hetpar.planner.estimate.memory import rank_memory
from hetpar.planner.estimate.report import Estimate, StageEstimate, TimeBreakdown
from hetpar.planner.estimate.schedule_play import Played, play
from hetpar.planner.estimate.step_costs import chunk_cost, dp_sync_s, optimizer_s, stage_params, synced_params
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.plan import Predicted
from hetpar.runtime.schedule import Kind


def estimate(model: ModelGraph, cluster: Cluster, config: EstimateConfig, *, breakdown: bool = True,
             memo: dict | None = None) -> Estimate:
    """Predict step time, memory per stage and throughput of ``config`` for ``model`` on ``cluster``.

    Args:
        model: the traced model (planner.capture.trace_model).
        cluster: the cluster (cost_models.cluster.parse_cluster).
        config: the parallel configuration.
        breakdown: tell pipeline transfers apart from the bubble, which takes a second
            simulation of the schedule without them; False counts them in the bubble
            (``pp_comm_s`` 0) and leaves the step time as it is, for callers that
            compare step times by the thousand (planner.strategies.hetero_dp).
        memo: the tensor-parallel collectives' seconds by layer kind, group and size, and
            the chunks' action seconds by configuration (but the number of micro-batches),
            kept across calls on one ``cluster`` and ``model`` by a caller that makes many;
            a fresh one per call by default.

    Returns:
        The estimate; ``fits`` says whether every stage fits its devices' memory.

    Raises:
        EstimateError: the configuration does not match the model or the cluster.
        cost_models.devices.ProfileError: a device lacks the training dtype.
    """
    check_against(model, cluster, config)
    whole = model
    model = model.at_context(config.cp)  # [Note: context parallelism costs] in cost_models/collectives.py
    if config.replica_batch_shares is not None or config.replica_tp is not None:  # hetero_dp builds on this module
        raise EstimateError("replica_batch_shares: estimate the plan with planner.strategies.hetero_dp.estimate_shares")
    layouts = stage_layout(cluster, config)
    split = stage_split(model, config)
    bounds = split.bounds
    memo = {} if memo is None else memo
    # a chunk's action seconds depend on everything but the number of micro-batches: kept across a caller's calls
    shape = ("chunk costs", tuple((f.name, repr(getattr(config, f.name))) for f in fields(config) if f.name != "global_batch_size"))
    if shape not in memo:
        memo[shape] = [chunk_cost(model, cluster, config, b, layouts[k % config.pp], k, memo) for k, b in enumerate(bounds)]
    costs = memo[shape]
    played = play(model, cluster, config, layouts, bounds, costs, breakdown)
    stages = [_stage_estimate(model, config, layouts, bounds, played, r) for r in range(config.pp)]
    return _assemble(model, cluster, config, layouts, split, played, stages, costs, whole)


def _stage_estimate(model, config, layouts, bounds, played: Played, r: int) -> StageEstimate:
    chunks = [k for k in range(len(bounds)) if k % config.pp == r]
    actions = played.schedule[r]
    m = config.num_microbatches
    fwd = sum(sum(played.parts[a.stage, a.kind]) for a in actions if a.kind is Kind.FORWARD) / m
    bwd = sum(sum(played.parts[a.stage, a.kind]) for a in actions if a.kind is not Kind.FORWARD) / m
    return StageEstimate(
        index=r,
        chunks=[bounds[k] for k in chunks],
        device_type=layouts[r].device_type,
        ranks=layouts[r].ranks,
        fwd_s=fwd,
        bwd_s=bwd,
        peak_in_flight=played.run.peak_in_flight(r),
        memory=rank_memory(model, config, bounds, chunks, actions),
        capacity_bytes=layouts[r].memory_bytes,
    )


def _assemble(model, cluster, config, layouts, split: StageSplit, played: Played, stages: list[StageEstimate],
              costs, whole: ModelGraph) -> Estimate:
    c, run = config, played.run
    params = [stage_params(model, c.tp_of(s.index), s.chunks, c.ep) for s in stages]
    synced = [synced_params(model, c.tp_of(s.index), s.chunks, c.dp, c.ep) for s in stages]
    dp_s = [_exposed_dp_s(dp_sync_s(synced[r], cluster, c, layouts[r], c.zero_of(r)), played, r, c) for r in range(c.pp)]
    pipeline_end = max(run.end_s(r) for r in range(c.pp))
    dp = max(run.end_s(r) + dp_s[r] for r in range(c.pp)) - pipeline_end
    busiest = max(range(c.pp), key=run.busy_s)
    compute, tp, zero3 = (sum(played.parts[t.action.stage, t.action.kind][i] for t in run.rank(busiest)) for i in range(3))
    ep = sum(costs[t.action.stage].ep_seconds(t.action.kind) for t in run.rank(busiest))
    cp = sum(costs[t.action.stage].cp_seconds(t.action.kind) for t in run.rank(busiest))
    host = sum(costs[t.action.stage].host_seconds(t.action.kind) for t in run.rank(busiest))
    tp -= ep + cp
    alone = played.run_without_transfers
    pp = max(0.0, run.end_s(busiest) - alone.end_s(busiest)) if alone is not None else 0.0
    def count(s: StageEstimate, attribute: str) -> int:
        return sum(getattr(model.layers[l], attribute) for first, last in s.chunks for l in range(first, last + 1))

    tensors = [count(s, "param_tensors") for s in stages]
    sharded = [count(s, "tp_sharded_tensors") if c.tp_of(s.index) > 1 else 0 for s in stages]
    optimizer = max(optimizer_s(params[r], tensors[r], sharded[r], cluster.profile(layouts[r].device_type), c, c.zero_of(r),
                                c.offload_of(r))
                    for r in range(c.pp))
    # The busiest rank's busy time never exceeds the makespan; max() drops a rounding error's -1e-21.
    time = TimeBreakdown(compute_s=compute, bubble_s=max(0.0, pipeline_end - compute - tp - ep - cp - zero3 - pp), tp_comm_s=tp,
                         pp_comm_s=pp, dp_comm_s=dp + zero3 - host, optimizer_s=optimizer, ep_comm_s=ep, cp_comm_s=cp,
                         host_comm_s=host)
    step = time.step_s
    flops = sum(l.fwd_flops + l.bwd_flops for l in whole.layers) * c.global_batch_size
    peak = sum(cluster.profile(t).peak_flops(c.dtype) for t in cluster.device_types())
    predicted = Predicted(
        step_time_s=step,
        throughput_samples_per_s=c.global_batch_size / step,
        peak_memory_bytes=[int(s.memory.total_bytes) for s in stages],
        compute_time_s=time.compute_s + time.optimizer_s,
        bubble_time_s=time.bubble_s,
        dp_comm_time_s=time.dp_comm_s,
        pp_comm_time_s=time.pp_comm_s,
        tp_comm_time_s=time.tp_comm_s,
        ep_comm_time_s=time.ep_comm_s,
        cp_comm_time_s=time.cp_comm_s,
        host_comm_time_s=time.host_comm_s,
        stage_fwd_s=[s.fwd_s for s in stages],
        stage_bwd_s=[s.bwd_s for s in stages],
    )
    return Estimate(config=c, cluster_spec=cluster.spec, world_size=cluster.world_size, predicted=predicted, time=time,
                    stages=stages, model_flops_per_step=flops, tflops_per_device=flops / step / cluster.world_size / 1e12,
                    mfu=flops / step / peak, busiest_rank=busiest, layout=split.layout, timeline=played.run)


def _exposed_dp_s(sync_s: float, played: Played, r: int, config: EstimateConfig) -> float:
    """What of a rank's gradient synchronisation the step waits for; the last backward hides some with overlap."""
    if not config.overlap_grad_reduce:
        return sync_s
    last = next(t for t in reversed(played.run.rank(r)) if t.action.kind is not Kind.FORWARD)
    return max(0.0, sync_s - (last.end_s - last.start_s))
