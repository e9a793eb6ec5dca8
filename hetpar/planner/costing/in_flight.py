"""How many micro-batches' activations each chunk keeps at once, per schedule: the memory
multiplier of [Note: split objective] (costing.tables)."""

from __future__ import annotations

import functools

from hetpar.cost_models.memory import WEIGHT_GRAD_ACTIVATION_SHARE
from hetpar.runtime.schedule import Kind, build_schedule
from hetpar.vocabulary import Schedule


@functools.lru_cache(maxsize=256)
def activation_multipliers(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[float, ...]:
    """Per chunk, the most micro-batches' activations it keeps at once, as its rank's action
    list plays out (a W keeps WEIGHT_GRAD_ACTIVATION_SHARE of one after its B; [Note: zero-bubble split]).

    GPipe keeps m; 1F1B min(m, pp - s); ZB-H1, with w = min(pp - s - 1, m) warm-up forwards
    and each W s backwards late, w + 1 + share * min(m - w - 1, s) (m when m <= w). The
    interleaved schedule's are counted on its action lists; they stop growing once m
    reaches pp (v + 2) (Megatron's warm-up is at most 2 (pp - 1) + (v - 1) pp forwards),
    so larger m are counted there (tests/test_search_space.py checks both against the lists).
    """
    m = num_microbatches
    if schedule == Schedule.GPIPE:
        return tuple(float(m) for _ in range(pp))
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE):
        share = WEIGHT_GRAD_ACTIVATION_SHARE if schedule == Schedule.ZERO_BUBBLE else 0.0
        out = []
        for s in range(pp):
            w = min(pp - s - 1, m)
            out.append(float(m) if m <= w else w + 1 + share * min(m - w - 1, s))
        return tuple(out)
    return _counted_multipliers(schedule, pp, min(m, pp * (virtual_stages + 2)), virtual_stages)


def _counted_multipliers(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[float, ...]:
    """``activation_multipliers`` counted on the schedule's action lists."""
    plan = build_schedule(schedule, pp, num_microbatches, virtual_stages)
    kept_for_w = WEIGHT_GRAD_ACTIVATION_SHARE if schedule == Schedule.ZERO_BUBBLE else 0.0
    peak = [0.0] * (pp * virtual_stages)
    for actions in plan:
        live: dict[int, float] = {}
        for a in actions:
            step = {Kind.FORWARD: 1.0, Kind.BACKWARD: -(1 - kept_for_w), Kind.WEIGHT: -kept_for_w}[a.kind]
            live[a.stage] = live.get(a.stage, 0.0) + step
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return tuple(peak)
