"""The model shard of one rank: its stage cut out of the whole model, tensor parallel
applied, and its slice of each global batch.

[Note: data order and sharding]
Each global batch is ``GLOBAL_BATCH_SIZE`` rows, and data-parallel replica d owns the
rows ``replica_rows(d)``: with equal shares ``[d*B/dp, (d+1)*B/dp)``, with the plan's
``replica_batch_shares`` (replica d's micro-batch size n_d) the ``num_microbatches *
n_d`` rows after those of replicas 0..d-1. These ranges partition every global batch,
so no sample is seen twice in a step and together the replicas see all of it, however
unequal the shares. Every rank of a replica (its tensor-parallel and pipeline ranks)
reads that replica's rows, and splits them into ``num_microbatches`` consecutive
micro-batches. Under context parallelism the cp rows of ranks of a data replica all read
its rows (``Placement.data_replica``), each keeping its own chunks of every sequence
([Note: context parallelism] in runtime/context.py).

What a rank reads depends on where the data comes from (``ModelFile.batches``):

- synthetic data (no ``batches`` in the model file) is made in blocks of 16 rows from
  (seed, step, block), so a rank makes only its replica's rows (and their blocks'), and a resumed run starts at
  its step directly ([Note: synthetic data] in runtime/model_file.py);
- the model file's ``batches(GLOBAL_BATCH_SIZE, seed)`` is a plain iterator of whole
  global batches with no notion of ranks or steps. Every rank draws it in the same
  order and keeps its rows, and a run resumed at step k draws and drops the first k
  batches. That is what keeps the order a function of the seed alone, identical to one
  process's and to an uninterrupted run's; the price is that every rank materialises
  whole global batches, cheap for token ids and worth a sharded loader for large
  inputs such as images.
"""

from __future__ import annotations

import copy
import sys
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hetpar.runtime.context import (ContextParallelError, ContextSplit, apply_to_decoder, apply_to_graph,
                                    local_example, require_attention)
from hetpar.runtime.graph import Stage, build_stage, record_values, trace_layers
from hetpar.runtime.model_file import ModelFile
from hetpar.runtime.module_stage import cut_module_stage, localise_attention
from hetpar.runtime.parts import (LAYOUTS_ATTRIBUTE, PartError, copy_shape_arguments, is_conv1d, localise_shapes,
                                  part_layouts)
from hetpar.runtime.recompute import apply_recompute
from hetpar.runtime.sequence import (SEQUENCE_ATTRIBUTE, SequenceError, SequenceGroup, gathered_for_colwise,
                                     save_gathered_as_shard, sequence_of, shard_graph, shard_module_stage)
from hetpar.vocabulary import Recompute, Sharding


class ShardError(Exception):
    """The program does not fit the model it was given (layers or module paths differ)."""


