"""Trace a model file on the meta device into a ModelGraph of measured layers.

Nothing is allocated: the model is built under ``torch.device("meta")``, captured
with torch.fx or torch.export (runtime.capture), grouped into layers
(runtime.graph), and each layer is cut out as a stage and run forward and backward
on meta tensors, node by node (planner.capture.measure). The numbers are measured, not
guessed.

[Note: measuring repeated blocks once]
A 96-block model has one block's worth of distinct work. Each layer's stage gets a
structural key: its graph with module and parameter paths taken relative to the
layer (``blocks.7.attn.q`` -> ``@.attn.q``), node references as positions, the
shapes and dtypes of every parameter, module and input, and the outputs it computes
(a mask that the last block no longer passes on does not make it different). Layers with equal keys run
the same kernels on the same shapes, so the first one is measured (with its
tensor-parallel probe) and the others reuse its numbers, node by node; what depends on
the position in the model (the tensors crossing the cut after the layer, which
parameters an earlier layer already holds) is worked out for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from hetpar.cost_models.layers import LayerProfile
from hetpar.planner.capture.measure import Measurement, NodeCounts, measure, node_label, node_module
from hetpar.planner.capture.module_tp import BlockDryRun, block_sharding
from hetpar.planner.capture.moe import NO_EXPERTS, LayerExperts, layer_experts
from hetpar.planner.capture.tp_collectives import layer_collectives
from hetpar.planner.capture.tp_dry_run import find_sharding
from hetpar.planner.capture.tp_ilp import split_nodes
from hetpar.planner.capture.tp_meta import check_sharded_shapes, shard_on_meta
from hetpar.planner.capture.tp_ops import linear_parts, run_graph
from hetpar.planner.capture.vocab_parallel import splits_vocabulary, token_embeddings, vocab_sharding
from hetpar.planner.model_graph import BoundaryTensor, ModelGraph, NodeProfile
from hetpar.vocabulary import Sharding
from hetpar.runtime.capture import attribute
from hetpar.runtime.experts import experts_modules
from hetpar.runtime.graph import LayeredGraph, Stage, boundary_values, build_stage, meta_run_error, record_values, trace_layers
from hetpar.runtime.model_file import ModelFile, file_fingerprint
from hetpar.runtime.module_stage import DecoderLayout, layout_for

_NO_KERNEL_OPS = ("placeholder", "get_attr", "output")
_PROBE_TP = 2  # the degree of the second measurement; see [Note: tensor-parallel scaling]
_MAX_TP_CHECKED = 16  # a split is dry-run at every degree up to this (a node's devices)
_RELATIVE = "@"  # stands for the layer's own path in structural keys and cached shardings


def trace_model(model_file: ModelFile, leaf_modules: tuple[str, ...] = ()) -> ModelGraph:
    """Build, trace and measure the model of ``model_file`` on the meta device.

    Raises:
        runtime.graph.TraceError: neither torch.fx nor torch.export can capture the model.
        runtime.model_file.ModelFileError: the model file breaks the contract.
    """
    with torch.device("meta"):
        model = model_file.build_model()
    example = model_file.example_inputs(1)
    meta_inputs = tuple(t.to("meta") for t in example)
    lg = trace_layers(model, leaf_modules, example_inputs=meta_inputs)
    layout = layout_for(model, lg.layer_names, example) if lg.capture == "export" else None
    values = record_values(lg, example)
    needs_grad = differentiable_values(lg, values)
    vocabularies = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    tokens = token_embeddings(lg.gm) if lg.capture == "fx" else None
    stages = [build_stage(lg, values, index, index) for index in range(lg.num_layers)]
    tied_ids = _tied_parameters(model) | _shared_by_layers([s.module for s in stages])
    if lg.capture == "fx":
        split_ties = _vocab_split_ties([s.module for s in stages], tied_ids, vocabularies, tokens)
    else:
        split_ties = _module_stage_ties(model, layout, tied_ids) if layout is not None else set()
    while True:  # [Note: tied vocab-parallel weights]
        measured_layers = _measure_layers(lg, stages, values, meta_inputs, needs_grad, model, layout, example,
                                          tied_ids - split_ties, vocabularies, tokens)
        if lg.capture != "fx":  # module stages split the pair by rule, not by measurement
            break
        unsplit = {pid for pid in split_ties if not _split_everywhere(pid, stages, measured_layers, lg.layer_names)}
        if not unsplit:
            break
        split_ties -= unsplit
    layers, shardings, parts, sources, boundaries, nodes = [], [], [], [], [], []
    held: set[int] = set()  # ids of the parameters earlier layers hold
    for index, (stage, measured) in enumerate(zip(stages, measured_layers)):
        name = lg.layer_names[index]
        params, tied, tensors, tied_held = _owned_params(stage.module, held)
        sent = _sent(lg, values, needs_grad, index, stage) if layout is not None else list(stage.send)
        profile = measured.profile(name=name, params=params, tied_params=tied, param_tensors=tensors,
                                   boundary_bytes=float(sum(s.nbytes for s in sent)))
        split_tied = sum(p.numel() for p in tied_held if id(p) in split_ties)
        if split_tied:  # counted as this layer's split parameters, but held (and counted) first by an earlier layer
            profile = replace(profile, tp_split_params=profile.tp_split_params - split_tied,
                              tp_split_tied_params=split_tied)
        layers.append(profile)
        shardings.append(_absolute(measured.relative_sharding, name))
        parts.append(_absolute(measured.relative_parts, name))
        sources.append(measured.tp_source if measured.relative_sharding else "")
        boundaries.append([BoundaryTensor(shape=t.shape, dtype=str(t.dtype).removeprefix("torch."), nbytes=t.nbytes)
                           for t in sent])
        nodes += _node_profiles(stage.module, index, measured.node_counts)
    return ModelGraph(
        file=str(model_file.path.resolve()),
        args=dict(model_file.model_args),
        fingerprint=file_fingerprint(model_file.path),
        layers=layers,
        tp_sharding=shardings,
        tp_parts=parts,
        tp_source=sources,
        input_bytes=float(sum(t.numel() * t.element_size() for t in example)),
        capture=lg.capture,
        boundaries=boundaries,
        nodes=nodes,
        measured_layers=len({id(m) for m in measured_layers}),
        sequence_length=_sequence_length(example),
    )


def _sequence_length(example: tuple) -> int:
    """The tokens per sample of a model whose first input is token ids [batch, tokens]; 0 otherwise."""
    first = example[0] if example else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return 0


# [Note: what a module stage sends]
# An exported Hugging Face decoder passes more than the hidden state from layer to layer:
# the causal mask ([1, 1, T, T], 16 GiB per sample at 128k tokens), the rotary cos and
# sin tables and the positions, each computed once before the first block. The program
# runs such a model as module stages (runtime/module_stage.py), which send only the
# hidden state and compute the mask, positions and rotary tables again on each stage
# from the sequence length. So a cut of a module-stage model hands over the tensors that
# carry gradients (the hidden state), and that is what its boundary bytes count: what
# the pipeline sends, and what full recompute keeps as a stage's input.
def _sent(lg: LayeredGraph, values: dict[str, Any], needs_grad: dict[str, bool], index: int, stage: Stage) -> list:
    """The tensors a module stage hands over after layer ``index``: the differentiable ones
    ([Note: what a module stage sends])."""
    if stage.is_last:
        return []
    names = boundary_values(lg, values, index)
    return [spec for name, spec in zip(names, stage.send) if needs_grad.get(name)]


def _measure_layers(lg: LayeredGraph, stages: list[Stage], values: dict[str, Any], meta_inputs: tuple, needs_grad,
                    model: torch.nn.Module, layout: DecoderLayout | None, example: tuple, tied: set[int],
                    vocabularies: set[int], tokens: set[str] | None = None) -> list[_Measured]:
    """Each layer's measurement, a repeated block measured once ([Note: measuring repeated
    blocks once]); weights in ``tied`` are not split over the vocabulary."""
    cache: dict[Any, _Measured] = {}
    out = []
    experts = {path: m.num_experts for path, m in experts_modules(model)}  # [Note: experts in a layer]
    for index, stage in enumerate(stages):
        inputs = _layer_inputs(lg, values, stage, meta_inputs, needs_grad)
        name = lg.layer_names[index]
        key = (_structure_key(stage, name, inputs), index == lg.num_layers - 1)  # the last layer may split its head
        block = layout.block_index(name) if layout is not None else None
        if key not in cache:
            try:
                if block is not None:  # [Note: tensor parallelism of exported graphs]
                    cache[key] = _measure_block(stage, inputs, model, layout, block, example[0].shape[1])
                else:
                    cache[key] = _measure_layer(stage, inputs, name, split=lg.capture == "fx",
                                                last_layer=index == lg.num_layers - 1, tied=tied,
                                                vocabularies=vocabularies, tokens=tokens)
                    if layout is not None and index in (0, lg.num_layers - 1):  # a module stage's embedding or head
                        cache[key] = _with_vocab_split(cache[key], model, layout, head=index > 0,
                                                       tokens=example[0].shape[1], tied=tied)
            except Exception as exc:  # noqa: BLE001 - located and reported as one line
                raise meta_run_error(stage.module, exc, f"layer {name}") from exc
            if experts:
                cache[key] = replace(cache[key], experts=layer_experts(stage.module, inputs, cache[key].whole, experts))
        out.append(cache[key])
    return out


# [Note: tied vocab-parallel weights]
# A weight tied between a token embedding and the head (GPT-2's wte and lm_head, Megatron's
# GPT) splits over the vocabulary like an untied pair ([Note: vocab-parallel layers] in
# planner.capture.vocab_parallel) when every module that holds it, in every layer, is one that
# split: both are then split Shard(0) of the same [V, H] weight, rank t holding rows
# t V / tp to (t + 1) V / tp, so the copies are split alike and the runtime keeps them
# equal shard by shard (runtime/tied.py; inside one stage, the two modules hold one
# DTensor again: runtime.shard). A weight also used some other way (``F.linear(x,
# emb.weight)`` reads it through an attribute, not a split module) stays whole. The
# tracer picks the candidates from the layers' graphs (``_vocab_split_ties``), measures,
# and gives up a candidate that a layer's measurement did not split after all (a dry run
# failed), measuring again without it. The head's layer counts the tied weight as its
# earlier holder's (``tied_params``), its split share as ``tp_split_tied_params``.
# A Hugging Face decoder's module stages split its tied embedding and ``lm_head`` when
# nothing else holds the weight (``_module_stage_ties``; its exported graphs cannot be
# measured split, [Note: stages of the eager model]).
def _vocab_split_ties(modules: list[fx.GraphModule], tied: set[int], vocabularies: set[int],
                      tokens: set[str] | None = None) -> set[int]:
    """The tied weights that every layer holding them would split over the vocabulary."""
    held, unsplit = set(), set()
    for index, gm in enumerate(modules):
        split = vocab_sharding(gm, last_layer=index == len(modules) - 1, tied=set(), vocabularies=vocabularies,
                               tokens=tokens)
        for path, module in gm.named_modules():
            for p in module.parameters(recurse=False):
                if id(p) in tied:
                    held.add(id(p))
                    if path not in split:
                        unsplit.add(id(p))
    return held - unsplit


def _module_stage_ties(model: torch.nn.Module, layout: DecoderLayout, tied: set[int]) -> set[int]:
    """The token embedding's weight of a Hugging Face decoder when it is tied to the head
    and to nothing else (GPT-2's wte and lm_head): its module stages split both
    (``_with_vocab_split``) or neither."""
    embedding = _splittable_embedding(model, layout)
    head = _splittable_head(model, layout, embedding.num_embeddings) if embedding is not None else None
    if head is None or head.weight is not embedding.weight or id(embedding.weight) not in tied:
        return set()
    holders = [m for m in model.modules() if any(p is embedding.weight for p in m.parameters(recurse=False))]
    return {id(embedding.weight)} if len(holders) == 2 else set()


def _split_everywhere(pid: int, stages: list[Stage], measured: list[_Measured], names: list[str]) -> bool:
    """Whether every layer that holds parameter ``pid`` split each of its modules that hold it."""
    for stage, m, name in zip(stages, measured, names):
        split = _absolute(m.relative_sharding, name)
        for path, module in stage.module.named_modules():
            if any(id(p) == pid for p in module.parameters(recurse=False)) and path not in split:
                return False
    return True


def _layer_inputs(lg: LayeredGraph, values: dict[str, Any], stage: Stage, meta_inputs: tuple,
                  needs_grad: dict[str, bool]) -> list[torch.Tensor]:
    """Meta tensors for a one-layer stage: the model inputs it reads, then what it receives."""
    received = boundary_values(lg, values, stage.first_layer - 1) if stage.first_layer > 0 else []
    return [meta_inputs[i] for i in stage.model_inputs] + [
        torch.empty(spec.shape, dtype=spec.dtype, device="meta", requires_grad=needs_grad[name])
        for spec, name in zip(stage.recv, received, strict=True)
    ]


# [Note: which activations need gradients]
# Autograd saves what the gradients it must compute need, so saved bytes depend on
# which inputs of a layer require gradients. In training, model inputs (tokens, pixels)
# do not; a tensor a layer receives does if it was computed, by differentiable ops,
# from a parameter. Rotary cos/sin tables and attention masks, computed from buffers
# and inputs, do not: ``q * cos`` then saves only ``cos``, not ``q`` as well.
_NO_GRAD_TARGETS = {torch.Tensor.detach, torch.detach, torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_NO_GRAD_METHODS = {"detach", "detach_", "requires_grad_"}


def differentiable_values(lg: LayeredGraph, values: dict[str, Any]) -> dict[str, bool]:
    """Which node values require gradients in training; see [Note: which activations need gradients]."""
    out: dict[str, bool] = {}
    grad_enabled = True
    for node in lg.gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
        if node.op == "placeholder":
            flag = False
        elif node.op == "get_attr":
            attr = attribute(lg.gm, str(node.target))
            flag = isinstance(attr, torch.Tensor) and attr.requires_grad
        elif node.op == "call_module":
            sub = lg.gm.get_submodule(str(node.target))
            flag = any(out.get(a.name, False) for a in node.all_input_nodes) or any(p.requires_grad for p in sub.parameters())
        elif node.target in _NO_GRAD_TARGETS or (node.op == "call_method" and node.target in _NO_GRAD_METHODS):
            flag = False
        else:
            flag = any(out.get(a.name, False) for a in node.all_input_nodes)
        value = values.get(node.name)
        if isinstance(value, torch.Tensor):  # a tuple of tensors stays flagged: getitem decides per element
            flag = flag and value.is_floating_point()
        out[node.name] = grad_enabled and flag
    return out


@dataclass(frozen=True, kw_only=True)
class _Measured:
    """What a layer's measurement gives that its structural twins share."""

    whole: Measurement
    num_ops: int
    relative_sharding: dict[str, Sharding]
    relative_parts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # [Note: part-laid Linears] in runtime/parts.py
    split_fraction: float = 0.0
    split_params: int = 0
    split_saved: float = 0.0
    collectives: tuple[tuple[str, str, float], ...] = ()
    sharded_tensors: int = 0
    tp_degrees: tuple[int, ...] | None = None
    tp_source: str = "finder"  # or "base_model_tp_plan"; see [Note: tensor parallelism of exported graphs]
    experts: LayerExperts = NO_EXPERTS  # [Note: experts in a layer] in planner.capture.moe

    @property
    def node_counts(self) -> list[NodeCounts]:
        return list(self.whole.nodes.values())

    def profile(self, *, name: str, params: int, tied_params: int, param_tensors: int, boundary_bytes: float) -> LayerProfile:
        w = self.whole
        return LayerProfile(
            name=name,
            fwd_flops=w.total("fwd_flops"),
            bwd_flops=w.total("bwd_flops"),
            params=params,
            saved_activation_bytes=w.total("saved_bytes"),
            boundary_bytes=boundary_bytes,
            num_ops=self.num_ops,
            tp_split_flops_fraction=self.split_fraction,
            tp_split_params=self.split_params,
            tp_split_saved_bytes=max(0.0, self.split_saved),
            tp_collectives=self.collectives,
            tp_sharded_modules=len(self.relative_sharding),
            tp_sharded_tensors=self.sharded_tensors,
            tp_degrees=self.tp_degrees,
            param_tensors=param_tensors,
            fwd_elementwise_flops=w.total("fwd_elementwise_flops"),
            bwd_elementwise_flops=w.total("bwd_elementwise_flops"),
            fwd_bytes_accessed=w.total("fwd_bytes"),
            bwd_bytes_accessed=w.total("bwd_bytes"),
            tied_params=tied_params,
            matmul_rows=_matmul_rows(w),
            matmul_ops=int(w.total("fwd_matmuls")),
            expert_params=self.experts.params,
            num_experts=self.experts.num_experts,
            routed_bytes=self.experts.routed_bytes,
            expert_flops_fraction=self.experts.flops_fraction,
            attention_kv_bytes=w.total("attention_kv_bytes"),
            selective_kept_bytes=w.total("kept_bytes"),
            selective_rerun_flops=w.total("rerun_flops"),
            widest_gradient_bytes=w.largest("widest_bytes"),
            attention_out_bytes=w.total("attention_out_bytes"),
        )


def _matmul_rows(measured: Measurement) -> tuple[tuple[int, bool, float, int], ...]:
    """The layer's forward matmul FLOPs by (rows, grows with the batch, width), as
    (rows, grows, share of its forward FLOPs, width); see [Note: matmul rows] in planner.capture.measure."""
    total = measured.total("fwd_flops")
    merged: dict[tuple[int, bool, int], float] = {}
    for counts in measured.nodes.values():
        for key, flops in counts.matmul_rows.items():
            merged[key] = merged.get(key, 0.0) + flops
    return tuple((rows, grows, flops / total, width) for (rows, grows, width), flops in sorted(merged.items())) if total > 0 else ()


def _measure_layer(stage: Stage, inputs: list[torch.Tensor], name: str, *, split: bool = True, last_layer: bool = False,
                   tied: set[int] = frozenset(), vocabularies: set[int] = frozenset(),
                   tokens: set[str] | None = None) -> _Measured:
    """Measure one layer whole and, if it has a tensor-parallel pattern (and ``split``:
    the program can split it), as one of two ranks. Its Embeddings and, on the last layer
    (``last_layer``), its output Linear as wide as a vocabulary, split over it unless ``tied``
    ([Note: vocab-parallel layers] in planner.capture.vocab_parallel)."""
    module = stage.module
    whole = measure(module, inputs)
    num_ops = sum(1 for n in module.graph.nodes if n.op not in _NO_KERNEL_OPS)
    sharding = find_sharding(module, inputs, measurement=whole) if split else {}
    if split:
        sharding = {**sharding, **vocab_sharding(module, last_layer=last_layer, tied=set(tied), vocabularies=set(vocabularies),
                                                   tokens=tokens)}
    if not sharding:
        return _Measured(whole=whole, num_ops=num_ops, relative_sharding={})
    try:
        sharded = shard_on_meta(module, sharding, _PROBE_TP, inputs)
        half = measure(sharded, inputs)
        ok = check_sharded_shapes(whole.outputs, half.outputs, _vocab_split(sharding, _PROBE_TP))
    except (RuntimeError, ValueError):
        ok = False
    whole_flops = whole.total("fwd_flops") + whole.total("bwd_flops")
    vocab_only = set(sharding.values()) == {Sharding.VOCAB_EMBEDDING}  # a lookup: parameters split, no FLOPs to
    if not ok or (whole_flops <= 0 and not vocab_only):
        return _Measured(whole=whole, num_ops=num_ops, relative_sharding={})
    scale = _PROBE_TP / (_PROBE_TP - 1)
    params = sum(p.numel() for p in module.parameters())
    split_flops = whole_flops - half.total("fwd_flops") - half.total("bwd_flops")
    return _Measured(
        whole=whole,
        num_ops=num_ops,
        relative_sharding=_relative(sharding, name),
        relative_parts={_relative_path(path, name): parts
                        for path, parts in linear_parts(module, sharding, run_graph(module, inputs)).items()},
        split_fraction=min(1.0, scale * split_flops / whole_flops) if whole_flops > 0 else 0.0,
        split_params=round(scale * (params - sum(p.numel() for p in sharded.parameters()))),
        split_saved=scale * (whole.total("saved_bytes") - half.total("saved_bytes")),
        collectives=layer_collectives(module, inputs, sharding),
        sharded_tensors=sum(len(list(module.get_submodule(path).parameters(recurse=False))) for path in sharding),
        tp_degrees=tuple(tp for tp in range(2, _MAX_TP_CHECKED + 1) if _splits_at(module, inputs, sharding, whole.outputs, tp)),
    )


def _measure_block(stage: Stage, inputs: list[torch.Tensor], model: torch.nn.Module, layout: DecoderLayout,
                   block: int, seq_len: int) -> _Measured:
    """Measure a block of an exported model that the program runs as its own module, and
    split it as [Note: tensor parallelism of exported graphs] says. What one rank's share
    saves is counted on the graph from the ILP's layout (the ops on split values, the
    split Linears), since the exported graph cannot run split."""
    module = stage.module
    whole = measure(module, inputs, masks=False)  # [Note: causal masks] in planner.capture.measure
    num_ops = sum(1 for n in module.graph.nodes if n.op not in _NO_KERNEL_OPS)
    split = block_sharding(model, layout, block, seq_len, module, inputs, whole)
    sharding = split.chosen
    whole_flops = whole.total("fwd_flops") + whole.total("bwd_flops")
    if not sharding or whole_flops <= 0:
        return _Measured(whole=whole, num_ops=num_ops, relative_sharding={})
    work, saved = split_nodes(split.problem, split.choices)
    counts = whole.nodes
    split_params = sharded_tensors = 0
    for path, how in sharding.items():
        for key in ("weight", "bias"):
            param = getattr(module.get_submodule(path), key, None)
            if isinstance(param, torch.Tensor):
                sharded_tensors += 1
                split_params += param.numel() if key == "weight" or how in (Sharding.COLWISE, Sharding.COLWISE_GATHER) else 0
    check = BlockDryRun(model, layout, block, seq_len)
    name = layout.block_path(block)
    return _Measured(
        whole=whole,
        num_ops=num_ops,
        relative_sharding=_relative(sharding, name),
        relative_parts={_relative_path(path, name): parts
                        for path, parts in linear_parts(module, sharding, run_graph(module, inputs)).items()},
        split_fraction=min(1.0, sum(counts[n].fwd_flops + counts[n].bwd_flops for n in work if n in counts) / whole_flops),
        split_params=split_params,
        split_saved=sum(counts[n].saved_bytes for n in saved if n in counts),
        collectives=layer_collectives(module, inputs, sharding),
        sharded_tensors=sharded_tensors,
        tp_degrees=tuple(tp for tp in range(2, _MAX_TP_CHECKED + 1) if check(sharding, tp) is None),
        tp_source=split.source,
    )


def _splits_at(module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding], outputs, tp: int) -> bool:
    """Whether one of ``tp`` ranks runs the split layer to the unsplit output shapes
    (features and heads divide by ``tp``); a dry run on the meta device."""
    try:
        with torch.no_grad():
            # An Interpreter, not a call: a failing GraphModule call prints its traceback.
            return check_sharded_shapes(outputs, fx.Interpreter(shard_on_meta(module, sharding, tp, inputs)).run(*inputs),
                                        _vocab_split(sharding, tp))
    except (RuntimeError, ValueError):
        return False


