"""The timed schedule simulator: closed-form bubbles for equal stages, hand-derived unequal cases."""

import random

import pytest

from hetpar.cost_models.pipeline import bubble_time_s
from hetpar.runtime import schedule
from hetpar.runtime.schedule import Kind, ScheduleError

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


def durations(fwd_s, bwd_s, weight_s=0.0, chunks=1):
    """Per-action seconds: a rank's work split evenly over its chunks; B without W when W is separate."""
    per_kind = {Kind.FORWARD: fwd_s / chunks, Kind.BACKWARD: (bwd_s - weight_s) / chunks, Kind.WEIGHT: weight_s / chunks}
    return lambda action: per_kind[action.kind]


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_one_f_one_b_and_gpipe_bubble_is_the_closed_form(name, p, m):
    fwd_s, bwd_s = 1.0, 2.0
    run = schedule.simulate_timed(schedule.build_schedule(name, p, m), durations(fwd_s, bwd_s))
    bubble = bubble_time_s(name, num_stages=p, num_microbatches=m, fwd_s=fwd_s, bwd_s=bwd_s)
    assert run.makespan_s == pytest.approx(m * (fwd_s + bwd_s) + bubble)
    # Megatron's bubble fraction: bubble / ideal = (p - 1) / m.
    assert (run.makespan_s - m * (fwd_s + bwd_s)) / (m * (fwd_s + bwd_s)) == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_the_closed_form_over_v(p, m, v):
    fwd_s, bwd_s = 1.0, 2.0
    run = schedule.simulate_timed(schedule.build_schedule("interleaved", p, m, v), durations(fwd_s, bwd_s, chunks=v))
    ideal = m * (fwd_s + bwd_s)
    assert run.makespan_s == pytest.approx(ideal + (p - 1) * (fwd_s + bwd_s) / v)
    assert (run.makespan_s - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert run.makespan_s == pytest.approx(
        ideal + bubble_time_s("interleaved", num_stages=p, num_microbatches=m, fwd_s=fwd_s, bwd_s=bwd_s, virtual_stages=v)
    )


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.3, 0.9, 0.7)])
def test_zero_bubble_h1_bubble_is_the_closed_form(p, m, t_f, t_b, t_w):
    run = schedule.simulate_timed(schedule.build_schedule("zb", p, m), durations(t_f, t_b + t_w, t_w))
    assert run.makespan_s == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w))
    one_f_one_b = schedule.simulate_timed(schedule.build_schedule("1f1b", p, m), durations(t_f, t_b + t_w))
    assert run.makespan_s <= one_f_one_b.makespan_s + 1e-9


