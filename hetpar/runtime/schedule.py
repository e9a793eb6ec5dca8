"""Pipeline schedules as data: per-rank lists of actions, a parser, and two simulators.

An action is ``(stage, kind, microbatch)`` and prints as ``1F0`` (stage 1, forward of
micro-batch 0), ``1B0`` (its backward) or ``1W0`` (its weight gradient, in zero-bubble
schedules); ``Action.parse`` reads that text back. A schedule generator returns one
action list per pipeline rank; every rank of a stage runs its stage's list, and
``runtime.executor`` interprets it. Communication is implied: a forward receives from
the previous stage and sends to the next, a backward the other way round (see
[Note: pipeline communication] in runtime/executor.py).

Most schedules give each rank one stage, so list s holds stage s. The interleaved
schedule gives each of p ranks v stages ("model chunks"): rank r holds stages
r, r + p, ..., r + (v - 1) p, and an action names its stage, not its rank.

``simulate`` plays the lists against each other with one tick per action, the way the
executor runs them (sends never block, a receive waits for its send), so it finds
deadlocks and draws timelines. ``simulate_timed`` plays them with real durations per
action and a transfer time per send (and, where a profile measured it, the wait of a
receive posted late: [Note: late receives]): the step time of a schedule, also for
stages of unequal speed.

The runtime executes every schedule of ``make_schedule``: 1F1B, GPipe, interleaved
1F1B (a rank runs several stages) and ZB-H1 (W actions; see [Note: zero-bubble split]
and runtime/executor.py).
"""

from __future__ import annotations

import heapq
import re
from hetpar.vocabulary import Schedule
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule is malformed or cannot finish (deadlock)."""


class Kind(str, Enum):
    """What an action computes.

    In a schedule with WEIGHT actions, BACKWARD computes only the gradient of the
    stage's input (what the previous stage waits for) and WEIGHT the gradients of its
    parameters (what nobody waits for); see [Note: zero-bubble split].
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


