"""Sequence parallelism: the residual stream of a tensor-parallel stage held on 1/tp of the sequence.

[Note: sequence parallelism]
Tensor parallelism (runtime/shard.py) splits the Linears of a block, but what lies
between a rowwise Linear's output and the next colwise Linear's input (the residual
adds, norms, dropout: the *residual stream*) runs whole and alike on every rank of the
tp group, and its activations are saved tp times over. Megatron's sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2) runs that region on 1/tp of the sequence instead. The sequence
is dimension 1 of a ``[batch, sequence, hidden]`` activation, and rank t holds
positions ``[t S / tp, (t + 1) S / tp)`` (``torch.chunk``'s cut, DTensor's ``Shard(1)``).

The four moves at the region's edges, each an autograd function whose backward is the
forward's transpose (Megatron's ``mappings.py`` names them alike):

| where | forward | backward | here |
|---|---|---|---|
| rowwise Linear output | reduce-scatter | all-gather | DTensor ``RowwiseParallel(output_layouts=Shard(1))`` |
| a replicated value enters (stage input, embeddings) | take this rank's chunk | all-gather | ``scatter_sequence`` |
| a colwise Linear's input | all-gather | reduce-scatter (its gradient is partial) | ``gather_sequence(partial_grad=True)`` |
| the stream leaves (stage output, an unsplit head, any op not known to be token-local) | all-gather | take this rank's chunk | ``gather_sequence`` |

So a stage's inputs and outputs, which pipelines send, stay whole and replicated, as
without sequence parallelism. The all-reduce of a rowwise output becomes a
reduce-scatter plus, at the next colwise input, an all-gather: the same bytes on a ring.
The all-gather before q, k and v happens once per shared input, and so does its
backward reduce-scatter (the gathered tensor is marked ``gathered_for_colwise``, so
the colwise style leaves its gradient partial; [Note: one all-reduce per shared input]
in runtime/shard.py).

A replicated parameter used on sequence-sharded data (a norm's weight and bias) gets
only this rank's tokens' share of its gradient. Each such use reads the parameter
through ``reduce_grad`` (the identity forward; the backward all-reduces over the tp
group), so its gradient is whole before autograd accumulates it, whatever follows:
micro-batches, recompute, data-parallel all-reduce or FSDP2's reduce-scatter over a
(dp, tp) mesh. Modules (``nn.LayerNorm``, Llama's RMSNorm) read their parameters so
through hooks (``reduce_parameter_grads``) that keep their names and state_dicts.

Why explicit functions and a graph rewrite rather than torch's ``SequenceParallel``
style alone: an fx stage (runtime/graph.py) is one flat graph where a residual add is a
node, a norm may be inlined as ``call_function``s on ``get_attr`` weights, and the
embedding's output meets a position embedding of shape ``[S, H]``; a DTensor style only
sees modules. ``shard_graph`` walks the stage graph once and gives every value a state:
replicated, split (features, after a colwise Linear), or sharded (sequence). An op
known to be token-local (elementwise, a norm over the last dimension, dropout) that
reads no split value, and whose output is the residual stream's ``[B, S, H]`` (the
rowwise outputs' shape) or that reads a sharded value, runs sharded: its replicated inputs are scattered (a broadcast partner such as ``[S, H]``
along its own sequence dimension; one of size 1 there, or without it, is read through
``reduce_grad``); any other op reads sharded values through a gather, so an unknown op
costs communication, never correctness. Shape reads of a sharded value (``B, T, _ =
x.shape``) are the whole micro-batch's, which is fixed ([Note: stage boundaries] in
runtime/graph.py), so they become constants; reads a shard answers as the whole would
(``x.device``, ``x.dtype``) stay. Module stages of Hugging Face decoders
(runtime/module_stage.py) use the same functions through hooks, as torchtitan's Llama
recipe places its styles: the hidden state is scattered after the embedding and the
position tables and masks (made from the whole sequence); a block's norms and dropout
run on the shard, every other child of the block (attention, MLP) reads its input
gathered and, unless a rowwise Linear already reduce-scattered its output, has the
output scattered again; the final norm runs on the shard, and the hidden state is
gathered before the head or the stage's output.

What the saving is: every activation saved in the residual stream (norm inputs, the
residual sums, dropout masks) is 1/tp; the gathered input of q, k, v and the MLP's
first Linear is saved as the shard and gathered again in backward (Korthikanti's
section 4.2.2), through ``saved_tensors_hooks`` around the colwise Linear (without
recompute, which drops it anyway). So a rank saves 1/tp of what one process saves
for its blocks: 0.50 measured at tp 2 on examples/gpt.py and a Hugging Face Llama
(tests/test_sequence_parallel.py ``saved_activation_bytes``; docs/running.md), where tp
alone saves 0.63 to 0.68 (the whole residual stream). Dropout in the
sharded region draws one mask per rank from the same generator state, so its masks
differ from one process's (Megatron forks the tensor-parallel RNG there); the tests
run without dropout.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from hetpar.runtime.buckets import all_gather_rows

# The attribute of a stage module that holds its ``SequenceGroup`` (set when the stage
# is cut with sequence parallelism; its group is bound by runtime.shard.apply_tensor_parallel).
SEQUENCE_ATTRIBUTE = "hetpar_sequence_parallel"
# Marks a tensor gathered for colwise Linears: its gradient reaches the gather partial.
GATHERED_ATTRIBUTE = "hetpar_gathered_for_colwise"
# (device, storage pointer) -> the live tensor ``gather_sequence(partial_grad=True)`` made there, so
# an alias of it counts as gathered too: FSDP2's pre-forward hook hands a module its
# inputs through an autograd function (``RegisterPostBackwardFunction``), as new tensor
# objects on the same storage that carry no attribute of the gathered one.
_GATHERED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class SequenceError(ValueError):
    """A stage cannot run sequence-parallel; the message names the module and the fix."""


@dataclass(eq=False)
class SequenceGroup:
    """The tp group a stage's sequence is split over; ``group`` is bound when tensor
    parallelism is applied (``bind``). ``group`` None with ``tp`` 1 is a group of one."""

    tp: int
    group: Any = None
    hooks: list = field(default_factory=list)
    head_partial_grad: bool = False  # a module stage's head is split colwise: it reads its input gathered so
    save_shards: bool = True  # colwise Linears save a gathered input as its shard (not under recompute, which drops it)
    _gathered: dict = field(default_factory=dict)  # storage pointer -> (weakref of a gathered tensor, its shard)

    def forget(self, *_: Any) -> None:
        """Drop the record of this forward's gathered tensors (a stage forward's hook)."""
        self._gathered.clear()

    def bind(self, group: Any) -> None:
        size = dist.get_world_size(group)
        if size != self.tp:
            raise SequenceError(f"the stage was cut for sequence parallelism over tp({self.tp}), its tp group has "
                                f"{size} ranks")
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if not self.unbound() else 0

    def unbound(self) -> bool:
        """True for a group of one without a process group (nothing to communicate).

        Raises:
            SequenceError: ``tp`` > 1 and no group was bound (tensor parallelism not applied).
        """
        if self.group is not None:
            return False
        if self.tp > 1:
            raise SequenceError(f"the stage runs sequence-parallel over tp({self.tp}) but no tp group was bound; "
                                f"apply tensor parallelism (runtime.shard.apply_tensor_parallel) before running it")
        return True


def sequence_of(module: nn.Module) -> SequenceGroup | None:
    """The ``SequenceGroup`` of a stage module, or None without sequence parallelism."""
    return getattr(module, SEQUENCE_ATTRIBUTE, None)


# ----------------------------------------------------------------------------- collectives


def _gather(x: torch.Tensor, seq: SequenceGroup, dim: int) -> torch.Tensor:
    if seq.unbound():
        return x
    moved = x.movedim(dim, 0)
    out = all_gather_rows(moved, seq.group)  # [tp, S / tp, ...]
    return out.reshape(-1, *moved.shape[1:]).movedim(0, dim).contiguous()


def _chunk(x: torch.Tensor, seq: SequenceGroup, dim: int) -> torch.Tensor:
    if x.shape[dim] % seq.tp:
        raise SequenceError(f"a sequence of {x.shape[dim]} does not split over tp({seq.tp})")
    return x.chunk(seq.tp, dim)[seq.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, seq: SequenceGroup, dim: int) -> torch.Tensor:
    if seq.unbound():
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // seq.tp, *moved.shape[1:]))
    # torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, moved, group=seq.group)
    return out.movedim(0, dim).contiguous()


class _Scatter(torch.autograd.Function):
    """This rank's chunk of a replicated value; the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seq: SequenceGroup, dim: int) -> torch.Tensor:
        ctx.seq, ctx.dim = seq, dim
        return _chunk(x, seq, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.seq, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """The whole sequence from every rank's chunk; the backward reduce-scatters a partial
    gradient (``partial_grad``: colwise Linears read it) or takes this rank's chunk of a
    replicated one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seq: SequenceGroup, dim: int, partial_grad: bool) -> torch.Tensor:
        ctx.seq, ctx.dim, ctx.partial_grad = seq, dim, partial_grad
        return _gather(x, seq, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _reduce_scatter(grad, ctx.seq, ctx.dim) if ctx.partial_grad else _chunk(grad, ctx.seq, ctx.dim)
        return grad, None, None, None


class _ReduceGrad(torch.autograd.Function):
    """The identity; the backward all-reduces the gradient over the tp group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seq: SequenceGroup) -> torch.Tensor:
        ctx.seq = seq
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.seq.unbound():
            # a copy: autograd may hand the same gradient tensor to another input too (an add's)
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=ctx.seq.group)
        return grad, None


