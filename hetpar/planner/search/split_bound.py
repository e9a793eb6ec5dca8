"""A lower bound on a candidate's objective from its tables, by dynamic programming over the chunks.

planner.search.split_model's pace bound ([Note: pace bound]) and objective floor ([Note: objective
floor]) call it before and after a candidate's CP-SAT solve; see [Note: split sum bound].
"""

from __future__ import annotations

import numpy as np

from hetpar.cost_models.memory import zero_runs
from hetpar.cost_models.pipeline import LinearStepWeights
from hetpar.planner.costing import CostTables
from hetpar.vocabulary import Recompute

# Relative slack on memory and pace comparisons: the bound must not be lost to float rounding
# (prefix-sum differences here, slice sums in planner.costing.chunk_terms).
_SLACK = 1e-9


# [Note: split sum bound]
# [Note: linear step time] is a weighted sum over chunks (A sum_c t_c - B sum_c w_c)
# plus three maxima (G on the pace, H on the largest w_c, E on the largest rank
# epilogue e_r). Each chunk's mode must fit its rank's memory on its own, and that
# couples a chunk's mode to its length: a pipeline too short to hold its layers
# without ZeRO or recomputation pays for them in time or in per-micro-batch
# reduce-scatters, which per-layer minima over the modes (the [Note: candidate bound])
# do not see. So the chunks' share of the objective,
#     S = sum_c (A t_c - B w_c + (E / P) e_c),   E max_r e_r >= (E / P) sum_c e_c,
# is minimised exactly over every split whose chunks each hold at least one layer and
# take a mode that fits their rank's memory alone (with ``pace_s``, also t_c within
# it), by a dynamic programme over (chunk, end layer): f[c + 1][j] = min_i f[c][i] +
# cost_c(i, j). Relaxations, so that S never exceeds the split's true share: the cut
# after a chunk costs its cheapest hand-off to any degree of the next chunk, a rank's
# other chunks (interleaved) and the degrees' sums over a type (tp_sum) are ignored.
# A chunk holds at most ``span`` layers, the longest run whose cheapest memory fits the
# largest device (and, with a pace, whose cheapest time stays within it), so the
# programme costs O(K C L span), milliseconds for 130 layers.
def split_sum_bound(tables: CostTables, wt: LinearStepWeights, pace_s: float | None = None) -> float:
    """The least S of [Note: split sum bound] over the splits of ``tables`` (inf when none fits).

    Args:
        wt: the candidate's schedule weights (cost_models.pipeline.linear_step_weights).
        pace_s: only splits whose every chunk's t_c is within this many seconds (None: any).
    """
    cand = tables.candidate
    K, L, C = tables.time_s.shape
    P = cand.pp
    allowed = np.isfinite(tables.time_s) & np.isfinite(tables.memory_bytes)
    time = np.where(allowed, tables.time_s + tables.gather_fwd_s + tables.gather_bwd_s, 0.0)
    memory = np.where(allowed, tables.memory_bytes, 0.0)
    value = wt.chunk_sum * time - wt.weight_sum * tables.weight_s + wt.epilogue_max / P * tables.epilogue_s
    value = np.where(allowed, value, 0.0)
    prefix = {name: _prefix(a) for name, a in (("time", time), ("memory", memory), ("value", value), ("bad", (~allowed).astype(float)))}
    span = longest_chunk(tables, allowed, time, memory, pace_s)
    if span == 0:
        return np.inf
    buffers = chunk_buffers(tables, span)  # [K, L, span]
    degree = np.array([tables.tp_index(k) for k in range(K)])
    cut = tables.cut_s.min(axis=1)[degree] if C > 1 else np.zeros((K, L, 1))  # [K, L, C]: the cheapest hand-off onwards
    starts = np.arange(L)[:, None]
    ends = starts + np.arange(1, span + 1)[None, :]  # [L, span]: j = i + d
    inside = ends <= L
    ends = np.minimum(ends, L)

    def run(name: str) -> np.ndarray:
        """[K, L, span, C]: the sum over the chunk from layer i holding d + 1 layers."""
        return prefix[name][:, ends, :] - prefix[name][:, starts, :]

    latency_t = tables.gather_fwd_latency_s + tables.gather_bwd_latency_s  # [K, C]
    extra_t = latency_t[:, None, None, :] + np.concatenate([cut[:, ends - 1, : C - 1], np.zeros((K, L, span, 1))], axis=3)
    t_c = run("time") + extra_t
    capacity = tables.capacity_bytes[np.arange(C) % P]
    ok = (run("memory") + buffers[..., None] <= capacity * (1 + _SLACK)) & inside[None, :, :, None] & (run("bad") < 0.5)
    if pace_s is not None:
        ok &= t_c <= pace_s * (1 + _SLACK)
    cost = run("value") + wt.chunk_sum * extra_t + wt.epilogue_max / P * tables.epilogue_latency_s[:, None, None, :]
    cost = np.where(ok, cost, np.inf).min(axis=0)  # [L, span, C]: the best mode of chunk c from i holding d + 1 layers
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    for c in range(C):
        reach = np.full(L + 1, np.inf)
        for d in range(1, span + 1):
            np.minimum(reach[d:], best[: L + 1 - d] + cost[: L + 1 - d, d - 1, c], out=reach[d:])
        reach[L - (C - c - 1) + 1 :] = np.inf  # the later chunks need a layer each
        best = reach
    return float(best[L])


