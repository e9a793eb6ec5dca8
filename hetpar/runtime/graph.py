"""Capture a model as an fx graph, group its nodes into layers, and cut it into stages.

The planner and the generated program both call these functions, so the layers that a
plan names are exactly the layers that the program builds.

[Note: layer grouping]
Layers are the units of pipeline partitioning. The repeated blocks of a model live in
containers: every child with parameters of an ``nn.ModuleList`` or ``nn.ModuleDict``,
or the children of one class that occurs at least twice in an ``nn.Sequential``. The
container whose blocks hold the most parameters wins (the shallower one on a tie).
A ModuleDict used as a namespace, holding a container of repeated blocks next to single
modules (nanoGPT's ``transformer = ModuleDict(wte, wpe, h=ModuleList([...]), ln_f)``), is
no container of blocks: its blocks are those of the container inside it
(``transformer.h.0``, ``transformer.h.1``, ...), not ``wte``, ``h`` and ``ln_f``.
Other containers that neither hold nor sit inside a chosen one join it if their blocks
hold at least 1% of the parameters (T5's encoder and decoder blocks; the bottlenecks
of a torchvision-style ResNet, whose four stages are separate Sequentials). Each block is a layer, in the order the
graph first runs it; the nodes before the first block form a leading layer and the
nodes after the last block a trailing one, each named after the modules it uses
(``tok_emb+pos_emb``, ``transformer.ln_f+lm_head``). Nodes are swept in graph order and
a node never goes to an earlier layer than the node before it, so every layer is a
contiguous run of the graph and any cut between layers is valid; nodes between two
blocks that belong to neither go with the earlier one. A parameter read with
``get_attr`` (every parameter of an exported graph) goes to the layer that first uses
it; a later layer that uses it too (tied embeddings) copies the read into its stage.
A node's module comes from ``node.meta["nn_module_stack"]``, which torch.fx and
torch.export both record (runtime.capture.module_paths reads either format).

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
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from hetpar.runtime.capture import (TraceError, capture, data_dependent, data_dependent_message, data_dependent_op,
                                    failure_site, module_path, module_paths)


@dataclass(frozen=True, kw_only=True)
class LayeredGraph:
    """A traced model with every node assigned to a layer; see [Note: layer grouping].

    ``capture`` says how the graph was made: ``"fx"`` (calls the model's modules) or
    ``"export"`` (ATen ops; see [Note: two ways to capture] in runtime.capture).
    """

    gm: fx.GraphModule
    layer_names: tuple[str, ...]
    node_layer: dict[str, int]
    capture: str = "fx"

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op != "output"]


def trace_layers(model: nn.Module, leaf_modules: tuple[str, ...] = (), *, example_inputs: tuple | None = None) -> LayeredGraph:
    """Trace ``model`` and group its nodes into layers.

    torch.fx first; when it fails and ``example_inputs`` are given, torch.export
    (non-strict) on the device of the model; see [Note: two ways to capture].

    Raises:
        TraceError: the model cannot be traced; one line naming the module and line.
    """
    gm, how = capture(model, leaf_modules, example_inputs)
    return _assign_layers(gm, find_blocks(model), how)


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks, in no particular order; see [Note: layer grouping]."""
    total = sum(p.numel() for p in model.parameters())
    candidates = []
    for path, module in model.named_modules():
        if isinstance(module, _CONTAINERS):
            candidates += _container_candidates(path, module)
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    chosen: list[tuple[int, int, str, list[str]]] = []
    for cand in candidates:
        params, _, path, _ = cand
        if params < _MIN_CONTAINER_SHARE * total or any(_nested(path, c[2]) for c in chosen):
            continue
        chosen.append(cand)
    if chosen:
        return [block for c in chosen for block in c[3]]
    # No repeated blocks: every top-level child with parameters is a layer.
    return [name for name, child in model.named_children() if any(True for _ in child.parameters())]


# A block container holding less than this share of the parameters is not worth a layer
# per block (a classifier head written as Sequential(Linear, Tanh, Linear)).
_MIN_CONTAINER_SHARE = 0.01


def _container_candidates(path: str, module: nn.Module) -> list[tuple[int, int, str, list[str]]]:
    """(params, -depth, path, blocks) for each way ``module`` holds repeated blocks.

    A ModuleList or ModuleDict is an explicit list of blocks: all its children with
    parameters are blocks, whatever their classes (hybrid models mix them). In a
    Sequential, the children of one class that occurs at least twice are the blocks;
    the others ride along with the block before them.
    """
    children = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
    if isinstance(module, nn.ModuleDict) and _is_namespace(child for _, child in children):
        return []
    groups: dict[type, list[str]] = collections.defaultdict(list)
    for name, child in children:
        groups[type(child)].append(name)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        groups = {nn.Module: [name for name, _ in children]} if children else {}
    out = []
    for names in groups.values():
        if len(names) < 2 and isinstance(module, nn.Sequential):
            continue
        params = sum(p.numel() for n in names for p in module.get_submodule(n).parameters())
        qualified = [f"{path}.{n}" if path else n for n in names]
        out.append((params, -path.count(".") - (1 if path else 0), path, qualified))
    return out


def _is_namespace(children) -> bool:
    """True if a ModuleDict's children (those with parameters) mix single modules with a
    container of repeated blocks of one class; see [Note: layer grouping]."""
    children = list(children)
    containers = [c for c in children if isinstance(c, _CONTAINERS)]
    return len(containers) < len(children) and any(_repeats_one_class(c) for c in containers)


def _repeats_one_class(container: nn.Module) -> bool:
    """True if at least two of ``container``'s children with parameters share a class."""
    classes = collections.Counter(type(c) for c in container.children() if any(True for _ in c.parameters()))
    return any(count >= 2 for count in classes.values())


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _nested(a: str, b: str) -> bool:
    """True if module paths ``a`` and ``b`` are the same or one contains the other."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def _block_of(node: fx.Node, block_index: dict[str, int]) -> int | None:
    """Index of the block a node runs in, from its innermost module outwards."""
    for path in reversed(module_paths(node)):
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            index = block_index.get(".".join(parts[:end]))
            if index is not None:
                return index
    return None


def _assign_layers(gm: fx.GraphModule, blocks: list[str], how: str = "fx") -> LayeredGraph:
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    compute = [n for n in nodes if n.op != "get_attr"]
    block_index = {block: i for i, block in enumerate(blocks)}
    found = {n.name: _block_of(n, block_index) for n in compute}
    # Blocks in the order the graph first runs them; blocks the graph never runs go.
    order: list[int] = []
    for n in compute:
        if found[n.name] is not None and found[n.name] not in order:
            order.append(found[n.name])
    blocks = [blocks[b] for b in order]
    block_idx = {name: (order.index(b) if b is not None else None) for name, b in found.items()}
    last_block_pos = max((i for i, n in enumerate(compute) if block_idx[n.name] is not None), default=-1)
    raw: dict[str, int] = {}
    current = 0
    for i, node in enumerate(compute):
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
    for node in nodes:  # a parameter goes to the layer that first uses it
        if node.op == "get_attr":
            raw[node.name] = min((raw[u.name] for u in node.users if u.name in raw), default=0)
    # Drop a leading or trailing layer that holds no computation.
    has_pre = any(raw[n.name] == 0 and n.op not in ("placeholder", "get_attr") for n in nodes)
    used = sorted(set(raw.values()) | ({0} if has_pre else set()))
    if not has_pre:
        used = [u for u in used if u != 0] or [0]
    renumber = {old: new for new, old in enumerate(used)}
    first_real = used[0]
    node_layer = {name: renumber.get(v, renumber[first_real]) for name, v in raw.items()}
    containers = sorted({b.rpartition(".")[0] for b in blocks})
    names = []
    for old in used:
        if 1 <= old <= len(blocks):
            names.append(blocks[old - 1])
        else:
            members = [n for n in nodes if raw[n.name] == old and n.op != "placeholder"]
            names.append(_edge_layer_name(members, containers, "input" if old == 0 else "output"))
    return LayeredGraph(gm=gm, layer_names=tuple(names), node_layer=node_layer, capture=how)


def _edge_layer_name(members: list[fx.Node], containers: list[str], fallback: str) -> str:
    """The modules a leading or trailing layer runs, named at the level of the block containers.

    A module is named down to one level below what it shares with the nearest block
    container: ``transformer.wte`` next to ``transformer.h``, ``lm_head`` next to
    ``blocks``. Parameter reads are left out (a tied head reads the embedding).
    """
    tops: list[str] = []
    for node in members:
        paths = module_paths(node)
        if node.op == "get_attr" or not paths:
            continue
        parts = paths[-1].split(".")
        shared = max((_common_prefix(parts, c.split(".") if c else []) for c in containers), default=0)
        if shared >= len(parts):
            continue  # code of an enclosing module's own forward
        top = ".".join(parts[: shared + 1])
        if top not in tops:
            tops.append(top)
    return "+".join(tops) if tops else fallback


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


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
    """Every node's value for ``inputs``, on the meta device (shapes, dtypes, constants).

    A torch.fx graph is run on the meta device: parameters and buffers are swapped for
    meta tensors for the run, so this costs no memory and works whatever device the
    model lives on. An exported graph is specialised to the shapes it was exported
    with and already carries every node's value (``node.meta["val"]``, fake tensors on
    the export's device), so those are returned; it may pin devices in its ops, so it
    is not re-run on meta.

    Raises:
        TraceError: the graph fails on the meta device, or ``inputs`` are not shaped
            like the inputs an exported graph was made for.
    """
    if lg.capture == "export":
        return _exported_values(lg, inputs)
    wrapper = _RecordingModule(lg.gm)
    meta_state = {
        f"gm.{name}": torch.empty_like(t, device="meta")
        for name, t in list(lg.gm.named_parameters()) + list(lg.gm.named_buffers())
    }
    meta_inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    try:
        with torch.no_grad():
            torch.func.functional_call(wrapper, meta_state, meta_inputs, strict=False)
    except Exception as exc:  # noqa: BLE001 - located and reported as one line
        raise meta_run_error(lg.gm, exc) from exc
    return wrapper.values


def _exported_values(lg: LayeredGraph, inputs: tuple) -> dict[str, Any]:
    placeholders = [n for n in lg.gm.graph.nodes if n.op == "placeholder"]
    traced = [tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None for n in placeholders]
    given = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs]
    if traced != given:
        raise TraceError(f"the graph was exported for inputs shaped {traced}, not {given}; export it again for these shapes")
    return {n.name: n.meta.get("val") for n in lg.gm.graph.nodes if n.op != "output"}


def meta_run_error(gm: fx.GraphModule, exc: BaseException, what: str = "") -> TraceError:
    """A one-line TraceError for a graph (or a stage of it) that fails to run on the meta
    device: a data-dependent op named with its module ([Note: data-dependent ops on meta]
    in runtime/capture.py), or where it failed."""
    node = _failing_node(exc)
    op = data_dependent_op(exc, node)
    if op is not None:
        module = module_path(node) if node is not None else failure_site("the meta run", exc, gm).module
        return TraceError(data_dependent_message(module, op))
    failure = failure_site("the meta run", exc, gm)
    hint = ("planning runs the model on meta tensors, so forward must not read tensor values "
            "(branch on shapes or config instead)" if data_dependent(exc) else "report this model")
    return TraceError(f"cannot run {what or type(gm).__name__} on the meta device: {failure.describe()}; {hint}")


def _failing_node(exc: BaseException) -> fx.Node | None:
    """The graph node an fx.Interpreter was running when ``exc`` was raised (the innermost one)."""
    node = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        candidate = frame.f_locals.get("n") if frame.f_code.co_name == "run_node" else None
        if isinstance(candidate, fx.Node):
            node = candidate
    return node


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
    ``module`` is a graph module cut from the model's graph, or a module that calls the
    model's own modules ([Note: stages of the eager model] in runtime/module_stage.py).
    """

    module: nn.Module
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
        _return_like_the_model(lg.gm.graph, graph)
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


# [Note: the last stage returns what the model returns]
# ``loss_fn(outputs, targets)`` must see the same ``outputs`` whether the model runs
# whole in one process or as a pipeline. A torch.fx graph's output node holds the
# model's own structure (a tuple, a dict of nodes), so a last stage cut from it returns
# that structure already. torch.export flattens the output: its graph returns the flat
# list of tensors, and the unlifted module's code generator (``_PyTreeCodeGen``) rebuilds
# the model's structure from the pytree spec it keeps (``out_spec``: a Hugging Face
# ``CausalLMOutputWithPast(logits=...)``, which transformers registers as a pytree node;
# a bare tensor is a leaf spec). The last stage's graph gets a code generator with the
# same ``out_spec``, and an ``in_spec`` of its own flat positional inputs, so it returns
# the ModelOutput (or tuple, dict, tensor) the whole model returns.
def _return_like_the_model(model_graph: fx.Graph, stage_graph: fx.Graph) -> None:
    """Give ``stage_graph`` the output structure of ``model_graph``; see [Note: the last stage returns what the model returns]."""
    info = getattr(model_graph._codegen, "pytree_info", None)
    if not isinstance(model_graph._codegen, _PyTreeCodeGen) or info is None or info.out_spec is None:
        return
    names = [n.name for n in stage_graph.nodes if n.op == "placeholder"]
    in_spec = pytree.tree_structure(tuple(range(len(names))))  # the stage's inputs as they are: flat and positional
    stage_graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(orig_args=names, in_spec=in_spec, out_spec=info.out_spec)))


def _node(lg: LayeredGraph, name: str) -> fx.Node:
    for n in lg.gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(name)


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(t.shape), dtype=t.dtype)


__all__ = [
    "LayeredGraph", "Stage", "TensorSpec", "TraceError",
    "boundary_values", "build_stage", "find_blocks", "meta_run_error", "record_values", "trace_layers",
]
