"""What a layer's fx graph holds for tensor parallelism: the ops a split feature dimension
passes through, its Linears, and each value as a meta run computes it.

The tensor-parallel ILP (tp_ilp), its dry runs (tp_dry_run) and the collective counts
(tp_collectives) read a layer's graph through these.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from hetpar.runtime.capture import attribute
from hetpar.vocabulary import Sharding


# Ops that act on each feature independently, or on whole heads: a split feature
# dimension passes through them unchanged.
FEATURE_WISE_FUNCTIONS = {
    F.gelu, F.relu, F.silu, F.dropout, F.scaled_dot_product_attention,
    torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.sigmoid,
    operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, operator.getitem,
    torch.add, torch.mul, torch.neg, torch.transpose, torch.reshape,
    # Dimension-sensitive: valid unless they act along the split dimension (the dry run checks).
    torch.cat, torch.stack, torch.chunk, torch.split, torch.softmax, F.softmax, operator.matmul, torch.matmul,
    torch.repeat_interleave,  # grouped-query attention's key/value heads, repeated per head (never along features)
    torch.bmm, torch.baddbmm, torch.masked_fill,  # attention written out over heads folded into the batch (Megatron's)
    getattr,  # ``q.shape``: a split value's shape is its local one, and no tensor flows on from it
}
FEATURE_WISE_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "size", "relu", "mul", "add", "neg", "float", "to",
    "type_as", "chunk", "split", "split_with_sizes", "softmax", "matmul", "repeat_interleave",
    "masked_fill", "new_empty", "bmm", "baddbmm",
}
FEATURE_WISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Dropout, nn.Tanh, nn.Sigmoid, nn.Identity)
# The same in an exported graph's ATen ops (dimension-sensitive ones included: the dry
# run of a module stage checks them; see [Note: tensor parallelism of exported graphs]).
_aten = torch.ops.aten
FEATURE_WISE_ATEN = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.transpose.int,
    _aten.permute.default, _aten.contiguous.default, _aten.clone.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.cat.default, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.chunk.default, _aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor,
    _aten.div.Tensor, _aten.neg.default, _aten.pow.Tensor_Scalar, _aten.silu.default, _aten.gelu.default,
    _aten.relu.default, _aten.tanh.default, _aten.sigmoid.default, _aten.dropout.default, _aten.to.dtype,
    _aten._to_copy.default, _aten.type_as.default, _aten.alias.default, _aten.scaled_dot_product_attention.default,
    _aten.softmax.int, _aten.matmul.default, _aten.bmm.default, _aten.baddbmm.default, _aten.masked_fill.Scalar,
}


@dataclass(frozen=True)
class LinearSite:
    """A Linear as the graph runs it: a call of the module (torch.fx), or an ``aten.linear``
    on its weight, or GPT-2's Conv1D as ``aten.addmm(bias, x, weight)`` with the weight
    stored [in, out] (torch.export)."""

    path: str  # the module's qualified name
    in_features: int
    out_features: int
    input: fx.Node  # the value it multiplies


def linear_site(gm: fx.GraphModule, node: fx.Node) -> LinearSite | None:
    """The Linear ``node`` runs, or None."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Linear):
            return LinearSite(str(node.target), module.in_features, module.out_features, node.args[0])
        return None
    if node.op != "call_function" or node.target not in (_aten.linear.default, _aten.addmm.default):
        return None
    conv1d = node.target is _aten.addmm.default
    weight = node.args[2] if conv1d else node.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight")):
        return None
    shape = attribute(gm, str(weight.target)).shape
    out_f, in_f = (shape[1], shape[0]) if conv1d else (shape[0], shape[1])
    return LinearSite(str(weight.target).removesuffix(".weight"), in_f, out_f, node.args[1] if conv1d else node.args[0])



# Dimension-sensitive ops: (function or method name, position of ``dim``, its default); the dry run checks them.
DIM_ARGUMENT = {
    torch.cat: (1, 0), torch.chunk: (2, 0), torch.split: (2, 0), torch.softmax: (1, None),
    F.softmax: (1, None), "chunk": (2, 0), "split": (2, 0), "split_with_sizes": (2, 0), "softmax": (1, None),
}
# Repeats each slice along a dimension: split values pass through when every slice
# repeats alike (an integer count) along a named dimension (each rank's heads repeat to
# its slice of the repeated heads: grouped-query attention); the dry run checks it.
REPEAT_INTERLEAVE = {torch.repeat_interleave, "repeat_interleave"}
# The ops that cut a value into parts along a dimension: a fused projection's output
# split into q, k and v ([Note: part-laid Linears] in runtime/parts.py).
SPLITS = {torch.split, "split", "split_with_sizes", torch.functional.split, _aten.split.Tensor,
          _aten.split_with_sizes.default}