def _with_vocab_split(measured: _Measured, model: torch.nn.Module, layout: DecoderLayout, *, head: bool, tokens: int,
                      tied: set[int]) -> _Measured:
    """A Hugging Face decoder's embedding layer or head layer (run as the model's own modules:
    [Note: stages of the eager model]) with its token embedding or output Linear split over
    the vocabulary where [Note: vocab-parallel layers] allows it. The exported graph cannot
    run split, so the split's terms are counted from the module: V x H parameters, the
    head's 6 T H V FLOPs per sample (forward and backward) and its logits, and the
    collectives the runtime issues."""
    embedding = _splittable_embedding(model, layout)
    if embedding is None or id(embedding.weight) in tied:
        return measured
    vocab, hidden = embedding.num_embeddings, embedding.embedding_dim
    if head:
        path, module = layout.head, _splittable_head(model, layout, vocab)
        if module is None or id(module.weight) in tied:
            return measured
        whole_flops = measured.whole.total("fwd_flops") + measured.whole.total("bwd_flops")
        fraction = min(1.0, 6.0 * tokens * hidden * vocab / whole_flops) if whole_flops > 0 else 0.0
        saved = min(measured.whole.total("saved_bytes"), 4.0 * tokens * vocab)
        collectives = (*[("forward", "all_reduce", 4.0 * tokens)] * 3, ("backward", "all_reduce", 4.0 * tokens * hidden))
        how = Sharding.VOCAB_HEAD
    else:
        path, fraction, saved, how = f"{layout.base}.{layout.embed[0]}", 0.0, 0.0, Sharding.VOCAB_EMBEDDING
        collectives = (("forward", "all_reduce", 4.0 * tokens * hidden),)
    return replace(measured, relative_sharding={path: how}, split_fraction=fraction, split_params=vocab * hidden,
                   split_saved=saved, collectives=collectives, sharded_tensors=1,
                   tp_degrees=tuple(tp for tp in range(2, _MAX_TP_CHECKED + 1) if vocab % tp == 0))


