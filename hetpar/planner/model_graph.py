"""ModelGraph: a model as the planner sees it, measured layers in execution order.

What planner.capture's ``trace_model`` makes and every later step reads (the cost
tables, the estimate, the search, the strategies): a leaf, plain data, no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from hetpar.cost_models.layers import LayerProfile, layer_kinds
from hetpar.vocabulary import Sharding


@dataclass(frozen=True, kw_only=True)
class NodeProfile:
    """One graph node, per sample, fp32; see [Note: what a kernel costs] in planner.capture.measure."""

    name: str  # the fx node
    layer: int
    op: str  # what it runs: aten.linear, attn.q (a module call), view
    module: str  # the innermost module it runs in
    fwd_flops: float
    bwd_flops: float
    fwd_elementwise_flops: float
    bwd_elementwise_flops: float
    fwd_bytes_accessed: float
    bwd_bytes_accessed: float
    param_bytes: float
    saved_activation_bytes: float
    output_bytes: float


@dataclass(frozen=True, kw_only=True)
class BoundaryTensor:
    """A tensor crossing the cut after a layer, per sample."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """A model as the planner sees it: measured layers in execution order."""

    file: str
    args: dict[str, Any]
    fingerprint: str
    layers: list[LayerProfile]
    tp_sharding: list[dict[str, Sharding]] = field(default_factory=list)  # per layer
    # per layer: module path -> part sizes of its colwise fused projections ([Note: part-laid Linears] in runtime/parts.py)
    tp_parts: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    # per layer: where its tp_sharding came from ("finder", "base_model_tp_plan"; "" unsplit)
    tp_source: list[str] = field(default_factory=list)
    input_bytes: float = 0.0  # per sample
    capture: str = "fx"  # "fx" or "export"; see [Note: two ways to capture] in runtime.capture
    boundaries: list[list[BoundaryTensor]] = field(default_factory=list)  # per layer: what crosses the cut after it
    nodes: list[NodeProfile] = field(default_factory=list)
    measured_layers: int = 0  # layers measured; the others reused a twin's numbers
    sequence_length: int = 0  # tokens per sample when the first input is token ids, else 0

    @functools.cached_property
    def layer_kinds(self) -> list[int]:
        """For each layer, the first layer of its kind (``cost_models.layers.layer_kinds``), found once per graph."""
        return layer_kinds(self.layers)

    def at_context(self, cp: int) -> "ModelGraph":
        """The model as one of ``cp`` context-parallel ranks runs it ([Note: context
        parallelism costs] in cost_models/collectives.py): each layer at 1/cp of the tokens."""
        if cp == 1:
            return self
        return replace(self, layers=[l.at_context(cp) for l in self.layers], input_bytes=self.input_bytes / cp)

    def with_sequence_parallel(self, regather: bool = True) -> "ModelGraph":
        """The model as a tensor-parallel rank runs it under sequence parallelism ([Note:
        sequence parallelism costs] in cost_models/layers.py); ``regather``: without recompute."""
        return replace(self, layers=[l.with_sequence_parallel(regather) for l in self.layers])

    def sequence_splits(self, tp: int) -> bool:
        """Whether sequence parallelism can run at degree ``tp``: a token model whose
        sequence divides by tp and whose layers split over tp."""
        return self.sequence_length > 0 and self.sequence_length % tp == 0 and any(l.tp_capable for l in self.layers)

    @property
    def context_capable(self) -> bool:
        """Whether context parallelism applies: a token model whose layers attend."""
        return self.sequence_length > 0 and any(l.attention_kv_bytes > 0 for l in self.layers)

    @property
    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)


__all__ = ["BoundaryTensor", "ModelGraph", "NodeProfile"]
