"""The cache the cost tables share across candidates: per-layer columns, collective fits and
hand-offs, computed once and keyed so that equal placements share an entry."""

from __future__ import annotations

from hetpar.planner.model_graph import ModelGraph


def memo(cache: dict, key, compute):
    """``cache[key]``, computed by ``compute()`` the first time it is asked for."""
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def model_token(model: ModelGraph, cache: dict) -> int:
    """A number that names ``model`` in ``cache`` (which keeps the model, so that its id is not reused)."""
    return memo(cache, ("model", id(model)), lambda: (model, len(cache)))[1]
