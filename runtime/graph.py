"""Capture a model as an fx graph, group its nodes into layers, and cut it into stages.

The planner and the generated program both call these functions, so the layers that a
plan names are exactly the layers that the program builds.

[Note: layer grouping]
Layers are the units of pipeline partitioning. The repeated blocks of a model are the
children of one ``nn.ModuleList`` or ``nn.Sequential`` that share a class (the
container whose such children hold the most parameters wins). Each block is a layer;
the nodes before the first block form a leading layer and the nodes after the last
block a trailing one, each named after the top-level modules it uses
(``tok_emb+pos_emb``, ``ln_f+lm_head``). Nodes are swept in graph order and a node
never goes to an earlier layer than the node before it, so every layer is a
contiguous run of the graph and any cut between layers is valid.

[Note: stage boundaries]
A stage is a run of layers. Its inputs are the model inputs it reads (fed from the
local data on every rank) and the tensors defined before it and used in or after it
(received from the previous stage); its outputs are the tensors defined in or before
it and used after it. A tensor that skips a stage passes through it. Non-tensor values
that cross a boundary (shapes read with ``x.shape``) are fixed for a run, since
micro-batches have static shapes, and become constants in the stage's graph.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn


class TraceError(Exception):
    """The model cannot be captured as a graph."""


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules: tuple[str, ...]):
        super().__init__()
        self.leaf_modules = set(leaf_modules)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaf_modules or super().is_leaf_module(m, qualname)


@dataclass(frozen=True, kw_only=True)
class LayeredGraph:
    """A traced model with every node assigned to a layer; see [Note: layer grouping]."""

    gm: fx.GraphModule
    layer_names: tuple[str, ...]
    node_layer: dict[str, int]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op != "output"]


def trace_layers(model: nn.Module, leaf_modules: tuple[str, ...] = ()) -> LayeredGraph:
    """Trace ``model`` with torch.fx and group its nodes into layers.

    Raises:
        TraceError: torch.fx cannot trace the model.
    """
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - reported as one line by the caller
        raise TraceError(f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: {exc}") from exc
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    blocks = _find_blocks(model)
    return _assign_layers(gm, blocks)


def _find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks; empty if the model has none."""
    best: tuple[int, int, list[str]] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[str]] = collections.defaultdict(list)
        for name, child in module.named_children():
            by_class[type(child)].append(name)
        for names in by_class.values():
            if len(names) < 2 and not isinstance(module, nn.ModuleList):
                continue
            children = [module.get_submodule(n) for n in names]
            params = sum(p.numel() for c in children for p in c.parameters())
            if params == 0:
                continue
            key = (params, -path.count("."), [f"{path}.{n}" if path else n for n in names])
            if best is None or key[:2] > best[:2]:
                best = key
    if best:
        return best[2]
    # No repeated blocks: every top-level child with parameters is a layer.
    return [name for name, child in model.named_children() if any(True for _ in child.parameters())]


def _module_paths(node: fx.Node) -> list[str]:
    paths = list(node.meta.get("nn_module_stack", {}).keys())
    if node.op in ("call_module", "get_attr"):
        paths.append(str(node.target))
    return paths


def _block_of(node: fx.Node, blocks: list[str]) -> int | None:
    for path in reversed(_module_paths(node)):
        for i, block in enumerate(blocks):
            if path == block or path.startswith(block + "."):
                return i
    return None


def _assign_layers(gm: fx.GraphModule, blocks: list[str]) -> LayeredGraph:
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    block_idx = {n.name: _block_of(n, blocks) for n in nodes}
    last_block_pos = max((i for i, n in enumerate(nodes) if block_idx[n.name] is not None), default=-1)
    raw: dict[str, int] = {}
    current = 0
    for i, node in enumerate(nodes):
        b = block_idx[node.name]
        if node.op == "placeholder":
            raw[node.name] = 0
        elif b is not None:
            current = max(current, b + 1)
            raw[node.name] = current
        elif i > last_block_pos:
            raw[node.name] = len(blocks) + 1
        else:
            raw[node.name] = current
    # Drop a leading or trailing layer that holds no computation.
    has_pre = any(raw[n.name] == 0 and n.op != "placeholder" for n in nodes)
    used = sorted({v for n, v in raw.items()} | ({0} if has_pre else set()))
    if not has_pre:
        used = [u for u in used if u != 0] or [0]
    renumber = {old: new for new, old in enumerate(used)}
    first_real = used[0]
    node_layer = {name: renumber.get(v, renumber[first_real]) for name, v in raw.items()}
    names = []
    for old in used:
        if 1 <= old <= len(blocks):
            names.append(blocks[old - 1])
        else:
            members = [n for n in nodes if raw[n.name] == old and n.op != "placeholder"]
            names.append(_edge_layer_name(members, "input" if old == 0 else "output"))
    return LayeredGraph(gm=gm, layer_names=tuple(names), node_layer=node_layer)