def scatter_sequence(x: torch.Tensor, seq: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of a value replicated over the tp group, along ``dim``; see
    [Note: sequence parallelism]."""
    return _Scatter.apply(x, seq, dim)


def gather_sequence(x: torch.Tensor, seq: SequenceGroup, *, partial_grad: bool = False, dim: int = 1) -> torch.Tensor:
    """The whole sequence of a sharded value. ``partial_grad``: what reads it are colwise
    Linears, whose gradients are partial sums (reduce-scattered in backward; the result
    is marked so the colwise style does not all-reduce them again); otherwise the
    gradient is replicated and the backward takes this rank's chunk."""
    out = _Gather.apply(x, seq, dim, partial_grad)
    if partial_grad:
        setattr(out, GATHERED_ATTRIBUTE, True)
        if out.device.type != "meta":
            _GATHERED[_storage_key(out)] = out
        if seq.save_shards and dim == 1 and torch.is_grad_enabled():
            seq._gathered[out.untyped_storage().data_ptr()] = (weakref.ref(out), x.detach())
    return out


def gathered_for_colwise(x: Any) -> bool:
    """Whether ``x`` came from ``gather_sequence(partial_grad=True)``, or is a whole alias
    of what it made (the same storage, shape and offset: an FSDP2 unit's input)."""
    if getattr(x, GATHERED_ATTRIBUTE, False):
        return True
    if not isinstance(x, torch.Tensor) or x.device.type == "meta":
        return False
    whole = _GATHERED.get(_storage_key(x))
    return whole is not None and whole.shape == x.shape and whole.storage_offset() == x.storage_offset()


def _storage_key(x: torch.Tensor) -> tuple[torch.device, int]:
    """Where ``x``'s storage lives: two devices may number their memory alike."""
    return x.device, x.untyped_storage().data_ptr()


def reduce_grad(x: torch.Tensor, seq: SequenceGroup) -> torch.Tensor:
    """``x``, whose gradient is all-reduced over the tp group in backward (a replicated
    value used on sharded data)."""
    return _ReduceGrad.apply(x, seq)


def reduce_parameter_grads(module: nn.Module, seq: SequenceGroup) -> None:
    """Make ``module`` read each of its own parameters through ``reduce_grad`` while it
    runs (forward hooks swap them in and out), keeping its names and state_dict."""
    def swap_in(mod: nn.Module, _args: Any) -> None:
        mod.__dict__["_hetpar_originals"] = dict(mod._parameters)
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = reduce_grad(p, seq)

    def swap_out(mod: nn.Module, _args: Any, _out: Any) -> None:
        mod._parameters.update(mod.__dict__.pop("_hetpar_originals"))

    for sub in module.modules():
        if any(p is not None for p in sub._parameters.values()):
            seq.hooks += [sub.register_forward_pre_hook(swap_in), sub.register_forward_hook(swap_out)]


def gather_input(module: nn.Module, seq: SequenceGroup, *, partial_grad: bool) -> None:
    """Make ``module`` read its first argument (or ``hidden_states=``) gathered."""
    def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (gather_sequence(args[0], seq, partial_grad=partial_grad), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather_sequence(kwargs["hidden_states"], seq, partial_grad=partial_grad)}

    seq.hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))


