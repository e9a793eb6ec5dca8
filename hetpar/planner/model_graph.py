"""ModelGraph: a model as the planner sees it, measured layers in execution order.

What planner.capture's ``trace_model`` makes and every later step reads (the cost
tables, the estimate, the search, the strategies): a leaf, plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetpar.cost_models.layers import LayerProfile
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

    @property
    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)


__all__ = ["BoundaryTensor", "ModelGraph", "NodeProfile"]