def _splittable_embedding(model: torch.nn.Module, layout: DecoderLayout) -> torch.nn.Embedding | None:
    """A Hugging Face decoder's token embedding if it may split over the vocabulary
    (no padding row, a vocabulary ``splits_vocabulary`` allows), else None."""
    embedding = model.get_submodule(f"{layout.base}.{layout.embed[0]}")
    if isinstance(embedding, torch.nn.Embedding) and embedding.padding_idx is None \
            and splits_vocabulary(embedding.num_embeddings):
        return embedding
    return None


def _splittable_head(model: torch.nn.Module, layout: DecoderLayout, vocab: int) -> torch.nn.Linear | None:
    """A Hugging Face decoder's ``lm_head`` if it may split over a vocabulary of ``vocab``
    rows (a Linear without bias, as wide as the vocabulary), else None."""
    head = model.get_submodule(layout.head)
    return head if isinstance(head, torch.nn.Linear) and head.bias is None and head.out_features == vocab else None


def _vocab_split(sharding: dict[str, Sharding], tp: int) -> int:
    """How many ways the layer's output logits are split: ``tp`` under a vocab-parallel head, else 1."""
    return tp if Sharding.VOCAB_HEAD in sharding.values() else 1


def _tied_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters that more than one module of ``model`` holds (tied weights)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {pid for pid, count in holders.items() if count > 1}