def cut_stage(
    model: nn.Module,
    model_file: ModelFile,
    micro_batch_size: int,
    layers: tuple[int, int],
    layer_names: list[str],
    leaf_modules: tuple[str, ...] = (),
    *,
    recompute: str = Recompute.NONE,
    tensor_parallel: int = 1,
    tp_sharding: dict[str, str] | None = None,
    cp_mesh: DeviceMesh | None = None,
    sequence_parallel: bool = False,
) -> Stage:
    """Trace the whole model and cut layers ``layers[0]..layers[1]`` out as this rank's stage.

    The stage module shares its parameters with ``model`` and keeps their qualified
    names (``blocks.0.attn.q.weight``). Shapes of the tensors between stages come from
    the model run on a micro-batch of ``micro_batch_size`` on the meta device. A Hugging
    Face decoder-only LM hetpar knows is cut at module boundaries instead
    (runtime.module_stage); another model torch.fx cannot trace is captured with
    torch.export for that micro-batch shape (then without tensor parallelism; see
    docs/model-file.md).
    ``recompute`` ("selective" or "full") runs each layer of the stage under
    torch.utils.checkpoint; see [Note: recompute by layer] in runtime/recompute.py.
    With ``tensor_parallel`` > 1 and the stage's ``tp_sharding``, the graph's shape
    constants are made one rank's ([Note: local shape constants] in runtime/parts.py),
    before ``apply_tensor_parallel`` splits its modules.
    ``model`` may be on the meta device (``runtime.materialize.build_on_meta``): the
    stage then holds meta tensors until ``materialize_stages`` computes them.
    With ``cp_mesh`` (``Groups.cp_mesh``), the stage is cut for the rank's share of each
    sequence and its positions and attention are made context-parallel ([Note: context
    parallelism] in runtime/context.py).
    With ``sequence_parallel`` (tp > 1), the stage's residual stream is made to run on
    1/tp of the sequence ([Note: sequence parallelism] in runtime/sequence.py; the tp
    group is bound by ``apply_tensor_parallel``).

    Raises:
        ShardError: the model's layers are not the ones the program was compiled for,
            or a shape constant cannot follow the split, or context parallelism cannot
            split the model.
    """
    example = model_file.example_inputs(micro_batch_size)
    split = ContextSplit.of(cp_mesh) if cp_mesh is not None else None
    if split is not None:
        example = _context_call(local_example, example, split.cp)
    stage = cut_module_stage(model, example, layers, layer_names, recompute=recompute)
    if stage is not None:  # a Hugging Face decoder: the model's own modules ([Note: stages of the eager model])
        if split is not None:
            _context_call(apply_to_decoder, stage.module, split)
        if sequence_parallel:
            _sequence_call(shard_module_stage, stage.module, _sequence_group(stage.module, tensor_parallel, recompute),
                           tp_sharding or {}, example[0].shape[1])
        return stage
    layered = trace_layers(model, leaf_modules, example_inputs=example)  # torch.fx, else torch.export
    if list(layered.layer_names) != list(layer_names):
        raise ShardError(
            f"{model_file.path.name} now has layers {list(layered.layer_names)}, "
            f"the program was compiled for {list(layer_names)}; re-run hetpar plan and compile"
        )
    if split is not None:  # before the meta run: a model without attention may fail it on a cut dimension 1
        if layered.capture != "fx":
            raise ShardError(f"context parallelism of {model_file.path.name}: a model captured with torch.export is "
                             f"not supported (only fx-traced models and Hugging Face decoders)")
        _context_call(require_attention, layered.gm, model_file.path.name)
    values = record_values(layered, example)
    stage = build_stage(layered, values, layers[0], layers[1])
    if layered.capture == "export" and any(p.is_meta for p in model.parameters()):
        _meta_ops_on_cpu(stage.module)
    if tensor_parallel > 1 and tp_sharding and layered.capture == "fx":
        _localise(stage, example, tensor_parallel, tp_sharding)
    node_layer = layered.node_layer
    if split is not None:
        node_layer = dict(node_layer)
        local_len = next(t.shape[1] for t in example if isinstance(t, torch.Tensor))
        _context_call(apply_to_graph, stage.module, values, node_layer, local_len, split)
    if sequence_parallel:
        if layered.capture != "fx":
            raise ShardError(f"sequence parallelism of {model_file.path.name}: a model captured with torch.export is "
                             f"not supported (only fx-traced models and Hugging Face decoders); plan it without")
        node_layer = _sequence_call(shard_graph, stage.module, values, node_layer, tp_sharding or {},
                                    _sequence_group(stage.module, tensor_parallel, recompute))
    apply_recompute(stage.module, node_layer, recompute)
    return stage


def _context_call(fn, *args):
    """``fn(*args)`` of runtime.context, its refusal raised as a ShardError."""
    try:
        return fn(*args)
    except ContextParallelError as exc:
        raise ShardError(str(exc)) from None


