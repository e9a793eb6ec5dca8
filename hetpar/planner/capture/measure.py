"""Measure a graph module on the meta device, node by node: FLOPs, bytes, saved activations.

Nothing is allocated and nothing is guessed: the module runs forward and backward on
meta tensors under a dispatch mode that sees every ATen kernel, and a second forward
runs under saved-tensor hooks that see every tensor autograd keeps.

[Note: what a kernel costs]
- FLOPs of matmuls, convolutions and attention come from torch's own formulas
  (``torch.utils.flop_counter``), so totals equal ``FlopCounterMode``'s; grouped
  matmuls (the experts of a mixture), which torch's counter does not know, are counted
  as [Note: grouped matmuls] says.
- Elementwise FLOPs (pointwise ops, reductions, norms, softmax) are counted as one per
  element of the largest operand: a floor, since these kernels are bound by memory
  traffic, which the byte counts give.
- Bytes: a kernel reads each tensor operand once and writes each output once; views
  move nothing. Fusion would lower the real traffic. Two kernels are counted as they run,
  not as the meta device decomposes them: an attention call (``scaled_dot_product_attention``)
  as one fused kernel ([Note: fused attention bytes]), and an embedding lookup, which
  reads the rows it returns, not the whole table (its backward adds those rows into
  the table's gradient).
- Backward kernels are charged to the forward node that created the autograd node
  running them (``torch._C._current_autograd_node``); the accumulation of parameter
  and input gradients is charged to no node but counted in the totals.
- Saved bytes count each storage once, parameters excluded; see
  [Note: fused attention on meta].
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hetpar.runtime.capture import attribute, module_path

aten = torch.ops.aten
UNATTRIBUTED = ""  # the bucket of kernels that belong to no node (gradient accumulation)

# Queries of tensor metadata: no kernel runs (the same list FlopCounterMode skips).
_METADATA_OPS = {
    aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
    aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
    aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default,
    torch.ops.prim.layout.default, torch.ops.prim.device.default,
}
# Ops that allocate without reading (their tensor arguments only give a shape).
_ALLOCATING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
               "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "arange", "scalar_tensor"}
# Ops that alias their input without the schema saying so: no bytes move.
_FREE = {"_unsafe_view", "_reshape_alias", "lift_fresh"}
# Elementwise-work ops that carry neither the pointwise nor the reduction tag.
_ELEMENTWISE_EXTRA = {
    "native_layer_norm", "native_layer_norm_backward", "_softmax", "_softmax_backward_data", "_log_softmax",
    "_log_softmax_backward_data", "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward", "gelu_backward",
    "threshold_backward", "silu_backward", "tanh_backward", "sigmoid_backward", "native_dropout",
    "native_dropout_backward", "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
    "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "embedding_dense_backward",
}


@dataclass
class NodeCounts:
    """What one node's kernels cost, forward and backward; see [Note: what a kernel costs]."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_elementwise_flops: float = 0.0
    bwd_elementwise_flops: float = 0.0
    fwd_bytes: float = 0.0  # read + written
    bwd_bytes: float = 0.0
    saved_bytes: float = 0.0
    output_bytes: float = 0.0
    widest_bytes: float = 0.0  # its largest output that needs a gradient: what backward holds the gradient of
    param_bytes: float = 0.0
    # Forward matmul FLOPs by (rows, rows grow with the batch, width); see [Note: matmul rows].
    matmul_rows: dict[tuple[int, bool, int], float] = field(default_factory=dict)
    fwd_matmuls: int = 0  # forward ops with FLOPs (matmuls, convolutions, attention): kernels compiling keeps
    attention_kv_bytes: float = 0.0  # keys and values its attention calls read ([Note: context parallelism costs])
    attention_out_bytes: float = 0.0  # its attention calls' outputs (the same Note)
    kept_bytes: float = 0.0  # outputs of its weight matmuls and attention: what selective recompute keeps ([Note: selective recompute costs])
    rerun_flops: float = 0.0  # forward FLOPs of its products of two activations: what selective recompute runs again


