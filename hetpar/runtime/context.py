"""Context parallelism: every sequence split over a group of ranks, attention all-gathering
the keys and values.

[Note: context parallelism]
A plan with ``context_parallel`` cp > 1 (one degree for the whole plan: ``StagePlan.
context_parallel``) gives each stage ``data_parallel * cp`` rows of ranks; row d trains
data replica ``d // cp`` on context index ``j = d % cp``, and the cp consecutive rows of
a replica at one tensor-parallel index form its context-parallel group (runtime.
distributed builds it as a 1-D DeviceMesh, ``Groups.cp_mesh``).

Layout (causal load balance). Every sequence of length T (T divisible by 2 cp) is cut
into 2 cp equal chunks; context rank j holds chunks j and 2 cp - 1 - j, concatenated.
Under a causal mask a query attends to the keys before it, so early chunks cost little
and late ones much; pairing chunk j with its mirror gives every rank the same work, as
Megatron-LM's and Llama 3's context parallelism do. The model's inputs and the targets
are split alike along dimension 1 (``split_batches``), so each rank's loss is the mean
over its own T / cp tokens of every row.

Positions. What the model computes per token runs unchanged on the rank's tokens; what
depends on a token's place in the sequence takes the rank's global positions
(``local_positions``): in an fx stage the ``torch.arange`` over the sequence's length
(``x.shape[1]``) becomes a call of ``ContextPositions``, in a Hugging Face module stage
the position ids (and so the rotary tables, or GPT-2's and OPT's learned position
embeddings) are the rank's positions.

Attention (``context_attention``). Each rank all-gathers the keys and values of its
group (an autograd function: the forward is an all-gather along the sequence, the
backward a reduce-scatter of their gradients, so each rank gets the sum of every
query's gradient for its keys and values) and puts the gathered chunks in global order.
Causal attention then runs chunk by chunk with no mask made: the rank's chunk c of L
tokens attends the keys of chunks 0..c, the last L of them causally, which is
``scaled_dot_product_attention`` with torch's lower-right causal bias
(``torch.nn.attention.bias.causal_lower_right(L, (c + 1) L)``): on CUDA the flash or
memory-efficient kernel with nothing of T^2 stored, and only the causal half of the work
done. Elsewhere (CPU) torch would build the [L, (c + 1) L] mask inside every call and
keep it for backward, once per layer and micro-batch; the rank makes that additive mask
once and every call shares it (``chunk_bias``). A sliding window (Mistral) or a
non-causal call takes a mask made from positions: query position >= key position,
within the window; that mask is [T/cp, T], never the global T x T, made once per shape
as an additive mask in the query's dtype and shared likewise (a boolean one would be
converted, and kept, by every call); on CUDA it rules out the flash kernel. Why an all-gather
rather than a ring (Ring Attention passes key-value blocks round the group, overlapping
each step with compute): Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models",
section 3.3.2) uses all-gather-based context parallelism because it supports any mask
(document masks, sliding windows) and the keys and values are small under grouped-query
attention (a few key-value heads), so the gather costs little next to the attention
itself. In an fx stage every call of ``F.scaled_dot_product_attention`` (without an
explicit ``attn_mask``) becomes a call of ``ContextAttention``; a Hugging Face module
stage's attention modules call ``hf_context_attention`` through transformers'
``AttentionInterface`` (the stage's own copy of the config names it in
``_attn_implementation``).

Gradients and loss. The data-parallel all-reduce of a stage runs over its column (all
dp * cp rows at one tensor-parallel index) and divides by the column's size: with equal
token counts per rank that is the mean over data replicas and context chunks, the
gradient of the global batch's mean loss as one process computes it. ZeRO (FSDP2 over
the column) averages the same way. The reported loss averages over the cp group too
(``training.LossReport``'s ``context_parallel``).

Pipelines. Each context rank's pipeline is independent: its peers in the neighbouring
stages are the same row, and the tensors between stages are [b, T / cp, h] (the stage
is cut from a local example, ``local_example``, so its receive shapes are the local ones).

Refused (one line): a sequence length that 2 cp does not divide, an input without a
sequence dimension, a model that calls no ``F.scaled_dot_product_attention`` (its
dimension 1 need not be a sequence), an attention written by hand (a softmax of a
product of two activations) or with an explicit mask, ``nn.MultiheadAttention``, an
``arange`` as long as the rank's sequence but not read from its shape, a non-Hugging
Face model captured with torch.export. Not detected: attention inside a leaf module, and
positions baked into a constant tensor (torch.fx folds ``torch.arange(16)``).
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.distributed.device_mesh import DeviceMesh


class ContextParallelError(ValueError):
    """A model or batch that context parallelism cannot split; the message says why."""


@dataclass(frozen=True)
class ContextSplit:
    """This rank's share of every sequence: context index ``index`` of ``cp``, in ``group``
    (None: no process group, only for one-process use with cp 1)."""

    cp: int
    index: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh) -> ContextSplit:
        """The split of this rank in its 1-D context-parallel mesh (``Groups.cp_mesh``)."""
        return cls(cp=mesh.size(), index=mesh.get_local_rank(), group=mesh.get_group())

    def positions(self, local_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens (``local_positions``)."""
        return local_positions(local_len, self.cp, self.index, device=device)


