"""The exact value of [Note: split objective] (costing.tables) for one split, and one stage's
memory terms: what the CP-SAT model optimises, evaluated without it."""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.memory import (
    MemoryBreakdown,
    activation_bytes_per_microbatch,
    backward_gradient_bytes,
    recompute_workspace_bytes,
    training_state_bytes,
    zero_runs,
)
from hetpar.cost_models.pipeline import linear_step_time_s
from hetpar.planner.costing.candidate import StageMode
from hetpar.planner.costing.in_flight import activation_multipliers
from hetpar.planner.costing.tables import CostTables
from hetpar.planner.model_graph import ModelGraph
from hetpar.vocabulary import Optimizer, Recompute


@dataclass(frozen=True, kw_only=True)
class SplitCost:
    """The exact value of [Note: split objective] for one split, with its parts."""

    objective_s: float
    stage_time_s: list[float]  # t_c per chunk
    dp_sync_s: list[float]  # e_r per rank: gradient synchronisation and optimizer step
    stage_memory_bytes: list[float]  # per rank
    modes: list[int]  # the mode index of each chunk

    def fits(self, tables: CostTables) -> bool:
        """Every rank within its memory, and the degrees summing to each type's devices."""
        return all(m <= c for m, c in zip(self.stage_memory_bytes, tables.capacity_bytes)) and tables.tp_sum_ok(self.modes)


def chunk_terms(tables: CostTables, c: int, first: int, last: int, k: int, next_k: int | None = None) -> tuple[float, float, float, float]:
    """(t_c, w_c, epilogue, memory) of chunk c holding layers first..last in mode k, the next chunk in mode
    ``next_k`` (k's degree when None); see [Note: split objective]."""
    rows = slice(first, last + 1)
    time = tables.time_s[k, rows, c].sum()
    a = tables.tp_index(k)
    b = a if next_k is None else tables.tp_index(next_k)
    t = time + (tables.cut_s[a, b, last, c] if c + 1 < tables.num_chunks else 0.0)
    t += tables.gather_fwd_latency_s[k, c] + tables.gather_fwd_s[k, rows, c].sum()
    t += tables.gather_bwd_latency_s[k, c] + tables.gather_bwd_s[k, rows, c].sum()
    epilogue = tables.epilogue_latency_s[k, c] + tables.epilogue_s[k, rows, c].sum()
    memory = tables.memory_bytes[k, rows, c].sum()
    mode = tables.candidate.modes[k]
    if mode.recompute != Recompute.NONE:  # selective's rebuilt layer is at most its whole saved activations
        memory += tables.workspace_bytes[a, rows].max()
    memory += tables.gradient_bytes[a, rows].max()
    if mode.zero_stage == 3 and zero_runs(tables.candidate.dp, mode.zero_stage, mode.offload):
        memory += tables.zero3_buffer_bytes[a, rows].max()
    return float(t), float(tables.weight_s[k, rows, c].sum()), float(epilogue), float(memory)


def evaluate_split(tables: CostTables, bounds: list[tuple[int, int]], modes: list[int] | None = None) -> SplitCost:
    """Evaluate a split given as inclusive (first, last) layer ranges per chunk, each chunk in mode ``modes[c]`` (0 by default)."""
    cand = tables.candidate
    modes = list(modes) if modes is not None else [0] * len(bounds)
    P = cand.pp
    times, weights = [], []
    epilogue, memory = [0.0] * P, [0.0] * P
    for c, ((first, last), k) in enumerate(zip(bounds, modes)):
        t, w, e, mem = chunk_terms(tables, c, first, last, k, modes[c + 1] if c + 1 < len(modes) else None)
        times.append(t)
        weights.append(w)
        epilogue[c % P] += e
        memory[c % P] += mem
    objective = linear_step_time_s(cand.schedule, num_stages=P, num_microbatches=cand.num_microbatches, chunk_time_s=times,
                                   rank_epilogue_s=epilogue, chunk_weight_s=weights, virtual_stages=cand.virtual_stages)
    return SplitCost(objective_s=objective, stage_time_s=times, dp_sync_s=epilogue, stage_memory_bytes=memory, modes=modes)


def stage_memory_breakdown(model: ModelGraph, tables: CostTables, s: int, first: int, last: int, dtype: str, optimizer: str = Optimizer.ADAMW,
                           mode: StageMode | None = None) -> MemoryBreakdown:
    """The memory terms of stage ``s`` holding layers ``first..last`` in ``mode`` (the first offered by default)."""
    cand = tables.candidate
    mode = mode or cand.modes[0]
    in_flight = activation_multipliers(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages)[s]
    layers = [l.with_sequence_parallel() if mode.sp else l for l in model.layers[first : last + 1]]
    c = dict(tp=mode.tp, micro_batch_size=cand.micro_batch_size, dtype=dtype)
    experts = sum(l.expert_params for l in layers) * (1.0 - 1.0 / cand.ep)  # held by other replicas ([Note: expert parallelism costs])
    weights, grads, opt = training_state_bytes(layers, tp=mode.tp, dtype=dtype, optimizer=optimizer, dp=cand.dp, zero_stage=mode.zero_stage,
                                               extra_params=-experts, offload=mode.offload)
    inputs = model.layers[first - 1].boundary_bytes if first > 0 else model.input_bytes
    per_mb = activation_bytes_per_microbatch(layers, recompute=mode.recompute, input_bytes=inputs, **c)
    workspace = recompute_workspace_bytes(layers, recompute=mode.recompute, **c) + backward_gradient_bytes(layers, **c)
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=per_mb * in_flight + workspace)
