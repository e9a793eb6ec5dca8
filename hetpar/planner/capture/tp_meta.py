"""The layer as one tensor-parallel rank holds it, on the meta device: local Linears and
Embeddings, the whole layer so sharded, and the check that split values do not escape."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from hetpar.planner.capture.tp_ops import TpError, linear_parts, run_graph
from hetpar.runtime.parts import PartError, PartLayout, localise_shapes
from hetpar.vocabulary import Sharding


class ShapeError(TpError):
    """A shape constant of the layer cannot follow the split (``node``: the op,
    ``split_input``: its split input)."""

    def __init__(self, message: str, *, node: str, split_input: str) -> None:
        super().__init__(message)
        self.node, self.split_input = node, split_input


class MetaGathered(nn.Module):
    """A colwise_gather Linear on the meta device: the local slice, then the gathered width."""

    def __init__(self, local: nn.Linear, tp: int):
        super().__init__()
        self.local, self.tp = local, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.local(x)] * self.tp, dim=-1)


class MetaSliced(nn.Module):
    """A rowwise_slice Linear on the meta device: the rank's slice of the input, then the local Linear."""

    def __init__(self, local: nn.Linear, tp: int):
        super().__init__()
        self.local, self.tp = local, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x[..., : x.shape[-1] // self.tp])


def local_linear(module: nn.Module, how: Sharding, tp: int, path: str) -> nn.Module:
    """One tensor-parallel rank's share of a Linear (or transformers' Conv1D) on the meta
    device, with the gathered output or sliced input its sharding implies.

    Raises:
        TpError: the split dimension is not divisible by ``tp``.
    """
    conv1d = not isinstance(module, nn.Linear)  # transformers' Conv1D: weight [in, out]
    in_f, out_f = (module.weight.shape[0], module.weight.shape[1]) if conv1d else (module.in_features, module.out_features)
    if how in (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.VOCAB_HEAD):
        if out_f % tp:
            raise TpError(f"{path}: out_features({out_f}) not divisible by tp({tp})")
        out_f //= tp
    else:
        if in_f % tp:
            raise TpError(f"{path}: in_features({in_f}) not divisible by tp({tp})")
        in_f //= tp
    local = copy.deepcopy(module)
    local.weight = nn.Parameter(torch.empty((in_f, out_f) if conv1d else (out_f, in_f), device="meta", dtype=module.weight.dtype))
    if getattr(module, "bias", None) is not None:
        local.bias = nn.Parameter(torch.empty(out_f, device="meta", dtype=module.weight.dtype))
    if conv1d:
        local.nx, local.nf = in_f, out_f
    else:
        local.in_features, local.out_features = in_f, out_f
    if how is Sharding.COLWISE_GATHER:
        return MetaGathered(local, tp)
    return MetaSliced(local, tp) if how is Sharding.ROWWISE_SLICE else local


def local_embedding(module: nn.Embedding, tp: int, path: str) -> nn.Embedding:
    """One rank's rows of a vocab-parallel Embedding on the meta device (its output has the
    whole width: the runtime all-reduces the ranks' partial lookups).

    Raises:
        TpError: the vocabulary is not divisible by ``tp``.
    """
    if module.num_embeddings % tp:
        raise TpError(f"{path}: num_embeddings({module.num_embeddings}) not divisible by tp({tp})")
    local = copy.deepcopy(module)
    local.num_embeddings //= tp
    local.weight = nn.Parameter(torch.empty((local.num_embeddings, module.embedding_dim), device="meta",
                                            dtype=module.weight.dtype))
    return local


def shard_on_meta(stage_module: fx.GraphModule, sharding: dict[str, Sharding], tp: int,
                  inputs: list[torch.Tensor] | None = None) -> fx.GraphModule:
    """A meta-device copy of the layer as one tensor-parallel rank holds it; given the
    ``inputs`` it runs on, with its shape constants made local ([Note: local shape
    constants] in runtime/parts.py), as the program makes them.

    Raises:
        TpError: a split dimension (or a part of a fused projection: [Note: part-laid
            Linears]) is not divisible by ``tp``, or a shape constant cannot follow
            the split; the message names the module or the op.
    """
    if inputs is not None:
        for path, parts in linear_parts(stage_module, sharding, run_graph(stage_module, inputs)).items():
            try:
                PartLayout(parts, tp)
            except PartError as exc:
                raise TpError(f"{path}: {exc}") from None
    sharded = copy.deepcopy(stage_module)
    for path, how in sharding.items():
        parent_path, _, name = path.rpartition(".")
        parent = sharded.get_submodule(parent_path) if parent_path else sharded
        module = getattr(parent, name)
        local = local_embedding(module, tp, path) if how is Sharding.VOCAB_EMBEDDING else local_linear(module, how, tp, path)
        setattr(parent, name, local)
    sharded.recompile()
    if inputs is not None:
        try:
            localise_shapes(stage_module, sharded, list(inputs))
        except PartError as exc:
            raise ShapeError(str(exc), node=exc.node, split_input=exc.split_input) from None
    return sharded


def check_sharded_shapes(reference_out: Any, sharded_out: Any, vocab_split: int = 1) -> bool:
    """True if a sharded layer's outputs have the unsharded shapes (split values never escape),
    but for logits of a vocab-parallel output layer (``vocab_split`` ranks), whose last
    dimension is split into the loss ([Note: vocab-parallel layers])."""
    ref = reference_out if isinstance(reference_out, (tuple, list)) else (reference_out,)
    got = sharded_out if isinstance(sharded_out, (tuple, list)) else (sharded_out,)

    def same(a, b) -> bool:
        a, b = getattr(a, "shape", None), getattr(b, "shape", None)
        return a == b or (vocab_split > 1 and a is not None and b is not None and len(a) == len(b) and
                          a[:-1] == b[:-1] and b[-1] * vocab_split == a[-1])

    return len(ref) == len(got) and all(same(a, b) for a, b in zip(ref, got))