@dataclass
class Measurement:
    """A module's counts per node (in graph order, ``UNATTRIBUTED`` last) and its outputs."""

    nodes: dict[str, NodeCounts] = field(default_factory=dict)
    outputs: Any = None

    def total(self, what: str) -> float:
        return float(sum(getattr(c, what) for c in self.nodes.values()))

    def largest(self, what: str) -> float:
        return float(max((getattr(c, what) for c in self.nodes.values()), default=0.0))


def measure(module: fx.GraphModule, inputs: list[torch.Tensor], *, masks: bool = True) -> Measurement:
    """Run ``module`` forward and backward on meta ``inputs`` and count its kernels.

    Inputs that require gradients (activations received from an earlier layer) get
    them; the others (data, masks) do not, as in training. Without ``masks`` the masks
    its attention calls receive are causal ones the program does not build: not counted
    as saved ([Note: causal masks]), and their attention costs as causal ([Note: causal
    attention FLOPs]).
    """
    result = Measurement(nodes={n.name: NodeCounts() for n in module.graph.nodes if n.op not in ("placeholder", "output")})
    result.nodes[UNATTRIBUTED] = NodeCounts()
    _count_kernels(module, inputs, result, masks)
    _count_saved(module, inputs, result, masks)
    _count_params(module, result)
    return result


