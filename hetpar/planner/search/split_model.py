"""The CP-SAT model of one candidate's split: cut positions and stage modes.

planner.search.solve builds one per outer candidate ([Note: split objective] in
planner.costing.tables); this module holds the model ([Note: cut formulation]), the hint it
starts from and the pace bound that spares it ([Note: pace bound]).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import numpy as np

from hetpar.cost_models.memory import zero_runs
from hetpar.cost_models.pipeline import linear_step_weights
from hetpar.planner.costing import CostTables, chunk_terms
from hetpar.planner.search.split_bound import split_sum_bound
from hetpar.planner.solver import to_ticks
from hetpar.vocabulary import Recompute

if TYPE_CHECKING:  # imported where a model is built ([Note: interleaved relaxation] spares most candidates one)
    from ortools.sat.python import cp_model

# Solver resolution: the objective's scale divided into this many ticks, the largest
# device memory into this many units.
_TICKS_PER_OBJECTIVE = 1_000_000
_MEMORY_UNITS = 10_000_000


def _ticks(seconds: np.ndarray, tick_s: float) -> np.ndarray:
    """``to_ticks`` over an array."""
    return np.rint(np.asarray(seconds) / tick_s).astype(np.int64)


# [Note: pace bound]
# Before a candidate's CP-SAT model is built under a cutoff (the best plan so far), a
# bound on its tables alone may rule it out: the chunks' weighted sums at least the
# least S of [Note: split sum bound] (planner.search.split_bound; each chunk in a mode that fits
# its rank's memory alone), the largest w_c at least any layer's cheapest, and the pace
# (the slowest chunk's t_c, or round) raised to the least that any split can reach when
# each chunk must fit its rank's memory on its own in some one mode (cuts, the one-layer
# buffers and the other chunks of an interleaved rank left out: a relaxation; ZeRO-3's
# exposed gathers counted, as they are part of t_c). Whether a pace T is reachable is
# decided greedily: each chunk in turn takes the longest run of layers that some mode
# holds within T and the memory; a run that fits stays fitting when it shrinks, so if
# any split reaches T, the greedy one ends each chunk no earlier and covers every layer.
# A split that beats the cutoff has a pace below what the cutoff leaves over the other
# terms, so S is taken over the splits within that pace only (which also keeps the
# chunks short and the programme fast); the larger S leaves a smaller pace to reach,
# and the two steps are repeated once more.
def may_beat(tables: CostTables, cutoff_s: float) -> bool:
    """False when no split of ``tables`` can have an objective below ``cutoff_s``; see [Note: pace bound]."""
    cand = tables.candidate
    wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches,
                             virtual_stages=cand.virtual_stages)
    C, P = tables.num_chunks, cand.pp
    sums = float((wt.chunk_sum * tables.time_s - wt.weight_sum * tables.weight_s).min(axis=(0, 2)).sum())
    cuts = wt.chunk_sum * (C - 1) * float(tables.cut_s[..., : C - 1].min()) if C > 1 else 0.0
    weight = wt.weight_max * float(tables.weight_s.min(axis=(0, 2)).max())
    epilogue = wt.epilogue_max * (float(tables.epilogue_latency_s[:, :P].min()) + float(tables.epilogue_s.min(axis=(0, 2)).sum()) / P)
    rest = sums + cuts + epilogue + weight
    if wt.round_max == 0:
        return rest < cutoff_s * wt.scale and split_sum_bound(tables, wt) + weight < cutoff_s * wt.scale
    reach = _Reach(tables)
    for _ in range(2):
        pace = (cutoff_s * wt.scale - rest) / wt.round_max * (1 + 1e-9)
        if not (pace > 0 and reach.reachable(pace)):
            return False
        rest = max(rest, split_sum_bound(tables, wt, pace) + weight)
    pace = (cutoff_s * wt.scale - rest) / wt.round_max * (1 + 1e-9)
    return pace > 0 and reach.reachable(pace)


# [Note: objective floor]
# The pace bound answers "can any split beat this cutoff?"; the same parts give a floor
# on the objective of every split, without a cutoff. The least reachable pace T0 comes
# from bisection on ``_Reach.reachable``. A split whose pace is T >= T0 costs at least
# G T + S(T) + H max_l min w_l, with S(T) the least S of [Note: split sum bound] over
# splits within pace T, which falls as T grows; so over a grid T0 = g_0 < g_1 < ...,
# every split costs at least min_i (G g_i + S(g_{i+1})) (its pace lies in some
# [g_i, g_{i+1}]), or G g_last + S(unbounded) above the grid. CP-SAT's own bound comes
# from its LP relaxation, which spreads the layers over the chunks as if they were
# divisible and so misses what whole layers cost the pace; this floor does not. The
# search prunes with it and reports it as the proven bound of a solve that stopped short.
_FLOOR_GRID = tuple(1 + 0.005 * i for i in range(41))  # g_i / T0: up to 20% above the least pace, in 0.5% steps
# The bisection stops within this fraction of the least pace, far below the grid's steps;
# the floor comes from the unreachable end, so it stays a floor.
_FLOOR_PRECISION = 1e-6


def objective_floor(tables: CostTables) -> float:
    """A lower bound on the objective, in seconds, of every split of ``tables`` that fits; see [Note: objective floor]."""
    cand = tables.candidate
    wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches,
                             virtual_stages=cand.virtual_stages)
    weight = wt.weight_max * float(tables.weight_s.min(axis=(0, 2)).max())
    unbounded = split_sum_bound(tables, wt)
    if wt.round_max == 0 or not math.isfinite(unbounded):
        return (unbounded + weight) / wt.scale
    per_layer = tables.time_s + tables.gather_fwd_s + tables.gather_bwd_s
    latency = tables.gather_fwd_latency_s + tables.gather_bwd_latency_s
    low, high = 0.0, float(np.where(np.isfinite(per_layer), per_layer, 0.0).max(axis=(0, 2)).sum() + latency.max()) + 1.0
    reach = _Reach(tables)
    if not reach.reachable(high):
        return math.inf  # no split fits whatever its pace
    while high - low > _FLOOR_PRECISION * high:  # low stays unreachable: every split's pace is above it
        middle = (low + high) / 2
        low, high = (low, middle) if reach.reachable(middle) else (middle, high)
    grid = [low * g for g in _FLOOR_GRID]
    floor = wt.round_max * grid[-1] + unbounded
    for pace, above in zip(grid, grid[1:]):
        if wt.round_max * pace + unbounded >= floor:
            break  # S(T) >= S(unbounded): no later grid point can go lower
        floor = min(floor, wt.round_max * pace + split_sum_bound(tables, wt, above))
    return (floor + weight) / wt.scale


class _Reach:
    """Whether some split of one table has every chunk within a pace and its rank's memory in some one
    mode (with several degrees, the degrees summing as ``candidate.tp_sum`` says: [Note: degree budget
    bound] in planner.search.bounds), asked at many paces: what does not depend on the pace (prefix
    sums, the runs that memory and the layers a mode cannot hold allow) is computed once."""

    def __init__(self, tables: CostTables):
        K, L, C = tables.time_s.shape
        cand = tables.candidate
        zeros = np.zeros((K, 1, C))
        allowed = np.isfinite(tables.time_s) & np.isfinite(tables.memory_bytes)
        per_layer = tables.time_s + tables.gather_fwd_s + tables.gather_bwd_s  # t_c's per-layer terms ([Note: split objective])
        self.latency = tables.gather_fwd_latency_s + tables.gather_bwd_latency_s
        self.time = np.concatenate([zeros, np.cumsum(np.where(allowed, per_layer, 0.0), axis=1)], axis=1)
        memory = np.concatenate([zeros, np.cumsum(np.where(allowed, tables.memory_bytes, 0.0), axis=1)], axis=1)
        positions = np.arange(L + 1)
        self.fixed = np.empty((K, C, L + 1), dtype=np.int64)  # the run's end by memory and by the layers mode k holds
        for k in range(K):
            for c in range(C):
                bad = np.append(np.flatnonzero(~allowed[k, :, c]), L)
                by_layers = bad[np.searchsorted(bad, positions)]  # a layer mode k cannot hold ends the run
                by_memory = np.searchsorted(memory[k, :, c], memory[k, :, c] + tables.capacity_bytes[c % cand.pp], side="right") - 1
                self.fixed[k, c] = np.minimum(by_memory, by_layers)
        self.budget = len(cand.tp_degrees) > 1 and cand.tp_sum and cand.virtual_stages == 1
        self.tables = tables

    def reachable(self, pace_s: float) -> bool:
        tables, cand = self.tables, self.tables.candidate
        K, _, C = tables.time_s.shape

        def ahead(k: int, c: int) -> np.ndarray:
            """From each position, the end of the longest run chunk c holds in mode k."""
            by_time = np.searchsorted(self.time[k, :, c], self.time[k, :, c] + (pace_s - self.latency[k, c]), side="right") - 1
            return np.minimum(by_time, self.fixed[k, c])

        if self.budget:
            steps = [[(cand.modes[k].tp, ahead(k, c)) for k in range(K)] for c in range(C)]
            return budget_reaches(steps, tables.device_types, dict(cand.tp_sum), tables.time_s.shape[1])
        return budget_reaches([[(0, ahead(k, c)) for k in range(K)] for c in range(C)], [""] * C, {"": 0}, tables.time_s.shape[1])


def budget_reaches(steps: list[list[tuple[int, np.ndarray]]], types: list[str], shares: dict[str, int], num_layers: int) -> bool:
    """Whether chunks in order, chunk c on device type ``types[c]`` taking one of ``steps[c]`` = [(devices,
    ahead)] (ahead[i]: where its run from layer i may end), hold every layer, each chunk at least one, with
    the devices of each type's (consecutive) chunks summing to its share; see [Note: degree budget bound] in
    planner.search.bounds. A chunk starting later ends no earlier, so the furthest layer per devices used decides."""
    L = num_layers
    best = np.full(shares[types[0]] + 1, -1)  # best[u]: the furthest layer reached with u of the current type's devices
    best[0] = 0
    for c, options in enumerate(steps):
        share = shares[types[c]]
        if c and types[c] != types[c - 1]:  # the previous type's devices all used
            reached, best = best[shares[types[c - 1]]], np.full(share + 1, -1)
            best[0] = reached
        nxt = np.full(share + 1, -1)
        for devices, ahead in options:
            if devices > share:  # a degree wider than the type's share per replica cannot be this type's
                continue
            start = best[: share + 1 - devices]
            far = np.where(start >= 0, ahead[np.maximum(start, 0)], -1)
            # every chunk holds a layer; once all are held, later chunks could take some from earlier ones
            nxt[devices:] = np.maximum(nxt[devices:], np.where((far > start) | (start == L), far, -1))
        best = nxt
    return bool(best[shares[types[-1]]] >= L)


def hint_degrees(tables: CostTables, bounds: list[tuple[int, int]]) -> list[int]:
    """A tensor-parallel degree per pipeline rank whose sums match ``candidate.tp_sum``: per type as even
    as the degrees allow, the larger degrees to the ranks with the most work; see [Note: per-stage tensor parallelism]."""
    cand = tables.candidate
    P, degrees = cand.pp, cand.tp_degrees
    out = [degrees[-1]] * P
    if len(degrees) == 1:
        return out
    cheapest = np.where(np.isfinite(tables.time_s), tables.time_s, np.inf).min(axis=0)  # [L, C]
    cheapest[~np.isfinite(cheapest)] = 0.0  # a layer no mode runs weighs nothing here: every mode misfits it anyway
    work = [sum(float(cheapest[a : b + 1, c].sum()) for c, (a, b) in enumerate(bounds) if c % P == r) for r in range(P)]
    for device_type, total in cand.tp_sum:
        ranks = sorted((r for r in range(P) if tables.device_types[r] == device_type), key=lambda r: -work[r])
        picks = degree_split(total, len(ranks), degrees)
        for r, d in zip(ranks, picks or [degrees[0]] * len(ranks)):
            out[r] = d
    return out


def degree_split(total: int, count: int, degrees: tuple[int, ...]) -> list[int] | None:
    """``count`` degrees (descending) summing to ``total``: two neighbouring degrees when they can, else
    the first split found largest first; None when none does."""
    ordered = sorted(degrees)
    for a, b in zip(ordered, ordered[1:] + ordered[-1:]):
        larger = (total - count * a) // (b - a) if b > a else 0
        if 0 <= larger <= count and larger * b + (count - larger) * a == total:
            return [b] * larger + [a] * (count - larger)
    return next(_splits(total, count, tuple(ordered[::-1])), None)


def _splits(total: int, count: int, degrees: tuple[int, ...]):
    """Every multiset of ``count`` of ``degrees`` (descending) summing to ``total``, each listed descending."""
    if count == 0:
        if total == 0:
            yield []
        return
    for i, d in enumerate(degrees):
        if d * count >= total >= d + degrees[-1] * (count - 1):
            for rest in _splits(total - d, count - 1, degrees[i:]):
                yield [d, *rest]


def greedy_modes(tables: CostTables, bounds: list[tuple[int, int]]) -> list[int]:
    """A mode per chunk for the solver's hint: per rank a degree (``hint_degrees``), then the fastest mode
    of that degree all its chunks can share that fits."""
    K, P = len(tables.candidate.modes), tables.candidate.pp
    degrees = hint_degrees(tables, bounds)
    modes = [0] * len(bounds)
    for r in range(P):
        chunks = list(range(r, len(bounds), P))
        scored = []
        for k in range(K):
            if tables.candidate.modes[k].tp != degrees[r]:
                continue
            terms = [chunk_terms(tables, c, *bounds[c], k) for c in chunks]
            scored.append((sum(t[3] for t in terms) > tables.capacity_bytes[r], sum(t[0] for t in terms) + max(t[2] for t in terms),
                           sum(t[3] for t in terms), k))
        best = min(scored)
        if best[0]:  # nothing fits: the smallest
            best = min(scored, key=lambda x: x[2])
        for c in chunks:
            modes[c] = best[3]
    return modes


class Unresolved(Exception):
    """The solver reached its limit before it found a split or proved there is none (under the cutoff)."""

    def __init__(self, bound_s: float, limit: str = "work"):
        super().__init__(bound_s)
        self.bound_s = bound_s
        self.limit = limit  # "work" or "time" ([Note: deterministic search] in planner.solver)


# [Note: cut formulation]
# A split is C + 1 increasing layer indices start[0] = 0 < start[1] < ... < start[C] = L.
# Every per-layer quantity of [Note: split objective] is additive, so chunk c's share
# is prefix[start[c + 1]] - prefix[start[c]] of a prefix-sum table of that chunk's
# column in its mode; per-chunk constants (the cut after the last layer, collective
# latencies) ride on the table read at start[c + 1]. Repeated layers make the tables
# affine over long runs of positions, so each start[i] is split into the few ranges on
# which every table read there is affine, one literal each, and a read is one affine
# expression per range (an element constraint per table cost CP-SAT's presolve seconds
# on 48-stage models). A chunk's mode is one literal per mode (exactly one); modes whose
# rows agree share their reads, and the chunk's sum equals the chosen group's under
# that group's literal, bounded by the elementwise-cheapest and dearest rows so that
# the LP relaxation sees the work. A range maximum (the one-layer buffers) is >= each of
# its few levels whose next layer at or after start[c] comes before start[c + 1]. The
# model has O(C) integer variables whatever the number of layers, which keeps CP-SAT
# fast on 100-layer, 64-stage instances where a layer x stage boolean model does not
# finish in seconds.
class SplitModel:
    """The CP-SAT model of [Note: split objective]; sections as in the OR-Tools samples.

    Built in two passes: each chunk first names the prefix tables it reads at its two
    cut positions, then every position is split into the few ranges where all tables
    read there are affine, and each read becomes affine per range ([Note: cut formulation]).
    """

    def __init__(self, tables: CostTables, tick_s: float, cutoff_s: float | None = None):
        self.tables, self.tick_s = tables, tick_s
        cand = tables.candidate
        L, C, P, K = tables.num_layers, tables.num_chunks, cand.pp, len(cand.modes)
        self.weights = linear_step_weights(cand.schedule, num_stages=P, num_microbatches=cand.num_microbatches,
                                           virtual_stages=cand.virtual_stages)
        self.horizon = self._horizon()
        # Memory in units of this many bytes, rounded up per layer: CP-SAT's presolve
        # misjudged models with 1e11-byte coefficients (tests/test_search_space.py).
        self.byte_unit = max(1.0, float(tables.capacity_bytes.max()) / _MEMORY_UNITS)
        self._memo: dict = {}
        from ortools.sat.python import cp_model

        model = self.model = cp_model.CpModel()

        # Variables
        # start[c] is the first layer of chunk c; start[C] = L closes the last chunk
        self.domains = [(0, 0)] + [(c, L - C + c) for c in range(1, C)] + [(L, L)]
        self.start = [model.new_int_var(lo, hi, f"start_{c}") for c, (lo, hi) in enumerate(self.domains)]
        # uses[c][k] is 1 iff chunk c runs in mode k (cand.modes[k]: its recompute and ZeRO stage)
        self.uses = [[model.new_bool_var(f"mode_{c}_{k}") for k in range(K)] if K > 1 else [model.new_constant(1)] for c in range(C)]
        # segment[i][j] is 1 iff start[i] lies in the j-th range where every table read at it is affine
        specs = [self._chunk_spec(c) for c in range(C)]
        self._segments = [self._segment(i) for i in range(C + 1)]

        # Constraints
        # chunk_time[c], chunk_weight[c], epilogue[c], memory[c]: the chunk's t_c, w_c, share of e_r, bytes
        chunk_time, chunk_weight, epilogue, memory = [], [], [], []
        for c in range(C):
            model.add(self.start[c + 1] >= self.start[c] + 1)  # every chunk holds at least one layer
            if K > 1:
                model.add_exactly_one(self.uses[c])
            self._forbid_unsplit(c, specs[c])
            t, w, e, mem = self._chunk_terms(c, specs[c])
            if "reshard" in specs[c]:
                t = t + self._reshard(c, specs[c]["reshard"])
            chunk_time.append(t)
            chunk_weight.append(w)
            epilogue.append(e)
            memory.append(mem)
        for r in range(P):
            model.add(sum(memory[r::P]) <= int(tables.capacity_bytes[r] // self.byte_unit))
        # The degrees of a type's stages sum to its devices per replica ([Note: per-stage tensor parallelism])
        for device_type, total in cand.tp_sum if len(cand.tp_degrees) > 1 else ():  # one degree: the enumeration made it sum
            ranks = [r for r in range(P) if tables.device_types[r] == device_type]
            model.add(sum(mode.tp * self.uses[r][k] for r in ranks for k, mode in enumerate(cand.modes)) == total)
        # round_time[j] >= t_c of every chunk of round j (chunks j P .. j P + P - 1): the slowest
        round_time = [model.new_int_var(0, self.horizon, f"round_time_{j}") for j in range(cand.virtual_stages)]
        for c in range(C):
            model.add(round_time[c // P] >= chunk_time[c])
        slowest_epilogue = model.new_int_var(0, self.horizon, "slowest_epilogue")
        for r in range(P):
            model.add(slowest_epilogue >= sum(epilogue[r::P]))
        wt = self.weights
        objective = wt.chunk_sum * sum(chunk_time) + wt.round_max * sum(round_time) + wt.epilogue_max * slowest_epilogue
        if wt.weight_sum or wt.weight_max:
            largest_weight = model.new_int_var(0, self.horizon, "largest_weight")
            for w in chunk_weight:
                model.add(largest_weight >= w)
            objective += wt.weight_max * largest_weight - wt.weight_sum * sum(chunk_weight)
        if cutoff_s is not None:  # only a plan better than one found already is of interest
            model.add(objective <= to_ticks(cutoff_s * wt.scale, tick_s))
        # Of equally fast plans, the plainest: one objective unit (1 / scale of a tick) per
        # stage that shards (ZeRO) or recomputes.
        plainness = [k for k, mode in enumerate(cand.modes) if mode.zero_stage or mode.recompute != Recompute.NONE]
        if K > 1 and plainness:
            objective += sum(self.uses[c][k] for c in range(C) for k in plainness)

        # Objective
        model.minimize(objective)

    def modes(self, solver: cp_model.CpSolver) -> list[int]:
        return [next(k for k, u in enumerate(uses) if solver.boolean_value(u)) if len(uses) > 1 else 0 for uses in self.uses]

    def hint(self, bounds: list[tuple[int, int]], modes: list[int]) -> None:
        for c in range(1, self.tables.num_chunks):
            self.model.add_hint(self.start[c], bounds[c][0])
        if len(self.tables.candidate.modes) > 1:
            for c, k in enumerate(modes):
                for j, u in enumerate(self.uses[c]):
                    self.model.add_hint(u, j == k)

    def _horizon(self) -> int:
        t = self.tables
        time = np.where(np.isfinite(t.time_s), t.time_s, 0.0)
        per_layer = time.max(axis=(0, 2)) + t.gather_bwd_s.max(axis=(0, 2)) + t.gather_fwd_s.max(axis=(0, 2)) + t.epilogue_s.max(axis=(0, 2))
        extra = t.cut_s.max() + t.gather_fwd_latency_s.max() + t.gather_bwd_latency_s.max() + t.epilogue_latency_s.max()
        return to_ticks(float(per_layer.sum() + extra * t.num_chunks), self.tick_s) + 2 * t.num_layers + t.num_chunks + 1

    # --- Pass 1: what each chunk reads ----------------------------------------------------

    def _chunk_spec(self, c: int) -> dict:
        """The prefix tables chunk c reads, by term; see [Note: split objective]."""
        t, cand = self.tables, self.tables.candidate
        K, L = len(cand.modes), t.num_layers
        own = [t.tp_index(k) for k in range(K)]
        if c + 1 < t.num_chunks:
            last_cut = np.stack([np.concatenate([[0.0], t.cut_s[a, a, :, c]]) for a in own])
        else:
            last_cut = np.zeros((K, L + 1))
        allowed = np.isfinite(t.time_s[:, :, c]) & np.isfinite(t.memory_bytes[:, :, c])
        spec = {"time": self._range_spec(c, np.where(allowed, t.time_s[:, :, c], 0.0), last_cut)}
        spec["unsplit"] = self._unsplit_spec(c, allowed)
        if c + 1 < t.num_chunks and len(cand.tp_degrees) > 1:
            spec["reshard"] = self._reshard_spec(c)
        zero3 = np.array([m.zero_stage == 3 and zero_runs(cand.dp, 3, m.offload) for m in cand.modes])
        if zero3.any():
            # All exposed ([Note: split objective]): nothing of the compute hides them.
            for name, gather, latency in (
                ("gather_fwd", t.gather_fwd_s, t.gather_fwd_latency_s),
                ("gather_bwd", t.gather_bwd_s, t.gather_bwd_latency_s),
            ):
                excess = np.where(zero3[:, None], gather[:, :, c], 0.0)
                spec[name] = self._range_spec(c, excess, np.where(zero3, latency[:, c], 0.0)[:, None] * np.ones(L + 1))
        if self.weights.weight_sum:
            spec["weight"] = self._range_spec(c, t.weight_s[:, :, c])
        spec["epilogue"] = self._range_spec(c, t.epilogue_s[:, :, c], t.epilogue_latency_s[:, c][:, None] * np.ones(L + 1))
        spec["memory"] = self._range_spec(c, np.where(allowed, t.memory_bytes[:, :, c], 0.0), bytes_=True)
        spec["buffers"] = []
        families = [
            family
            for a, tp in enumerate(cand.tp_degrees)
            for family in (
                (f"workspace_tp{tp}", t.workspace_bytes[a], [k for k, m in enumerate(cand.modes) if m.recompute != Recompute.NONE and m.tp == tp]),
                (f"gradient_tp{tp}", t.gradient_bytes[a], [k for k, m in enumerate(cand.modes) if m.tp == tp]),
                (f"zero3_tp{tp}", t.zero3_buffer_bytes[a], [k for k, m in enumerate(cand.modes) if m.zero_stage == 3 and zero_runs(cand.dp, 3, m.offload) and m.tp == tp]),
            )
        ]
        for name, values, members in families:
            if members:
                levels = sorted({int(math.ceil(v / self.byte_unit)) for v in values}, reverse=True)
                steps = [(level, self._want(c, self._next_at(values, level))) for level in levels[:-1]]
                spec["buffers"].append((name, members, levels, steps))
        return spec

    def _unsplit_spec(self, c: int, allowed: np.ndarray) -> list[tuple[list[int], tuple[int, ...] | None]]:
        """[(modes, next_bad)]: modes that cannot hold some layer of column c, with next_bad[i] the first such
        layer at or after i (None: none at all may be held)."""
        groups: dict = {}
        for k in range(allowed.shape[0]):
            if not allowed[k].all():
                groups.setdefault(allowed[k].tobytes(), []).append(k)
        out = []
        for members in groups.values():
            row = allowed[members[0]]
            if not row.any():
                out.append((members, None))
                continue
            L, nxt, next_bad = len(row), len(row), [len(row)] * (len(row) + 1)
            for i in range(L - 1, -1, -1):
                nxt = i if not row[i] else nxt
                next_bad[i] = nxt
            out.append((members, self._want(c, tuple(next_bad))))
        return out

    def _reshard_spec(self, c: int) -> dict:
        """(a, b) -> the table read at start[c + 1] of the cut's extra seconds when chunk c at degree a
        hands over to chunk c + 1 at degree b, over what it costs between equal degrees."""
        t = self.tables
        out = {}
        for a in range(len(t.candidate.tp_degrees)):
            for b in range(len(t.candidate.tp_degrees)):
                extra = _ticks(np.concatenate([[0.0], t.cut_s[a, b, :, c] - t.cut_s[a, a, :, c]]), self.tick_s)
                out[a, b] = self._want(c + 1, tuple(extra.tolist()))
        return out

    def _range_spec(self, c: int, values: np.ndarray, end_extra: np.ndarray | None = None, bytes_: bool = False) -> tuple[list, list]:
        """([(modes, table read at start[c], table read at start[c + 1])], envelopes): the modes whose rows
        agree share one pair; the envelopes bound every mode's sum from below and above (for the LP relaxation)."""
        key = ("spec", values.tobytes(), None if end_extra is None else np.ascontiguousarray(end_extra).tobytes(), bytes_)
        if key not in self._memo:
            self._memo[key] = self._range_tables(values, end_extra, bytes_)
        groups, envelopes = self._memo[key]
        return ([(members, self._want(c, lo), self._want(c + 1, hi)) for members, lo, hi in groups],
                [(self._want(c, lo), self._want(c + 1, hi)) for lo, hi in envelopes])

    def _range_tables(self, values: np.ndarray, end_extra: np.ndarray | None, bytes_: bool) -> tuple[list, list]:
        """The integer prefix tables of ``_range_spec``, not yet tied to positions."""
        K, L = values.shape
        per_layer = np.ceil(values / self.byte_unit).astype(np.int64) if bytes_ else _ticks(values, self.tick_s)
        extra = np.zeros((K, L + 1), dtype=np.int64) if end_extra is None else (np.ceil(end_extra / self.byte_unit).astype(np.int64) if bytes_ else _ticks(end_extra, self.tick_s))

        def prefix(rows: np.ndarray) -> np.ndarray:
            return np.concatenate([np.zeros((rows.shape[0], 1), dtype=np.int64), np.cumsum(rows, axis=1)], axis=1)

        starts = prefix(per_layer)
        ends = starts + extra
        groups: dict = {}
        for k in range(K):
            groups.setdefault((tuple(starts[k].tolist()), tuple(ends[k].tolist())), []).append(k)
        out = [(members, lo, hi) for (lo, hi), members in groups.items()]
        envelopes = []
        if len(out) > 1:
            for pick in (np.min, np.max):
                rows = prefix(pick(per_layer, axis=0, keepdims=True))[0]
                envelopes.append((tuple(rows.tolist()), tuple((rows + pick(extra, axis=0)).tolist())))
        return out, envelopes

    def _want(self, i: int, table: tuple[int, ...]) -> tuple[int, ...]:
        self._memo.setdefault(("tables", i), set()).add(table)
        return table

    def _next_at(self, values: np.ndarray, level: int) -> tuple[int, ...]:
        """next_at[i]: the first layer at or after i whose value reaches ``level`` (L if none)."""
        L = len(values)
        out, nxt = [L] * (L + 1), L
        for i in range(L - 1, -1, -1):
            if math.ceil(values[i] / self.byte_unit) >= level:
                nxt = i
            out[i] = nxt
        return tuple(out)

    def _segment(self, i: int) -> list[tuple[int, int, object]]:
        """Ranges [a, b] of start[i] on which every table read there is affine, with their literals."""
        lo, hi = self.domains[i]
        tables = self._memo.get(("tables", i))
        cuts = []
        if tables and hi - lo > 1:
            window = np.array(list(tables), dtype=np.int64)[:, lo : hi + 1]
            bends = (np.diff(window, n=2, axis=1) != 0).any(axis=0)  # bends[j]: a kink at position lo + 1 + j
            cuts = [lo + 1 + int(j) for j in np.flatnonzero(bends)]
        ranges = [(a, b) for a, b in zip([lo] + [k + 1 for k in cuts], cuts + [hi]) if a <= b]
        if len(ranges) == 1:
            return [(lo, hi, None)]
        out = []
        for a, b in ranges:
            lit = self.model.new_bool_var("")
            self.model.add_linear_constraint(self.start[i], a, b).only_enforce_if(lit)
            out.append((a, b, lit))
        self.model.add_exactly_one(lit for _, _, lit in out)
        return out

    # --- Pass 2: the reads as expressions -------------------------------------------------

    def _read(self, i: int, table: tuple[int, ...]):
        """An expression equal to table[start[i]]: affine on each range of start[i]."""
        key = ("read", i, table)
        if key in self._memo:
            return self._memo[key]
        pieces = []
        for a, b, lit in self._segments[i]:
            slope = table[a + 1] - table[a] if b > a else 0
            pieces.append((table[a] - slope * a, slope, lit))
        if len(pieces) == 1:
            offset, slope, _ = pieces[0]
            expr = offset + slope * self.start[i] if slope else offset
        else:
            lo, hi = self.domains[i]
            expr = self.model.new_int_var(min(table[lo : hi + 1]), max(table[lo : hi + 1]), "")
            for offset, slope, lit in pieces:
                self.model.add(expr == offset + slope * self.start[i]).only_enforce_if(lit)
        self._memo[key] = expr
        return expr

    def _chunk_terms(self, c: int, spec: dict):
        """(t_c, w_c, epilogue share, memory) of chunk c as linear expressions."""
        chunk_time = self._range_sum(c, "time", spec["time"])
        for name in ("gather_fwd", "gather_bwd"):
            if name in spec:
                # exposed >= the gathers' excess over the compute they overlap (none outside ZeRO-3), and >= 0
                exposed = self.model.new_int_var(0, self.horizon, f"{name}_exposed_{c}")
                self.model.add(exposed >= self._range_sum(c, name, spec[name]))
                chunk_time = chunk_time + exposed
        weight = self._range_sum(c, "weight", spec["weight"]) if "weight" in spec else 0
        epilogue = self._range_sum(c, "epilogue", spec["epilogue"])
        memory = self._range_sum(c, "memory", spec["memory"])
        for name, members, levels, steps in spec["buffers"]:
            memory = memory + self._range_max(c, name, members, levels, steps)
        return chunk_time, weight, epilogue, memory

    def _forbid_unsplit(self, c: int, spec: dict) -> None:
        """Chunk c takes no mode whose degree one of its layers cannot split."""
        for members, next_bad in spec["unsplit"]:
            if next_bad is None:
                for k in members:
                    self.model.add(self.uses[c][k] == 0)
            else:
                self.model.add(self._read(c, next_bad) >= self.start[c + 1]).only_enforce_if(self._in_modes(c, members))

    def _reshard(self, c: int, spec: dict):
        """The extra seconds of chunk c's cut when the next chunk's degree differs from its own."""
        degrees = self.tables.candidate.tp_degrees
        low = min(min(v) for v in spec.values())
        high = max(max(v) for v in spec.values())
        extra = self.model.new_int_var(min(low, 0), max(high, 0), f"reshard_{c}")
        for (a, b), table in spec.items():
            here, there = self._degree_literal(c, degrees[a]), self._degree_literal(c + 1, degrees[b])
            self.model.add(extra == (self._read(c + 1, table) if any(table) else 0)).only_enforce_if([here, there])
        return extra

    def _degree_literal(self, c: int, tp: int):
        """A literal that is 1 iff chunk c's degree is ``tp``."""
        return self._in_modes(c, [k for k, m in enumerate(self.tables.candidate.modes) if m.tp == tp])

    def _range_sum(self, c: int, name: str, spec: tuple[list, list]):
        """Chunk c's sum over its layers in its mode: one group's difference of reads, chosen by the mode."""
        groups, envelopes = spec
        diffs = [(self._read(c + 1, hi) - self._read(c, lo) if any(lo) or any(hi) else 0, members) for members, lo, hi in groups]
        if len(diffs) == 1:
            return diffs[0][0]
        low = min(min(lo) for _, lo, _ in groups) - max(max(hi) for _, _, hi in groups)
        high = max(max(hi) for _, _, hi in groups) - min(min(lo) for _, lo, _ in groups)
        value = self.model.new_int_var(min(low, 0), max(high, 0), f"{name}_{c}")
        for diff, members in diffs:
            self.model.add(value == diff).only_enforce_if(self._in_modes(c, members))
        (low_lo, low_hi), (high_lo, high_hi) = envelopes
        self.model.add(value >= self._read(c + 1, low_hi) - self._read(c, low_lo))
        self.model.add(value <= self._read(c + 1, high_hi) - self._read(c, high_lo))
        return value

    def _in_modes(self, c: int, members: list[int]):
        """A literal that is 1 iff chunk c's mode is one of ``members``."""
        uses = self.uses[c]
        if len(members) == len(uses):
            return self.model.new_constant(1)
        if len(members) == 1:
            return uses[members[0]]
        key = ("modes", c, tuple(members))
        if key not in self._memo:
            lit = self.model.new_bool_var("")
            self.model.add(lit == sum(uses[k] for k in members))
            self._memo[key] = lit
        return self._memo[key]

    def _range_max(self, c: int, name: str, members: list[int], levels: list[int], steps: list):
        """A variable >= the largest level among chunk c's layers when its mode is one of ``members``, else >= 0:
        a level counts when its next layer at or after start[c] comes before start[c + 1]."""
        model = self.model
        in_mode = self._in_modes(c, members)
        buffer = model.new_int_var(0, levels[0], f"{name}_{c}")
        model.add(buffer >= levels[-1]).only_enforce_if(in_mode)
        for level, next_at in steps:
            holds = model.new_bool_var("")
            model.add(self._read(c, next_at) >= self.start[c + 1]).only_enforce_if(~holds)
            model.add(buffer >= level).only_enforce_if([holds, in_mode])
        return buffer
