"""planner.capture: a model file -> a ModelGraph of measured layers, each with the
tensor-parallel sharding its Linears take.

trace (``trace_model``) builds the model on the meta device, captures and cuts it
into layers (runtime.graph) and measures each one (measure). The tensor-parallel
finder: tp_ops (what a layer's graph holds), tp_ilp ([Note: tensor-parallel ILP]),
tp_meta (a layer as one rank holds it), tp_dry_run (the ILP's answer checked, solved
again on failure), vocab_parallel ([Note: vocab-parallel layers]), tp_collectives
(what a sharded layer communicates), module_tp (a Hugging Face block's own plan).
"""

from hetpar.planner.capture.module_tp import block_sharding
from hetpar.planner.capture.tp_collectives import layer_collectives
from hetpar.planner.capture.tp_dry_run import find_sharding
from hetpar.planner.capture.tp_ilp import TpCostModel
from hetpar.planner.capture.trace import trace_model

__all__ = ["TpCostModel", "block_sharding", "find_sharding", "layer_collectives", "trace_model"]