def _grad_inputs(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh leaves for each run, requiring gradients where the given inputs do."""
    return [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]


class _NodeRunner(fx.Interpreter):
    """Runs a graph node by node, calling ``before(node)`` and ``after(node, value)`` around each."""

    def __init__(self, module: fx.GraphModule, before: Any = None, after: Any = None):
        super().__init__(module)
        self.before, self.after = before, after

    def run_node(self, n: fx.Node) -> Any:
        if self.before:
            self.before(n)
        out = super().run_node(n)
        if self.after:
            self.after(n, out)
        return out


class _KernelCounter(TorchDispatchMode):
    """Charges every kernel's FLOPs and bytes to the node that runs it."""

    def __init__(self, result: Measurement):
        super().__init__()
        self.result = result
        self.current = UNATTRIBUTED
        self.backward = False
        self.owner: dict[int, str] = {}  # id(autograd node) -> fx node name
        self.keep: list[Any] = []  # the autograd nodes themselves, so their ids stay unique
        self.scale = 1.0  # the share of the kernels now running that real kernels compute ([Note: causal attention FLOPs])
        self.scales: dict[int, float] = {}  # id(autograd node) -> that share of its backward
        # [Note: fused attention bytes]: inside an attention call the meta device's kernels move no bytes of their
        # own; the call charges its fused kernel's
        self.fused = False
        self.fused_backward: set[int] = set()  # id(autograd node) of those calls' backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return func(*args, **kwargs)
        # as FlopCounterMode: count composite ops by their parts
        if func not in flop_registry and func._schema.name not in GROUPED_MATMULS:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._charge(func, args, kwargs, out)
        return out

    def _charge(self, func, args, kwargs, out) -> None:
        counts = self.result.nodes[self._node()]
        packet, qualified = func._overloadpacket, func._schema.name
        flops, elementwise = 0.0, 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif qualified in GROUPED_MATMULS:
            flops = grouped_mm_flops(qualified, args)
        elif torch.Tag.pointwise in func.tags or torch.Tag.reduction in func.tags or packet.__name__ in _ELEMENTWISE_EXTRA:
            elementwise = float(max((t.numel() for t in _tensors((args, kwargs, out))), default=0))
        written = float(sum(_nbytes(t) for t in _tensors(out)))
        if func.is_view or packet.__name__ in _FREE:
            moved = 0.0
        elif packet.__name__ in _ALLOCATING:
            moved = written
        elif packet.__name__ == "embedding":  # the rows looked up, and the indices
            moved = 2 * written + _nbytes(args[1])
        elif packet.__name__ == "embedding_dense_backward":  # those rows' gradients read and added into the table
            moved = 2 * _nbytes(args[0]) + _nbytes(args[1])
        else:
            moved = float(sum(_nbytes(t) for t in _tensors((args, kwargs)))) + written
        scale = self.scale
        if self.backward:
            autograd_node = torch._C._current_autograd_node()
            scale = self.scales.get(id(autograd_node), 1.0) if autograd_node is not None else 1.0
            if autograd_node is not None and id(autograd_node) in self.fused_backward:
                moved = 0.0
        elif self.fused:
            moved = 0.0
        flops, elementwise = flops * scale, elementwise * scale
        if self.backward:
            counts.bwd_flops += flops
            counts.bwd_elementwise_flops += elementwise
            counts.bwd_bytes += moved
        else:
            counts.fwd_flops += flops
            counts.fwd_elementwise_flops += elementwise
            counts.fwd_bytes += moved
            counts.fwd_matmuls += int(flops > 0)
            if flops <= 0:
                rows = None
            elif qualified in GROUPED_MATMULS:
                rows = grouped_mm_rows(qualified, args)
            else:
                rows = matmul_rows(packet.__name__, args, out)
            if rows is not None:
                counts.matmul_rows[rows] = counts.matmul_rows.get(rows, 0.0) + flops

    def _node(self) -> str:
        if not self.backward:
            return self.current
        autograd_node = torch._C._current_autograd_node()
        return self.owner.get(id(autograd_node), UNATTRIBUTED) if autograd_node is not None else UNATTRIBUTED

    def claim(self, node: fx.Node, out: Any) -> None:
        """Mark the autograd nodes that ``node`` created (those not yet claimed) as its own.

        Gradient accumulation into leaves (parameters, inputs) stays unclaimed.
        """
        stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in self.owner or type(fn).__name__ == "AccumulateGrad":
                continue
            self.owner[id(fn)] = node.name
            self.keep.append(fn)
            stack.extend(next_fn for next_fn, _ in fn.next_functions)


# [Note: matmul rows]
# A matmul's throughput on a CPU (and, less so, on a GPU) falls with its row count M:
# the profile measures that curve (docs/profiling.md, "matmul by rows").
# The layer cost model therefore needs each forward matmul's M, not only its FLOPs:
# the rows of the left operand of mm/addmm (a Linear's batch and sequence positions
# flattened, so they grow with the micro-batch), the rows of each matrix of bmm/baddbmm
# and of attention (the query length: the batch goes into the batch dimension, so
# they do not grow), and a convolution's output positions per image (they grow). Other
# FLOP-counted kernels record none. The backward's matmuls of a forward matmul run
# with the same M (the input gradient has M rows; the weight gradient sums over M).
# It falls with the matmul's width too (a transposed weight and a bias weigh more on
# fewer FLOPs per output; docs/benchmarks/matmul-width_cpu-2core_2026-12-03.md), so
# each matmul also records its width, the geometric mean of its inner dimension K and
# its output columns N (of attention: the head size and the key length), and the cost
# model interpolates between curves measured at two widths (cost_models/compute.py
# ``matmul_efficiency``).
def matmul_rows(op: str, args: tuple, out: Any) -> tuple[int, bool, int] | None:
    """(rows M at the traced batch, whether M grows with the batch, width sqrt(K N)) of a
    FLOP-counted kernel; see [Note: matmul rows]."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op in ("mm", "bmm") and len(tensors) >= 2:
        a, b = tensors[0], tensors[1]
        return int(a.shape[-2]), op == "mm", _width(a.shape[-1], b.shape[-1])
    if op in ("addmm", "baddbmm") and len(tensors) >= 3:
        a, b = tensors[1], tensors[2]
        return int(a.shape[-2]), op == "addmm", _width(a.shape[-1], b.shape[-1])
    if op.startswith("_scaled_dot_product") and len(tensors) >= 2:
        return int(tensors[0].shape[-2]), False, _width(tensors[0].shape[-1], tensors[1].shape[-2])
    if op == "convolution" and len(tensors) >= 2:
        result = _tensors(out)
        if result and result[0].dim() > 2:
            weight = tensors[1]
            return int(result[0][0, 0].numel()), True, _width(weight[0].numel(), weight.shape[0])
    return None


# [Note: grouped matmuls]
# A mixture of experts multiplies each routed row by its own expert's matrices in one
# grouped kernel, which torch's FLOP counter does not know:
# - ``aten._grouped_mm`` (``F.grouped_mm``): rows [S, K] grouped by offsets times a
#   stack [G, K, N], one matrix per group (the experts' forward and their input
#   gradient); [K, S] by [S, N], grouped along the shared S, giving [G, K, N] (the
#   weights' gradient); a stack [G, M, K] by [K, N] grouped along N; and [G, M, K] by
#   [G, K, N], a batch of products (runtime.experts ``grouped_mm_shape``).
# - Hugging Face's ``transformers::grouped_mm_fallback`` (input [S, K] by weights
#   [E, K, N]), which transformers 5 runs under torch.export, so on the meta capture of
#   its models, for dtypes other than bfloat16, and its backward op
#   ``transformers::grouped_mm_fallback_backward``, both gradients: two such products.
# They are matched by qualified name (hetpar never imports transformers) and counted as
# matmuls: 2 FLOPs per multiply-add of every group's product, every row in a group (the
# routing sends each of the tokens x top-k rows to one expert, so the offsets end at
# the last row). Bytes are any kernel's: each operand read once (every expert's weights),
# the output written once. A grouped kernel runs each group's product as a matmul of
# its own, so its rows ([Note: matmul rows]) are a group's: in the experts' forward, the
# S rows over G experts, S / G on average (uniform routing), growing with the batch;
# the other layouts record their products' rows, which do not grow, as bmm's do.
GROUPED_MATMULS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback",
                   "transformers::grouped_mm_fallback_backward")


def grouped_mm_flops(op: str, args: tuple) -> float:
    """FLOPs of the grouped matmul ``op`` (a qualified name of ``GROUPED_MATMULS``) on
    operands ``args``; see [Note: grouped matmuls]."""
    a, b = args[0].shape, args[1].shape
    if op != "aten::_grouped_mm":  # Hugging Face's: input [S, K], weights [E, K, N]
        products = 2 if op.endswith("_backward") else 1  # the input's and the weights' gradients
        return 2.0 * products * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 3:  # rows grouped, a matrix per group
        return 2.0 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:  # columns of b grouped, a matrix of a per group
        return 2.0 * a[1] * a[2] * b[1]
    if len(a) == 2 and len(b) == 2:  # the shared dimension grouped: one [M, N] product per group
        return 2.0 * a[0] * a[1] * b[1]
    return 2.0 * a[0] * a[1] * a[2] * b[2]  # a batch of products


def grouped_mm_rows(op: str, args: tuple) -> tuple[int, bool, int]:
    """(rows of one group's product at the traced batch, whether they grow with the batch,
    width) of a forward grouped matmul; see [Note: grouped matmuls] and [Note: matmul rows]."""
    a, b = args[0].shape, args[1].shape
    if len(a) == 2 and len(b) == 3:  # the experts' forward: S rows over G experts
        return max(1, round(a[0] / b[0])), True, _width(a[1], b[2])
    offs = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
    groups = a[0] if len(a) == 3 else (offs.shape[0] if offs is not None else 1)
    if len(a) == 3 and len(b) == 3:
        return int(a[1]), False, _width(a[2], b[2])
    if len(a) == 3:
        return int(a[1]), False, _width(a[2], max(1, b[1] // groups))
    return int(a[0]), False, _width(max(1, a[1] // groups), b[1])


def _width(inner: int, columns: int) -> int:
    return max(1, round(math.sqrt(int(inner) * int(columns))))


def _count_kernels(module: fx.GraphModule, inputs: list[torch.Tensor], result: Measurement, masks: bool = True) -> None:
    counter = _KernelCounter(result)

    def before(n: fx.Node) -> None:
        counter.current = n.name if n.name in result.nodes else UNATTRIBUTED

    def after(n: fx.Node, out: Any) -> None:
        if n.name in result.nodes:
            counter.claim(n, out)
        if n.name in result.nodes and n.op != "get_attr":
            result.nodes[n.name].output_bytes = float(sum(_nbytes(t) for t in _tensors(out)))
            result.nodes[n.name].widest_bytes = float(max((_nbytes(t) for t in _tensors(out) if t.requires_grad), default=0))

    args = _grad_inputs(inputs)
    with _CausalAttention(counter, masks), counter:
        out = _NodeRunner(module, before, after).run(*args)
    result.outputs = out
    grads = [t for t in _tensors(out) if t.requires_grad]
    counter.backward = True
    with counter:
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])


def _count_saved(module: fx.GraphModule, inputs: list[torch.Tensor], result: Measurement, masks: bool = True) -> None:
    """Bytes autograd keeps for backward, per node, parameters excluded, each storage once;
    and the keys and values each node's attention reads."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: set[int] = set()
    current = [UNATTRIBUTED]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            result.nodes[current[0]].saved_bytes += storage.nbytes()
        return t

    def before(n: fx.Node) -> None:
        current[0] = n.name if n.name in result.nodes else UNATTRIBUTED

    def attention(key: torch.Tensor, value: torch.Tensor, out: Any = None) -> None:
        counts = result.nodes[current[0]]
        if out is None:
            counts.attention_kv_bytes += _nbytes(key) + _nbytes(value)
        else:
            counts.kept_bytes += sum(_nbytes(t) for t in out)
            counts.attention_out_bytes += _nbytes(out[0])

    def kept(out: Any, rerun_flops: float = 0.0) -> None:
        counts = result.nodes[current[0]]
        if rerun_flops:
            counts.rerun_flops += rerun_flops
        else:
            counts.kept_bytes += sum(_nbytes(t) for t in _tensors(out))

    with _fused_attention(_AttentionSeen(attention, masks)), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _KeptOutputs(kept):
        _NodeRunner(module, before).run(*_grad_inputs(inputs))


# [Note: selective recompute costs]
# Selective recompute (runtime/recompute.py) is Korthikanti et al.'s (2022, section 4.2):
# it keeps the outputs of a layer's weight matmuls (``mm``/``addmm``: a Linear on any
# input is one of those), convolutions and fused attention, and recomputes everything
# else in backward: the norms, activations and dropout, and the products of two
# activations (``bmm``/``baddbmm``: a written-out attention's Q K^T and its
# probabilities times V, whose s x s inputs are what selective recompute exists not to
# keep). The saved-bytes pass counts per node the kept outputs (``kept_bytes``: a fused
# attention's output and log-sum-exp included) and the forward FLOPs of the recomputed
# products (``rerun_flops``); the cost models keep, per micro-batch, the layer's input
# and those outputs (never more than recompute none keeps), and charge the backward
# the forward's memory-bound part and those FLOPs again (``LayerTime.selective_rerun_s``).
_KEPT_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.convolution.default})  # runtime/recompute.py's list, attention counted at its call
_RERUN_OPS = frozenset({aten.bmm.default, aten.baddbmm.default})


