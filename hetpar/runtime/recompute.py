"""Activation recomputation of a stage: each of its layers runs under torch.utils.checkpoint.

[Note: recompute by layer]
A stage module is one flat fx graph (runtime.graph): a layer's modules are not called
as a whole, so wrapping ``blocks.3`` in a checkpoint wrapper would never fire. Instead
the stage graph is rewritten: the nodes of each layer (a contiguous run of the graph,
see [Note: layer grouping] in runtime/graph.py) become one function compiled from a
sub-graph, and the stage graph calls ``torch.utils.checkpoint.checkpoint`` on it.
Between layers only the layer boundaries stay alive; inside a layer, backward recomputes
what it needs. The layer functions take the stage module as ``self`` and read their
parameters from it when they run, so tensor parallelism, FSDP2 (which swaps parameters
in and out) and checkpoints see the stage module exactly as before: same submodules,
same qualified parameter names.

``full`` recomputes every activation of a layer. ``selective`` keeps the outputs of
weight matmuls (``mm``/``addmm``), convolutions and fused attention and recomputes the
rest: norms, activations, dropout, reshapes, and the products of two activations
(``bmm``/``baddbmm``, a written-out attention's scores and its probabilities times V),
Korthikanti et al.'s selective recompute ([Note: selective recompute costs] in
planner/capture/measure.py; torchtitan's op-level list keeps ``bmm`` too, which keeps
the s x s scores). It needs torch's ``create_selective_checkpoint_contexts``. Both use the non-reentrant checkpoint, which
replays autocast and the RNG state, so a recomputed forward equals the first one.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from hetpar.vocabulary import Recompute
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


_aten = torch.ops.aten
# Ops whose outputs selective recompute keeps (torchtitan's _save_list, less the
# collectives and the products of two activations).
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(module: fx.GraphModule, node_layer: dict[str, int], mode: str) -> None:
    """Rewrite ``module`` so that each layer's nodes run under a checkpoint; see
    [Note: recompute by layer].

    Args:
        module: a stage module (runtime.graph.Stage.module); changed in place.
        node_layer: the layer of each node, by node name (LayeredGraph.node_layer).
        mode: "none" (nothing changes), "selective" or "full".

    Raises:
        ValueError: unknown mode, or a node without a layer.
    """
    if mode not in tuple(Recompute):
        raise ValueError(f"recompute {mode!r} must be one of {', '.join(Recompute)}")
    if mode == Recompute.NONE:
        return
    context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy) if mode == Recompute.SELECTIVE else None
    graph = module.graph
    segments = _layer_segments(graph, node_layer)
    new = fx.Graph()
    new.set_codegen(graph._codegen)  # the model's output structure ([Note: the last stage returns what the model returns])
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = new.placeholder(node.name)
    for layer, members in segments:
        inputs, outputs, fn = _compile_segment(graph, members, layer)
        runner = _checkpointed(fn, module, context_fn, layer)
        call = new.call_function(runner, tuple(env[n] for n in inputs))
        for i, out in enumerate(outputs):
            env[out] = new.call_function(operator.getitem, (call, i))
    output = next(n for n in graph.nodes if n.op == "output")
    new.output(fx.map_arg(output.args[0], lambda n: env[n] if n.op != "get_attr" else new.node_copy(n)))
    module.__dict__[GRAPH_BEFORE_RECOMPUTE] = graph
    module.graph = new
    module.recompile()


# The attribute of a stage module rewritten by ``apply_recompute`` that holds its graph
# from before: its ``call_module`` and ``get_attr`` nodes, which the layer functions now
# hold, name the modules FSDP2 gathers one at a time (runtime.data_parallel.fsdp_units).
GRAPH_BEFORE_RECOMPUTE = "hetpar_graph_before_recompute"


def graph_before_recompute(module: fx.GraphModule) -> fx.Graph:
    """The graph whose nodes ``module`` runs: its own, or the one ``apply_recompute`` split into layer functions."""
    return module.__dict__.get(GRAPH_BEFORE_RECOMPUTE, module.graph)


def _layer_segments(graph: fx.Graph, node_layer: dict[str, int]) -> list[tuple[int, list[fx.Node]]]:
    """Runs of consecutive compute nodes of one layer, in graph order."""
    segments: list[tuple[int, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.name not in node_layer:
            raise ValueError(f"node {node.name!r} of the stage graph has no layer")
        layer = node_layer[node.name]
        if segments and segments[-1][0] == layer:
            segments[-1][1].append(node)
        else:
            segments.append((layer, [node]))
    return segments


def _compile_segment(graph: fx.Graph, members: list[fx.Node], layer: int
                     ) -> tuple[list[fx.Node], list[fx.Node], Callable[..., tuple]]:
    """A function ``fn(self, *inputs) -> outputs`` for one run of nodes, compiled from a
    sub-graph whose attribute reads (``self.blocks.0.attn.q``) resolve on the ``self`` it
    is called with. Parameters read with ``get_attr`` are read inside the function."""
    inside = set(members)
    inputs: list[fx.Node] = []
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: sub.placeholder(n.name) for n in inputs}

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:  # a get_attr: read the parameter inside the segment
            env[n] = sub.node_copy(n)
        return env[n]

    for node in members:
        env[node] = sub.node_copy(node, lookup)
    sub.output(tuple(env[n] for n in outputs))
    code = sub.python_code(root_module="self")
    scope = dict(code.globals)
    exec(compile(code.src, f"<hetpar recompute layer {layer}>", "exec"), scope)  # noqa: S102 - fx's own codegen
    return inputs, outputs, scope["forward"]


def _checkpointed(fn: Callable[..., tuple], module: torch.nn.Module, context_fn: Callable | None, layer: int
                  ) -> Callable[..., tuple]:
    def run(*inputs: Any) -> tuple:
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(fn, module, *inputs, use_reentrant=False, **kwargs)

    run.__name__ = run.__qualname__ = f"recompute_layer_{layer}"
    return run


def checkpoint_call(fn: Callable[..., Any], *inputs: Any, mode: str) -> Any:
    """``fn(*inputs)``, under torch.utils.checkpoint unless ``mode`` is "none": a module
    stage's way to recompute a block it calls as a module (runtime.module_stage)."""
    if mode == Recompute.NONE:
        return fn(*inputs)
    kwargs = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} \
        if mode == Recompute.SELECTIVE else {}
    return checkpoint(fn, *inputs, use_reentrant=False, **kwargs)


__all__ = ["GRAPH_BEFORE_RECOMPUTE", "apply_recompute", "checkpoint_call", "graph_before_recompute"]
