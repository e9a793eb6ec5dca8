"""Pipeline schedules as data: per-stage lists of actions, a parser, and a simulator.

An action is ``(stage, kind, microbatch)`` and prints as ``1F0`` (stage 1, forward of
micro-batch 0) or ``1B0`` (its backward); ``Action.parse`` reads that text back. A
schedule generator returns one action list per stage; every rank of a stage runs its
stage's list, and ``runtime.executor`` interprets it. Communication is implied: a
forward receives from the previous stage and sends to the next, a backward the other
way round (see [Note: pipeline communication] in runtime/executor.py).

``simulate`` plays the lists against each other with one tick per action, the way the
executor runs them (sends never block, a receive waits for its send), so it finds
deadlocks and draws timelines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ScheduleError(ValueError):
    """A schedule is malformed or cannot finish (deadlock)."""


class Kind(str, Enum):
    """What an action computes."""

    FORWARD = "F"
    BACKWARD = "B"


_ACTION_RE = re.compile(r"^\s*(\d+)([FB])(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step of one stage: ``Action(1, Kind.FORWARD, 0)`` prints as ``1F0``."""

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # Action(1, "F", 0) works too

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
            raise ScheduleError(f"{text!r} is not an action like '1F0' (stage, F or B, micro-batch)")
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


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The schedule called ``name`` (``1f1b`` or ``gpipe``, as in a plan's ``schedule``).

    Raises:
        ScheduleError: unknown name or bad sizes.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def validate(schedule: list[list[Action]], num_microbatches: int) -> None:
    """Check that stage s lists exactly one forward and one backward of every
    micro-batch, and each backward after its forward.

    Raises:
        ScheduleError: naming the stage and the action at fault.
    """
    for s, actions in enumerate(schedule):
        seen: set[Action] = set()
        for a in actions:
            if a.stage != s:
                raise ScheduleError(f"stage {s} lists {a}, an action of stage {a.stage}")
            if a in seen:
                raise ScheduleError(f"stage {s} lists {a} twice")
            if a.kind is Kind.BACKWARD and Action(s, Kind.FORWARD, a.microbatch) not in seen:
                raise ScheduleError(f"stage {s} runs {a} before its forward")
            seen.add(a)
        expected = {Action(s, k, i) for k in Kind for i in range(num_microbatches)}
        if seen != expected:
            faults = [f"lacks {_in_order(expected - seen)}"] if expected - seen else []
            faults += [f"has extra {_in_order(seen - expected)}"] if seen - expected else []
            raise ScheduleError(f"stage {s} " + " and ".join(faults))


def _in_order(actions: set[Action]) -> str:
    return format_actions(sorted(actions, key=lambda a: (a.microbatch, a.kind is Kind.BACKWARD)))


def _dependency(action: Action, num_stages: int) -> Action | None:
    """The action of another stage whose send this action receives, if any."""
    if action.kind is Kind.FORWARD and action.stage > 0:
        return Action(action.stage - 1, Kind.FORWARD, action.microbatch)
    if action.kind is Kind.BACKWARD and action.stage < num_stages - 1:
        return Action(action.stage + 1, Kind.BACKWARD, action.microbatch)
    return None


def simulate(schedule: list[list[Action]]) -> list[list[Action | None]]:
    """Run the stages' action lists together, one tick per action.

    An action starts once the action whose output it receives finished in an earlier
    tick; sends never block. This is how the executor behaves, so a schedule that
    simulates to the end cannot deadlock there.

    Returns:
        ``timeline[s][tick]``: the action stage s runs at that tick, or None (a bubble).

    Raises:
        ScheduleError: the stages wait on each other (deadlock), naming who waits for what.
    """
    num_stages = len(schedule)
    done: set[Action] = set()
    position = [0] * num_stages
    timeline: list[list[Action | None]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        finished_now = []
        for s in range(num_stages):
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
            waits = [
                f"{schedule[s][position[s]]} waits for {_dependency(schedule[s][position[s]], num_stages)}"
                for s in range(num_stages)
                if position[s] < len(schedule[s])
            ]
            raise ScheduleError("deadlock: " + "; ".join(waits))
        done.update(finished_now)
    width = max(len(t) for t in timeline)
    while width and all(t[width - 1] is None for t in timeline):
        width -= 1
    return [t[:width] for t in timeline]


def draw(timeline: list[list[Action | None]]) -> str:
    """A timeline as text, one line per stage, ``..`` for a bubble."""
    lines = []
    for s, row in enumerate(timeline):
        cells = [f"{a.kind.value}{a.microbatch}" if a else ".." for a in row]
        lines.append(f"stage {s}: " + " ".join(cells).rstrip(". "))
    return "\n".join(lines)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches a stage holds activations for (forward done, backward not)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind is Kind.FORWARD else -1
        peak = max(peak, live)
    return peak


__all__ = [
    "Action",
    "Kind",
    "ScheduleError",
    "SCHEDULES",
    "draw",
    "format_actions",
    "gpipe",
    "make_schedule",
    "max_in_flight",
    "one_f_one_b",
    "parse_actions",
    "simulate",
    "validate",
]