class _KeptOutputs(TorchDispatchMode):
    """Reports the outputs of the forward ops selective recompute keeps, and the FLOPs of
    the products it runs again ([Note: selective recompute costs])."""

    def __init__(self, record: Any):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is None:
            if func in _KEPT_OPS:
                self.record(out)
            elif func in _RERUN_OPS:
                a, b = (args[1], args[2]) if func is aten.baddbmm.default else (args[0], args[1])
                self.record(out, 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        return out


def _count_params(module: fx.GraphModule, result: Measurement) -> None:
    """Bytes of the parameters each node reads (get_attr) or owns (a module call)."""
    seen: set[int] = set()
    for node in module.graph.nodes:
        if node.op == "get_attr":
            tensors = [attribute(module, str(node.target))]
        elif node.op == "call_module":
            tensors = list(module.get_submodule(str(node.target)).parameters())
        else:
            continue
        for t in tensors:
            if isinstance(t, torch.nn.Parameter) and id(t) not in seen:
                seen.add(id(t))
                result.nodes[node.name].param_bytes += _nbytes(t)



# [Note: fused attention on meta]
# On the meta device scaled_dot_product_attention always takes the math path, which
# saves the T x T attention matrix. Real devices run a fused kernel (flash attention on
# CUDA and on CPU) that saves only q, k, v, the mask, the output and the row
# log-sum-exp. The saved-bytes pass stands in that kernel's footprint, for the
# function (torch.fx graphs, and modules that call it) and for the ATen op (exported
# graphs); the FLOP pass keeps the math path, scaled for a causal call ([Note: causal attention FLOPs]).
class _FusedSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask):
        # Fused kernels return (B, T, H, D) memory seen as (B, H, T, D), so the usual
        # transpose(1, 2).reshape(B, T, -1) after attention is a view, not a copy.
        batch, heads, length = q.shape[0], q.shape[1], q.shape[2]
        out = q.new_empty((batch, length, heads, v.shape[-1])).transpose(1, 2)
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        saved = (q, k, v, out, logsumexp) + ((mask,) if mask is not None else ())
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