def _sequence_group(module: nn.Module, tp: int, recompute: str) -> SequenceGroup:
    """A new ``SequenceGroup`` of ``tp`` ranks, kept on the stage module for ``apply_tensor_parallel``."""
    if tp < 2:
        raise ShardError(f"sequence parallelism needs tensor_parallel > 1, not {tp}; plan the stage without it")
    seq = SequenceGroup(tp, save_shards=recompute == Recompute.NONE)
    setattr(module, SEQUENCE_ATTRIBUTE, seq)
    return seq


def _sequence_call(fn, *args):
    """``fn(*args)`` of runtime.sequence, its refusal raised as a ShardError."""
    try:
        return fn(*args)
    except SequenceError as exc:
        raise ShardError(str(exc)) from None


def _localise(stage: Stage, example: tuple, tp: int, tp_sharding: dict[str, str]) -> None:
    """Make ``stage``'s shape constants one tensor-parallel rank's, in place; see [Note:
    local shape constants] in runtime/parts.py.

    Raises:
        ShardError: a shape constant cannot follow the split.
    """
    local = copy.deepcopy(stage.module).to("meta")
    for path, kind in tp_sharding.items():
        module = local.get_submodule(path)
        if isinstance(module, nn.Linear) and kind in (Sharding.COLWISE, Sharding.VOCAB_HEAD, Sharding.ROWWISE):
            out_f, in_f = module.out_features, module.in_features
            if kind == Sharding.ROWWISE:
                in_f //= tp
            else:
                out_f //= tp
            parent, _, name = path.rpartition(".")
            setattr(local.get_submodule(parent) if parent else local, name,
                    nn.Linear(in_f, out_f, bias=module.bias is not None, device="meta", dtype=module.weight.dtype))
    local.recompile()
    inputs = [example[i].to("meta") for i in stage.model_inputs] + [
        torch.empty(spec.shape, dtype=spec.dtype, device="meta") for spec in stage.recv]
    try:
        changed = localise_shapes(stage.module, local, inputs)
    except PartError as exc:
        raise ShardError(f"tensor parallelism of tp({tp}): {exc}; re-run hetpar plan") from None
    copy_shape_arguments(local, stage.module, changed)


def _meta_ops_on_cpu(module: torch.fx.GraphModule) -> None:
    """Make the ops of a graph exported on the meta device (``build_on_meta``'s model)
    name the CPU, where its tensors are materialised, as an export on the CPU does
    (``arange(..., device=meta)``); see [Note: building only this rank's tensors]."""
    cpu = torch.device("cpu")
    for node in module.graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(
            torch.device, lambda d: cpu if d.type == "meta" else d, (node.args, node.kwargs))
    module.recompile()


class Chunks(nn.ModuleList):
    """The stages one rank holds under the interleaved schedule, as one module for the
    optimizer, data-parallel gradients and checkpoints. Never called: the executor
    runs each chunk. Its state_dict keys carry the chunk number (``0.blocks.0...``);
    ``chunk_modules`` gives the chunks with their own names."""


def rank_module(stage_modules: list[nn.Module]) -> nn.Module:
    """The module of this rank's parameters: its one stage, or its chunks as ``Chunks``."""
    return stage_modules[0] if len(stage_modules) == 1 else Chunks(stage_modules)


def compile_stages(modules: list[nn.Module], device: torch.device, mode: str, *, planned: bool = False,
                   announce: bool = False) -> str:
    """``torch.compile`` each stage module in place (``nn.Module.compile``), per ``mode``
    ("on", "off", or "auto": as ``planned``, the plan's ``compiled``, whose costs assume it). Compiling is lazy: a graph that does
    not compile falls back to eager code at its first call with dynamo's warning, and
    training goes on (``suppress_errors``).

    Returns:
        One line for the log, printed on stderr with ``announce``: compiled, or why not.
    """
    line = _compile_stages(modules, device, mode, planned)
    if announce:
        print(f"hetpar: {line}", file=sys.stderr, flush=True)
    return line


