"""Cost tables per device type, and the tables of a pipeline whose ranks run on given types;
see [Note: stage device types]."""

from __future__ import annotations

import numpy as np

from hetpar.planner.costing.candidate import Candidate
from hetpar.planner.costing.slots import RankSlots, type_slots
from hetpar.planner.costing.tables import CostTables, build_tables
from hetpar.planner.model_graph import ModelGraph
from hetpar.vocabulary import Optimizer


# [Note: stage device types]
# On a cluster whose device types each host whole stages (every type's device count a
# multiple of dp), the search chooses the order of the device types along the pipeline
# jointly with the layer split; how many stages each type hosts is part of the outer
# candidate. A type's stages are consecutive, so the pipeline crosses each type
# boundary once (one slow inter-type link instead of several); every order of the types
# (at most 3! = 6 for three types) is solved exactly, which keeps the search exact
# within that space and fast. (A CP-SAT model over every stage-by-stage type sequence
# was tried: its bounds were weak and 12-stage instances did not close within the per-candidate work limit.) Each
# type gets its own cost columns, built as if every stage ran on that type's first
# blocks of its degree; a stage that chooses a type reads that type's column. The p2p
# cost of a cut is the one between the sending type's own blocks, an approximation
# when neighbouring stages are of different types. After solving, each stage takes its
# block of its type (``pack_stage_ranks``), and the plan's prediction is recomputed on
# those exact ranks.
def tables_by_type(model: ModelGraph, cluster, cand: Candidate, dtype: str, optimizer: str = Optimizer.ADAMW,
                   cache: dict | None = None) -> dict[str, "CostTables"]:
    """One set of cost columns per device type of ``cand.stages_per_type``, each as if every stage ran on that type."""
    out = {}
    blocks = {tp: type_slots(cluster, cand.dp, tp) for tp in cand.tp_degrees}
    for device_type, _ in cand.stages_per_type:
        slots: list[RankSlots] = [{} for _ in range(cand.pp)]
        cut_to: list[RankSlots] = [{} for _ in range(cand.pp)]
        for tp, available in blocks.items():
            mine = available.get(device_type, [])
            if not mine:
                continue
            peers = [b[0] for t, b in available.items() if t != device_type and b]
            for s in range(cand.pp):
                slots[s][tp] = mine[s % min(len(mine), 2)]
                # a single block hosts one stage of this degree at most: its cuts go to another type
                cut_to[s][tp] = mine[1 - s % 2] if len(mine) > 1 else (peers[0] if peers else mine[0])
        out[device_type] = build_tables(model, cluster, cand, dtype, optimizer, slots=slots, cut_to=cut_to, cache=cache)
    return out


def compose_tables(tables_by_type: dict[str, "CostTables"], types: list[str]) -> "CostTables":
    """The cost tables of a split whose pipeline rank r runs on device type ``types[r]``."""
    first = next(iter(tables_by_type.values()))
    P, C = len(types), first.num_chunks
    chunk_types = [types[c % P] for c in range(C)]

    def pick(name: str, axis: int) -> np.ndarray:
        cols = [np.take(getattr(tables_by_type[t], name), [c], axis=axis) for c, t in enumerate(chunk_types)]
        return np.concatenate(cols, axis=axis)

    per_chunk3 = ("time_s", "fwd_s", "weight_s", "gather_fwd_s", "gather_bwd_s", "epilogue_s", "memory_bytes", "tp_time_s")
    return CostTables(
        candidate=first.candidate,
        slots=[tables_by_type[t].slots[r] for r, t in enumerate(types)],
        **{name: pick(name, 2) for name in per_chunk3},
        **{name: pick(name, 1) for name in ("gather_fwd_latency_s", "gather_bwd_latency_s", "epilogue_latency_s")},
        cut_s=pick("cut_s", 3),
        workspace_bytes=first.workspace_bytes,
        gradient_bytes=first.gradient_bytes,
        zero3_buffer_bytes=first.zero3_buffer_bytes,
        capacity_bytes=np.array([tables_by_type[t].capacity_bytes[r] for r, t in enumerate(types)], dtype=float),
        device_types=list(types),
    )

def type_sequence(order: list[str], stages_per_type: dict[str, int]) -> list[str]:
    """Stage device types: each type's stages in one block, blocks in ``order``."""
    return [k for k in order for _ in range(stages_per_type[k])]