_SDPA = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)


# [Note: causal masks]
# A model whose attention is causal needs no T x T mask: the fused kernels take
# ``is_causal``. Hugging Face decoders exported on meta still build one ([1, 1, T, T],
# 16 GiB per sample at 128k tokens) and hand it to every attention call, while the
# program runs them as module stages (runtime/module_stage.py) through SDPA with no
# materialised mask when there is no padding. Their blocks are measured with
# ``masks=False``: the mask is not counted as saved. Any other model's mask is counted
# at its true size, as the fused kernel keeps it.
@dataclass(frozen=True)
class _AttentionSeen:
    """What the saved-bytes pass does at each attention call: report its keys and values,
    and whether the mask counts as saved."""

    record: Any  # callable(key, value, outputs=None)
    masks: bool = True


_SEEN: list[_AttentionSeen] = []  # the innermost pass's, while one runs


def _fused_sdpa(query, key, value, attn_mask=None, *args: Any, **kwargs: Any) -> torch.Tensor:
    seen = _SEEN[-1] if _SEEN else None
    if seen is not None:
        seen.record(key, value)
    keep_mask = isinstance(attn_mask, torch.Tensor) and (seen is None or seen.masks)
    out = _FusedSDPA.apply(query, key, value, attn_mask if keep_mask else None)
    if seen is not None:  # the fused kernel's output and its row log-sum-exp (float32), kept by selective recompute
        seen.record(key, value, (out, query.new_empty(query.shape[:-1], dtype=torch.float32)))
    return out