def test_unequal_stages_and_transfers_by_hand():
    # Stage 1 is twice as slow; every send takes 0.5 s. Rank 0: F0 [0,1] F1 [1,2]; rank 1:
    # F0 [1.5,3.5] B0 [3.5,7.5] F1 [7.5,9.5] B1 [9.5,13.5]; rank 0: B0 waits for 7.5 + 0.5 -> [8,10],
    # B1 for 13.5 + 0.5 -> [14,16].
    fwd, bwd = [1.0, 2.0], [2.0, 4.0]
    run = schedule.simulate_timed(
        schedule.one_f_one_b(2, 2),
        lambda a: fwd[a.stage] if a.kind is Kind.FORWARD else bwd[a.stage],
        lambda sender, receiver: 0.5,
    )
    assert [(str(t.action), t.start_s, t.end_s) for t in run.ranks[0]] == [
        ("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 8.0, 10.0), ("0B1", 14.0, 16.0)]
    assert [(str(t.action), t.start_s) for t in run.ranks[1]] == [("1F0", 1.5), ("1B0", 3.5), ("1F1", 7.5), ("1B1", 9.5)]
    assert run.makespan_s == 16.0 and run.busy_s(1) == 12.0 and run.end_s(1) == 13.5


def test_a_late_receive_from_a_computing_sender_waits_for_it_by_hand():
    # GPipe, 3 micro-batches, every action 1 s on rank 0 and 1.5 s on rank 1, no transfer
    # time, 0.5 s per late receive ([Note: late receives]). Rank 0: F0 [0,1] F1 [1,2]
    # F2 [2,3]. Rank 1: F0 waits from 0 for the send at 1 (posted first: free) -> [1,2.5];
    # F1 arrives at 2.5, after the send at 2, while rank 0 computes F2 -> [3,4.5]; F2
    # arrives at 4.5, after the send at 3, with rank 0 idle -> [4.5,6]; B0 [6,7.5] B1
    # [7.5,9] B2 [9,10.5]. Rank 0 waits for each gradient before it is sent: B0 [7.5,8.5]
    # B1 [9,10] B2 [10.5,11.5].
    plan = schedule.build_schedule("gpipe", 2, 3)
    run = schedule.simulate_timed(plan, lambda a: [1.0, 1.5][a.stage], late_receive_s=lambda sender: 0.5)
    assert [(str(t.action), t.start_s) for t in run.ranks[1]] == [
        ("1F0", 1.0), ("1F1", 3.0), ("1F2", 4.5), ("1B0", 6.0), ("1B1", 7.5), ("1B2", 9.0)]
    assert [(str(t.action), t.start_s) for t in run.ranks[0][3:]] == [("0B0", 7.5), ("0B1", 9.0), ("0B2", 10.5)]
    assert run.makespan_s == 11.5
    assert schedule.simulate_timed(plan, lambda a: [1.0, 1.5][a.stage]).makespan_s == 11.0  # uncharged: 1F1 at 2.5


def test_a_late_receive_is_charged_only_where_the_sender_computes():
    # Equal stages, B = 2 F, a transfer of 0.1 s: under 1F1B each receive of rank 1
    # comes while rank 0 waits for rank 1's own gradient, so nothing is charged; under
    # GPipe rank 0 sends its forwards back to back and rank 1 arrives at them late.
    def step(name: str, late: float) -> float:
        run = schedule.simulate_timed(schedule.build_schedule(name, 2, 4), durations(1.0, 2.0), lambda s, r: 0.1,
                                      (lambda sender: late) if late else None)
        return run.makespan_s

    assert step("1f1b", 0.5) == pytest.approx(step("1f1b", 0.0))
    assert step("gpipe", 0.5) > step("gpipe", 0.0) + 0.5


def test_one_f_one_b_beats_the_alpa_bound_on_unequal_stages():
    """sum(t) + (m - 1) max(t) (Alpa's Eq. 2) is reached by GPipe-like timing; 1F1B never does worse."""
    rng = random.Random(0)
    for _ in range(100):
        p, m = rng.randint(1, 5), rng.randint(1, 8)
        fwd = [rng.uniform(0.5, 2.0) for _ in range(p)]
        run = schedule.simulate_timed(
            schedule.one_f_one_b(p, m), lambda a: fwd[a.stage] * (1 if a.kind is Kind.FORWARD else 2))
        stage_s = [3 * f for f in fwd]
        assert run.makespan_s <= sum(stage_s) + (m - 1) * max(stage_s) + 1e-9
        assert run.makespan_s >= m * max(stage_s) - 1e-9


def test_transfers_between_chunks_on_one_rank_are_free():
    # One rank, two chunks: the hand-off from stage 0 to stage 1 stays on the rank.
    run = schedule.simulate_timed(schedule.build_schedule("interleaved", 1, 2, 2), lambda a: 1.0, lambda s, r: 100.0)
    assert run.makespan_s == 8.0


def test_timed_simulator_finds_a_deadlock():
    plan = [schedule.parse_actions("0F0 0B0 0F1 0B1"), schedule.parse_actions("1F0 1F1 1B0 1B1")]
    with pytest.raises(ScheduleError, match="deadlock: 0B0 waits for 1B0; 1F1 waits for 0F1"):
        schedule.simulate_timed(plan, lambda a: 1.0)


def test_peak_in_flight_of_a_timed_run():
    run = schedule.simulate_timed(schedule.one_f_one_b(4, 8), lambda a: 1.0)
    assert [run.peak_in_flight(r) for r in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 4, 6, 1), ("gpipe", 3, 4, 1), ("zb", 4, 5, 1), ("zb", 5, 3, 1), ("interleaved", 2, 4, 3)])
def test_timed_simulation_in_order_equals_in_time_order(name, pp, m, v):
    """Without late receives the simulator plays each rank on until it waits ([Note: late receives] needs the
    time order): every action's start and end equal the time-ordered play's (a zero charge takes that path)."""
    from hetpar.runtime.schedule import build_schedule, simulate_timed

    rng = random.Random(f"{name}{pp}{m}{v}")
    durations, hops = {}, [rng.uniform(0, 0.3) for _ in range(pp * v)]
    plan = build_schedule(name, pp, m, v)
    for actions in plan:
        for a in actions:
            durations[a] = rng.uniform(0.5, 2.0)
    fast = simulate_timed(plan, durations.__getitem__, lambda s, r: hops[min(s.stage, r.stage)])
    ordered = simulate_timed(plan, durations.__getitem__, lambda s, r: hops[min(s.stage, r.stage)], late_receive_s=lambda a: 0.0)
    assert fast.ranks == ordered.ranks