def save_gathered_as_shard(seq: SequenceGroup) -> torch.autograd.graph.saved_tensors_hooks:
    """A context in which a tensor saved for backward that is a whole view of what
    ``gather_sequence(partial_grad=True)`` made (a colwise Linear's input, a DTensor's local
    tensor) is saved as this rank's shard and gathered again when backward needs it
    (Korthikanti et al. 2022, section 4.2.2: the input is not kept whole)."""
    from torch.distributed.tensor import DTensor

    def pack(t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        entry = seq._gathered.get(local.untyped_storage().data_ptr()) if local.device.type != "meta" else None
        whole = entry[0]() if entry is not None else None
        if whole is None or not local.is_contiguous() or local.storage_offset() or local.numel() != whole.numel():
            return t
        spec = (t.device_mesh, t.placements) if isinstance(t, DTensor) else None
        return _SHARD_OF_GATHERED, entry[1], tuple(local.shape), spec

    def unpack(packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and packed and packed[0] is _SHARD_OF_GATHERED):
            return packed
        _, shard, shape, spec = packed
        whole = _gather(shard, seq, 1).reshape(shape)
        return whole if spec is None else DTensor.from_local(whole, spec[0], spec[1], run_check=False)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


_SHARD_OF_GATHERED = object()


def _check_length(sequence_length: int, tp: int) -> None:
    if sequence_length % tp:
        raise SequenceError(f"sequence parallelism splits the sequence of {sequence_length} over tp({tp}), which does "
                            f"not divide it; choose a sequence length that tp divides or plan without it")


# ----------------------------------------------------------------------------- what runs on a shard

_REPLICATED, _SPLIT, _SHARDED = "replicated", "split", "sharded"

# Ops that act on each token alone (elementwise, or over the last dimension only).
_TOKEN_LOCAL_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.rsqrt, torch.sqrt, torch.tanh, torch.exp,
    torch.sigmoid, torch.relu, torch.pow,
    F.gelu, F.silu, F.relu, F.dropout, F.layer_norm, F.rms_norm, F.tanh, F.sigmoid,
}
_TOKEN_LOCAL_METHODS = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "tanh", "exp", "sigmoid", "relu",
                        "float", "to", "type_as", "contiguous"}
