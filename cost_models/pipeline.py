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

SCHEDULES = ("1f1b", "gpipe")  # what the search enumerates and the runtime runs
ALL_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb")  # what the estimator simulates

# [Note: pipeline bubble closed forms]
# For p equal stages whose micro-batch takes t_f forward and t_b backward (t_b = B + W
# for zero-bubble schedules, t_w its W part), m micro-batches, no transfer time:
#   GPipe, 1F1B:         bubble = (p - 1)(t_f + t_b)            (Narayanan et al. 2021, 2.2.1)
#   interleaved, v chunks: bubble = (p - 1)(t_f + t_b) / v      (Narayanan et al. 2021, 2.2.2; m a multiple of p)
#   ZB-H1:               bubble = (p - 1)(t_f + t_b - 2 t_w)    (Qi et al. 2023, with t_b = t_B + t_W:
#                                                              their (p - 1)(T_F + T_B - T_W); m >= p)
# and the step is m (t_f + t_b) + bubble, so bubble / ideal = (p - 1) / m for 1F1B and
# (p - 1) / (v m) interleaved. runtime.schedule.simulate_timed must agree with these
# for equal stages (tests/test_simulator.py); it also handles the unequal ones.


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


def bubble_time_s(
    schedule: str, *, num_stages: int, num_microbatches: int, fwd_s: float, bwd_s: float,
    weight_s: float = 0.0, virtual_stages: int = 1,
) -> float:
    """Closed-form bubble of ``schedule`` for equal stages; see [Note: pipeline bubble closed forms].

    Args:
        schedule: one of ALL_SCHEDULES.
        num_stages: pipeline ranks p.
        num_microbatches: m (only the ZB-H1 formula needs m >= p; it is not checked).
        fwd_s: forward seconds of one micro-batch on one stage (all of the rank's chunks together).
        bwd_s: backward seconds, B and W together.
        weight_s: the W part of ``bwd_s`` (zero-bubble only).
        virtual_stages: v chunks per rank (interleaved only).

    Raises:
        ValueError: unknown schedule.
    """
    p = num_stages
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) * (fwd_s + bwd_s)
    if schedule == "interleaved":
        return (p - 1) * (fwd_s + bwd_s) / virtual_stages
    if schedule == "zb":
        return (p - 1) * (fwd_s + bwd_s - 2 * weight_s)
    raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(ALL_SCHEDULES)}")
