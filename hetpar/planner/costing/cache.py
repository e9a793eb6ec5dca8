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


def model_variant(model: ModelGraph, cache: dict, *, cp: int = 1, sequence_parallel: bool = False,
                  regather: bool = True) -> ModelGraph:
    """``model`` as one rank of ``cp`` context-parallel ranks runs it, under sequence
    parallelism where asked (``regather``: without recompute) ([Note: context parallelism
    costs] in cost_models/collectives.py, [Note: sequence parallelism costs] in
    cost_models/layers.py); made once per cache."""
    if cp == 1 and not sequence_parallel:
        return model

    def make() -> ModelGraph:
        out = model.at_context(cp)
        return out.with_sequence_parallel(regather) if sequence_parallel else out

    return memo(cache, ("variant", model_token(model, cache), cp, sequence_parallel, sequence_parallel and regather), make)
