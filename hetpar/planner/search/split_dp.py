"""An exact split solver without CP-SAT for candidates of one chunk per pipeline rank.

planner.search.solve calls ``solve_split_dp`` before it builds a CP-SAT model; see
[Note: split by dynamic programming].
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from hetpar.cost_models.pipeline import linear_step_weights
from hetpar.planner.costing import CostTables, evaluate_split
from hetpar.planner.search.split_bound import chunk_buffers, longest_chunk
from hetpar.vocabulary import Recompute

# Candidates whose option arrays (modes x degrees x layers x chunk lengths x chunks)
# exceed this many entries go to CP-SAT: the programme's memory and time grow with it.
MAX_OPTIONS = 2_000_000
# Relative slack on memory comparisons: prefix-sum differences here, slice sums in
# planner.costing.chunk_terms.
_SLACK = 1e-9
# Of equally fast splits, the plainest: each chunk that shards (ZeRO) or recomputes
# costs this fraction of the objective's scale ([Note: split by dynamic programming]).
_PLAINNESS = 1e-9
# Bound and incumbent closer than this fraction are equal (float rounding of the sums).
_TOLERANCE = 1e-12
# Programmes one interleaved candidate's relaxation solves before CP-SAT takes over, in the first pass and in
# the pass that tries to prove the best split it found optimal ([Note: interleaved relaxation]).
_RELAXATION_SOLVES = 32
_PROOF_SOLVES = 160


# [Note: split by dynamic programming]
# With one chunk per pipeline rank (v = 1), [Note: split objective] is a sum over the
# chunks, A sum_c t_c - B sum_c w_c, plus three maxima, G max_c t_c + H max_c w_c +
# E max_c e_c ([Note: linear step time]); each chunk's memory binds its own rank alone,
# and the degrees' sums per device type ([Note: per-stage tensor parallelism]) are a
# count carried along the chunks. Under caps (T, W, E) on the three maxima, the least
# sum g(T, W, E) is a shortest path over (chunk, end layer, the next chunk's degree,
# the devices its type has used), exact: every chunk's mode, length and hand-off cost
# are read from the tables as chunk_terms reads them. g falls as the caps rise, so
# over a box of caps [T1, T2] x [W1, W2] x [E1, E2] every split whose maxima lie in
# it costs at least G T1 + H W1 + E E1 + g(T2, W2, E2), and the split that attains
# g(T2, W2, E2) is a real split whose objective is an upper bound. The root box runs
# from the least each maximum reaches over every fitting split (a bottleneck path: max
# in place of sum) to the most it can be in a split that beats the incumbent, the sum
# and the other maxima at their least. Branch and bound over boxes of the caps'
# distinct values (bisecting the widest) then ends with the optimum and its proof, or
# with no split below a cutoff. The candidate's objective
# is the exact float of evaluate_split (CP-SAT's is rounded to ticks), ties going to
# the split with fewest chunks that shard or recompute. Interleaved candidates
# (v > 1: a rank's chunks share its memory and epilogue) stay with CP-SAT, which the
# programme's relaxation spares where it can ([Note: interleaved relaxation]).
#
# [Note: interleaved relaxation]
# With v chunks per rank the step is A sum_c t_c + G sum_j max_{c in round j} t_c +
# E max_r e_r ([Note: linear step time]), and a rank's memory and epilogue sum over its
# chunks, which lie apart in the layer order. The same programme then solves a
# relaxation: each round's maximum is a dimension of the caps (v of them), each chunk
# need only fit its rank's memory alone, and E max_r e_r >= E sum_r mu_r e_r for any
# weights mu_r >= 0 summing to 1 joins the sum. Its optimum is a lower bound on every
# split's objective. The first pass weighs the ranks alike (mu_r = 1/P) and stops after
# _RELAXATION_SOLVES programmes (the least bound of its open boxes is still a bound);
# where its best fitting split is not proven, a second pass puts all the weight on that
# split's heaviest rank, which bounds it exactly, and tries (for _PROOF_SOLVES
# programmes) to show that no split's relaxation falls below it. The search asks the
# relaxation first: a bound at or above the cutoff rules the candidate out without
# CP-SAT (the common case once a good plan is known); a fitting split that attains the
# bound is the optimum; otherwise CP-SAT solves the candidate from the best fitting
# split the relaxation saw (it already beats the cutoff, so CP-SAT runs without one,
# which it proves faster) and reports the relaxation's bound where it stops short.
@dataclass(frozen=True)
class DpSplit:
    """The best fitting split found (None: none below the cutoff), a lower bound in seconds on every split's
    objective, and whether the split is proven optimal (always where ``dp_eligible``)."""

    bounds: list[tuple[int, int]] | None
    modes: list[int] | None
    lower_s: float = 0.0
    exact: bool = True


def dp_eligible(tables: CostTables) -> bool:
    """Whether ``solve_split_dp`` takes this candidate: one chunk per rank and option arrays of bounded size."""
    cand = tables.candidate
    if cand.virtual_stages != 1:
        return False
    K, L, C = tables.time_s.shape
    return K * len(cand.tp_degrees) * L * max(_longest(tables), 1) * C <= MAX_OPTIONS


def dp_relaxes(tables: CostTables) -> bool:
    """Whether ``solve_split_dp`` gives an interleaved candidate its relaxation's bound ([Note: interleaved relaxation])."""
    cand = tables.candidate
    K, L, C = tables.time_s.shape
    return cand.virtual_stages > 1 and len(cand.tp_degrees) == 1 and K * L * max(_longest(tables), 1) * C <= MAX_OPTIONS


