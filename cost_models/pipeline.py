"""Step time of a pipeline schedule from per-stage micro-batch times.

[Note: pipeline step time]
With p stages whose forward+backward of one micro-batch take t_s (p2p sends
included) and m micro-batches, GPipe and 1F1B both take

    T = sum_s t_s + (m - 1) * max_s t_s

The first micro-batch walks through every stage (sum), and the slowest stage paces
the other m - 1 (Alpa, Zheng et al. 2022, Eq. 2; for equal stages this is Megatron's
(m + p - 1) * t, bubble fraction (p - 1) / m). The gradient all-reduce that follows
the last backward is added once, at the pace of the slowest stage's data-parallel
group. 1F1B keeps at most p - s micro-batches in flight on stage s (Narayanan et al.
2021, section 2.2.1); GPipe keeps all m.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """A step's time and how it splits."""

    step_time_s: float
    compute_time_s: float  # m * slowest stage: the ideal, bubble-free part
    bubble_time_s: float
    dp_comm_time_s: float


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at the peak."""
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b":
        return min(num_microbatches, num_stages - stage)
    raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def pipeline_step_time(stage_times_s: list[float], num_microbatches: int, dp_sync_s: list[float]) -> StepTime:
    """Step time of GPipe/1F1B; see [Note: pipeline step time].

    Args:
        stage_times_s: forward + backward (+ p2p) seconds of one micro-batch, per stage.
        num_microbatches: m.
        dp_sync_s: gradient all-reduce seconds per stage (0 without data parallelism).
    """
    slowest = max(stage_times_s)
    total = sum(stage_times_s) + (num_microbatches - 1) * slowest
    dp = max(dp_sync_s) if dp_sync_s else 0.0
    compute = num_microbatches * slowest
    return StepTime(step_time_s=total + dp, compute_time_s=compute, bubble_time_s=total - compute, dp_comm_time_s=dp)