def _edge_layer_name(members: list[fx.Node], fallback: str) -> str:
    tops: list[str] = []
    for node in members:
        for path in _module_paths(node)[:1] or ([str(node.target)] if node.op in ("call_module", "get_attr") else []):
            top = path.split(".")[0]
            if top and top not in tops:
                tops.append(top)
    return "+".join(tops) if tops else fallback


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n.name] = result
        return result


class _RecordingModule(nn.Module):
    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm
        self.values: dict[str, Any] = {}

    def forward(self, *args: Any) -> Any:
        recorder = _Recorder(self.gm)
        out = recorder.run(*args)
        self.values = recorder.values
        return out


def record_values(lg: LayeredGraph, inputs: tuple) -> dict[str, Any]:
    """Run the graph on the meta device and return every node's value.

    Parameters and buffers are swapped for meta tensors for the run, so this costs no
    memory and works whatever device the model lives on.
    """
    wrapper = _RecordingModule(lg.gm)
    meta_state = {
        f"gm.{name}": torch.empty_like(t, device="meta")
        for name, t in list(lg.gm.named_parameters()) + list(lg.gm.named_buffers())
    }
    meta_inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    with torch.no_grad():
        torch.func.functional_call(wrapper, meta_state, meta_inputs, strict=False)
    return wrapper.values


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of a tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class Stage:
    """A run of layers as a module; see [Note: stage boundaries].

    ``module(*inputs)`` takes the model inputs named in ``model_inputs`` (positions of
    ``forward``'s arguments) followed by the received tensors ``recv``, and returns a
    tuple of the tensors ``send`` (or, for the last stage, the model's output).
    """

    module: fx.GraphModule
    first_layer: int
    last_layer: int
    is_last: bool
    model_inputs: tuple[int, ...]
    recv: tuple[TensorSpec, ...]
    send: tuple[TensorSpec, ...]


def boundary_values(lg: LayeredGraph, values: dict[str, Any], after_layer: int) -> list[str]:
    """Names of the tensors that cross the cut after ``after_layer``, in graph order."""
    names = []
    for node in lg.nodes():
        if node.op in ("placeholder", "get_attr") or lg.node_layer[node.name] > after_layer:
            continue
        if not isinstance(values.get(node.name), torch.Tensor):
            continue
        if any(u.op == "output" or lg.node_layer[u.name] > after_layer for u in node.users):
            names.append(node.name)
    return names


def build_stage(lg: LayeredGraph, values: dict[str, Any], first_layer: int, last_layer: int) -> Stage:
    """Cut layers ``first_layer..last_layer`` (inclusive) out of the graph as a module."""
    is_last = last_layer == lg.num_layers - 1
    placeholders = [n for n in lg.gm.graph.nodes if n.op == "placeholder"]
    members = [n for n in lg.nodes() if n.op != "placeholder" and first_layer <= lg.node_layer[n.name] <= last_layer]
    recv = boundary_values(lg, values, first_layer - 1) if first_layer > 0 else []
    used = {a.name for n in members for a in n.all_input_nodes}
    if is_last:
        output_node = next(n for n in lg.gm.graph.nodes if n.op == "output")
        used |= {a.name for a in output_node.all_input_nodes}
    used_inputs = [i for i, p in enumerate(placeholders) if p.name in used]

    graph = fx.Graph()
    env: dict[str, Any] = {}
    for i in used_inputs:
        env[placeholders[i].name] = graph.placeholder(placeholders[i].name)
    for name in recv:
        env[name] = graph.placeholder(name)

    def lookup(n: fx.Node) -> Any:
        if n.name in env:
            return env[n.name]
        if n.op == "get_attr":  # a parameter shared with an earlier layer
            env[n.name] = graph.node_copy(n, lookup)
            return env[n.name]
        value = values[n.name]
        if isinstance(value, torch.Tensor):
            raise TraceError(f"layer cut before {n.name!r} misses a tensor input; report this model")
        return tuple(value) if isinstance(value, torch.Size) else value

    for node in members:
        env[node.name] = graph.node_copy(node, lookup)
    if is_last:
        graph.output(fx.map_arg(output_node.args[0], lookup))
        send: list[str] = []
    else:
        send = boundary_values(lg, values, last_layer)
        graph.output(tuple(lookup(_node(lg, s)) for s in send))
    module = fx.GraphModule(lg.gm, graph, class_name=f"Stage{first_layer}_{last_layer}")
    return Stage(
        module=module,
        first_layer=first_layer,
        last_layer=last_layer,
        is_last=is_last,
        model_inputs=tuple(used_inputs),
        recv=tuple(_spec(values[n]) for n in recv),
        send=tuple(_spec(values[n]) for n in send),
    )


def _node(lg: LayeredGraph, name: str) -> fx.Node:
    for n in lg.gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(name)


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(t.shape), dtype=t.dtype)
