"""Pipeline schedules as data: generators, print/parse, validation and the deadlock simulator."""

import re

import pytest

from hetpar.runtime import schedule
from hetpar.runtime.schedule import Action, Kind, ScheduleError

GRID = [(p, m) for p in range(1, 6) for m in range(1, 9)]


def test_action_prints_and_parses_back():
    a = Action(1, Kind.FORWARD, 0)
    assert str(a) == "1F0"
    assert str(Action(12, Kind.BACKWARD, 31)) == "12B31"
    assert Action.parse("1F0") == a
    assert Action.parse(" 12B31 ") == Action(12, Kind.BACKWARD, 31)
    assert Action(1, "F", 0) == a and repr(a) == "Action(1F0)"


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "-1F0", "1f0", "1F0 2F0"])
def test_parse_rejects_malformed_actions(bad):
    with pytest.raises(ScheduleError, match="is not an action"):
        Action.parse(bad)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("generator", [schedule.one_f_one_b, schedule.gpipe])
def test_schedules_round_trip_through_text(generator, p, m):
    for actions in generator(p, m):
        assert schedule.parse_actions(schedule.format_actions(actions)) == actions


def expected_one_f_one_b(s: int, p: int, m: int) -> str:
    warmup = min(p - s - 1, m)
    words = [f"{s}F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"{s}F{warmup + i}", f"{s}B{i}"]
    words += [f"{s}B{i}" for i in range(m - warmup, m)]
    return " ".join(words)


def test_one_f_one_b_order_by_hand():
    assert [schedule.format_actions(a) for a in schedule.one_f_one_b(2, 4)] == [
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    ]
    assert schedule.format_actions(schedule.one_f_one_b(4, 2)[0]) == "0F0 0F1 0B0 0B1"


@pytest.mark.parametrize("p,m", GRID)
def test_one_f_one_b_order_and_memory_bound(p, m):
    plan = schedule.one_f_one_b(p, m)
    assert len(plan) == p
    for s, actions in enumerate(plan):
        assert schedule.format_actions(actions) == expected_one_f_one_b(s, p, m)
        assert schedule.max_in_flight(actions) <= p - s
        assert schedule.max_in_flight(actions) == min(p - s, m)


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_holds_every_microbatch_at_the_turn(p, m):
    for actions in schedule.gpipe(p, m):
        assert schedule.max_in_flight(actions) == m


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("generator", [schedule.one_f_one_b, schedule.gpipe])
def test_generated_schedules_are_valid_and_never_deadlock(generator, p, m):
    plan = generator(p, m)
    schedule.validate(plan, m)
    timeline = schedule.simulate(plan)
    for s, row in enumerate(timeline):
        assert [a for a in row if a is not None] == plan[s]
    # Every receive comes strictly after its send: F of stage s after F of s-1, B of s after B of s+1.
    tick = {a: t for row in timeline for t, a in enumerate(row) if a is not None}
    for a, t in tick.items():
        if a.kind is Kind.FORWARD and a.stage > 0:
            assert tick[Action(a.stage - 1, Kind.FORWARD, a.microbatch)] < t
        if a.kind is Kind.BACKWARD and a.stage < p - 1:
            assert tick[Action(a.stage + 1, Kind.BACKWARD, a.microbatch)] < t


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3)])
def test_one_f_one_b_and_gpipe_take_the_same_ticks(p, m):
    # Both have the classic (p - 1) bubbles per direction: 2 * (m + p - 1) ticks at one tick per action.
    for generator in (schedule.one_f_one_b, schedule.gpipe):
        assert len(schedule.simulate(generator(p, m))[0]) == 2 * (m + p - 1)


def test_simulator_finds_a_deadlock():
    # Stage 0 waits for its backward before sending the second forward that stage 1 waits for.
    plan = [
        schedule.parse_actions("0F0 0B0 0F1 0B1"),
        schedule.parse_actions("1F0 1F1 1B0 1B1"),
    ]
    schedule.validate(plan, 2)
    with pytest.raises(ScheduleError, match="deadlock: 0B0 waits for 1B0; 1F1 waits for 0F1"):
        schedule.simulate(plan)


@pytest.mark.parametrize(
    "text,m,message",
    [
        ("0F0 0B0 0F0 0B1", 2, "lists 0F0 twice"),
        ("0B0 0F0", 1, "runs 0B0 before its forward"),
        ("0F0", 1, "lacks 0B0"),
        ("0F0 0B0 0F1 0B1", 1, "stage 0 has extra 0F1 0B1"),
        ("1F0 1B0", 1, "stage 0 lists 1F0"),
    ],
)
def test_validate_names_the_fault(text, m, message):
    with pytest.raises(ScheduleError, match=message):
        schedule.validate([schedule.parse_actions(text)], m)


def test_make_schedule_knows_the_plan_names():
    assert schedule.make_schedule("1f1b", 2, 2) == schedule.one_f_one_b(2, 2)
    assert schedule.make_schedule("gpipe", 2, 2) == schedule.gpipe(2, 2)
    assert schedule.make_schedule("zb", 2, 2) == schedule.zero_bubble_h1(2, 2)
    assert schedule.make_schedule("interleaved", 2, 4, 2) == schedule.interleaved_one_f_one_b(2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        schedule.make_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="at least one stage"):
        schedule.one_f_one_b(0, 2)