def _compile_stages(modules: list[nn.Module], device: torch.device, mode: str, planned: bool) -> str:
    wanted = mode == "on" or (mode == "auto" and planned)
    if not wanted:
        return f"stages run eagerly (--compile {mode}{', as planned' if mode == 'auto' else ''})"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "stages run eagerly: torch.compile needs triton on CUDA, which is not installed"
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    for module in modules:
        module.compile()
    return f"stages compiled with torch.compile (--compile {mode}; a graph that fails runs eagerly)"


def chunk_modules(module: nn.Module) -> list[nn.Module]:
    """The stage modules inside a ``rank_module``."""
    return list(module) if isinstance(module, Chunks) else [module]


# [Note: one all-reduce per shared input]
# A colwise Linear's input gradient is a partial sum on each tensor-parallel rank (each
# holds some of the output features). ColwiseParallel all-reduces it per module, so q,
# k and v, which read one normed value, would all-reduce three gradients of the same
# shape where Megatron all-reduces their sum once (its "f" operator; Shoeybi et al.
# 2019, Figure 3). Here a colwise module keeps its input gradient local and partial
# (``grad_placements`` Partial) and reads its input through ``_SharedInputs.wrap``,
# which hands every colwise module of one forward the same wrapper of a given tensor:
# autograd sums the partial gradients at the wrapper and its backward all-reduces the
# sum once. Gradients that reach the tensor another way (a residual) are already
# whole and never pass the wrapper. The wrappers are forgotten before and after each
# forward of the stage (hooks on the modules the executor calls), so each lives no
# longer than that forward's own references to it. planner.tensor_parallel's
# ``layer_collectives`` counts one backward all-reduce per shared input accordingly.