def _longest(tables: CostTables) -> int:
    """The most layers one chunk can hold: split_bound's span, memory alone (0: some layer fits nowhere)."""
    allowed = np.isfinite(tables.time_s) & np.isfinite(tables.memory_bytes)
    return longest_chunk(tables, allowed, np.where(allowed, tables.time_s, 0.0), np.where(allowed, tables.memory_bytes, 0.0), None)


class _Options:
    """Per chunk, every (mode, start, length) with its terms, and the hand-off cost per next degree."""

    def __init__(self, tables: CostTables, fixed_sizes: tuple[int, ...] | None):
        cand = tables.candidate
        K, L, C = tables.time_s.shape
        self.tables, self.K, self.L, self.C = tables, K, L, C
        self.wt = linear_step_weights(cand.schedule, num_stages=cand.pp, num_microbatches=cand.num_microbatches,
                                      virtual_stages=cand.virtual_stages)
        self.P, self.v = cand.pp, cand.virtual_stages
        self.degrees = cand.tp_degrees
        T = len(self.degrees)
        self.span = span = max(_longest(tables), 1)
        self.deg = np.array([tables.tp_index(k) for k in range(K)])
        allowed = np.isfinite(tables.time_s) & np.isfinite(tables.memory_bytes)

        starts = np.arange(L)[:, None]
        ends = np.minimum(starts + np.arange(1, span + 1)[None, :], L)  # [L, span]
        inside = (starts + np.arange(1, span + 1)[None, :]) <= L
        # the sums over every run of layers, of the per-layer terms at once: [5, K, L, span, C]
        per_layer = np.stack([tables.time_s + tables.gather_fwd_s + tables.gather_bwd_s, tables.weight_s, tables.epilogue_s,
                              tables.memory_bytes, np.zeros_like(tables.time_s)])
        per_layer = np.where(allowed, per_layer, 0.0)
        per_layer[4] = ~allowed  # layers a mode cannot hold
        prefix = np.concatenate([np.zeros((5, K, 1, C)), np.cumsum(per_layer, axis=2)], axis=2)
        time, self.weight, epilogue, memory, bad = prefix[:, :, ends, :] - prefix[:, :, starts, :]
        self.time = time + (tables.gather_fwd_latency_s + tables.gather_bwd_latency_s)[:, None, None, :]
        self.epilogue = epilogue + tables.epilogue_latency_s[:, None, None, :]
        memory = memory + chunk_buffers(tables, span)[..., None]
        ok = (memory <= tables.capacity_bytes[np.arange(C) % cand.pp] * (1 + _SLACK)) & (bad < 0.5) & inside[None, :, :, None]
        if fixed_sizes:
            pinned = np.zeros((L, span, C), dtype=bool)
            first = 0
            for c, size in enumerate(fixed_sizes):
                if size <= span:  # a longer chunk fits no memory
                    pinned[first, size - 1, c] = True
                first += size
            ok &= pinned[None]
        self.ok = ok
        # cut[a, b]: [L, span, C] the hand-off after the chunk's last layer from degree a to the next chunk's b (none after the last)
        last = ends - 1
        self.cut = np.zeros((T, T, L, span, C))
        if C > 1:
            self.cut[..., : C - 1] = tables.cut_s[:, :, last, : C - 1]
        plain = np.array([0.0 if (m.zero_stage == 0 and m.recompute == Recompute.NONE) else 1.0 for m in cand.modes])
        self.plain = plain
        # the budget of each type: its devices per replica, when the degrees differ ([Note: degree budget bound])
        self.budget = len(self.degrees) > 1 and bool(cand.tp_sum)
        self.types = tables.device_types
        self.shares = dict(cand.tp_sum) if self.budget else {}