def _shared_by_layers(modules: list[torch.nn.Module]) -> set[int]:
    """Ids of the parameters that more than one layer holds: a later layer that reads a
    weight as an attribute (``F.linear(x, emb.weight)``) holds it too (runtime.graph)."""
    layers: dict[int, int] = {}
    for module in modules:
        for pid in {id(p) for p in module.parameters()}:
            layers[pid] = layers.get(pid, 0) + 1
    return {pid for pid, count in layers.items() if count > 1}


def _owned_params(module: fx.GraphModule, held: set[int]) -> tuple[int, int, int, list[torch.Tensor]]:
    """(parameters this layer holds first, parameters an earlier layer already holds,
    tensors this layer holds first, the tensors an earlier layer already holds); updates ``held``."""
    owned = tied = tensors = 0
    tied_held = []
    for p in module.parameters():
        if id(p) in held:
            tied += p.numel()
            tied_held.append(p)
        else:
            held.add(id(p))
            owned += p.numel()
            tensors += 1
    return owned, tied, tensors, tied_held


def _structure_key(stage: Stage, layer_name: str, inputs: list[torch.Tensor]) -> Any:
    """What a layer's measurement depends on; see [Note: measuring repeated blocks once].

    Inputs are named by where they are first used, not by their order, which depends on
    where in the model each received tensor was made.
    """
    graph = stage.module.graph
    compute = [n for n in graph.nodes if n.op != "placeholder"]
    ref = {n.name: f"%{i}" for i, n in enumerate(compute)}
    for placeholder, t in zip([n for n in graph.nodes if n.op == "placeholder"], inputs, strict=True):
        first = min(compute.index(u) for u in placeholder.users) if placeholder.users else -1
        slot = compute[first].all_input_nodes.index(placeholder) if first >= 0 else -1
        ref[placeholder.name] = f"in{first}.{slot}"
        ref[placeholder.name + ".spec"] = (ref[placeholder.name], tuple(t.shape), t.dtype, t.requires_grad)
    rows: list[Any] = [tuple(sorted(v for k, v in ref.items() if k.endswith(".spec")))]
    for node in compute:
        args = fx.map_arg((node.args, node.kwargs), lambda a: ref[a.name])
        if node.op == "output":  # tensors passed through untouched cost nothing
            args = [ref[a.name] for a in node.all_input_nodes if a.op != "placeholder"]
        target = node.target if callable(node.target) else _relative_path(str(node.target), layer_name)
        row: list[Any] = [node.op, target if isinstance(target, str) else repr(target), repr(args)]
        if node.op == "get_attr":
            row.append(_tensor_signature(attribute(stage.module, str(node.target))))
        elif node.op == "call_module":
            sub = stage.module.get_submodule(str(node.target))
            row += [repr(sub), tuple(_tensor_signature(t) for t in (*sub.parameters(), *sub.buffers()))]
        rows.append(tuple(row))
    return tuple(rows)