def _prefix(a: np.ndarray) -> np.ndarray:
    """[K, L, C] -> [K, L + 1, C] sums of the first l layers."""
    return np.concatenate([np.zeros((a.shape[0], 1, a.shape[2])), np.cumsum(a, axis=1)], axis=1)


def longest_chunk(tables: CostTables, allowed: np.ndarray, time: np.ndarray, memory: np.ndarray, pace_s: float | None) -> int:
    """The most layers any chunk can hold: the longest run whose cheapest memory (over modes and chunks)
    fits the largest device and, with a pace, whose cheapest time stays within it."""
    L, C = tables.num_layers, tables.num_chunks
    limits = [(np.where(allowed, memory, np.inf).min(axis=(0, 2)), float(tables.capacity_bytes.max()))]
    if pace_s is not None:
        limits.append((np.where(allowed, time, np.inf).min(axis=(0, 2)), pace_s))
    span = L - C + 1
    for per_layer, limit in limits:
        if not np.isfinite(per_layer).all():
            return 0  # some layer fits no mode anywhere
        total = np.concatenate([[0.0], np.cumsum(per_layer)])
        far = np.searchsorted(total, total + limit * (1 + _SLACK), side="right") - 1
        span = min(span, int((far - np.arange(L + 1)).max()))
    return max(span, 0)


def chunk_buffers(tables: CostTables, span: int) -> np.ndarray:
    """[K, L, span]: the one-layer buffers (recompute's workspace, the widest gradient, ZeRO-3's gathered weights) of a chunk
    from layer i holding d + 1 layers in mode k; see [Note: split objective] in planner.costing.tables."""
    cand = tables.candidate
    K, L = len(cand.modes), tables.num_layers
    out = np.zeros((K, L, span))
    for k, mode in enumerate(cand.modes):
        a = tables.tp_index(k)
        rows = [tables.gradient_bytes[a]]
        if mode.recompute != Recompute.NONE:
            rows.append(tables.workspace_bytes[a])
        if mode.zero_stage == 3 and zero_runs(cand.dp, 3, mode.offload):
            rows.append(tables.zero3_buffer_bytes[a])
        for row in rows:
            padded = np.concatenate([row, np.zeros(span)])
            running = np.zeros(L)
            for d in range(span):
                running = np.maximum(running, padded[d : d + L])
                out[k, :, d] += running
    return out


__all__ = ["chunk_buffers", "longest_chunk", "split_sum_bound"]