class _Programme:
    """g(T, W, E) of [Note: split by dynamic programming] and the split attaining it."""

    def __init__(self, opts: _Options, epsilon: float, rank_share: np.ndarray | None = None):
        """``rank_share``: with v > 1, the weights (summing to 1) of the ranks' epilogues in the relaxation's sum."""
        self.o = opts
        wt = opts.wt
        self.epsilon = epsilon
        self.value = wt.chunk_sum * opts.time - wt.weight_sum * opts.weight + epsilon * opts.plain[:, None, None, None]
        if opts.v > 1:  # [Note: interleaved relaxation]: E max_r e_r >= E sum_r mu_r e_r
            share = np.full(opts.P, 1.0 / opts.P) if rank_share is None else rank_share
            self.value = self.value + wt.epilogue_max * share[np.arange(opts.C) % opts.P] * opts.epilogue
        self.cut_value = wt.chunk_sum * opts.cut
        L, span = opts.L, opts.span
        j = np.arange(L + 1)[:, None]
        d = np.arange(1, span + 1)[None, :]
        self.src = j - d  # [L + 1, span]: where a chunk of d layers ending before j starts
        self.valid_src = self.src >= 0
        self.src_clip = np.maximum(self.src, 0)
        self.by_degree = [np.flatnonzero(opts.deg == a) for a in range(len(opts.degrees))]
        self.lengths = np.arange(span)[None, :]
        self.rounds = np.arange(opts.C) // opts.P  # each chunk's round
        self._pairs: dict = {}

    def values(self, i: int, low: float, high: float) -> np.ndarray:
        """The distinct values within [low, high], ascending, of maximum i (``solve``'s order) over the fitting options."""
        o = self.o
        if i >= o.v:
            a = (o.weight, o.epilogue)[i - o.v][o.ok]
            return np.unique(a[(a >= low) & (a <= high)])
        parts = []
        for a, ka in enumerate(self.by_degree):
            for b in range(len(o.degrees)):
                t = self._pair(a, b)[0][..., self.rounds == i]
                t = t[o.ok[ka][..., self.rounds == i]]
                parts.append(t[(t >= low) & (t <= high)])
        return np.unique(np.concatenate(parts))

    def _pair(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(t_c, the programme's value) of every option of degree a handing over to degree b: [|ka|, L, span, C]."""
        key = (a, b)
        if key not in self._pairs:
            o, ka = self.o, self.by_degree[a]
            self._pairs[key] = (o.time[ka] + o.cut[a, b][None], self.value[ka] + self.cut_value[a, b][None])
        return self._pairs[key]

    def _costs(self, caps: tuple[float, ...], least: int | None) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """(a, b) -> ([L, span, C] the cheapest option's cost per chunk, the mode giving it), every chunk at once."""
        o = self.o
        P, v = o.P, o.v
        t_caps = np.array([caps[c // P] for c in range(o.C)])
        base_ok = o.ok & (o.weight <= caps[v]) & (o.epilogue <= caps[v + 1])
        out = {}
        for a, ka in enumerate(self.by_degree):
            if not len(ka):
                continue
            for b in range(len(o.degrees)):
                t, value = self._pair(a, b)
                ok = base_ok[ka] & (t <= t_caps)
                if least is None:
                    val = value
                elif least < v:  # this round's chunks' largest t_c; the other chunks' count nothing
                    val = np.where(self.rounds == least, t, 0.0)
                else:
                    val = (o.weight, o.epilogue)[least - v][ka]
                val = np.where(ok, val, np.inf)
                pick = val.argmin(axis=0)
                out[a, b] = (np.take_along_axis(val, pick[None], axis=0)[0], ka[pick])
        return out

    def solve(self, caps: tuple[float, ...], least: int | None = None) -> tuple[float, list | None, list | None, tuple]:
        """(g(caps), the split's bounds, its modes, its maxima), caps and maxima in one order (each round's
        largest t_c, then the largest w_c and e_c); with ``least``, instead the least that maximum
        (the index into caps) reaches over every fitting split (caps ignored), and that split."""
        o = self.o
        L, C, P, v = o.L, o.C, o.P, o.v
        T = len(o.degrees)
        if least is not None:
            caps = (math.inf,) * (v + 2)
        costs = self._costs(caps, least)
        # states: (degree index of the chunk about to start, devices its type used before it) -> best[j] over positions
        budget = o.budget
        states: dict[tuple[int, int], np.ndarray] = {}
        for a in range(T):
            if budget and o.degrees[a] > o.shares[o.types[0]]:
                continue
            start = np.full(L + 1, np.inf)
            start[0] = 0.0
            states[(a, 0)] = start
        back: list[dict] = []
        rows = np.arange(L + 1)
        for c in range(C):
            last = c == C - 1
            new: dict[tuple[int, int], np.ndarray] = {}
            trace: dict[tuple[int, int], tuple] = {}
            for (a, used), best in states.items():
                if (a, a) not in costs:
                    continue
                used_after = used + o.degrees[a] if budget else 0
                crossing = last or o.types[(c + 1) % P] != o.types[c % P]
                if budget and (used_after > o.shares[o.types[c]] or (crossing and used_after != o.shares[o.types[c]])):
                    continue
                before = np.where(self.valid_src, best[self.src_clip], np.inf)  # [L + 1, span]
                for b in [a] if last else range(T):  # nothing follows the last chunk: its hand-off costs nothing
                    cost, modes = costs[a, b]
                    # reach[j] = min over d of best[j - d] (+ or max) cost[j - d, d - 1]
                    here = cost[self.src_clip, self.lengths, c]
                    total = before + here if least is None else np.maximum(before, here)
                    if not last:
                        total[L - (C - c - 1) + 1 :] = np.inf  # the later chunks need a layer each
                    d_pick = total.argmin(axis=1)
                    reach = total[rows, d_pick]
                    k_pick = modes[self.src_clip[rows, d_pick], d_pick, c]
                    key = (b, 0 if not budget or crossing else used_after)
                    if key in new:
                        better = reach < new[key]
                        if not better.any():
                            continue
                        new[key] = np.where(better, reach, new[key])
                        old = trace[key]
                        trace[key] = (np.where(better, a, old[0]), np.where(better, used, old[1]), np.where(better, d_pick, old[2]),
                                      np.where(better, k_pick, old[3]))
                    else:
                        new[key] = reach
                        trace[key] = (np.full(L + 1, a), np.full(L + 1, used), d_pick, k_pick)
            states = new
            back.append(trace)
            if not states:
                return math.inf, None, None, ()
        value, key = min(((best[L], key) for key, best in states.items()), key=lambda x: x[0])
        if not math.isfinite(value):
            return math.inf, None, None, ()
        bounds, modes, degrees = [], [], []
        j = L
        for c in range(C - 1, -1, -1):
            a_arr, used_arr, d_arr, k_arr = back[c][key]
            d = int(d_arr[j]) + 1
            bounds.append((j - d, j - 1))
            modes.append(int(k_arr[j]))
            degrees.append(int(a_arr[j]))
            key = (int(a_arr[j]), int(used_arr[j]))
            j -= d
        bounds, modes, degrees = bounds[::-1], modes[::-1], degrees[::-1]
        maxima = [0.0] * (v + 2)
        for c, ((first, end), k) in enumerate(zip(bounds, modes)):
            d = end - first
            t = o.time[k, first, d, c] + (o.cut[degrees[c], degrees[c + 1], first, d, c] if c + 1 < C else 0.0)
            for i, x in ((c // P, t), (v, o.weight[k, first, d, c]), (v + 1, o.epilogue[k, first, d, c])):
                maxima[i] = max(maxima[i], float(x))
        return float(value), bounds, modes, tuple(maxima)


def solve_split_dp(tables: CostTables, cutoff_s: float | None = None,
                   fixed_sizes: tuple[int, ...] | None = None) -> DpSplit:
    """The optimum of [Note: split objective] for a candidate ``dp_eligible`` takes (see [Note: split by dynamic
    programming]), or for one ``dp_relaxes`` takes, its relaxation's ([Note: interleaved relaxation]).

    Args:
        cutoff_s: only splits faster than this are of interest.
        fixed_sizes: layers per chunk, when the split is pinned (the modes are still chosen).

    Returns:
        The best fitting split found and its modes (None when none fits below the cutoff), with a proven lower
        bound on every split's objective and whether the split attains it.
    """
    opts = _Options(tables, fixed_sizes)
    wt, v = opts.wt, opts.v
    weights = [wt.round_max] * v + [wt.weight_max, wt.epilogue_max if v == 1 else 0]
    # the scale of the plainness term: the objective's order, the longest fitting chunk's time in every term
    scale = float(np.where(opts.ok, opts.time, 0.0).max(initial=0.0) * (wt.chunk_sum * opts.C + sum(weights))) or 1.0
    epsilon = _PLAINNESS * scale / opts.C
    true_best: list = [math.inf, None, None]  # the least objective (seconds) of a fitting split seen, its bounds and modes

    def consider(bounds, modes) -> None:
        cost = evaluate_split(tables, bounds, modes)
        if cost.fits(tables) and cost.objective_s < true_best[0]:
            true_best[:] = [cost.objective_s, bounds, modes]

    cut = math.inf if cutoff_s is None else cutoff_s * wt.scale
    floor, heaviest = _branch_and_bound(_Programme(opts, epsilon), weights, cut, consider)
    if floor is None:
        return DpSplit(None, None, lower_s=math.inf)
    if v > 1 and heaviest is not None and not true_best[0] * wt.scale <= floor * (1 + 1e-9) and floor < cut:
        # [Note: interleaved relaxation]: the heaviest epilogue's rank alone may bound tighter than the mean
        share = np.zeros(opts.P)
        share[heaviest] = 1.0
        target = min(cut, true_best[0] * wt.scale)  # what it must prove every split reaches
        proven = _branch_and_bound(_Programme(opts, epsilon, share), weights, target, consider, prove=True)[0]
        floor = max(floor, proven if proven is not None else math.inf)
    # every split costs at least the relaxation's optimum (less the plainness terms), or the cutoff where the
    # search stopped there; for v = 1 the relaxation is the objective itself
    lower_s = max(0.0, (min(floor, cut) - opts.C * epsilon) / wt.scale)
    exact = v == 1 or true_best[0] * wt.scale <= floor * (1 + 1e-9)
    if cutoff_s is not None and not true_best[0] < cutoff_s:
        # none below the cutoff: proven where the relaxation reached it, else undecided
        return DpSplit(None, None, lower_s=lower_s, exact=v == 1 or floor >= cut * (1 - _TOLERANCE))
    return DpSplit(true_best[1], true_best[2], lower_s=lower_s, exact=exact)


def _branch_and_bound(programme: _Programme, weights: list[float], cut: float, consider,
                      prove: bool = False) -> tuple[float | None, int | None]:
    """The least programme objective over every split (its relaxation's, with v > 1) and the rank whose epilogue is
    heaviest in the split attaining it; each improving split goes to ``consider``. A bound at or above ``cut`` may
    stop it there. (None, None) when no split fits. See [Note: split by dynamic programming].

    With ``prove``, only whether every split reaches ``cut``: it stops, returning a lower bound below ``cut``,
    as soon as a split below ``cut`` turns up ([Note: interleaved relaxation])."""
    opts = programme.o
    v = opts.v
    n = v + 2
    active = [i for i in range(n) if weights[i] > 0]  # a maximum of weight 0 keeps no cap
    g, bounds, modes, maxima = programme.solve((math.inf,) * n)  # no caps: the least sum, and a first split
    if bounds is None:
        return None, None
    incumbent = [g + sum(weights[i] * maxima[i] for i in range(n)), bounds, modes]
    consider(bounds, modes)
    # Each maximum is at least the least any fitting split reaches, and at most what leaves the others
    # their least and the sum its least below the incumbent (or the cutoff): the caps' values lie between.
    least = {i: programme.solve((), least=i)[0] for i in active}
    limit = min(incumbent[0], cut)
    vals = []
    for i in range(n):
        if i not in active:
            vals.append(np.array([math.inf]))
            continue
        others = g + sum(weights[j] * least[j] for j in active if j != i)
        vals.append(programme.values(i, least[i], (limit - others) / weights[i] * (1 + 1e-9)))
    if any(not len(x) for x in vals):  # nothing can beat the incumbent (or the cutoff)
        vals = [x if len(x) else np.array([least[i]]) for i, x in enumerate(vals)]
    solved: dict[tuple[int, ...], tuple] = {}

    def evaluate(hi: tuple[int, ...]):
        """The programme under the caps at ``hi``; its split, when better than any so far, is considered."""
        if hi not in solved:
            solved[hi] = found = programme.solve(tuple(float(vals[i][hi[i]]) for i in range(n)))
            if found[1] is not None:
                value = found[0] + sum(weights[i] * found[3][i] for i in range(n))
                if value < incumbent[0]:
                    incumbent[:] = [value, found[1], found[2]]
                    consider(found[1], found[2])
        return solved[hi]

    def lower(lo: tuple[int, ...], g: float) -> float:
        return sum(weights[i] * float(vals[i][lo[i]]) for i in active) + g

    top = tuple(len(x) - 1 for x in vals)
    lo = (0,) * n
    heap = [(lower(lo, g), lo, top)]
    floor = None  # the least bound of the boxes left where the relaxation stopped early
    while heap:
        bound, lo, hi = heapq.heappop(heap)
        limit = min(incumbent[0], cut)
        if bound >= limit - _TOLERANCE * abs(limit):
            break
        if v > 1 and (len(solved) > (_PROOF_SOLVES if prove else _RELAXATION_SOLVES) or (prove and incumbent[0] < cut * (1 - 1e-9))):
            floor = min(bound, incumbent[0])  # [Note: interleaved relaxation]: CP-SAT closes the rest
            break
        widths = [(weights[i] * float(vals[i][hi[i]] - vals[i][lo[i]]), i) for i in active if hi[i] > lo[i]]
        if not widths:  # one point of the caps: the programme there gives the box's best split, which closes it
            evaluate(hi)
            continue
        _, axis = max(widths)
        middle = (lo[axis] + hi[axis]) // 2
        upper_lo = tuple(middle + 1 if i == axis else lo[i] for i in range(n))
        heapq.heappush(heap, (lower(upper_lo, evaluate(hi)[0]), upper_lo, hi))
        lower_hi = tuple(middle if i == axis else hi[i] for i in range(n))
        g_low, b_low, _, _ = evaluate(lower_hi)
        if b_low is not None:
            heapq.heappush(heap, (lower(lo, g_low), lo, lower_hi))
    heaviest = None
    if v > 1:
        epilogue = np.zeros(opts.P)
        for c, ((first, last), k) in enumerate(zip(incumbent[1], incumbent[2])):
            epilogue[c % opts.P] += opts.epilogue[k, first, last - first, c]
        heaviest = int(epilogue.argmax())
    return (min(incumbent[0], cut) if floor is None else floor), heaviest


__all__ = ["DpSplit", "dp_eligible", "dp_relaxes", "solve_split_dp"]