def _tensor_signature(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return (tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter))
    return repr(t)



def _relative_path(path: str, layer_name: str) -> str:
    if path == layer_name or path.startswith(layer_name + "."):
        return _RELATIVE + path[len(layer_name):]
    return path


def _relative(sharding: dict[str, Sharding], layer_name: str) -> dict[str, Sharding]:
    return {_relative_path(path, layer_name): how for path, how in sharding.items()}


def _absolute(sharding: dict[str, Sharding], layer_name: str) -> dict[str, Sharding]:
    return {
        (layer_name + path[len(_RELATIVE):] if path.startswith(_RELATIVE) else path): how
        for path, how in sharding.items()
    }


def _node_profiles(module: fx.GraphModule, layer: int, counts: list[NodeCounts]) -> list[NodeProfile]:
    """This layer's nodes with the counts of the measured twin, matched by position."""
    nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "output")]
    out = []
    for node, c in zip(nodes, counts):  # the trailing UNATTRIBUTED bucket has no node
        out.append(NodeProfile(
            name=node.name, layer=layer, op=node_label(node), module=node_module(node),
            fwd_flops=c.fwd_flops, bwd_flops=c.bwd_flops,
            fwd_elementwise_flops=c.fwd_elementwise_flops, bwd_elementwise_flops=c.bwd_elementwise_flops,
            fwd_bytes_accessed=c.fwd_bytes, bwd_bytes_accessed=c.bwd_bytes,
            param_bytes=c.param_bytes, saved_activation_bytes=c.saved_bytes, output_bytes=c.output_bytes,
        ))
    return out


__all__ = ["differentiable_values", "trace_model"]