class _AllReduceGradient(torch.autograd.Function):
    """The identity forward; the backward all-reduces the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SharedInputs:
    """The all-reducing wrapper of each tensor that colwise modules read in the current forward."""

    def __init__(self, group) -> None:
        self.group = group
        self._wrapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def wrap(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad) or gathered_for_colwise(x):
            return x  # gathered over the sequence: its backward sums the gradients ([Note: sequence parallelism])
        seen = self._wrapped.get(id(x))
        if seen is not None and seen[0] is x:
            return seen[1]
        wrapped = _AllReduceGradient.apply(x, self.group)
        self._wrapped[id(x)] = (x, wrapped)
        return wrapped

    def forget(self, *_) -> None:
        self._wrapped.clear()


class _Colwise(ColwiseParallel):
    """ColwiseParallel whose input gradient is all-reduced once per shared input; see
    [Note: one all-reduce per shared input]."""

    def __init__(self, shared: _SharedInputs, *, output_layouts=None, use_local_output: bool = True) -> None:
        super().__init__(output_layouts=output_layouts, use_local_output=use_local_output)
        self._shared = shared

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(self._shared.wrap(x), device_mesh, input_layouts, run_check=False, grad_placements=(Partial(),))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, _conv1d_partition(Shard(1), Shard(0), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _Rowwise(RowwiseParallel):
    """RowwiseParallel that also splits a Conv1D (a Linear whose weight is stored transposed)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, _conv1d_partition(Shard(0), Replicate(), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _conv1d_partition(weight: Shard, bias: Shard | Replicate, src_data_rank: int | None):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, placement in (("weight", weight), ("bias", bias)):
            param = getattr(module, key, None)
            if param is not None:
                module.register_parameter(key, nn.Parameter(
                    distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                    requires_grad=param.requires_grad))
    return partition


_STYLES = {
    Sharding.COLWISE: lambda shared: _Colwise(shared),
    Sharding.ROWWISE: lambda shared: _Rowwise(),
    Sharding.COLWISE_GATHER: lambda shared: _Colwise(shared, output_layouts=Replicate()),
    Sharding.ROWWISE_SLICE: lambda shared: _Rowwise(input_layouts=Replicate()),
    # [Note: vocab-parallel loss] in runtime/executor.py: an Embedding's rows split over the
    # vocabulary (each rank looks up its own tokens, the outputs are all-reduced), and the
    # output Linear split over it, its logits left split for the loss.
    Sharding.VOCAB_EMBEDDING: lambda shared: RowwiseParallel(input_layouts=Replicate()),
    Sharding.VOCAB_HEAD: lambda shared: _Colwise(shared, use_local_output=False),
}


# Under sequence parallelism a rowwise Linear reduce-scatters its output over the sequence
# instead of all-reducing it ([Note: sequence parallelism] in runtime/sequence.py).
_SEQUENCE_STYLES = {
    Sharding.ROWWISE: lambda: _Rowwise(output_layouts=Shard(1)),
    Sharding.ROWWISE_SLICE: lambda: _Rowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
}
_COLWISE_KINDS = frozenset({Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.VOCAB_HEAD})


# The styles that cut a [V, H] weight alike wherever it is held, an Embedding's and a
# head's: Shard(0), rank t holding rows t V / tp to (t + 1) V / tp, so a weight tied
# between them splits the same way in both ([Note: tied vocab-parallel weights] in
# planner/capture/trace.py; runtime/tied.py).
VOCAB_SPLITS = frozenset({Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD})


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, tp_sharding: dict[str, str],
                          tp_parts: dict[str, list[int]] | None = None) -> None:
    """Shard the named submodules over ``mesh`` with DTensor (docs/plan-format.md, tp_sharding).

    ``colwise`` splits a Linear's output features (its output stays split, as a plain
    local tensor); ``rowwise`` splits its input features and all-reduces the output.
    ``colwise_gather`` is colwise with the output all-gathered, so what follows (a norm,
    the layer's output) sees every feature; ``rowwise_slice`` is rowwise on a
    replicated input, each rank taking its slice locally. A transformers ``Conv1D``
    (GPT-2; a Linear whose weight is stored [in, out]) is split like a Linear along the
    transposed dimensions. Every rank already holds
    identical weights, so each takes its shard locally (``src_data_rank=None``)
    instead of receiving it from rank 0. Colwise modules that read one tensor
    all-reduce their input gradients once ([Note: one all-reduce per shared input]).
    A colwise fused projection ``tp_parts`` names (module path -> part sizes) is
    part-laid ([Note: part-laid Linears] in runtime/parts.py): its layouts are kept on
    ``module`` for materialisation, checkpoints and the final state_dict; the
    attributes of a Hugging Face attention whose fused projection is so split are made
    one rank's ([Note: local attention attributes] in runtime/module_stage.py).

    Raises:
        ShardError: a path names no submodule of the stage, or an unknown sharding.
    """
    shared = _SharedInputs(mesh.get_group())
    sequences = [s for s in map(sequence_of, chunk_modules(module)) if s is not None]
    for seq in sequences:  # [Note: sequence parallelism] in runtime/sequence.py
        _sequence_call(seq.bind, mesh.get_group())
    styles: dict[str, ParallelStyle] = {}
    for path, kind in tp_sharding.items():
        try:
            module.get_submodule(path)
        except AttributeError:
            raise ShardError(f"tp_sharding names {path!r}, which is not a module of this stage") from None
        if kind not in _STYLES:
            raise ShardError(f"tp_sharding of {path!r} is {kind!r}; expected one of {', '.join(_STYLES)}")
        styles[path] = _SEQUENCE_STYLES[kind]() if sequences and kind in _SEQUENCE_STYLES else _STYLES[kind](shared)
    try:
        setattr(module, LAYOUTS_ATTRIBUTE, part_layouts(tp_parts or {}, module, mesh.size()))
    except (PartError, AttributeError) as exc:
        raise ShardError(f"tp_parts: {exc}") from None
    try:  # a Hugging Face attention's head attributes ([Note: local attention attributes] in runtime/module_stage.py)
        localise_attention(module, tp_sharding, mesh.size(), tp_parts or {})
    except PartError as exc:
        raise ShardError(f"tensor parallelism of tp({mesh.size()}): {exc}; re-run hetpar plan") from None
    ties = _ties(module)
    parallelize_module(module, mesh, styles, src_data_rank=None)
    _retie(module, ties)
    for stage_module in chunk_modules(module):
        stage_module.register_forward_pre_hook(shared.forget)
        stage_module.register_forward_hook(shared.forget)
    for stage_module in chunk_modules(module):
        seq = sequence_of(stage_module)
        if seq is not None:
            _keep_gathered_inputs_as_shards(stage_module, seq, tp_sharding)