@pytest.mark.parametrize("generator,p,m", [(schedule.one_f_one_b, 4, 4), (schedule.gpipe, 3, 3)])
def test_docstring_timelines_are_what_the_simulator_draws(generator, p, m):
    """The timelines drawn in the generators' docstrings are golden files; to regenerate
    one, paste ``schedule.draw(schedule.simulate(generator(p, m)))``."""
    drawn = [line.strip() for line in generator.__doc__.splitlines() if re.match(r"\s*stage \d+:", line)]
    assert drawn == schedule.draw(schedule.simulate(generator(p, m))).splitlines()


def test_weight_actions_print_and_parse():
    assert str(Action(2, Kind.WEIGHT, 5)) == "2W5" and Action.parse("2W5") == Action(2, "W", 5)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_is_valid_and_never_deadlocks(p, m, v):
    plan = schedule.interleaved_one_f_one_b(p, m, v)
    schedule.validate(plan, m, virtual_stages=v)
    timeline = schedule.simulate(plan)
    for r, row in enumerate(timeline):
        assert [a for a in row if a is not None] == plan[r]
        assert {a.stage for a in plan[r]} == {r + c * p for c in range(v)}


def test_interleaved_needs_whole_groups_of_microbatches():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) to be a multiple of pipeline ranks \(4\)"):
        schedule.interleaved_one_f_one_b(4, 6, 2)
    assert schedule.interleaved_one_f_one_b(3, 6, 1) == schedule.one_f_one_b(3, 6)


@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_is_valid_and_holds_no_more_than_one_f_one_b(p, m):
    plan = schedule.zero_bubble_h1(p, m)
    schedule.validate(plan, m)
    schedule.simulate(plan)
    for actions, reference in zip(plan, schedule.one_f_one_b(p, m)):
        assert [a for a in actions if a.kind is not Kind.WEIGHT] == reference
        assert schedule.max_in_flight(actions) == schedule.max_in_flight(reference)


@pytest.mark.parametrize(
    "text,m,message",
    [
        ("0F0 0W0 0B0", 1, "runs 0W0 before its backward"),
        ("0F0 0B0 0W0 0F1 0B1", 2, "lacks 0W1"),
    ],
)
def test_validate_checks_weight_actions(text, m, message):
    with pytest.raises(ScheduleError, match=message):
        schedule.validate([schedule.parse_actions(text)], m)


def test_validate_names_a_chunk_on_the_wrong_rank():
    plan = [schedule.parse_actions("0F0 0B0 1F0 1B0"), schedule.parse_actions("3F0 3B0 2F0 2B0")]
    with pytest.raises(ScheduleError, match=r"stage 0 lists 1F0, but holds stages \[0, 2\]"):
        schedule.validate(plan, 1, virtual_stages=2)


def test_build_schedule_names_and_refusals():
    assert schedule.build_schedule("1f1b", 2, 2) == schedule.one_f_one_b(2, 2)
    assert schedule.build_schedule("zb", 2, 2) == schedule.zero_bubble_h1(2, 2)
    with pytest.raises(ScheduleError, match="virtual stages \\(2\\) need the interleaved schedule"):
        schedule.build_schedule("1f1b", 2, 2, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        schedule.build_schedule("pipedream", 2, 2)


@pytest.mark.parametrize("generator,args", [(schedule.interleaved_one_f_one_b, (2, 4, 2)), (schedule.zero_bubble_h1, (4, 4))])
def test_new_docstring_timelines_are_what_the_simulator_draws(generator, args):
    """Golden timelines; regenerate with ``schedule.draw(schedule.simulate(generator(*args)))``."""
    drawn = [line.strip() for line in generator.__doc__.splitlines() if re.match(r"\s*stage \d+:", line)]
    assert drawn == schedule.draw(schedule.simulate(generator(*args))).splitlines()


@pytest.mark.parametrize("ranks,m,v", [(p, m, v) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)])
def test_every_interleaved_schedule_the_runtime_runs_validates_and_finishes(ranks, m, v):
    plan = schedule.make_schedule("interleaved", ranks, m, v)
    schedule.validate(plan, m, virtual_stages=v)
    timeline = schedule.simulate(plan)
    assert sum(a is not None for row in timeline for a in row) == 2 * m * v * ranks


@pytest.mark.parametrize("stages,m", [(s, m) for s in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 7, 8)])
def test_every_zero_bubble_schedule_validates_and_finishes_with_one_w_per_backward(stages, m):
    plan = schedule.make_schedule("zb", stages, m)
    schedule.validate(plan, m)
    assert all(sum(a.kind is schedule.Kind.WEIGHT for a in actions) == m for actions in plan)
    timeline = schedule.simulate(plan)
    assert sum(a is not None for row in timeline for a in row) == 3 * m * stages


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 1, 3, 1), ("1f1b", 4, 6, 1), ("gpipe", 3, 5, 1), ("zb", 4, 8, 1),
                                        ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3)])
def test_an_evaluation_runs_each_forward_once_without_deadlock(name, p, m, v):
    """The forwards of a training schedule, in its order, are an evaluation's schedule."""
    whole = schedule.make_schedule(name, p, m, v)
    forwards = [schedule.forwards_only(actions) for actions in whole]
    timeline = schedule.simulate(forwards)  # raises on a deadlock
    ran = [a for row in timeline for a in row if a is not None]
    assert sorted(ran) == sorted(Action(s, Kind.FORWARD, i) for s in range(p * v) for i in range(m))