_ACTION_RE = re.compile(r"^\s*(\d+)([FBW])(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step of one stage: ``Action(1, Kind.FORWARD, 0)`` prints as ``1F0``."""

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:  # Action(1, "F", 0) works too
            object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read an action printed as ``<stage><F|B><microbatch>``.

        Raises:
            ScheduleError: ``text`` is not of that form.
        """
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError(f"{text!r} is not an action like '1F0' (stage, F, B or W, micro-batch)")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def format_actions(actions: list[Action]) -> str:
    """Actions as space-separated text, e.g. ``0F0 0F1 0B0 0B1``."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """The inverse of ``format_actions``."""
    return [Action.parse(word) for word in text.split()]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one stage and one micro-batch, got {num_stages} and {num_microbatches}")


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The 1F1B schedule (PipeDream-Flush): per stage, a warm-up of forwards, then one
    forward and one backward alternately, then the remaining backwards.

    Stage s runs ``min(num_stages - s - 1, m)`` warm-up forwards, so at most
    ``num_stages - s`` micro-batches are in flight on it, whatever ``m`` is: that bounds
    the activation memory. 4 stages, 4 micro-batches (one tick per action)::

        stage 0: F0 F1 F2 F3 .. .. .. B0 .. B1 .. B2 .. B3
        stage 1: .. F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
        stage 2: .. .. F0 F1 .. B0 F2 B1 F3 B2 .. B3
        stage 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3

    Returns:
        ``actions[s]``: the actions of stage s in execution order.
    """
    _check_sizes(num_stages, num_microbatches)
    schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        actions = [Action(s, Kind.FORWARD, i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions.append(Action(s, Kind.FORWARD, warmup + i))
            actions.append(Action(s, Kind.BACKWARD, i))
        actions += [Action(s, Kind.BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The GPipe schedule: every stage runs all forwards, then all backwards.

    Simple, the same bubble as 1F1B, but all ``m`` micro-batches are in flight on every
    stage at the turn. 3 stages, 3 micro-batches::

        stage 0: F0 F1 F2 .. .. .. .. B0 B1 B2
        stage 1: .. F0 F1 F2 .. .. B0 B1 B2
        stage 2: .. .. F0 F1 F2 B0 B1 B2

    Returns:
        ``actions[s]``: the actions of stage s in execution order.
    """
    _check_sizes(num_stages, num_microbatches)
    return [
        [Action(s, Kind.FORWARD, i) for i in range(num_microbatches)]
        + [Action(s, Kind.BACKWARD, i) for i in range(num_microbatches)]
        for s in range(num_stages)
    ]


def interleaved_one_f_one_b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: each of p ranks holds v model chunks (stages r, r + p, ...).

    A micro-batch passes every rank v times, each time through a chunk of 1/v of the
    rank's layers, so the warm-up and cool-down are v times shorter: the bubble is
    (p - 1) (t_f + t_b) / v instead of (p - 1) (t_f + t_b) (Narayanan et al. 2021,
    section 2.2.2), at the price of v times more point-to-point traffic. The order is
    Megatron's (megatron/core/pipeline_parallel/schedules.py,
    ``forward_backward_pipelining_with_interleaving``): micro-batches go in groups of p
    through chunk 0, then chunk 1, ...; rank r runs ``2 (p - r - 1) + (v - 1) p``
    warm-up forwards (all of them when m == p), then one forward and one backward
    alternately. 2 ranks, 2 chunks, 4 micro-batches (one tick per action; ``F0`` on
    rank 0 is stage 0 or stage 2)::

        stage 0: F0 F1 F0 F1 F2 B0 F3 B1 F2 B0 F3 B1 .. B2 .. B3 B2 B3
        stage 1: .. F0 F1 F0 B0 F1 B1 F2 B0 F3 B1 F2 B2 F3 B3 B2 B3

    Args:
        num_ranks: p, the pipeline ranks.
        num_microbatches: m, a multiple of p.
        virtual_stages: v >= 1 chunks per rank; v = 1 is plain 1F1B.

    Returns:
        ``actions[r]``: the actions of rank r in execution order.

    Raises:
        ScheduleError: bad sizes, or m not a multiple of p.
    """
    _check_sizes(num_ranks, num_microbatches)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if v < 1:
        raise ScheduleError(f"virtual stages must be at least 1, got {v}")
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple of pipeline ranks ({p})")
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    schedule = []
    for r in range(p):
        warmup = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        forwards = [Action(chunk(k, True) * p + r, Kind.FORWARD, microbatch(k)) for k in range(total)]
        backwards = [Action(chunk(k, False) * p + r, Kind.BACKWARD, microbatch(k)) for k in range(total)]
        actions = forwards[:warmup]
        for i in range(total - warmup):
            actions += [forwards[warmup + i], backwards[i]]
        schedule.append(actions + backwards[total - warmup :])
    return schedule


# [Note: zero-bubble split]
# A backward does two things: the gradient of the stage's input, which the previous
# stage waits for, and the gradients of the stage's weights, which nobody waits for
# until the optimizer step. Zero-bubble schedules (Qi et al. 2023, "Zero Bubble
# Pipeline Parallelism", ICLR 2024) run them as separate actions, B and W, and move W
# into what would have been bubbles. With t_F = t_B = t_W, 1F1B's bubble
# (p - 1)(t_F + t_B + t_W) shrinks to ZB-H1's (p - 1)(t_F + t_B - t_W), a third, while
# each stage still holds at most as many micro-batches as under 1F1B (W keeps only the
# inputs of the stage's matmuls alive; cost_models/memory.py counts them).


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into B and W; stage s runs
    each W ``s`` backwards late, so later stages pass input gradients upstream sooner
    and earlier stages fill their waits with W; see [Note: zero-bubble split].

    4 stages, 4 micro-batches, one tick per action (F, B and W alike)::

        stage 0: F0 F1 F2 F3 .. .. .. B0 W0 B1 W1 B2 W2 B3 W3
        stage 1: .. F0 F1 F2 .. .. B0 F3 B1 W0 B2 W1 B3 W2 W3
        stage 2: .. .. F0 F1 .. B0 F2 B1 F3 B2 W0 B3 W1 W2 W3
        stage 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3

    Returns:
        ``actions[s]``: the actions of stage s in execution order.
    """
    _check_sizes(num_stages, num_microbatches)
    schedule = []
    for s, actions in enumerate(one_f_one_b(num_stages, num_microbatches)):
        deferred = s
        out, backwards = [], 0
        for a in actions:
            out.append(a)
            if a.kind is Kind.BACKWARD:
                if backwards >= deferred:
                    out.append(Action(s, Kind.WEIGHT, backwards - deferred))
                backwards += 1
        out += [Action(s, Kind.WEIGHT, i) for i in range(max(0, backwards - deferred), backwards)]
        schedule.append(out)
    return schedule




def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The schedule called ``name`` (as in a plan's ``schedule``), one action list per pipeline rank.

    Args:
        name: "1f1b", "gpipe", "interleaved" or "zb" (ZB-H1).
        num_ranks: pipeline ranks p (the number of stages, unless interleaved).
        num_microbatches: m.
        virtual_stages: chunks per rank; only the interleaved schedule takes v > 1.

    Raises:
        ScheduleError: unknown name, bad sizes, or v > 1 for a schedule without chunks.
    """
    if name not in tuple(Schedule):
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(Schedule)}")
    if name == Schedule.INTERLEAVED:
        return interleaved_one_f_one_b(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"virtual stages ({virtual_stages}) need the interleaved schedule, not {name!r}")
    generators = {Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.GPIPE: gpipe, Schedule.ZERO_BUBBLE: zero_bubble_h1}
    return generators[name](num_ranks, num_microbatches)


def forwards_only(actions: list[Action]) -> list[Action]:
    """A rank's forward actions in its schedule's order: the schedule of an evaluation
    (forwards without gradients; [Note: held-out loss] in runtime/training.py).

    Free of deadlocks wherever the whole schedule is: a forward waits only for the
    previous stage's forward of its micro-batch, so some run of the whole schedule,
    restricted to its forwards, runs these lists, sends never blocking.
    """
    return [a for a in actions if a.kind is Kind.FORWARD]


def build_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``make_schedule`` under the name the simulators' callers know."""
    return make_schedule(name, num_ranks, num_microbatches, virtual_stages)


def validate(schedule: list[list[Action]], num_microbatches: int, virtual_stages: int = 1) -> None:
    """Check that every stage lists exactly one forward and one backward of every
    micro-batch (and one weight-gradient action each, if it lists any), each backward
    after its forward and each W after its backward; with ``virtual_stages`` v, that
    rank r lists only its stages r, r + p, ..., r + (v - 1) p.

    Raises:
        ScheduleError: naming the stage and the action at fault.
    """
    p = len(schedule)
    for r, actions in enumerate(schedule):
        mine = {r + c * p for c in range(virtual_stages)}
        seen: set[Action] = set()
        for a in actions:
            if a.stage not in mine:
                held = f"an action of stage {a.stage}" if virtual_stages == 1 else f"but holds stages {sorted(mine)}"
                raise ScheduleError(f"stage {r} lists {a}, {held}")
            if a in seen:
                raise ScheduleError(f"stage {a.stage} lists {a} twice")
            before = {Kind.BACKWARD: Kind.FORWARD, Kind.WEIGHT: Kind.BACKWARD}.get(a.kind)
            if before is not None and Action(a.stage, before, a.microbatch) not in seen:
                raise ScheduleError(f"stage {a.stage} runs {a} before its {'forward' if before is Kind.FORWARD else 'backward'}")
            seen.add(a)
        for stage in sorted(mine):
            _check_complete(stage, {a for a in seen if a.stage == stage}, num_microbatches)


def _check_complete(stage: int, seen: set[Action], num_microbatches: int) -> None:
    kinds = [Kind.FORWARD, Kind.BACKWARD] + ([Kind.WEIGHT] if any(a.kind is Kind.WEIGHT for a in seen) else [])
    expected = {Action(stage, k, i) for k in kinds for i in range(num_microbatches)}
    if seen != expected:
        faults = [f"lacks {_in_order(expected - seen)}"] if expected - seen else []
        faults += [f"has extra {_in_order(seen - expected)}"] if seen - expected else []
        raise ScheduleError(f"stage {stage} " + " and ".join(faults))


def _in_order(actions: set[Action]) -> str:
    order = {Kind.FORWARD: 0, Kind.BACKWARD: 1, Kind.WEIGHT: 2}
    return format_actions(sorted(actions, key=lambda a: (a.microbatch, order[a.kind])))


def _num_stages(schedule: list[list[Action]]) -> int:
    return 1 + max((a.stage for actions in schedule for a in actions), default=len(schedule) - 1)


def _dependency(action: Action, num_stages: int) -> Action | None:
    """The action of another stage whose send this action receives, if any."""
    if action.kind is Kind.FORWARD and action.stage > 0:
        return Action(action.stage - 1, Kind.FORWARD, action.microbatch)
    if action.kind is Kind.BACKWARD and action.stage < num_stages - 1:
        return Action(action.stage + 1, Kind.BACKWARD, action.microbatch)
    return None


def _deadlock(schedule: list[list[Action]], position: list[int], num_stages: int) -> ScheduleError:
    waits = [
        f"{schedule[s][position[s]]} waits for {_dependency(schedule[s][position[s]], num_stages)}"
        for s in range(len(schedule))
        if position[s] < len(schedule[s])
    ]
    return ScheduleError("deadlock: " + "; ".join(waits))


def simulate(schedule: list[list[Action]]) -> list[list[Action | None]]:
    """Run the ranks' action lists together, one tick per action.

    An action starts once the action whose output it receives finished in an earlier
    tick; sends never block. This is how the executor behaves, so a schedule that
    simulates to the end cannot deadlock there.

    Returns:
        ``timeline[r][tick]``: the action rank r runs at that tick, or None (a bubble).

    Raises:
        ScheduleError: the ranks wait on each other (deadlock), naming who waits for what.
    """
    num_ranks, num_stages = len(schedule), _num_stages(schedule)
    done: set[Action] = set()
    position = [0] * num_ranks
    timeline: list[list[Action | None]] = [[] for _ in range(num_ranks)]
    while any(position[s] < len(schedule[s]) for s in range(num_ranks)):
        finished_now = []
        for s in range(num_ranks):
            if position[s] == len(schedule[s]):
                timeline[s].append(None)
                continue
            action = schedule[s][position[s]]
            needs = _dependency(action, num_stages)
            if needs is None or needs in done:
                finished_now.append(action)
                timeline[s].append(action)
                position[s] += 1
            else:
                timeline[s].append(None)
        if not finished_now:
            raise _deadlock(schedule, position, num_stages)
        done.update(finished_now)
    width = max(len(t) for t in timeline)
    while width and all(t[width - 1] is None for t in timeline):
        width -= 1
    return [t[:width] for t in timeline]


class TimedAction(NamedTuple):
    """One action as the timed simulator ran it (a named tuple: a planner's estimate makes hundreds of thousands)."""

    action: Action
    start_s: float
    end_s: float


class TimedRun:
    """What ``simulate_timed`` found: every action's start and end, rank by rank.

    Kept as columns (each rank's actions, starts and ends); a rank's ``TimedAction`` list is built the
    first time it is read: a planner's estimate reads one rank's, of thousands of actions.
    """

    def __init__(self, ranks: list[list[TimedAction]] | None = None, *, actions: list[list[Action]] | None = None,
                 starts: list[list[float]] | None = None, ends: list[list[float]] | None = None):
        if ranks is not None:
            actions = [[t.action for t in run] for run in ranks]
            starts = [[t.start_s for t in run] for run in ranks]
            ends = [[t.end_s for t in run] for run in ranks]
        self._actions, self._starts, self._ends = actions or [], starts or [], ends or []
        self._rows: dict[int, list[TimedAction]] = {}

    def rank(self, r: int) -> list[TimedAction]:
        """Rank r's actions as it ran them, in order."""
        if r not in self._rows:
            self._rows[r] = [TimedAction(action=a, start_s=b, end_s=e) for a, b, e in zip(self._actions[r], self._starts[r], self._ends[r])]
        return self._rows[r]

    @property
    def ranks(self) -> list[list[TimedAction]]:
        """Every rank's ``rank(r)``."""
        return [self.rank(r) for r in range(len(self._actions))]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TimedRun):
            return NotImplemented
        return (self._actions, self._starts, self._ends) == (other._actions, other._starts, other._ends)

    def __repr__(self) -> str:
        return f"TimedRun(ranks={self.ranks!r})"

    @property
    def makespan_s(self) -> float:
        """From the first action's start to the last action's end, over all ranks."""
        return max((ends[-1] for ends in self._ends if ends), default=0.0)

    def busy_s(self, rank: int) -> float:
        """Seconds rank ``rank`` computes."""
        return sum(e - b for b, e in zip(self._starts[rank], self._ends[rank]))

    def end_s(self, rank: int) -> float:
        """When rank ``rank`` finishes its last action."""
        return self._ends[rank][-1] if self._ends[rank] else 0.0

    def peak_in_flight(self, rank: int) -> int:
        """The most micro-batches rank ``rank`` holds activations for (F done, B not)."""
        return max_in_flight(self._actions[rank])


# [Note: late receives]
# The executor posts a receive when it reaches the action that reads it
# ([Note: pipeline communication] in runtime/executor.py), and gloo moves a message
# only once its receive is posted: a rendezvous, in which the sender's transport thread
# answers the receiver's request. When the receive comes after the send and the sender
# is then computing, that thread has to be scheduled beside the sender's compute; on a
# host whose cores are all busy (CPU workers computing on every core) it waits for the
# OS scheduler. ``hetpar profile`` measures the mean wait of exactly that case
# (profiler/collectives.py ``late_receive_times``; docs/benchmarks/late-receive_cpu-2core_2026-12-03.md sets it beside a receive posted late to an idle sender), and
# ``simulate_timed`` charges it to every message the timeline finds in that case: the
# message arrives no earlier than the receiver's arrival at the action plus the charge. GPipe runs into it on every micro-batch (its first stage sends forwards
# back to back while the next is still computing the previous ones), 1F1B rarely (its
# late receives mostly find the sender waiting itself). Ranks are played in the order
# of their actions' start times, so the sender's timeline is known up to the moment
# the receiver arrives. Without a measured charge nothing changes. (Posting receives
# earlier in the executor was tried: it sped GPipe up less than it slowed 1F1B down.)
def simulate_timed(
    schedule: list[list[Action]],
    duration_s: Callable[[Action], float],
    transfer_s: Callable[[Action, Action], float] | None = None,
    late_receive_s: Callable[[Action], float] | None = None,
) -> TimedRun:
    """Run the ranks' action lists with real durations: the step time of a schedule.

    Each rank runs its list in order; an action starts when its rank is free and the
    output it receives has arrived: the sending action's end plus
    ``transfer_s(sender, receiver)`` when they run on different ranks. Sends never
    block the sender, as in ``simulate``. Stages may be of any speed: the durations
    come per action.

    Args:
        schedule: ``actions[r]`` per rank (``build_schedule``).
        duration_s: seconds of one action.
        transfer_s: seconds from the end of a sending action to the arrival of its
            output at the receiving action's rank; none when omitted.
        late_receive_s: seconds, per sending action, from the receiver's arrival at the
            action to the message when the send came first and the sender is then
            computing another action; see [Note: late receives]. None when omitted.

    Returns:
        Every action's start and end.

    Raises:
        ScheduleError: the ranks wait on each other (deadlock).
    """
    if late_receive_s is None:
        return _simulate_in_order(schedule, duration_s, transfer_s)
    num_stages = _num_stages(schedule)
    rank_of = {a.stage: r for r, actions in enumerate(schedule) for a in actions}
    end: dict[Action, float] = {}
    runs: list[list[TimedAction]] = [[] for _ in schedule]
    position, free = [0] * len(schedule), [0.0] * len(schedule)

    def computing(r: int, at: float) -> bool:
        for t in reversed(runs[r]):  # in time order: the first that ended by ``at`` ends the search
            if t.end_s <= at:
                return False
            if t.start_s < at:  # an action that starts as the receiver arrives waited for it
                return True
        return False

    def start_of(r: int) -> float | None:
        action = schedule[r][position[r]]
        needs = _dependency(action, num_stages)
        if needs is None:
            return free[r]
        if needs not in end:
            return None
        if rank_of[needs.stage] == r:
            return max(free[r], end[needs])
        arrival = end[needs] + (transfer_s(needs, action) if transfer_s else 0.0)
        if late_receive_s and free[r] > end[needs] and computing(rank_of[needs.stage], free[r]):
            arrival = max(arrival, free[r] + late_receive_s(needs))
        return max(free[r], arrival)

    # Each rank's next action, keyed by its start as far as the played actions tell:
    # more of a sender's past can only make a receive later, so a popped entry whose
    # start has grown goes back, and the entry that stays on top starts first. Every
    # action starting before it is then played, so ``computing`` sees the sender's whole
    # past. A rank whose next action waits for an unplayed one has no entry until it is played.
    queue: list[tuple[float, int]] = []
    blocked: dict[Action, int] = {}

    def enqueue(r: int) -> None:
        if position[r] < len(schedule[r]):
            start = start_of(r)
            if start is None:
                blocked[_dependency(schedule[r][position[r]], num_stages)] = r
            else:
                heapq.heappush(queue, (start, r))

    for r in range(len(schedule)):
        enqueue(r)
    while queue:
        start, r = heapq.heappop(queue)
        now = start_of(r)
        if now > start:
            heapq.heappush(queue, (now, r))
            continue
        action = schedule[r][position[r]]
        end[action] = free[r] = start + duration_s(action)
        runs[r].append(TimedAction(action=action, start_s=start, end_s=end[action]))
        position[r] += 1
        enqueue(r)
        if action in blocked:
            enqueue(blocked.pop(action))
    if any(position[r] < len(schedule[r]) for r in range(len(schedule))):
        raise _deadlock(schedule, position, num_stages)
    return TimedRun(ranks=runs)


def _simulate_in_order(
    schedule: list[list[Action]], duration_s: Callable[[Action], float], transfer_s: Callable[[Action, Action], float] | None
) -> TimedRun:
    """``simulate_timed`` without late receives: every action starts at the later of its rank's last end and
    its input's arrival, whatever order the ranks are played in, so each rank runs on until it waits for an
    action not yet played and resumes once that one is (O(actions); pipelines of 128 stages and 1024
    micro-batches plan in seconds)."""
    num_stages = _num_stages(schedule)
    # where[kind][stage][microbatch]: (rank, position) of the forward / backward that sends to the next action
    where: dict[Kind, dict[int, dict[int, tuple[int, int]]]] = {Kind.FORWARD: {}, Kind.BACKWARD: {}}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.kind is not Kind.WEIGHT:
                where[a.kind].setdefault(a.stage, {})[a.microbatch] = (r, i)
    sends = {Kind.FORWARD: (-1, where[Kind.FORWARD]), Kind.BACKWARD: (1, where[Kind.BACKWARD])}
    end: list[list[float | None]] = [[None] * len(actions) for actions in schedule]
    begin: list[list[float]] = [[0.0] * len(actions) for actions in schedule]
    position, free = [0] * len(schedule), [0.0] * len(schedule)
    waiting: dict[tuple[int, int], int] = {}  # (rank, position) of an unplayed action -> the rank waiting for it
    ready = list(range(len(schedule)))[::-1]
    while ready:
        r = ready.pop()
        actions, ends, begins, i, start = schedule[r], end[r], begin[r], position[r], free[r]
        while i < len(actions):
            action = actions[i]
            step, senders = sends.get(action.kind, (0, None))
            if step and 0 <= action.stage + step < num_stages:
                source = senders.get(action.stage + step, {}).get(action.microbatch)
                if source is None:
                    break  # never played: a deadlock, reported below
                sent = end[source[0]][source[1]]
                if sent is None:
                    waiting[source] = r
                    break
                if source[0] != r and transfer_s is not None:
                    sent += transfer_s(schedule[source[0]][source[1]], action)
                if sent > start:
                    start = sent
            begins[i] = start
            start = ends[i] = start + duration_s(action)
            waiter = waiting.pop((r, i), None)
            i += 1
            if waiter is not None:
                ready.append(waiter)
        position[r], free[r] = i, start
    if any(position[r] < len(schedule[r]) for r in range(len(schedule))):
        raise _deadlock(schedule, position, num_stages)
    return TimedRun(actions=schedule, starts=begin, ends=end)


def draw(timeline: list[list[Action | None]]) -> str:
    """A timeline as text, one line per rank, ``..`` for a bubble."""
    lines = []
    for s, row in enumerate(timeline):
        cells = [f"{a.kind.value}{a.microbatch}" if a else ".." for a in row]
        lines.append(f"stage {s}: " + " ".join(cells).rstrip(". "))
    return "\n".join(lines)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches a rank holds activations for (forward done, backward not)."""
    live = peak = 0
    for a in actions:
        if a.kind is not Kind.WEIGHT:
            live += 1 if a.kind is Kind.FORWARD else -1
        peak = max(peak, live)
    return peak


__all__ = [
    "Action",
    "forwards_only",
    "Kind",
    "ScheduleError",
    "TimedAction",
    "TimedRun",
    "build_schedule",
    "draw",
    "format_actions",
    "gpipe",
    "interleaved_one_f_one_b",
    "make_schedule",
    "max_in_flight",
    "one_f_one_b",
    "parse_actions",
    "simulate",
    "simulate_timed",
    "validate",
    "zero_bubble_h1",
]