# ----------------------------------------------------------------------------- chunks and positions


def chunk_positions(seq_len: int, cp: int, index: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions context rank ``index`` of ``cp`` holds of a sequence of
    ``seq_len`` tokens: chunks ``index`` and ``2 cp - 1 - index`` of 2 cp ([Note: context
    parallelism]).

    Raises:
        ContextParallelError: 2 cp does not divide ``seq_len``.
    """
    if seq_len % (2 * cp):
        raise ContextParallelError(f"a sequence of {seq_len} tokens does not split into 2 * context_parallel({cp}) "
                                   f"equal chunks; use a sequence length divisible by {2 * cp}")
    chunk = seq_len // (2 * cp)
    early, late = index * chunk, (2 * cp - 1 - index) * chunk
    return torch.cat([torch.arange(early, early + chunk, device=device),
                      torch.arange(late, late + chunk, device=device)])


def local_positions(local_len: int, cp: int, index: int, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The global positions of a rank's ``local_len`` tokens (a sequence of ``local_len * cp``)."""
    positions = chunk_positions(local_len * cp, cp, index, device=device)
    return positions if dtype is None else positions.to(dtype)


def split_sequence(t: torch.Tensor, cp: int, index: int) -> torch.Tensor:
    """The rank's two chunks of every row of ``t`` along dimension 1.

    Raises:
        ContextParallelError: ``t`` has no dimension 1, or 2 cp does not divide it.
    """
    if t.dim() < 2:
        raise ContextParallelError(f"context parallelism splits inputs and targets along dimension 1 (the sequence); "
                                   f"a tensor of shape {list(t.shape)} has none")
    return t.index_select(1, chunk_positions(t.shape[1], cp, index, device=t.device))


def split_batches(data: Iterable[tuple[tuple[torch.Tensor, ...], torch.Tensor]], cp: int, index: int
                  ) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``data``'s batches (inputs, targets) with every tensor cut to this rank's chunks
    (``split_sequence``); see [Note: context parallelism]."""
    for inputs, targets in data:
        yield tuple(split_sequence(t, cp, index) for t in inputs), split_sequence(targets, cp, index)


def local_example(example: tuple, cp: int) -> tuple:
    """A model's example inputs with dimension 1 of every tensor cut to a rank's share
    (the values are not the rank's: only the shapes matter, to cut the stage).

    Raises:
        ContextParallelError: an input has no dimension 1, or 2 cp does not divide it.
    """
    local = []
    for t in example:
        if isinstance(t, torch.Tensor):
            t = split_sequence(t, cp, 0)
        local.append(t)
    return tuple(local)


# ----------------------------------------------------------------------------- attention


# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor for the same
# calls named *_single; an older torch has only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """All-gather along dimension 0 over ``group``; the backward reduce-scatters (sums)
    the gradients back to their ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, split: ContextSplit, dim: int = -2) -> torch.Tensor:
    """``x`` (this rank's tokens along ``dim``) gathered over the context-parallel group,
    in global order (collective); the identity with cp 1."""
    if split.cp == 1:
        return x
    if split.group is None:
        raise ContextParallelError(f"context_parallel({split.cp}) needs its process group to gather keys and values")
    gathered = _AllGather.apply(x.movedim(dim, 0), split.group)  # rank 0's chunks, rank 1's, ...
    return gathered.index_select(0, global_order(x.shape[dim], split.cp, device=x.device)).movedim(0, dim)


@functools.lru_cache(maxsize=64)
def global_order(local_len: int, cp: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """For each global position of a sequence of ``local_len * cp`` tokens, its row in the
    rank-ordered gather of every rank's ``local_len`` tokens. Kept per (length, cp,
    device): every attention call of a step asks for the same one, and a copy to a GPU
    would otherwise wait for it each time."""
    held = torch.cat([local_positions(local_len, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, *, sliding_window: int | None = None
                   ) -> torch.Tensor:
    """[queries, keys] True where a query may attend to a key: causal (key position <=
    query position) and, with ``sliding_window`` W, less than W tokens back (Hugging
    Face's convention: ``masking_utils.sliding_window_overlay``)."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed = allowed & (k_positions[None, :] > q_positions[:, None] - sliding_window)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
           *, causal: bool = True, sliding_window: int | None = None, dropout_p: float = 0.0,
           scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Queries ``q`` [b, heads, s_q, d] at ``q_positions`` attended to keys and values
    ``k``, ``v`` [b, kv_heads, s_k, d] at ``k_positions``, masked by position
    (``attention_mask``; no mask when not ``causal`` and no window)."""
    mask = attention_mask(q_positions, k_positions, sliding_window=sliding_window) \
        if causal or sliding_window is not None else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def context_attention(split: ContextSplit, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      sliding_window: int | None = None, dropout_p: float = 0.0, scale: float | None = None,
                      enable_gqa: bool = False) -> torch.Tensor:
    """This rank's queries attended to the whole sequence's keys and values (collective
    over the context-parallel group); q, k, v are [b, heads, local tokens, d]. See
    [Note: context parallelism]."""
    local = q.shape[-2]
    k_all, v_all = gather_sequence(k, split), gather_sequence(v, split)
    if causal and sliding_window is None:  # chunk by chunk, no mask made ([Note: context parallelism])
        chunk = local // 2
        outs = []
        for c, q_chunk in zip((split.index, 2 * split.cp - 1 - split.index), q.split(chunk, dim=-2)):
            end = (c + 1) * chunk
            outs.append(F.scaled_dot_product_attention(q_chunk, k_all[..., :end, :], v_all[..., :end, :],
                                                       attn_mask=chunk_bias(chunk, end, q), dropout_p=dropout_p,
                                                       scale=scale, enable_gqa=enable_gqa))
        return torch.cat(outs, dim=-2)
    mask = _position_bias(local, split.cp, split.index, sliding_window, q.device, q.dtype) \
        if causal or sliding_window is not None else None
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def chunk_bias(chunk: int, end: int, q: torch.Tensor) -> Any:
    """The lower-right causal bias of ``chunk`` queries over ``end`` keys for ``q``'s device:
    torch's ``causal_lower_right`` on CUDA, whose fused kernels store no mask; elsewhere
    one additive mask of that shape, made once and shared by every call ([Note: context
    parallelism]), where torch would build and keep one per call."""
    if q.device.type in ("cuda", "meta") or chunk == end:
        return causal_lower_right(chunk, end)
    return _additive(("lower_right", chunk, end), q.device, q.dtype)


def _position_bias(local: int, cp: int, index: int, sliding_window: int | None, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rank ``index``'s [local, local * cp] mask by position (``attention_mask``), additive, shared."""
    if device.type == "meta":
        return _masked(attention_mask(local_positions(local, cp, index, device=device),
                                      torch.arange(local * cp, device=device), sliding_window=sliding_window), dtype)
    return _additive(("positions", local, cp, index, sliding_window), device, dtype)


@functools.lru_cache(maxsize=8)
def _additive(key: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere, for the mask ``key`` names."""
    with torch.no_grad():
        if key[0] == "lower_right":
            _, chunk, end = key
            allowed = causal_lower_right(chunk, end)._materialize(device)
        else:
            _, local, cp, index, window = key
            allowed = attention_mask(local_positions(local, cp, index, device=device),
                                     torch.arange(local * cp, device=device), sliding_window=window)
        return _masked(allowed, dtype)


def _masked(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class ContextPositions(nn.Module):
    """What an fx stage calls in place of ``torch.arange(n)`` over the sequence: the
    global positions of the rank's ``n`` tokens. Holds no tensors."""

    def __init__(self, split: ContextSplit):
        super().__init__()
        self.split = split

    def forward(self, length: int, *, device: torch.device | None = None, dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        return local_positions(int(length), self.split.cp, self.split.index, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"cp={self.split.cp}, index={self.split.index}"


class ContextAttention(nn.Module):
    """What an fx stage calls in place of ``F.scaled_dot_product_attention``:
    ``context_attention`` over the rank's group. Holds no tensors."""

    def __init__(self, split: ContextSplit):
        super().__init__()
        self.split = split

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                dropout_p: float = 0.0, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        return context_attention(self.split, q, k, v, causal=is_causal, dropout_p=dropout_p, scale=scale,
                                 enable_gqa=enable_gqa)

    def extra_repr(self) -> str:
        return f"cp={self.split.cp}, index={self.split.index}"


# ----------------------------------------------------------------------------- fx stages

POSITIONS = "hetpar_context_positions"  # the submodules an fx stage calls under context parallelism
ATTENTION = "hetpar_context_attention"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MATMULS = {torch.matmul, torch.bmm, operator.matmul, torch.einsum, "matmul", "bmm", "__matmul__"}
_SOFTMAXES = {F.softmax, torch.softmax, "softmax"}


def apply_to_graph(module: fx.GraphModule, values: dict[str, Any], node_layer: dict[str, int], local_len: int,
                   split: ContextSplit) -> int:
    """Make an fx stage compute on the rank's tokens, in place ([Note: context parallelism]):
    ``torch.arange`` over the sequence's length becomes ``ContextPositions``, each
    ``F.scaled_dot_product_attention`` becomes ``ContextAttention``. New nodes take the
    layer of the node they replace in ``node_layer`` (for recompute).

    Args:
        module: the stage, cut from the model traced on a local example (``local_example``).
        values: the recorded value of each node on that example.
        node_layer: the layer of each node, by name; updated.
        local_len: the rank's tokens per sequence.
        split: the rank's place in its context-parallel group.

    Returns:
        How many attention calls were replaced.

    Raises:
        ContextParallelError: attention the rewrite cannot split (one line).
    """
    graph = module.graph
    _refuse_other_attention(module)
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.arange and _counts_the_sequence(node, values, local_len):
            kwargs = {k: node.kwargs[k] for k in ("device", "dtype") if k in node.kwargs}
            _replace(graph, node, POSITIONS, (node.args[0],), kwargs, node_layer, split)
        elif node.target is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
            if bound.get("attn_mask") is not None:
                raise ContextParallelError(f"{_where(node)}: scaled_dot_product_attention with an explicit attn_mask; "
                                           f"context parallelism masks by position (is_causal=True) and cannot tell "
                                           f"what this mask means")
            kwargs = {k: bound[k] for k in ("is_causal", "dropout_p", "scale", "enable_gqa") if k in bound}
            _replace(graph, node, ATTENTION, (bound["query"], bound["key"], bound["value"]), kwargs, node_layer,
                     split)
            replaced += 1
    graph.lint()
    module.recompile()
    return replaced


def require_attention(model: fx.GraphModule, name: str) -> None:
    """Raise unless the traced whole model calls ``F.scaled_dot_product_attention``: a
    model without attention has no sequence that context parallelism knows to split
    (its dimension 1 may be features).

    Raises:
        ContextParallelError: no attention call in the model.
    """
    if not any(n.op == "call_function" and n.target is F.scaled_dot_product_attention for n in model.graph.nodes):
        raise ContextParallelError(f"context parallelism of {name}: the model calls no F.scaled_dot_product_attention, "
                                   f"so it has no sequence to split over ranks; plan it without context parallelism")


def _replace(graph: fx.Graph, node: fx.Node, target: str, args: tuple, kwargs: dict,
             node_layer: dict[str, int], split: ContextSplit) -> None:
    """``node`` replaced by a call of the submodule ``target`` (``POSITIONS`` or
    ``ATTENTION``, added on first use)."""
    module = graph.owning_module
    if not hasattr(module, target):
        module.add_submodule(target, (ContextPositions if target == POSITIONS else ContextAttention)(split))
    with graph.inserting_before(node):
        new = graph.call_module(target, args, kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if node.name in node_layer:
        node_layer[new.name] = node_layer[node.name]


def _counts_the_sequence(node: fx.Node, values: dict[str, Any], local_len: int) -> bool:
    """Whether an ``arange`` node is 0 .. T - 1 over the local sequence length T read
    from a tensor's shape (``x.shape[1]``, ``x.size(1)``). ``values`` are meta tensors:
    only their shapes are known.

    Raises:
        ContextParallelError: an ``arange`` of the sequence's length whose length is a
            constant, which may or may not count the sequence's positions.
    """
    value = values.get(node.name)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != local_len or local_len == 0:
        return False
    if len(node.args) != 1 or set(node.kwargs) - {"device", "dtype", "layout", "requires_grad", "pin_memory"}:
        return False  # a start or a step: not 0 .. T - 1
    end = node.args[0]
    if isinstance(end, fx.Node) and _reads_the_sequence_length(end, values):
        return True
    raise ContextParallelError(f"{_where(node)}: torch.arange({end}) has the length of a sequence here but is not read "
                               f"from a tensor's shape along the sequence (x.shape[1]), so context parallelism cannot "
                               f"tell whether it counts positions; read the length from the input's shape")


def _reads_the_sequence_length(node: fx.Node, values: dict[str, Any]) -> bool:
    """Whether ``node`` is ``x.shape[i]``, ``x.size(i)`` or ``x.size()[i]`` with i naming
    dimension 1 of ``x`` (the sequence of [b, T, ...])."""
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        source, dim = node.args
    elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        shape, dim = node.args
        is_shape = (shape.op == "call_function" and shape.target is getattr and shape.args[1] == "shape") or \
            (shape.op == "call_method" and shape.target == "size" and len(shape.args) == 1)
        if not is_shape:
            return False
        source = shape.args[0]
    else:
        return False
    value = values.get(source.name) if isinstance(source, fx.Node) else None
    return isinstance(value, torch.Tensor) and isinstance(dim, int) and value.dim() >= 2 and dim % value.dim() == 1


def _refuse_other_attention(module: fx.GraphModule) -> None:
    """Raise on attention that context parallelism would get wrong silently: a softmax
    of a product of two activations (attention written by hand, which would attend to
    the rank's keys only) or ``nn.MultiheadAttention`` called as a module."""
    for node in module.graph.nodes:
        if node.op == "call_module" and isinstance(module.get_submodule(node.target), nn.MultiheadAttention):
            raise ContextParallelError(f"{_where(node)}: nn.MultiheadAttention under context parallelism; write "
                                       f"attention with F.scaled_dot_product_attention(q, k, v, is_causal=True)")
        if node.target in _SOFTMAXES and node.op in ("call_function", "call_method") and _after_product(node.args[0]):
            raise ContextParallelError(f"{_where(node)}: a softmax of a product of two activations (attention written "
                                       f"by hand?) under context parallelism; write attention with "
                                       f"F.scaled_dot_product_attention(q, k, v, is_causal=True)")


def _after_product(node: Any, depth: int = 4) -> bool:
    """Whether ``node`` is, within ``depth`` nodes back, a matmul of two activations."""
    if not isinstance(node, fx.Node) or depth == 0 or node.op in ("placeholder", "get_attr", "call_module"):
        return False
    if node.target in _MATMULS and node.op in ("call_function", "call_method"):
        operands = [a for a in node.args if isinstance(a, fx.Node)]
        return len(operands) >= 2 and all(a.op not in ("get_attr",) for a in operands)
    return any(_after_product(a, depth - 1) for a in node.all_input_nodes)


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else v for v in stack.values()]
    return f"{paths[-1]} ({node.name})" if paths else node.name


# ----------------------------------------------------------------------------- Hugging Face module stages

HF_ATTENTION = "hetpar_context"  # the name hetpar registers in transformers' AttentionInterface


def hf_context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function ([Note: context parallelism]): ``context_attention``
    over the split ``apply_to_decoder`` left on ``module``; the stage passes no mask, the
    positions make it. Returns [b, tokens, heads, d] as transformers' own functions do."""
    if kwargs.get("softcap") is not None:
        raise ContextParallelError(f"{type(module).__name__}: attention logit soft-capping under context parallelism")
    split: ContextSplit = module.hetpar_context_split
    out = context_attention(split, query, key, value, sliding_window=sliding_window, dropout_p=dropout, scale=scaling,
                            enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def apply_to_decoder(stage: nn.Module, split: ContextSplit) -> list[str]:
    """Make a Hugging Face module stage (runtime.module_stage.DecoderStage) compute on the
    rank's tokens, in place: its positions are the rank's, and its attention modules call
    ``hf_context_attention`` (through their own copy of the config).

    Returns:
        The paths of the attention modules changed.

    Raises:
        ContextParallelError: a block without an attention module that reads its config.
    """
    from transformers import AttentionInterface

    layout = stage._layout
    AttentionInterface.register(HF_ATTENTION, hf_context_attention)
    stage.context = split
    changed, configs = [], {}
    blocks = stage.get_submodule(layout.base).get_submodule(layout.blocks) if stage._blocks else None
    for i in stage._blocks:
        found = [(path, m) for path, m in blocks.get_submodule(str(i)).named_modules()
                 if type(m).__name__.endswith("Attention")
                 and hasattr(getattr(m, "config", None), "_attn_implementation")]
        if not found:
            raise ContextParallelError(f"{layout.block_path(i)} has no attention module that reads its config's "
                                       f"_attn_implementation; context parallelism cannot replace its attention")
        for path, attention in found:
            config = configs.get(id(attention.config))
            if config is None:
                config = configs[id(attention.config)] = copy.copy(attention.config)
                config._attn_implementation = HF_ATTENTION
            attention.config = config
            attention.hetpar_context_split = split
            changed.append(f"{layout.block_path(i)}.{path}")
    return changed


__all__ = [
    "ATTENTION",
    "HF_ATTENTION",
    "POSITIONS",
    "ContextAttention",
    "ContextParallelError",
    "ContextPositions",
    "ContextSplit",
    "apply_to_decoder",
    "apply_to_graph",
    "attend",
    "attention_mask",
    "chunk_positions",
    "context_attention",
    "gather_sequence",
    "global_order",
    "hf_context_attention",
    "local_example",
    "local_positions",
    "require_attention",
    "split_batches",
    "split_sequence",
]