_LAST_DIM_METHODS = {"mean", "sum", "var", "norm", "amax"}
_TOKEN_LOCAL_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Identity)

# ----------------------------------------------------------------------------- module stages

# A model's own token-local modules, by how their class names end (``LlamaRMSNorm``,
# ``GemmaRMSNorm``); a BatchNorm or GroupNorm mixes tokens and is not one.
_TOKEN_LOCAL_NAMES = ("LayerNorm", "RMSNorm", "Dropout")


def _token_local_module(module: nn.Module) -> bool:
    """A module that acts on each token alone: a norm over the features or dropout."""
    return isinstance(module, _TOKEN_LOCAL_MODULES) or type(module).__name__.endswith(_TOKEN_LOCAL_NAMES)


def shard_module_stage(stage: nn.Module, seq: SequenceGroup, tp_sharding: dict[str, str], sequence_length: int
                       ) -> None:
    """Make a Hugging Face module stage (runtime.module_stage.DecoderStage) run its
    residual stream sharded over the sequence, with hooks; see [Note: sequence parallelism].

    Every direct child of a block that is a norm or dropout runs on the shard, its
    parameters read through ``reduce_grad``; every other child (attention, MLP) reads
    its input gathered (for colwise Linears when it holds one) and, unless a rowwise
    Linear already reduce-scattered it, has its output scattered again. The final norms
    run on the shard; the stage gathers before its head (``DecoderStage.forward``).

    Raises:
        SequenceError: the stage's family does not keep its blocks' children so (OPT),
            or tp does not divide ``sequence_length``.
    """
    from hetpar.vocabulary import Sharding

    _check_length(sequence_length, seq.tp)
    try:
        blocks, norms, head = stage.sequence_layout()
    except ValueError as exc:
        raise SequenceError(str(exc)) from None
    colwise = {p for p, k in tp_sharding.items() if k in (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.VOCAB_HEAD)}
    split = set(tp_sharding)
    for block in blocks:
        for name, child in stage.get_submodule(block).named_children():
            path = f"{block}.{name}"
            if _token_local_module(child):
                reduce_parameter_grads(child, seq)
                continue
            inside = [p for p in split if p == path or p.startswith(path + ".")]
            gather_input(child, seq, partial_grad=any(p in colwise for p in inside))
            seq.hooks.append(child.register_forward_hook(_scatter_whole_output(seq), with_kwargs=True))
    for path in norms:
        if not _token_local_module(stage.get_submodule(path)):
            raise SequenceError(f"{path} runs between the last block and the head and is not a norm; sequence "
                                f"parallelism shards only norms there: plan this stage without it")
        reduce_parameter_grads(stage.get_submodule(path), seq)
    seq.head_partial_grad = head is not None and head in colwise