CHUNKS = {torch.chunk, "chunk", _aten.chunk.default}
# An exported graph's views that only restore the leading dimensions of a Linear's
# output (GPT-2's Conv1D: ``addmm`` on [B*T, in], then ``view`` to [B, T, out]): the
# parts are read through them.
_LEADING_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


def cuts(node: fx.Node, width: int, ndim: int) -> set[int] | None:
    """The feature offsets at which ``node`` (a split or chunk) cuts a value ``width``
    features wide along its last dimension, or None if it cuts elsewhere or is no cut."""
    if node.op not in ("call_function", "call_method") or node.target not in SPLITS | CHUNKS:
        return None
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if not isinstance(dim, int) or dim not in (-1, ndim - 1):
        return None
    if node.target in CHUNKS:
        k = node.kwargs.get("chunks", node.args[1] if len(node.args) > 1 else None)
        return {i * width // k for i in range(k + 1)} if isinstance(k, int) and k > 0 and width % k == 0 else None
    size = next((node.kwargs[k] for k in ("split_size_or_sections", "split_size") if k in node.kwargs),
                node.args[1] if len(node.args) > 1 else None)
    sizes = list(size) if isinstance(size, (list, tuple)) else [size] * -(-width // size) if isinstance(size, int) else None
    if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
        return None
    out, offset = {0}, 0
    for s in sizes:
        offset = min(offset + s, width)
        out.add(offset)
    return out


def find_parts(node: fx.Node, width: int, ndim: int) -> tuple[int, ...]:
    """The parts a Linear's output (``node``, ``width`` features, ``ndim`` dimensions) is
    cut into along its features: the common refinement of the cuts of its users that
    split or chunk it there ([Note: part-laid Linears] in runtime/parts.py), read through
    an exported graph's views that keep the features last (GPT-2's Conv1D). One part:
    nothing cuts it (a view into heads first, an activation)."""
    offsets = {0, width}
    users = [(user, ndim) for user in node.users]
    while users:
        user, dims = users.pop()
        shape = user.args[1] if user.op == "call_function" and user.target in _LEADING_VIEWS and len(user.args) > 1 \
            else None
        if isinstance(shape, (list, tuple)) and shape and shape[-1] == width:
            users += [(u, len(shape)) for u in user.users]
            continue
        offsets |= cuts(user, width, dims) or set()
    ordered = sorted(offsets)
    return tuple(b - a for a, b in zip(ordered, ordered[1:]))


def linear_parts(gm: fx.GraphModule, sharding: dict[str, Any], values: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parts of each colwise Linear of ``sharding`` (module path -> Sharding) in
    ``gm`` whose output is cut into more than one ([Note: part-laid Linears] in
    runtime/parts.py); ``values``: ``run_graph``'s."""
    out: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        site = linear_site(gm, node)
        if site is None or sharding.get(site.path) is not Sharding.COLWISE:
            continue
        value = values.get(node.name)
        parts = find_parts(node, site.out_features, value.dim()) if isinstance(value, torch.Tensor) else (site.out_features,)
        if len(parts) > 1:
            out[site.path] = parts
    return out
MATMULS = {operator.matmul, torch.matmul, "matmul"}


class TpError(ValueError):
    """A sharding does not fit the layer (a split dimension does not divide, a view breaks)."""


def run_graph(module: fx.GraphModule, inputs: list[torch.Tensor], record: dict[str, Any] | None = None, *,
              grad: bool = False) -> dict[str, Any]:
    """Run ``module`` on meta ``inputs``; each node's value by name. With ``grad``, inputs
    require gradients where they do in training, and so do the values made from them."""
    values = {} if record is None else record

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.set_grad_enabled(grad):
        _Recorder(module).run(*[t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in inputs])
    return values


def is_tensors(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(is_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


def tensor_nbytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(tensor_nbytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


__all__ = ["CHUNKS", "DIM_ARGUMENT", "REPEAT_INTERLEAVE", "SPLITS", "cuts", "find_parts", "linear_parts", "FEATURE_WISE_ATEN", "FEATURE_WISE_FUNCTIONS", "FEATURE_WISE_METHODS", "FEATURE_WISE_MODULES", "MATMULS",
           "LinearSite", "TpError", "is_tensors", "linear_site", "run_graph", "tensor_nbytes"]
