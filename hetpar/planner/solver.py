"""Shared solver helpers: CP-SAT configured for [Note: deterministic search], seconds as
integer ticks, which limit stopped a solve, and divisors.

One small leaf module, so that the tensor-parallel finder (planner.capture), the split
model (planner.search) and the strategies over the search all configure CP-SAT alike
without importing each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # CP-SAT's module imports pandas (a third of a second): imported where a model is solved
    from ortools.sat.python import cp_model


def to_ticks(seconds: float, tick_s: float) -> int:
    """The one place where seconds become integer solver ticks (``planner.search.split_model._ticks`` maps it over arrays)."""
    return int(round(seconds / tick_s))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# [Note: deterministic search]
# A plan must not depend on how fast or how busy the machine is. Every CP-SAT solve of
# the planner stops on a work limit, CP-SAT's deterministic time (max_deterministic_time:
# a weighted count of the solver's operations, calibrated to about a second of one core);
# one worker is then deterministic, and several run in lockstep batches (interleave_search:
# the search is a function of the model, num_workers and random_seed, per sat_parameters.proto).
# The same request gives the same plan, status and gap on a laptop or a busy login node,
# only later. A wall-clock --time-limit stays as an opt-in safety net; a solve it cuts
# short is named in the plan's status, as where it stopped depends on the machine.
# One worker by default: OR-Tools 9.15's interleaved search with 2 workers and its default
# batch of 3 * workers tasks aborted the process (CHECK "heuristics.fixed_search !=
# nullptr") on a split model that max_lp proves infeasible while loading; batches of
# `workers` tasks did not, so more workers run with that batch size.
def cp_solver(*, work_limit_s: float, workers: int, seed: int, time_limit_s: float | None = None) -> cp_model.CpSolver:
    """A CP-SAT solver whose answer depends only on its model and these arguments; see [Note: deterministic search].

    Args:
        work_limit_s: deterministic seconds the solve may take.
        workers: CP-SAT workers; more than one run in deterministic batches.
        seed: CP-SAT's random seed.
        time_limit_s: wall-clock seconds, when a safety net is wanted (None: none).
    """
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = work_limit_s
    solver.parameters.num_workers = workers
    if workers > 1:
        solver.parameters.interleave_search = True
        solver.parameters.interleave_batch_size = workers
    solver.parameters.random_seed = seed
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = time_limit_s
    return solver


def limit_hit(solver: cp_model.CpSolver, time_limit_s: float | None) -> str:
    """Which limit stopped a solve that did not finish: "time" (the wall clock) or "work"."""
    return "time" if time_limit_s is not None and solver.wall_time >= time_limit_s else "work"


__all__ = ["cp_solver", "divisors", "limit_hit", "to_ticks"]