def _scatter_whole_output(seq: SequenceGroup) -> Callable:
    """A forward hook scattering a module's output (or its first element) when it holds
    the whole sequence its gathered input had (what a rowwise Linear reduce-scattered is
    a shard already)."""
    def hook(_mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        given = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(first, torch.Tensor) or not isinstance(given, torch.Tensor) or first.ndim < 2 or \
                first.shape[1] != given.shape[1]:
            return out
        first = scatter_sequence(first, seq)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return hook


# ----------------------------------------------------------------------------- fx stages

_SHAPE_READS = {"shape", "size"}
# Reads a shard answers as the whole value would (``x.device`` for an ``arange``): no gather.
_ALIKE_READS = {"device", "dtype", "ndim", "dim", "is_cuda", "get_device"}


def shard_graph(module: fx.GraphModule, values: dict[str, Any], node_layer: dict[str, int],
                tp_sharding: dict[str, str], seq: SequenceGroup) -> dict[str, int]:
    """Rewrite an fx stage to run its residual stream sharded over the sequence, in place;
    see [Note: sequence parallelism].

    Args:
        module: the stage graph module (runtime.graph.Stage.module), its shape constants
            already one tp rank's.
        values: every node's value for one whole micro-batch (runtime.graph.record_values).
        node_layer: the layer of each node by name.
        tp_sharding: module path -> sharding of the stage.
        seq: the stage's sequence group (its process group bound later).

    Returns:
        ``node_layer`` with the nodes added (each in the layer of the node it serves).

    Raises:
        SequenceError: the rowwise outputs are not ``[batch, sequence, hidden]`` of one
            shape, the sequence does not divide by tp, or a module runs both sharded and not.
    """
    return _GraphSharder(module, values, node_layer, tp_sharding, seq).run()


class _GraphSharder:
    def __init__(self, module: fx.GraphModule, values: dict[str, Any], node_layer: dict[str, int],
                 tp_sharding: dict[str, str], seq: SequenceGroup) -> None:
        from hetpar.vocabulary import Sharding

        self.module, self.values, self.seq = module, values, seq
        self.layer = dict(node_layer)
        self.kinds = {path: Sharding(kind) for path, kind in tp_sharding.items()}
        self.colwise = {Sharding.COLWISE, Sharding.VOCAB_HEAD, Sharding.COLWISE_GATHER}
        self.rowwise = {Sharding.ROWWISE, Sharding.ROWWISE_SLICE}
        self.replicated_out = {Sharding.COLWISE_GATHER, Sharding.VOCAB_EMBEDDING}
        self.state: dict[fx.Node, str] = {}
        self.made: dict[tuple, fx.Node] = {}
        self.sharded_modules: dict[str, str] = {}  # module path -> the node that first ran it sharded
        self.plain_modules: dict[str, str] = {}
        self.functions = _functions(seq)

    def run(self) -> dict[str, int]:
        graph = self.module.graph
        rows = [n for n in graph.nodes if n.op == "call_module" and self.kinds.get(n.target) in self.rowwise]
        if not rows:
            return self.layer
        shapes = {tuple(self.values[n.name].shape) for n in rows}
        shape = next(iter(shapes))
        if len(shapes) != 1 or len(shape) != 3:
            raise SequenceError(f"{rows[0].target} gives {sorted(shapes)}; sequence parallelism shards one "
                                f"[batch, sequence, hidden] residual stream per stage: plan this stage without it")
        self.batch, self.sequence, self.hidden = shape
        _check_length(self.sequence, self.seq.tp)
        for node in list(graph.nodes):
            self._visit(node)
        both = sorted(set(self.sharded_modules) & set(self.plain_modules))
        if both:
            raise SequenceError(f"{both[0]} runs both on the sequence-sharded residual stream and on whole values; "
                                f"plan this stage without sequence parallelism")
        for path in self.sharded_modules:
            reduce_parameter_grads(self.module.get_submodule(path), self.seq)
        graph.lint()
        self.module.recompile()
        return self.layer

    # -- one node

    def _visit(self, node: fx.Node) -> None:
        if node.op in ("placeholder", "get_attr"):
            self.state[node] = _REPLICATED
            return
        if node.op == "output":
            self._gather_args(node, partial_grad=False)
            return
        inputs = [a for a in node.all_input_nodes if a in self.state]
        states = {self.state[a] for a in inputs}
        if _SHARDED in states and self._reads(node, _SHAPE_READS) and node.name in self.values:
            self._fold(node)
            return
        if self._reads(node, _ALIKE_READS):
            self.state[node] = _REPLICATED
            return
        kind = self.kinds.get(node.target) if node.op == "call_module" else None
        if kind is not None:
            self._visit_split_module(node, kind, states)
        elif _SPLIT not in states and self._token_local(node) and self._shardable(node, states):
            self._run_sharded(node)
        else:
            if _SHARDED in states:
                self._gather_args(node, partial_grad=False)
            self.state[node] = _SPLIT if _SPLIT in states else _REPLICATED
            if node.op == "call_module":
                self.plain_modules.setdefault(node.target, node.name)

    def _visit_split_module(self, node: fx.Node, kind: str, states: set[str]) -> None:
        if kind in self.colwise:
            self._gather_args(node, partial_grad=True)
            self.state[node] = _REPLICATED if kind in self.replicated_out else _SPLIT
        elif kind in self.rowwise:
            self._gather_args(node, partial_grad=False)  # a rowwise_slice's replicated input
            self.state[node] = _SHARDED  # reduce-scattered: RowwiseParallel(output_layouts=Shard(1))
        else:
            self._gather_args(node, partial_grad=False)
            self.state[node] = _REPLICATED

    @staticmethod
    def _reads(node: fx.Node, attributes: set[str]) -> bool:
        """Whether ``node`` reads one of ``attributes`` of a tensor (``x.shape``, ``x.size(1)``)."""
        if node.op == "call_function" and node.target is getattr:
            return node.args[1] in attributes
        return node.op == "call_method" and node.target in attributes

    def _fold(self, node: fx.Node) -> None:
        """Replace a shape read of a sharded value by the whole micro-batch's shape."""
        value = self.values[node.name]
        value = tuple(value) if isinstance(value, torch.Size) else value
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a: value if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
        self.module.graph.erase_node(node)

    def _token_local(self, node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(self.module.get_submodule(node.target), _TOKEN_LOCAL_MODULES)
        if node.op == "call_function":
            if node.target is F.layer_norm:
                return len(node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else ())) == 1
            if node.target is F.rms_norm:
                return len(node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else ())) == 1
            return node.target in _TOKEN_LOCAL_FUNCTIONS
        if node.op == "call_method":
            if node.target in _LAST_DIM_METHODS:
                dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
                ndim = getattr(self.values.get(node.args[0].name if isinstance(node.args[0], fx.Node) else ""),
                               "ndim", None)
                dims = dim if isinstance(dim, (list, tuple)) else [dim]
                return ndim is not None and all(isinstance(d, int) and d in (-1, ndim - 1) for d in dims)
            return node.target in _TOKEN_LOCAL_METHODS
        return False

    def _shardable(self, node: fx.Node, states: set[str]) -> bool:
        """A token-local op runs sharded when it reads a sharded value or makes a
        ``[B, S, H]`` one, and its other tensor inputs can follow (scattered along their
        own sequence dimension, or broadcast)."""
        out = self.values.get(node.name)
        if not isinstance(out, torch.Tensor) or out.ndim < 2 or out.shape[1] != self.sequence:
            return False
        if _SHARDED not in states and tuple(out.shape) != (self.batch, self.sequence, self.hidden):
            return False
        for arg in node.all_input_nodes:
            value = self.values.get(arg.name)
            if self.state.get(arg) == _SHARDED:
                if not isinstance(value, torch.Tensor) or value.ndim != out.ndim:
                    return False
            elif isinstance(value, torch.Tensor) and self._scatter_dim(value, out) == "no":
                return False
        return True

    def _scatter_dim(self, value: torch.Tensor, out: torch.Tensor) -> int | None | str:
        """Where a replicated input of a sharded op holds the sequence: a dimension to
        scatter along, None (broadcast over it), or "no" (it cannot follow)."""
        d = value.ndim - out.ndim + 1
        if d < 0 or value.shape[d] == 1:
            return None
        return d if value.shape[d] == self.sequence else "no"

    def _run_sharded(self, node: fx.Node) -> None:
        out = self.values[node.name]
        for arg in node.all_input_nodes:
            if self.state.get(arg) == _SHARDED:
                continue
            value = self.values.get(arg.name)
            if not isinstance(value, torch.Tensor):
                continue
            dim = self._scatter_dim(value, out)
            new = self._make(("scatter", arg, dim), node, self.functions["scatter"], (arg, dim)) if dim is not None \
                else self._make(("reduce_grad", arg), node, self.functions["reduce_grad"], (arg,))
            node.replace_input_with(arg, new)
        self.state[node] = _SHARDED
        if node.op == "call_module":
            self.sharded_modules.setdefault(node.target, node.name)

    def _gather_args(self, node: fx.Node, *, partial_grad: bool) -> None:
        key = "gather_colwise" if partial_grad else "gather"
        for arg in list(node.all_input_nodes):
            if self.state.get(arg) == _SHARDED:
                node.replace_input_with(arg, self._make((key, arg), node, self.functions[key], (arg,)))

    def _make(self, key: tuple, before: fx.Node, fn: Callable, args: tuple) -> fx.Node:
        """The node ``fn(*args)`` (one per ``key``), made before ``before``, in its layer."""
        made = self.made.get(key)
        if made is None:
            with self.module.graph.inserting_before(before):
                made = self.module.graph.call_function(fn, args)
            layer = self.layer.get(before.name)
            if layer is None:  # the output node: the stage's last layer
                layer = max(self.layer[n.name] for n in self.module.graph.nodes if n.name in self.layer)
            self.layer[made.name] = layer
            self.state[made] = _REPLICATED if key[0].startswith("gather") or key[0] == "reduce_grad" else _SHARDED
            self.made[key] = made
        return made


def _functions(seq: SequenceGroup) -> dict[str, Callable]:
    """The functions an fx stage calls, bound to ``seq`` and named for fx's code."""
    def scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
        return scatter_sequence(x, seq, dim)

    def gather(x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, seq)

    def gather_colwise(x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, seq, partial_grad=True)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return reduce_grad(x, seq)

    out = {}
    for key, fn, name in (("scatter", scatter, "scatter_sequence"), ("gather", gather, "gather_sequence"),
                          ("gather_colwise", gather_colwise, "gather_sequence_for_colwise"),
                          ("reduce_grad", reduce, "reduce_grad")):
        fn.__name__ = fn.__qualname__ = name
        out[key] = fn
    return out


__all__ = ["GATHERED_ATTRIBUTE", "SEQUENCE_ATTRIBUTE", "SequenceError", "SequenceGroup", "gather_input",
           "gather_sequence", "gathered_for_colwise", "reduce_grad", "reduce_parameter_grads", "save_gathered_as_shard",
           "scatter_sequence", "sequence_of", "shard_graph", "shard_module_stage"]
