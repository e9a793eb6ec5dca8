"""The pipeline schedule of an estimate, played action by action with its transfers
(``runtime.schedule.simulate_timed``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hetpar.planner.estimate.config import EstimateError
from hetpar.planner.estimate.step_costs import ChunkCost, boundary_s
from hetpar.runtime.schedule import Action, Kind, ScheduleError, TimedRun, build_schedule, simulate_timed
from hetpar.vocabulary import Schedule


@dataclass(frozen=True, kw_only=True)
class Played:
    schedule: list[list[Action]]
    run: TimedRun
    run_without_transfers: TimedRun | None  # None: not simulated (``estimate(breakdown=False)``)
    parts: dict[tuple[int, Kind], tuple[float, float, float]]  # (stage, kind) -> (compute, tensor-parallel, exposed ZeRO-3) seconds


@functools.lru_cache(maxsize=32)
def _schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """``build_schedule``, kept: the heterogeneous data-parallel plan estimates the same schedule thousands of
    times (the lists are only read here)."""
    return build_schedule(name, pp, num_microbatches, virtual_stages)


def play(model, cluster, config, layouts, bounds, costs: list[ChunkCost], breakdown: bool = True) -> Played:
    try:
        plan = _schedule(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    except ScheduleError as exc:
        raise EstimateError(str(exc)) from None
    split = config.schedule == Schedule.ZERO_BUBBLE
    parts = {(k, kind): costs[k].seconds(kind, split) for k in range(len(costs)) for kind in Kind}
    totals = {key: sum(value) for key, value in parts.items()}
    hop = [boundary_s(model, cluster, config, bounds[k][1], layouts[k % config.pp], layouts[(k + 1) % config.pp])
           for k in range(len(bounds) - 1)]

    def transfer(sender: Action, receiver: Action) -> float:
        return hop[min(sender.stage, receiver.stage)]

    def duration(action: Action) -> float:
        return totals[action.stage, action.kind]

    # [Note: late receives] in runtime/schedule.py: measured on the sender's host
    late = [getattr(cluster.profile(layouts[k % config.pp].device_type), "late_receive_s", None) or 0.0
            for k in range(len(bounds))]
    return Played(schedule=plan, run=simulate_timed(plan, duration, transfer, (lambda a: late[a.stage]) if any(late) else None),
                   run_without_transfers=simulate_timed(plan, duration) if breakdown else None, parts=parts)