class _FusedAttentionMode(TorchFunctionMode):
    """Sees the attention calls of a graph: fx's function nodes and export's ATen op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SDPA:
            return _fused_sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fused_attention(seen: _AttentionSeen | None = None):
    """Stand in fused attention; see [Note: fused attention on meta]. ``seen`` hears of each call.

    A torch-function mode only sees the outermost call, so attention inside a function
    it passes on (``F.multi_head_attention_forward`` of an opaque nn.MultiheadAttention)
    is reached by swapping ``F.scaled_dot_product_attention``, which such code looks up
    when it runs, for the duration of the pass.
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa
    if seen is not None:
        _SEEN.append(seen)
    try:
        with _FusedAttentionMode():
            yield
    finally:
        F.scaled_dot_product_attention = original
        if seen is not None:
            _SEEN.pop()


# [Note: causal attention FLOPs]
# On meta, scaled_dot_product_attention takes the math path, whose matmuls and softmax
# cover every (query, key) pair. A causal kernel (flash attention, torch's fused CPU
# kernel) computes only the pairs the mask lets through and skips the blocks above
# the diagonal: the FLOPs of pairs (i, j <= i), ``causal_fraction`` of the whole,
# about half at any length worth planning (0.5 + 1 / 2T), forward and backward. So
# the kernel pass charges an attention call's kernels that fraction of what they
# count when the call is causal: ``is_causal=True``, or, in a block measured without
# ``masks`` ([Note: causal masks]), a mask the program does not build. Every figure
# made of FLOPs follows: layer times, the plan's model FLOPs per step and so MFU
# (FlashAttention's convention; PaLM's and Megatron's formulas count the masked half
# too). An attention written out as matmuls and a masked softmax computes every pair,
# and costs so.
def causal_fraction(queries: int, keys: int) -> float:
    """The share of (query, key) pairs a causal mask lets through: query i (top-left
    aligned, torch's ``is_causal``) sees keys ``0 .. i``."""
    if queries <= 0 or keys <= 0:
        return 1.0
    shared = min(queries, keys)
    seen = shared * (shared + 1) // 2 + max(0, queries - keys) * keys
    return seen / (queries * keys)


