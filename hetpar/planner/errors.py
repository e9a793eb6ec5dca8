"""The planner's error types, named by what failed: the leaf every planner module may import.

``PlanningError``: a request no plan meets (the pins, the batch, the cluster), said in
the user's terms. ``PlanFileError``: a plan, or the file it was read from, is not a valid
hetpar plan, or no longer matches its model file: nothing was planned wrong. ``hetpar``'s
commands turn both into one line on stderr.
"""

from __future__ import annotations


class PlanningError(Exception):
    """No plan satisfies the request; the message says why and what to change."""


class PlanFileError(ValueError):
    """A plan is inconsistent, or a plan file is corrupt, not a hetpar plan, or stale against its model file."""


__all__ = ["PlanFileError", "PlanningError"]
