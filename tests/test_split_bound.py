"""[Note: split sum bound]: the dynamic programme never exceeds the chunks' share of the objective of any
split that fits, on instances small enough to enumerate (tests/search_tables.py)."""

import itertools
import zlib

import numpy as np
import pytest

from hetpar.cost_models.pipeline import linear_step_weights
from hetpar.planner.costing import chunk_terms, evaluate_split
from hetpar.planner.search import objective_floor
from hetpar.planner.search.split_bound import split_sum_bound
from search_tables import RECOMPUTE, ZERO, brute_force, compositions, random_tables

# (layers, pp, v, m, schedule, modes, memory, degrees, devices)
CASES = [
    (L, pp, v, m, schedule, modes, memory, (1,), None)
    for schedule, pp, v, m in (("1f1b", 3, 1, 4), ("zb", 3, 1, 2), ("zb", 2, 1, 5), ("interleaved", 2, 2, 4), ("gpipe", 2, 1, 3))
    for modes in (RECOMPUTE, ZERO) if modes is RECOMPUTE or schedule in ("1f1b", "gpipe")
    for L in (pp * v + 1, 6)
    for memory in (0.7, 1.2, 100)
] + [
    (L, pp, 1, 4, "1f1b", modes, memory, degrees, devices)
    for pp, degrees, devices in ((2, (1, 2), 3), (3, (1, 2), 5))
    for modes in (RECOMPUTE, ZERO[::3])
    for L in (pp + 1, 6)
    for memory in (0.6, 100)
]


def _shares(tables):
    """(largest t_c, S of [Note: split sum bound]) of every split and mode list that fits."""
    cand = tables.candidate
    wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches, virtual_stages=cand.virtual_stages)
    out = []
    C, K = tables.num_chunks, len(cand.modes)
    for bounds in compositions(tables.num_layers, C):
        for modes in itertools.product(range(K), repeat=C):
            if not evaluate_split(tables, bounds, list(modes)).fits(tables):
                continue
            terms = [chunk_terms(tables, c, a, b, modes[c], modes[c + 1] if c + 1 < C else None) for c, (a, b) in enumerate(bounds)]
            share = sum(wt.chunk_sum * t - wt.weight_sum * w + wt.epilogue_max / cand.pp * e for t, w, e, _ in terms)
            out.append((max(t for t, _, _, _ in terms), share))
    return wt, out


@pytest.mark.parametrize("num_layers,pp,v,m,schedule,modes,memory,degrees,devices", CASES)
def test_split_sum_bound_never_exceeds_a_fitting_split(num_layers, pp, v, m, schedule, modes, memory, degrees, devices):
    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, v, m, schedule, len(modes), memory, degrees)).encode()))
    tables = random_tables(rng, num_layers, pp, m, modes=modes, schedule=schedule, virtual_stages=v, memory=memory,
                           degrees=degrees, devices=devices)
    wt, shares = _shares(tables)
    if not shares:
        return
    tolerance = 1e-9 * max(abs(s) for _, s in shares) + 1e-15
    assert split_sum_bound(tables, wt) <= min(s for _, s in shares) + tolerance
    for pace in sorted({t for t, _ in shares})[:: max(1, len(shares) // 12)]:
        within = min(s for t, s in shares if t <= pace)
        assert split_sum_bound(tables, wt, pace) <= within + tolerance


def test_split_sum_bound_is_tight_without_maxima():
    """With one mode and ample memory the programme's S is the best split's own (it is exact, not only a bound)."""
    rng = np.random.default_rng(7)
    tables = random_tables(rng, 7, 3, 4, memory=100)
    wt, shares = _shares(tables)
    assert split_sum_bound(tables, wt) == pytest.approx(min(s for _, s in shares), rel=1e-12)


def test_split_sum_bound_sees_what_memory_forces():
    """Too little memory for the plain mode: the bound pays for ZeRO or recomputation, per-layer minima do not."""
    rng = np.random.default_rng(3)
    tables = random_tables(rng, 6, 2, 4, modes=ZERO, memory=0.7)
    wt, shares = _shares(tables)
    assert shares
    per_layer = float((wt.chunk_sum * tables.time_s - wt.weight_sum * tables.weight_s + wt.epilogue_max / 2 * tables.epilogue_s)
                      .min(axis=(0, 2)).sum())
    assert per_layer < split_sum_bound(tables, wt) <= min(s for _, s in shares) * (1 + 1e-9)


@pytest.mark.parametrize("num_layers,pp,v,m,schedule,modes,memory,degrees,devices", CASES[::2])
def test_objective_floor_never_exceeds_the_brute_force_optimum(num_layers, pp, v, m, schedule, modes, memory, degrees, devices):
    """[Note: objective floor]: a bound on every split that fits, so on the best one."""
    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, v, m, schedule, len(modes), memory, degrees)).encode()))
    tables = random_tables(rng, num_layers, pp, m, modes=modes, schedule=schedule, virtual_stages=v, memory=memory,
                           degrees=degrees, devices=devices)
    best = brute_force(tables)
    floor = objective_floor(tables)
    if best is None:
        return
    assert floor <= best[0] * (1 + 1e-9)
