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

from hetpar.vocabulary import Schedule


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


# [Note: linear step time]
# The search needs each schedule's step time as a linear function of per-stage sums
# and maxima, which CP-SAT optimises exactly; planner.estimate then simulates the plan
# it picks. With p pipeline ranks, v chunks per rank (C = p v chunks in layer order,
# chunk c on rank c mod p), m micro-batches, and per chunk c: t_c the forward and
# backward of one micro-batch (its p2p sends, its exposed ZeRO-3 gathers included)
# and w_c the weight-gradient (W) part of it, and per rank r: e_r its epilogue
# (gradient synchronisation and optimizer step):
#
#   GPipe, 1F1B:  T = sum_c t_c + (m - 1) max_c t_c + max_r e_r
#   interleaved:  T = (1/v) sum_c t_c + (m - 1/v) sum_j max_r t_{j p + r} + max_r e_r
#   ZB-H1:        T = sum_c t_c - (1 + k/p) sum_c w_c + (m - 1) max_c t_c + max_c w_c + max_r e_r,
#                 k = min(m, p) - 1
#
# Each is exact for equal stages (it reduces to m t + the closed-form bubble of
# [Note: pipeline bubble closed forms]; for ZB-H1 with m < p, W can fill only m - 1
# bubbles) and tracks runtime.schedule.simulate_timed on unequal ones:
# - 1F1B: the first micro-batch walks every stage, the slowest stage paces the other
#   m - 1 (Alpa's Eq. 2). An upper bound of the simulated makespan: 1F1B lets a slow
#   first stage run ahead (tests/test_simulator.py).
# - Interleaved: a micro-batch walks all C chunks once, at 1/v of a rank's work per
#   chunk round; in the steady state micro-batches pass chunk round j at the pace of its
#   slowest chunk, so a micro-batch costs sum_j max_r t_{jp+r} (>= the busiest rank's
#   total; equal to it when the chunks of each round are equal).
# - ZB-H1: as 1F1B, but during the warm-up and cool-down each stage fills up to k of
#   its bubbles with W (on average k/p of the stages' W each) and the first micro-batch
#   waits for no W except the last one's.
# On random stages up to threefold unequal they stay within about -10%..+35% of the simulated
# makespan (tests/test_search_space.py checks the equal-stage identities and a band).
# GPipe's T equals 1F1B's and its memory is never lower, so the search offers GPipe
# only when it is pinned.
@dataclass(frozen=True, kw_only=True)
class LinearStepWeights:
    """Integer weights of [Note: linear step time], all multiplied by ``scale`` = p v."""

    scale: int
    chunk_sum: int  # on sum_c t_c
    weight_sum: int  # subtracted: on sum_c w_c (ZB-H1)
    round_max: int  # on sum_j max_r t_{j p + r} (max_c t_c when v = 1)
    weight_max: int  # on max_c w_c (ZB-H1)
    epilogue_max: int  # on max_r e_r


def linear_step_weights(schedule: str, *, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> LinearStepWeights:
    """The weights of ``schedule``'s linear step time; see [Note: linear step time].

    Raises:
        ValueError: unknown schedule, or virtual stages with a schedule that has none.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule not in tuple(Schedule):
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(Schedule)}")
    if v != 1 and schedule != Schedule.INTERLEAVED:
        raise ValueError(f"virtual stages ({v}) need the interleaved schedule, not {schedule!r}")
    scale = p * v
    zb = schedule == Schedule.ZERO_BUBBLE
    k = min(m, p) - 1
    return LinearStepWeights(scale=scale, chunk_sum=p, weight_sum=(p + k) if zb else 0, round_max=p * (v * m - 1),
                             weight_max=p if zb else 0, epilogue_max=scale)


def linear_step_time_s(
    schedule: str, *, num_stages: int, num_microbatches: int, chunk_time_s: list[float], rank_epilogue_s: list[float],
    chunk_weight_s: list[float] | None = None, virtual_stages: int = 1,
) -> float:
    """[Note: linear step time] of one split, in seconds.

    Args:
        chunk_time_s: t_c per chunk in layer order (p v of them).
        rank_epilogue_s: e_r per pipeline rank.
        chunk_weight_s: w_c per chunk (ZB-H1 only).
    """
    p, v = num_stages, virtual_stages
    wt = linear_step_weights(schedule, num_stages=p, num_microbatches=num_microbatches, virtual_stages=v)
    w = chunk_weight_s or [0.0] * len(chunk_time_s)
    rounds = sum(max(chunk_time_s[j * p : (j + 1) * p]) for j in range(v))
    total = (wt.chunk_sum * sum(chunk_time_s) - wt.weight_sum * sum(w) + wt.round_max * rounds
             + wt.weight_max * max(w) + wt.epilogue_max * max(rank_epilogue_s))
    return total / wt.scale


def bubble_time_s(
    schedule: str, *, num_stages: int, num_microbatches: int, fwd_s: float, bwd_s: float,
    weight_s: float = 0.0, virtual_stages: int = 1,
) -> float:
    """Closed-form bubble of ``schedule`` for equal stages; see [Note: pipeline bubble closed forms].

    Args:
        schedule: a Schedule.
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
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        return (p - 1) * (fwd_s + bwd_s)
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) * (fwd_s + bwd_s) / virtual_stages
    if schedule == Schedule.ZERO_BUBBLE:
        return (p - 1) * (fwd_s + bwd_s - 2 * weight_s)
    raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(Schedule)}")
