"""Fused projections split part by part, and the shape constants that follow the shard.

[Note: part-laid Linears]
Most hand-written GPTs compute q, k and v (or a SwiGLU's gate and up) with one Linear
and cut its output by fixed widths: ``q, k, v = c_attn(x).split(n_embd, dim=2)``,
``split([q_size, kv_size, kv_size], dim=-1)``, ``chunk(2, dim=-1)``. The *parts* of
such a Linear are the pieces its output is cut into along the features (the planner
reads them from the graph: ``planner.capture.tp_ops.find_parts``; the plan carries
them as ``StagePlan.tp_parts``). Split column-wise as one block (rank 0 the first
rows, rank 1 the next), rank 0 would hold all of q and the split would be wrong. So a
colwise Linear with parts is *part-laid*: each rank holds, of every part, its tp-th
contiguous slice of rows, in part order (``PartLayout.rank_rows``): rank r computes
``[q_r, k_r, v_r]``, its heads of each, and the split made local (below) separates
them.

The weight is an ordinary ``Shard(0)`` DTensor of the rows so permuted ("rank-major"
order, ``PartLayout.rank_major``), so every consumer of DTensors works unchanged: the
colwise style and its one all-reduce per shared input, optimizers, gradient norms,
data parallelism. The permutation never reaches the user: materialisation takes the
rank's rows of the user's tensor (``rank_rows``; runtime.materialize), and full
tensors, ``--save-final`` and checkpoints are turned back into the user's order
(``to_user``; runtime.training, runtime.checkpoint), so a checkpoint holds the model's
own tensors under their own names and any tensor-parallel degree resumes it.
A Hugging Face ``Conv1D`` (GPT-2's ``c_attn``) stores its weight [in, out], so its
"rows" are the weight's columns (``PartLayout.dim`` 1; its bias's are rows), and the
attention's own attributes follow ([Note: local attention attributes] in
runtime/module_stage.py). A Linear with one part (Megatron's and GPT-NeoX's per-head interleaved
``query_key_value``, viewed as ``(B, T, heads, 3 * head_dim)`` before the split) is
plain colwise: its permutation is the identity.

[Note: local shape constants]
The same models view heads with a fixed count (``view(B, T, self.n_head, hd)``,
``view(B, T, C)``, ``split(self.n_embd)``): on a rank holding 1/tp of the features
these numbers are wrong. ``localise_shapes`` runs the layer on the meta device as one
rank holds it, node by node, next to the unsplit run; before each view, reshape,
expand or split whose input is split, it sets the size arguments that give the
unsplit shape with the split dimension divided by tp (a view cuts the split features
into (heads, per-head): the heads, the outermost, shrink), and checks the result.
The planner does this in its dry runs and measurements, the program on its own cut
stage before tensor parallelism is applied, so both run the same graph.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn


class PartError(ValueError):
    """A layer's shapes cannot follow its tensor-parallel split; the message names the op
    (``node``: its fx name, and ``split_input``: its split input's, where known)."""

    def __init__(self, message: str, *, node: str = "", split_input: str = "") -> None:
        super().__init__(message)
        self.node, self.split_input = node, split_input


# ----------------------------------------------------------------------------- the rank's rows

@dataclass(frozen=True)
class PartLayout:
    """How a part-laid colwise Linear's output rows are held ([Note: part-laid Linears]):
    ``parts`` (sizes along the output features, in the user's order), each split into
    ``tp`` contiguous slices. ``dim`` is the tensor's dimension of output features: 0 for
    a Linear's weight and any bias, 1 for the weight of transformers' ``Conv1D`` (GPT-2),
    stored [in, out]; "rows" below are indices along it."""

    parts: tuple[int, ...]
    tp: int
    dim: int = 0

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if p % self.tp]
        if bad:
            raise PartError(f"a part of {bad[0]} features (parts {list(self.parts)}) does not divide by tp({self.tp})")

    def rank_rows(self, rank: int) -> torch.Tensor:
        """The rows (user order) tensor-parallel rank ``rank`` holds, in the order it holds them."""
        rows, offset = [], 0
        for p in self.parts:
            n = p // self.tp
            rows.append(torch.arange(offset + rank * n, offset + (rank + 1) * n))
            offset += p
        return torch.cat(rows)

    def rank_major(self) -> torch.Tensor:
        """``rank_major()[i]``: the user's row at row i of the DTensor's global tensor."""
        return torch.cat([self.rank_rows(r) for r in range(self.tp)])

    def of_rank(self, user_full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a full tensor in the user's layout."""
        return user_full.index_select(self.dim, self.rank_rows(rank).to(user_full.device))

    def to_user(self, rank_major_full: torch.Tensor) -> torch.Tensor:
        """A full tensor in the DTensor's (rank-major) row order, in the user's."""
        out = torch.empty_like(rank_major_full)
        index = [slice(None)] * self.dim + [self.rank_major()]
        out[tuple(index)] = rank_major_full
        return out

    def from_user(self, user_full: torch.Tensor) -> torch.Tensor:
        """A full tensor in the user's row order, in the DTensor's (rank-major)."""
        return user_full.index_select(self.dim, self.rank_major().to(user_full.device))


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): ``x @ weight + bias`` with ``weight`` [in, out]."""
    return type(module).__name__ == "Conv1D" and tuple(module.weight.shape) == (module.nx, module.nf)


def part_layouts(tp_parts: dict[str, Iterable[int]], module: nn.Module, tp: int) -> dict[str, PartLayout]:
    """``{parameter name: PartLayout}`` of the part-laid Linears ``tp_parts`` names (module
    path -> part sizes, the plan's ``tp_parts``) among ``module``'s submodules: their
    weight and bias (a ``Conv1D``'s weight along its dimension 1)."""
    out: dict[str, PartLayout] = {}
    for path, parts in tp_parts.items():
        sizes = tuple(int(p) for p in parts)
        if len(PartLayout(sizes, tp).parts) < 2:
            continue
        sub = module.get_submodule(path)
        for key, _ in sub.named_parameters(recurse=False):
            dim = 1 if key == "weight" and is_conv1d(sub) else 0
            out[f"{path}.{key}" if path else key] = PartLayout(sizes, tp, dim)
    return out


# The attribute of a stage module that holds its part layouts (``{parameter name:
# PartLayout}``, names as the stage's own state_dict has them), set by
# ``runtime.shard.apply_tensor_parallel`` and read by materialisation, checkpoints and
# the final state_dict.
LAYOUTS_ATTRIBUTE = "tp_part_layouts"


def layouts_of(module: nn.Module) -> dict[str, PartLayout]:
    """The part layouts of ``module`` and its submodules (a rank's chunks), by the
    parameter names of ``module.state_dict()``."""
    out: dict[str, PartLayout] = {}
    for prefix, sub in module.named_modules():
        for name, layout in getattr(sub, LAYOUTS_ATTRIBUTE, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = layout
    return out


# ----------------------------------------------------------------------------- local shape constants

_VIEWS = {"view", "reshape", torch.reshape}
_SPLITS = {"split", "split_with_sizes", torch.split, torch.functional.split}


def _split_dims(full: Any, local: Any) -> list[int]:
    """Dimensions (negative) in which ``local`` is smaller than ``full``."""
    if not (isinstance(full, torch.Tensor) and isinstance(local, torch.Tensor)) or full.dim() != local.dim():
        return []
    return [d - full.dim() for d in range(full.dim()) if full.shape[d] != local.shape[d]]


def _record(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> dict[str, Any]:
    values: dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    with torch.no_grad():
        _Recorder(gm).run(*inputs)
    return values


def _name(n: fx.Node) -> str:
    return f"{n.name} ({n.target if isinstance(n.target, str) else getattr(n.target, '__name__', n.target)})"


def localise_shapes(reference: fx.GraphModule, local: fx.GraphModule, inputs: list[torch.Tensor]) -> set[str]:
    """Make ``local``'s shape constants those of one tensor-parallel rank, in place; see
    [Note: local shape constants].

    Args:
        reference: the unsplit layer (run on a meta copy; not changed).
        local: the same graph with one rank's Linears, on the meta device.
        inputs: meta tensors both run on.

    Returns:
        The names of the nodes whose arguments changed (``copy_shape_arguments`` makes
        the same changes in another copy of the graph).

    Raises:
        PartError: a shape op cannot be made local (heads do not divide by tp, a view
            moves the split dimension inside another); the message names the op.
    """
    ref = _record(copy.deepcopy(reference).to("meta"), inputs)
    changed: set[str] = set()
    values: dict[str, Any] = {}

    class _Local(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            try:
                localised = src is not None and n.op in ("call_method", "call_function") and \
                    bool(_split_dims(ref.get(src.name), values.get(src.name))) and _localise(n, ref, values)
                if localised:
                    changed.add(n.name)
                out = super().run_node(n)
            except PartError as exc:
                raise PartError(str(exc), node=n.name, split_input=src.name if src is not None else "") from None
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                raise PartError(f"{_name(n)}: {type(exc).__name__}: {str(exc).splitlines()[0]}", node=n.name,
                                split_input=src.name if src is not None else "") from None
            values[n.name] = out
            return out

    with torch.no_grad():
        _Local(local).run(*inputs)
    local.recompile()
    return changed


def copy_shape_arguments(source: fx.GraphModule, target: fx.GraphModule, names: set[str]) -> None:
    """Give ``target``'s nodes ``names`` the arguments of ``source``'s nodes of the same
    names (``localise_shapes``'s changes), and recompile it."""
    if not names:
        return
    here = {n.name: n for n in target.graph.nodes}
    there = {n.name: n for n in source.graph.nodes}
    for name in names:
        node = here[name]
        node.args = fx.node.map_arg(there[name].args, lambda a: here[a.name])
        node.kwargs = fx.node.map_arg(there[name].kwargs, lambda a: here[a.name])
    target.recompile()


def _shape_args(node: fx.Node) -> tuple[int, list[Any]]:
    """(index where the sizes start, or -1 for one tuple argument; the sizes) of a view."""
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return -1, list(node.args[1])
    return 1, list(node.args[1:])


def _view_local_shape(ref_in: torch.Tensor, ref_out: torch.Tensor, local_in: torch.Tensor, where: str) -> list[int]:
    """The local output of a view: the split input dimension starts a group of output
    dimensions, whose outermost (the heads) shrinks by the split factor."""
    dims = _split_dims(ref_in, local_in)
    if len(dims) != 1:
        raise PartError(f"{where}: a view of a value split in dimensions {dims}")
    d = dims[0] + ref_in.dim()
    factor = ref_in.shape[d] // local_in.shape[d]
    before = math.prod(ref_in.shape[:d])
    starts = [j for j in range(ref_out.dim()) if math.prod(ref_out.shape[:j]) == before and ref_out.shape[j] > 1]
    if not starts:
        raise PartError(f"{where}: the view moves the split dimension inside another")
    j = starts[0]
    if ref_out.shape[j] % factor:
        raise PartError(f"{where}: views {ref_in.shape[d]} features as {ref_out.shape[j]} heads, "
                        f"which tp({factor}) does not divide")
    shape = list(ref_out.shape)
    shape[j] //= factor
    return shape


def _localise(n: fx.Node, ref: dict[str, Any], values: dict[str, Any]) -> bool:
    """Make the size arguments of ``n`` local before it runs; whether any changed."""
    src = n.args[0]
    ref_in, local_in = ref[src.name], values[src.name]
    where = _name(n)
    if n.target in _VIEWS or n.target == "expand":
        if n.target == "expand":
            want = list(ref[n.name].shape)
            for d in _split_dims(ref_in, local_in):
                want[d] = local_in.shape[d]
        else:
            want = _view_local_shape(ref_in, ref[n.name], local_in, where)
        start, sizes = _shape_args(n)
        if len(sizes) != len(want):
            return False
        new = list(sizes)
        for i, (size, w) in enumerate(zip(sizes, want)):
            current = values[size.name] if isinstance(size, fx.Node) else size
            if current != -1 and current != w:
                new[i] = w  # a feature width is static: a literal replaces a traced size too
        if new == sizes:
            return False
        n.args = (n.args[0], tuple(new)) if start == -1 else (n.args[0], *new)
        return True
    if n.target in _SPLITS:
        dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
        dim = dim - ref_in.dim() if dim >= 0 else dim
        if dim not in _split_dims(ref_in, local_in):
            return False
        factor = ref_in.shape[dim] // local_in.shape[dim]
        key = "split_size_or_sections" if "split_size_or_sections" in n.kwargs else ("split_size" if "split_size" in n.kwargs else None)
        size = n.kwargs[key] if key else n.args[1]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size]
        if any(not isinstance(s, int) or s % factor for s in sizes):
            raise PartError(f"{where}: split sizes {sizes} do not divide by tp({factor})")
        new = [s // factor for s in sizes]
        value = new if isinstance(size, (list, tuple)) else new[0]
        if key:
            n.kwargs = {**n.kwargs, key: value}
        else:
            n.args = (n.args[0], value, *n.args[2:])
        return True
    return False


__all__ = ["LAYOUTS_ATTRIBUTE", "PartError", "PartLayout", "copy_shape_arguments", "is_conv1d", "layouts_of",
           "localise_shapes", "part_layouts"]
