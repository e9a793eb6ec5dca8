"""Find which Linear modules of a layer can be split across tensor-parallel ranks.

[Note: tensor-parallel pattern]
A Linear whose input is replicated is split by output features ("colwise"): each rank
holds a slice of the features. The slice may flow through ops that treat features
independently (activations, element-wise arithmetic, views, attention over whole
heads) into a Linear that is then split by input features ("rowwise"); its partial
sums are added with one all-reduce and the result is replicated again. A colwise
output that reaches anything else (a norm over features, the layer's output) cannot
stay split, so that Linear stays replicated. Repeating this to a fixed point finds
Megatron's pattern on a transformer block (q, k, v and mlp.fc colwise; o and
mlp.proj rowwise: two all-reduces per block forward) without naming any of them. A
dry run of the split layer on the meta device then checks the shapes, for example
that the heads divide evenly (``view(B, T, -1, head_dim)``).
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from planner.plan import Sharding

# Ops that act on each feature independently, or on whole heads: a split feature
# dimension passes through them unchanged.
_FEATURE_WISE_FUNCTIONS = {
    F.gelu, F.relu, F.silu, F.dropout, F.scaled_dot_product_attention,
    torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.sigmoid,
    operator.add, operator.mul, operator.sub, operator.truediv, operator.getitem,
    torch.add, torch.mul, torch.transpose, torch.reshape,
}
_FEATURE_WISE_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "size", "relu", "mul", "add", "float", "to", "type_as"}
_FEATURE_WISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Dropout, nn.Tanh, nn.Sigmoid, nn.Identity)


def find_sharding(stage_module: fx.GraphModule) -> dict[str, Sharding]:
    """Colwise/rowwise choice for the Linear modules of one layer; see [Note: tensor-parallel pattern].

    Returns:
        Module path -> Sharding; modules left out stay replicated.
    """
    linears = {
        n.name: str(n.target)
        for n in stage_module.graph.nodes
        if n.op == "call_module" and isinstance(stage_module.get_submodule(str(n.target)), nn.Linear)
    }
    colwise = set(linears)
    while True:
        split, rowwise, broken = _propagate(stage_module, colwise, linears)
        bad = {c for c in colwise if broken.get(c)}
        if not bad:
            break
        colwise -= bad
    chosen = {**{linears[c]: Sharding.COLWISE for c in colwise if c in split}, **{linears[r]: Sharding.ROWWISE for r in rowwise}}
    return dict(sorted(chosen.items()))


def _propagate(gm: fx.GraphModule, colwise: set[str], linears: dict[str, str]):
    """Follow split values from colwise Linears. Returns (colwise that split, rowwise, broken)."""
    origin: dict[str, set[str]] = {}  # node -> colwise Linears whose split output reaches it
    rowwise: set[str] = set()
    broken: dict[str, bool] = {}
    used: set[str] = set()
    for node in gm.graph.nodes:
        sources = set().union(*(origin.get(a.name, set()) for a in node.all_input_nodes)) if node.all_input_nodes else set()
        if node.name in linears:
            if sources:
                rowwise.add(node.name)
                used |= sources
            elif node.name in colwise:
                origin[node.name] = {node.name}
            continue
        if not sources:
            continue
        if node.op == "output" or not _feature_wise(gm, node):
            for s in sources:
                broken[s] = True
            continue
        origin[node.name] = sources
    # A Linear is only colwise if its split output is consumed by a rowwise Linear.
    for c in colwise:
        if c not in used:
            broken.setdefault(c, True)
    return used, rowwise, broken


def _feature_wise(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _FEATURE_WISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _FEATURE_WISE_METHODS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _FEATURE_WISE_MODULES)
    return False


def shard_on_meta(stage_module: fx.GraphModule, sharding: dict[str, Sharding], tp: int) -> fx.GraphModule:
    """A meta-device copy of the layer as one tensor-parallel rank holds it.

    Raises:
        ValueError: a split dimension is not divisible by ``tp``.
    """
    sharded = copy.deepcopy(stage_module)
    for path, how in sharding.items():
        linear = sharded.get_submodule(path)
        out_f, in_f = linear.out_features, linear.in_features
        if how is Sharding.COLWISE:
            if out_f % tp:
                raise ValueError(f"{path}: out_features({out_f}) not divisible by tp({tp})")
            out_f //= tp
        else:
            if in_f % tp:
                raise ValueError(f"{path}: in_features({in_f}) not divisible by tp({tp})")
            in_f //= tp
        parent_path, _, name = path.rpartition(".")
        parent = sharded.get_submodule(parent_path) if parent_path else sharded
        bias = linear.bias is not None
        setattr(parent, name, nn.Linear(in_f, out_f, bias=bias, device="meta", dtype=linear.weight.dtype))
    sharded.recompile()
    return sharded


def check_sharded_shapes(reference_out: Any, sharded_out: Any) -> bool:
    """True if a sharded layer's outputs have the unsharded shapes (split values never escape)."""
    ref = reference_out if isinstance(reference_out, (tuple, list)) else (reference_out,)
    got = sharded_out if isinstance(sharded_out, (tuple, list)) else (sharded_out,)
    return len(ref) == len(got) and all(
        getattr(a, "shape", None) == getattr(b, "shape", None) for a, b in zip(ref, got)
    )


def rowwise_output_bytes(module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding]) -> float:
    """Bytes of the outputs of rowwise Linears: the payload of the forward all-reduces."""
    rowwise = {p for p, s in sharding.items() if s is Sharding.ROWWISE}
    sizes: list[int] = []
    hooks = [
        module.get_submodule(p).register_forward_hook(lambda m, a, out: sizes.append(out.numel() * out.element_size()))
        for p in rowwise
    ]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return float(sum(sizes))