def _keep_gathered_inputs_as_shards(stage_module: nn.Module, seq: SequenceGroup, tp_sharding: dict[str, str]) -> None:
    """Make the colwise Linears of a sequence-parallel stage save a gathered input as its
    shard (not under recompute), and the stage forget its gathers after each forward
    ([Note: sequence parallelism] in runtime/sequence.py)."""
    stage_module.register_forward_pre_hook(seq.forget)
    stage_module.register_forward_hook(seq.forget)
    if not seq.save_shards:
        return
    for path, kind in tp_sharding.items():
        if kind in _COLWISE_KINDS:
            _save_gathered_as_shard(stage_module.get_submodule(path), seq)


def _save_gathered_as_shard(module: nn.Module, seq: SequenceGroup) -> None:
    """Run ``module`` under ``save_gathered_as_shard`` ([Note: sequence parallelism] in runtime/sequence.py)."""
    def enter(mod: nn.Module, _args) -> None:
        context = save_gathered_as_shard(seq)
        context.__enter__()
        mod.__dict__.setdefault("_hetpar_saved_hooks", []).append(context)

    def leave(mod: nn.Module, _args, _out) -> None:
        mod.__dict__["_hetpar_saved_hooks"].pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _ties(module: nn.Module) -> list[list[tuple[str, str]]]:
    """The parameters ``module`` holds in more than one submodule, each as its (submodule
    path, attribute) holders."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, sub in module.named_modules():
        for key, p in sub.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((path, key))
    return [h for h in holders.values() if len(h) > 1]


def _retie(module: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make the holders of each tied parameter hold one tensor again after tensor
    parallelism gave each its own ([Note: tied vocab-parallel weights] in planner/capture/trace.py:
    an embedding and a head split over the vocabulary hold the same Shard(0) DTensor, and
    autograd sums both uses' gradients into it).

    Raises:
        ShardError: the holders were split differently (one whole, one split), so no
            one tensor can serve them.
    """
    for holders in ties:
        params = [module.get_submodule(path).get_parameter(key) for path, key in holders]
        if all(p is params[0] for p in params):
            continue
        layouts = {(p.placements, p.shape) if isinstance(p, DTensor) else None for p in params}
        if len(layouts) > 1:
            where = ", ".join(f"{path}.{key}" if path else key for path, key in holders)
            raise ShardError(f"the tied weight {where} is split differently by tp_sharding across its holders; "
                             f"split all of them the same way or none")
        for path, key in holders[1:]:
            setattr(module.get_submodule(path), key, params[0])


Microbatch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def replica_rows(micro_batch_sizes: list[int], num_microbatches: int, replica: int) -> range:
    """The rows of every global batch that replica ``replica`` trains on; see
    [Note: data order and sharding].

    Args:
        micro_batch_sizes: each replica's micro-batch size (``REPLICA_MICRO_BATCH_SIZES``).
        num_microbatches: micro-batches per replica and step.
        replica: the data-parallel replica.
    """
    start = sum(micro_batch_sizes[:replica]) * num_microbatches
    return range(start, start + micro_batch_sizes[replica] * num_microbatches)


