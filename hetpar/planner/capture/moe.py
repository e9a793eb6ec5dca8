"""The modules of experts in a layer: their parameters, their work and the rows they receive.

[Note: experts in a layer]
A module of experts ([Note: the experts contract] in runtime/experts.py) is found in a
layer's graph by module path: under torch.fx it is one ``call_module`` node (the tracer
keeps it a leaf), under torch.export its ATen ops carry its path in
``nn_module_stack`` (runtime.capture ``module_path``), and so do the ``get_attr`` nodes
reading its weights. The measurement charges each kernel, forward and backward, to the
node that ran it ([Note: what a kernel costs] in planner.capture.measure), so the
experts' share of the layer's FLOPs is the share of those nodes. What expert
parallelism would send is read from the module's call, ``experts(hidden, top_k_index,
top_k_weights)``: each token's hidden row goes to each of its top-k experts, so one
dispatch moves tokens x k rows of H values (its combine moves as many back). Under
torch.export the call is no node: its inputs are the values the module's ops read from
outside it, the integer [N, k] one being the index and the floating [N, H] one beside
it the hidden rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from hetpar.planner.capture.measure import Measurement, node_module
from hetpar.planner.capture.tp_ops import run_graph
from hetpar.runtime.capture import TraceError


@dataclass(frozen=True, kw_only=True)
class LayerExperts:
    """A layer's modules of experts, per sample, fp32; see [Note: experts in a layer]."""

    params: int = 0  # the experts' parameters: what expert parallelism splits
    num_experts: int = 0  # E of the modules (their gcd if they differ); 0: none
    routed_bytes: float = 0.0  # hidden rows the experts receive: tokens x top-k x H x element size
    flops_fraction: float = 0.0  # of the layer's forward and backward FLOPs


NO_EXPERTS = LayerExperts()


def layer_experts(module: fx.GraphModule, inputs: list[torch.Tensor], measured: Measurement,
                  experts: dict[str, int]) -> LayerExperts:
    """The modules of experts of the layer ``module`` (measured as ``measured`` on meta
    ``inputs``), given the model's modules of experts as path -> number of experts.

    Raises:
        runtime.capture.TraceError: a module of experts is not called as the contract says (no [N, H]
            hidden rows and [N, k] expert index found among its inputs).
    """
    owner = {node.name: _owner(node, experts) for node in module.graph.nodes}
    held = {path for path in owner.values() if path}
    if not held:
        return NO_EXPERTS
    counts = measured.nodes
    total = measured.total("fwd_flops") + measured.total("bwd_flops")
    inside = sum(counts[name].fwd_flops + counts[name].bwd_flops for name, path in owner.items() if path and name in counts)
    params = {id(p): p.numel() for name, p in module.named_parameters() if _under(name.rpartition(".")[0], held)}
    return LayerExperts(
        params=sum(params.values()),
        num_experts=math.gcd(*(experts[path] for path in held)),
        routed_bytes=_routed_bytes(module, inputs, owner),
        flops_fraction=min(1.0, inside / total) if total > 0 else 0.0,
    )


def _owner(node: fx.Node, experts: dict[str, int]) -> str:
    """The module of experts ``node`` runs in (or calls), "" if none."""
    path = node_module(node)
    while path and path not in experts:
        path = path.rpartition(".")[0]
    return path


def _under(path: str, roots: set[str]) -> bool:
    while path:
        if path in roots:
            return True
        path = path.rpartition(".")[0]
    return False


def _routed_bytes(module: fx.GraphModule, inputs: list[torch.Tensor], owner: dict[str, str]) -> float:
    """Bytes of the hidden rows every call of a module of experts receives."""
    values = run_graph(module, inputs)
    calls: dict[str, list[Any]] = {}  # one entry per call: the values it reads from outside
    for node in module.graph.nodes:
        path = owner[node.name]
        if not path or node.op == "get_attr":
            continue
        outside = [values.get(a.name) for a in node.all_input_nodes if owner[a.name] != path]
        if node.op == "call_module":  # a leaf call: its arguments in order
            calls[node.name] = outside
        else:
            calls.setdefault(path, []).extend(outside)
    return float(sum(_call_bytes(path, read) for path, read in calls.items()))


def _call_bytes(where: str, read: list[Any]) -> float:
    tensors = [t for t in read if isinstance(t, torch.Tensor) and t.dim() == 2]
    index = next((t for t in tensors if not t.is_floating_point()), None)
    hidden = next((t for t in tensors if index is not None and t.is_floating_point() and t.shape[0] == index.shape[0]
                   and t.shape != index.shape), None)
    if index is None or hidden is None:
        raise TraceError(f"{where} is a module of experts but is not called as experts(hidden [N, H], "
                         f"top_k_index [N, k], top_k_weights [N, k]) (docs/model-file.md, 'Mixtures of experts')")
    return float(index.numel() * hidden.shape[-1] * hidden.element_size())


__all__ = ["LayerExperts", "NO_EXPERTS", "layer_experts"]