# [Note: fused attention bytes]
# On meta an attention call runs the math path, whose kernels write and read the s x s
# scores; the fused kernel a device runs (flash attention, torch's fused CPU kernel)
# keeps them on chip. So the kernel pass charges an attention call the bytes of one
# fused kernel, not its math kernels': forward, q, k, v and the mask (where one is
# passed and counted, [Note: causal masks]) read, the output and the row log-sum-exp
# (float32) written; backward, those and the output's gradient read, the gradients of
# q, k and v written. Its FLOPs stay the math path's ([Note: causal attention FLOPs]).
# An attention written out as matmuls and a softmax is no such call and moves its scores.
class _CausalAttention(TorchFunctionMode):
    """Charges an attention call's kernels as one fused kernel runs them: the share of the
    math path's FLOPs a causal kernel computes ([Note: causal attention FLOPs]) and the
    fused kernel's bytes ([Note: fused attention bytes])."""

    def __init__(self, counter: _KernelCounter, masks: bool):
        super().__init__()
        self.counter, self.masks = counter, masks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA or self.counter.fused:
            return func(*args, **kwargs)
        query, key, value = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key", "value")))
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False)) or (
            isinstance(mask, torch.Tensor) and not self.masks)
        share = causal_fraction(int(query.shape[-2]), int(key.shape[-2])) if causal else 1.0
        counts = self.counter.result.nodes[self.counter.current]
        self.counter.scale, self.counter.fused = share, True
        try:
            out = func(*args, **kwargs)
        finally:
            self.counter.scale, self.counter.fused = 1.0, False
        inputs = float(_nbytes(query) + _nbytes(key) + _nbytes(value))
        if isinstance(mask, torch.Tensor) and self.masks:
            inputs += _nbytes(mask)
        output = float(sum(_nbytes(t) for t in _tensors(out)))
        written = output + query[..., 0].numel() * 4  # and the row log-sum-exp
        counts.fwd_bytes += inputs + written
        if any(t.requires_grad for t in (query, key, value)):  # the output's gradient read too, q's, k's and v's written
            counts.bwd_bytes += inputs + written + output + float(_nbytes(query) + _nbytes(key) + _nbytes(value))
        stop = {id(t.grad_fn) for t in _tensors(args[:3]) if t.grad_fn is not None}
        stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        while stack:  # the autograd nodes the call made: from its output back to q, k and v
            fn = stack.pop()
            if fn is None or id(fn) in stop or id(fn) in self.counter.fused_backward or type(fn).__name__ == "AccumulateGrad":
                continue
            self.counter.fused_backward.add(id(fn))
            if causal:
                self.counter.scales[id(fn)] = share
            self.counter.keep.append(fn)
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_label(node: fx.Node) -> str:
    """What a node runs, short: ``aten.linear``, ``attn.q`` (a module), ``view``, an op of
    another library by its namespace (``transformers.grouped_mm_fallback``)."""
    if node.op == "call_module":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._overloadpacket.__name__}"  # aten.mm, transformers.grouped_mm_fallback
    return getattr(target, "__name__", str(target))


def node_module(node: fx.Node) -> str:
    """The innermost module a node runs in."""
    return module_path(node)


__all__ = ["GROUPED_MATMULS", "Measurement", "NodeCounts", "UNATTRIBUTED", "causal_fraction", "grouped_mm_flops", "grouped_mm_rows", "matmul_rows", "measure", "node_label", "node_module"]