def replica_batches(model_file: ModelFile, batch_size: int, seed: int, *, rows: range, start_step: int = 0
                    ) -> Iterator[tuple[tuple, torch.Tensor]]:
    """The ``rows`` of the global batches of steps ``start_step + 1, start_step + 2, ...``;
    see [Note: data order and sharding].

    Raises:
        ShardError: (on the batch concerned) a global batch of the model file is too
            small to hold ``rows``.
    """
    for inputs, targets in model_file.batches(batch_size, seed, rows=rows, start_step=start_step):
        if any(t.shape[0] != len(rows) for t in (*inputs, targets)):
            raise ShardError(
                f"batches({batch_size}, seed) of {model_file.path.name} gave a batch without rows "
                f"{rows.start}-{rows.stop - 1} (inputs {[t.shape[0] for t in inputs]} rows there, targets "
                f"{targets.shape[0]}); it must yield {batch_size} rows per batch"
            )
        yield inputs, targets


def microbatches(
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    *,
    num_microbatches: int,
    device: torch.device,
    replica: int = 0,
    data_parallel: int = 1,
    micro_batch_sizes: list[int] | None = None,
) -> list[Microbatch]:
    """A replica's micro-batches; see [Note: data order and sharding].

    By default the batch is the replica's own rows (``replica_batches``), split into
    ``num_microbatches`` consecutive micro-batches of equal size. Given a whole global
    batch, ``replica`` and ``data_parallel`` (and ``micro_batch_sizes``, the plan's
    ``replica_batch_shares``) pick that replica's rows (``replica_rows``) first.

    Raises:
        ShardError: the batch does not split that way.
    """
    batch = targets.shape[0]
    sizes = micro_batch_sizes
    if sizes is None:
        if batch % (data_parallel * num_microbatches) or any(t.shape[0] != batch for t in inputs):
            raise ShardError(
                f"a batch of {batch} rows (inputs {[t.shape[0] for t in inputs]}) does not split into "
                f"data_parallel({data_parallel}) * num_microbatches({num_microbatches}) equal micro-batches"
            )
        sizes = [batch // (data_parallel * num_microbatches)] * data_parallel
    elif len(sizes) != data_parallel or sum(sizes) * num_microbatches != batch or any(
        t.shape[0] != batch for t in inputs
    ):
        raise ShardError(
            f"a global batch of {batch} rows (inputs {[t.shape[0] for t in inputs]}) does not split into "
            f"num_microbatches({num_microbatches}) micro-batches of {sizes} rows per replica"
        )
    size, start = sizes[replica], replica_rows(sizes, num_microbatches, replica).start
    out = []
    for i in range(num_microbatches):
        lo, hi = start + i * size, start + (i + 1) * size
        out.append((tuple(_to_device(t[lo:hi], device) for t in inputs), _to_device(targets[lo:hi], device)))
    return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host batch bound for a GPU goes through pinned memory, so
    the copy runs on the stream without holding the host (``non_blocking``)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def loss_weight(micro_batch_sizes: list[int], replica: int) -> float:
    """The factor on replica ``replica``'s loss that makes the data-parallel average of
    gradients the gradient of the mean loss over the whole global batch.

    Replica d's loss is the mean over its ``n_d`` samples per micro-batch; averaging over
    dp replicas weighs each replica 1/dp, but its samples are ``n_d / sum(n)`` of the
    batch. So its loss is scaled by ``dp * n_d / sum(n)``: exactly 1 with equal shares.
    This assumes a loss that is a mean over samples (every model file's ``loss_fn``).
    """
    return len(micro_batch_sizes) * micro_batch_sizes[replica] / sum(micro_batch_sizes)


__all__ = [
    "Chunks", "Microbatch", "ShardError", "VOCAB_SPLITS", "apply_tensor_parallel", "chunk_modules", "compile_stages", "cut_stage", "rank_module",
    "loss_weight", "microbatches", "replica_batches", "replica_rows",
]
