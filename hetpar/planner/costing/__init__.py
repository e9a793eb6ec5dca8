"""planner.costing: the cost tables of one search candidate and the communication they price.

A ``Candidate`` (what the search fixes outside its CP-SAT model) and a ModelGraph give
``CostTables``, the coefficients of [Note: split objective] (costing.tables) that the
split model optimises and ``evaluate_split`` evaluates exactly. Modules, in the order
they build on each other:

- candidate: ``StageMode`` and ``Candidate`` ([Note: per-stage tensor parallelism]).
- slots: where a stage runs (``StageSlot``), Megatron's and each device type's blocks.
- cache: the cache shared across candidates.
- communication: collectives as latency + per byte, boundary hand-offs, gradient sync.
- in_flight: micro-batches whose activations a chunk keeps, per schedule.
- tables: ``CostTables`` and ``build_tables``.
- by_type: tables per device type ([Note: stage device types]).
- evaluation: a split's exact cost and a stage's memory terms.
"""

from hetpar.planner.costing.by_type import compose_tables, tables_by_type, type_sequence
from hetpar.planner.costing.cache import memo, model_token, model_variant
from hetpar.planner.costing.candidate import Candidate, StageMode
from hetpar.planner.costing.communication import boundary_seconds, collective_linear, data_parallel_linear, sync_linear
from hetpar.planner.costing.evaluation import SplitCost, chunk_terms, evaluate_split, stage_memory_breakdown
from hetpar.planner.costing.in_flight import activation_multipliers
from hetpar.planner.costing.slots import RankSlots, StageSlot, pack_stage_ranks, ranks_by_type, stage_slots, type_slots, type_width
from hetpar.planner.costing.tables import CostTables, LayerColumns, build_tables, layer_columns, tp_collectives

__all__ = [
    "Candidate",
    "CostTables",
    "LayerColumns",
    "RankSlots",
    "SplitCost",
    "StageMode",
    "StageSlot",
    "activation_multipliers",
    "boundary_seconds",
    "build_tables",
    "chunk_terms",
    "collective_linear",
    "compose_tables",
    "data_parallel_linear",
    "evaluate_split",
    "layer_columns",
    "memo",
    "model_token",
    "model_variant",
    "pack_stage_ranks",
    "ranks_by_type",
    "stage_memory_breakdown",
    "stage_slots",
    "sync_linear",
    "tables_by_type",
    "tp_collectives",
    "type_sequence",
    "type_slots",
    "type_width",
]
