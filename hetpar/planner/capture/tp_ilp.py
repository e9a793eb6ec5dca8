"""Choose, per Linear module of a layer, how tensor-parallel ranks split it: an ILP.

[Note: tensor-parallel ILP]
Each Linear of a layer's fx graph is kept whole on every rank (replicated) or split
one of four ways, each a DTensor style the runtime applies (runtime.shard):

    choice           input needed   output     forward comm          backward comm
    replicated       replicated     replicated -                     -
    colwise          replicated     split      -                     all-reduce(input)
    colwise_gather   replicated     replicated all-gather(output)    all-reduce(input)
    rowwise          split          replicated all-reduce(output)    -
    rowwise_slice    replicated     replicated all-reduce(output)    all-gather(input)

The backward collectives act on the input's gradient, so they vanish where the input
needs none (data); the colwise ones are one per input value, however many colwise
Linears read it (q, k and v share one: [Note: one all-reduce per shared input] in
runtime/shard.py), so the model charges that all-reduce to the value. "split" is a value of which each rank holds a slice of the
features (or heads).
A split value passes through ops that treat features independently (activations,
element-wise arithmetic, views, attention over whole heads: the _FEATURE_WISE_*
sets) and must reach a rowwise Linear; anything else (a norm over features, a
reduction, the layer's output) needs a replicated value, and only a Linear's own
output can be gathered on the way (that is where DTensor can redistribute). A
rowwise Linear's partial sums are all-reduced at its output, so partial sums never
travel further.

The CP-SAT model has one layout per fx value (split or replicated) and one choice
per Linear, tied together by the table above. Its objective is the time one rank
spends on the layer per sample, in an alpha-beta model (TpCostModel): a replicated
Linear or element-wise op does all the work on every rank, a split one 1/tp of it;
the collectives cost their ring time. Split work saves O(h^2) FLOPs per token where a
collective moves O(h) bytes, so on a transformer block of useful width the optimum
is Megatron's pattern (q, k, v and mlp.fc colwise; o and mlp.proj rowwise: two
all-reduces per block forward), found without naming a module; a plain MLP stack
pairs its Linears the same way, and a Linear before a norm gathers its output.

The model cannot see every way a split can go wrong (a view that splits the head
dimension instead of the heads, a chunk over the split features), so the chosen
layer is run on the meta device as one rank holds it, recording each value's shape
next to the unsplit run's. A failure forbids what caused it (the split input of the
failing op, or else the whole assignment) and the model is solved again.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from ortools.sat.python import cp_model

from hetpar.cost_models.devices import DeviceProfile, get_device
from hetpar.planner.measure import Measurement, measure
from hetpar.planner.options import cp_solver, to_ticks
from hetpar.planner.plan import Sharding

# Ops that act on each feature independently, or on whole heads: a split feature
# dimension passes through them unchanged.
_FEATURE_WISE_FUNCTIONS = {
    F.gelu, F.relu, F.silu, F.dropout, F.scaled_dot_product_attention,
    torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.sigmoid,
    operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, operator.getitem,
    torch.add, torch.mul, torch.neg, torch.transpose, torch.reshape,
    # Dimension-sensitive: valid unless they act along the split dimension (the dry run checks).
    torch.cat, torch.stack, torch.chunk, torch.split, torch.softmax, F.softmax, operator.matmul, torch.matmul,
}
_FEATURE_WISE_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "size", "relu", "mul", "add", "neg", "float", "to",
    "type_as", "chunk", "split", "softmax", "matmul",
}
_FEATURE_WISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Dropout, nn.Tanh, nn.Sigmoid, nn.Identity)
# The same in an exported graph's ATen ops (dimension-sensitive ones included: the dry
# run of a module stage checks them; see [Note: tensor parallelism of exported graphs]).
_aten = torch.ops.aten
_FEATURE_WISE_ATEN = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.transpose.int,
    _aten.permute.default, _aten.contiguous.default, _aten.clone.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.cat.default, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.chunk.default, _aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor,
    _aten.div.Tensor, _aten.neg.default, _aten.pow.Tensor_Scalar, _aten.silu.default, _aten.gelu.default,
    _aten.relu.default, _aten.tanh.default, _aten.sigmoid.default, _aten.dropout.default, _aten.to.dtype,
    _aten._to_copy.default, _aten.type_as.default, _aten.alias.default, _aten.scaled_dot_product_attention.default,
    _aten.softmax.int, _aten.matmul.default,
}


@dataclass(frozen=True)
class LinearSite:
    """A Linear as the graph runs it: a call of the module (torch.fx), or an ``aten.linear``
    on its weight, or GPT-2's Conv1D as ``aten.addmm(bias, x, weight)`` with the weight
    stored [in, out] (torch.export)."""

    path: str  # the module's qualified name
    in_features: int
    out_features: int
    input: fx.Node  # the value it multiplies


def linear_site(gm: fx.GraphModule, node: fx.Node) -> LinearSite | None:
    """The Linear ``node`` runs, or None."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Linear):
            return LinearSite(str(node.target), module.in_features, module.out_features, node.args[0])
        return None
    if node.op != "call_function" or node.target not in (_aten.linear.default, _aten.addmm.default):
        return None
    conv1d = node.target is _aten.addmm.default
    weight = node.args[2] if conv1d else node.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight")):
        return None
    shape = _get_attr(gm, str(weight.target)).shape
    out_f, in_f = (shape[1], shape[0]) if conv1d else (shape[0], shape[1])
    return LinearSite(str(weight.target).removesuffix(".weight"), in_f, out_f, node.args[1] if conv1d else node.args[0])


def _get_attr(module: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)
# Dimension-sensitive ops: (function or method name, position of ``dim``, its default).
_DIM_ARGUMENT = {
    torch.cat: (1, 0), torch.chunk: (2, 0), torch.split: (2, 0), torch.softmax: (1, None),
    F.softmax: (1, None), "chunk": (2, 0), "split": (2, 0), "softmax": (1, None),
}
_MATMULS = {operator.matmul, torch.matmul, "matmul"}

_SPLIT_CHOICES = (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.ROWWISE, Sharding.ROWWISE_SLICE)
_COLWISE = (Sharding.COLWISE, Sharding.COLWISE_GATHER)  # input replicated, its gradient a partial sum
_CHOICES: tuple[Sharding | None, ...] = (None, *_SPLIT_CHOICES)  # None: replicated
_MAX_SOLVES = 32  # dry-run failures tolerated before the layer stays replicated


class TpError(ValueError):
    """A sharding does not fit the layer (a split dimension does not divide, a view breaks)."""


# Variables ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TpCostModel:
    """What one rank's time on a layer costs, per sample, in an alpha-beta model.

    ``link_latency_s`` is per ring step of a collective; it is zero for a layer
    planned per sample (the trace), whose micro-batch size is not known yet, and the
    search charges latency per micro-batch.
    """

    tp: int = 2
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    link_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tp < 2:
            raise ValueError(f"tp({self.tp}) must be >= 2 to split anything")

    @classmethod
    def for_device(cls, device: DeviceProfile | str = "A100-80GB", *, dtype: str = "fp32", tp: int = 2,
                   latency: bool = False) -> TpCostModel:
        """The model of ``tp`` devices of one node. The default, an A100 in fp32 (the
        dtype the trace measures in), is the reference the trace plans layers for."""
        profile = get_device(device) if isinstance(device, str) else device
        return cls(tp=tp, matmul_flops_per_s=profile.achievable_matmul_flops(dtype),
                   memory_bytes_per_s=profile.mem_bw_bytes_per_s, link_bytes_per_s=profile.intra_node_bw_bytes_per_s,
                   link_latency_s=profile.intra_node_latency_s if latency else 0.0)

    def compute_s(self, flops: float, memory_bytes: float) -> float:
        return flops / self.matmul_flops_per_s + memory_bytes / self.memory_bytes_per_s

    def all_reduce_s(self, nbytes: float) -> float:
        """Ring all-reduce: 2(n-1) steps, 2(n-1)/n of the buffer over each link."""
        n = self.tp
        return 2 * (n - 1) * self.link_latency_s + 2 * (n - 1) / n * nbytes / self.link_bytes_per_s

    def all_gather_s(self, nbytes: float) -> float:
        """Ring all-gather of an ``nbytes`` output: n-1 steps, (n-1)/n of it over each link."""
        n = self.tp
        return (n - 1) * self.link_latency_s + (n - 1) / n * nbytes / self.link_bytes_per_s


class _Kind(Enum):
    SOURCE = "source"  # placeholder, get_attr: replicated on every rank
    LINEAR = "linear"
    FEATURE = "feature"  # a split input passes through
    OTHER = "other"  # needs replicated inputs, gives a replicated output


@dataclass(frozen=True, kw_only=True)
class _Site:
    """One fx value of the layer and what its op allows."""

    name: str
    kind: _Kind
    inputs: tuple[str, ...]  # fx inputs that are tensors (or tuples of tensors)
    same_shape: tuple[str, ...] = ()  # FEATURE: inputs as large as the output (split with it, or never)
    full_ticks: int = 0  # one rank's compute when replicated
    split_ticks: int = 0  # ... when split
    choice_ticks: dict[Sharding | None, int] = field(default_factory=dict)  # LINEAR: compute + comm per choice
    # The backward all-reduce of this value's gradient when colwise Linears read it:
    # once however many do ([Note: one all-reduce per shared input] in runtime/shard.py).
    grad_reduce_ticks: int = 0
    path: str = ""  # LINEAR: module path


@dataclass(frozen=True, kw_only=True)
class TpProblem:
    """The sharding ILP of one layer, in integer ticks of ``tick_s`` seconds."""

    sites: tuple[_Site, ...]
    tick_s: float
    tp: int

    @property
    def linears(self) -> list[_Site]:
        return [s for s in self.sites if s.kind is _Kind.LINEAR]


@dataclass(frozen=True, kw_only=True)
class TpSolution:
    """A solved layer: each Linear's choice (None: replicated) and one rank's time."""

    choices: dict[str, Sharding | None]  # fx node name -> choice
    objective_ticks: int
    time_s: float
    status: str  # "optimal" or "feasible"
    solves: int = 1  # CP-SAT solves, one more per dry-run failure

    def sharding(self, problem: TpProblem) -> dict[str, Sharding]:
        """Module path -> Sharding of the split Linears."""
        paths = {s.name: s.path for s in problem.linears}
        return dict(sorted((paths[n], c) for n, c in self.choices.items() if c is not None))


def build_problem(gm: fx.GraphModule, inputs: list[torch.Tensor], cost: TpCostModel,
                  measurement: Measurement | None = None) -> TpProblem:
    """The sharding ILP of ``gm`` run on meta ``inputs``; see [Note: tensor-parallel ILP].

    Args:
        gm: one layer's graph module.
        inputs: meta tensors it runs on (one sample's worth).
        cost: the alpha-beta model and the tensor-parallel degree.
        measurement: ``planner.measure.measure(gm, inputs)`` when already taken.
    """
    counts = (measurement or measure(gm, inputs)).nodes
    values = _run(gm, inputs, grad=True)
    seconds: dict[str, float] = {}
    linear_s: dict[str, dict[Sharding | None, float]] = {}
    grad_reduce_s: dict[str, float] = {}
    raw: list[tuple[str, _Kind, tuple[str, ...], tuple[str, ...], str]] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        c = counts.get(node.name)
        kind, path, same = _kind(gm, node), "", ()
        # A Linear is charged its FLOPs alone: its weight traffic is per micro-batch, not per sample.
        memory_bytes = 0.0 if kind is _Kind.LINEAR or c is None else c.fwd_bytes + c.bwd_bytes
        seconds[node.name] = cost.compute_s(c.fwd_flops + c.bwd_flops, memory_bytes) if c else 0.0
        tensors = tuple(a.name for a in node.all_input_nodes if _is_tensors(values.get(a.name)))
        if kind is _Kind.LINEAR:
            site = linear_site(gm, node)
            path, tensors = site.path, (site.input.name,)
            x = values[tensors[0]]
            linear_s[node.name] = _linear_seconds(site, seconds[node.name], _nbytes(x),
                                                  _nbytes(values[node.name]), getattr(x, "requires_grad", False), cost)
            if getattr(x, "requires_grad", False):
                grad_reduce_s[tensors[0]] = cost.all_reduce_s(_nbytes(x))
        elif kind is _Kind.FEATURE:
            shape = getattr(values.get(node.name), "shape", None)
            same = tuple(a for a in tensors if shape is not None and getattr(values[a], "shape", None) == shape)
        raw.append((node.name, kind, tensors, same, path))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    raw.append((output.name, _Kind.OTHER, tuple(a.name for a in output.all_input_nodes), (), ""))
    tick_s = max(sum(seconds.values()), 1e-30) / 1e6  # [Note: tensor-parallel ILP]: one rank's layer in ~1e6 ticks
    sites = []
    for name, kind, tensors, same, path in raw:
        full = to_ticks(seconds.get(name, 0.0), tick_s)
        sites.append(_Site(
            name=name, kind=kind, inputs=tensors, same_shape=same, path=path, full_ticks=full,
            split_ticks=to_ticks(seconds.get(name, 0.0) / cost.tp, tick_s),
            choice_ticks={k: to_ticks(v, tick_s) for k, v in linear_s.get(name, {}).items()},
            grad_reduce_ticks=to_ticks(grad_reduce_s.get(name, 0.0), tick_s),
        ))
    return TpProblem(sites=tuple(sites), tick_s=tick_s, tp=cost.tp)


def _linear_seconds(linear: LinearSite, compute_s: float, in_bytes: int, out_bytes: int, input_grad: bool,
                    cost: TpCostModel) -> dict[Sharding | None, float]:
    """One rank's time for each choice a Linear can take (left out where its features do
    not divide). The backward collectives on the input gradient run only if the input
    needs one (not for data); a colwise input's all-reduce is charged to the input
    value instead, once for all the colwise Linears that read it (``grad_reduce_ticks``)."""
    tp = cost.tp
    split = compute_s / tp
    grad_all_gather = cost.all_gather_s(in_bytes) if input_grad else 0.0
    options: dict[Sharding | None, float] = {None: compute_s}
    if linear.out_features % tp == 0:
        options[Sharding.COLWISE] = split
        options[Sharding.COLWISE_GATHER] = split + cost.all_gather_s(out_bytes)
    if linear.in_features % tp == 0:
        options[Sharding.ROWWISE] = split + cost.all_reduce_s(out_bytes)
        options[Sharding.ROWWISE_SLICE] = split + cost.all_reduce_s(out_bytes) + grad_all_gather
    return options


def _kind(gm: fx.GraphModule, node: fx.Node) -> _Kind:
    if node.op in ("placeholder", "get_attr"):
        return _Kind.SOURCE
    if linear_site(gm, node) is not None:
        return _Kind.LINEAR
    if node.op == "call_module":
        return _Kind.FEATURE if isinstance(gm.get_submodule(str(node.target)), _FEATURE_WISE_MODULES) else _Kind.OTHER
    if node.op == "call_function" and (node.target in _FEATURE_WISE_FUNCTIONS or node.target in _FEATURE_WISE_ATEN):
        return _Kind.FEATURE
    if node.op == "call_method" and node.target in _FEATURE_WISE_METHODS:
        return _Kind.FEATURE
    return _Kind.OTHER


# Solve ----------------------------------------------------------------------------------------------------------

def solve(problem: TpProblem, *, forbidden_splits: frozenset[str] = frozenset(),
          forbidden_together: tuple[frozenset[str], ...] = (),
          forbidden_assignments: tuple[dict[str, Sharding | None], ...] = (),
          work_limit_s: float = 10.0, workers: int = 1, seed: int = 0) -> TpSolution:
    """Solve the sharding ILP of one layer.

    Args:
        problem: from ``build_problem``.
        forbidden_splits: values that must stay replicated.
        forbidden_together: sets of values that must not all be split at once.
        forbidden_assignments: Linear choices (node -> choice) not to return again.
        work_limit_s, workers, seed: CP-SAT's deterministic seconds, workers and seed ([Note: deterministic search] in planner.options).

    Returns:
        The cheapest assignment found; "optimal" when proven.

    Raises:
        TpError: CP-SAT found no assignment in time (replicating everything always fits,
            unless every assignment is forbidden).
    """
    model = cp_model.CpModel()
    sites = {s.name: s for s in problem.sites}
    # Variables
    # split[v] is 1 iff value v is held split across the tensor-parallel ranks
    split = {v: model.NewBoolVar(f"split[{v}]") for v in sites}
    # choose[m, c] is 1 iff Linear m takes choice c (None: replicated)
    choose = {(s.name, c): model.NewBoolVar(f"choose[{s.name},{c.value if c else 'replicated'}]")
              for s in problem.linears for c in s.choice_ticks}
    # Constraints
    for s in problem.sites:
        _layout_rules(model, s, split, choose)
    for v in forbidden_splits:
        model.Add(split[v] == 0)
    for group in forbidden_together:
        model.AddBoolOr([split[v].Not() for v in group])
    for assignment in forbidden_assignments:
        model.AddBoolOr([choose[m, c].Not() for m, c in assignment.items() if (m, c) in choose])
    # reduced[v] is 1 if some colwise Linear reads v: its gradient is all-reduced once
    reduced = {}
    for s in problem.linears:
        v = s.inputs[0]
        if sites[v].grad_reduce_ticks:
            reduced.setdefault(v, model.NewBoolVar(f"reduced[{v}]"))
            for c in _COLWISE:
                if (s.name, c) in choose:
                    model.AddImplication(choose[s.name, c], reduced[v])
    # Objective: one rank's time on the layer
    terms = [choose[key] * sites[key[0]].choice_ticks[key[1]] for key in choose]
    terms += [var * sites[v].grad_reduce_ticks for v, var in reduced.items()]
    terms += [split[s.name] * (s.split_ticks - s.full_ticks) for s in problem.sites if s.kind is _Kind.FEATURE]
    constant = sum(s.full_ticks for s in problem.sites if s.kind is not _Kind.LINEAR)
    model.Minimize(sum(terms) + constant)
    for (m, c), var in choose.items():  # hint: everything replicated, always valid
        model.AddHint(var, c is None)
    solver = cp_solver(work_limit_s=work_limit_s, workers=workers, seed=seed)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TpError(f"no tensor-parallel sharding of the layer ({solver.StatusName(status)})")
    choices = {m: c for (m, c), var in choose.items() if solver.Value(var)}
    ticks = round(solver.ObjectiveValue())
    return TpSolution(choices=choices, objective_ticks=ticks, time_s=ticks * problem.tick_s,
                      status="optimal" if status == cp_model.OPTIMAL else "feasible")


def _layout_rules(model: cp_model.CpModel, s: _Site, split: dict, choose: dict) -> None:
    """The rows of the table in [Note: tensor-parallel ILP], for one value."""
    if s.kind is _Kind.LINEAR:
        model.AddExactlyOne(choose[s.name, c] for c in s.choice_ticks)
        rowwise = choose.get((s.name, Sharding.ROWWISE))
        colwise = choose.get((s.name, Sharding.COLWISE))
        model.Add(split[s.inputs[0]] == (rowwise if rowwise is not None else 0))
        model.Add(split[s.name] == (colwise if colwise is not None else 0))
    elif s.kind is _Kind.FEATURE and s.inputs:
        model.AddMaxEquality(split[s.name], [split[i] for i in s.inputs])
        for i in s.same_shape:
            model.AddImplication(split[s.name], split[i])
    else:
        model.Add(split[s.name] == 0)
        for i in s.inputs:
            model.Add(split[i] == 0)


def evaluate(problem: TpProblem, choices: dict[str, Sharding | None]) -> int | None:
    """One rank's ticks under ``choices`` (node -> choice of every Linear), or None if invalid.

    The table of [Note: tensor-parallel ILP] followed forward through the graph: the
    brute-force check of ``solve``.
    """
    split: dict[str, bool] = {}
    total = 0
    sites = {s.name: s for s in problem.sites}
    reduced: set[str] = set()
    for s in problem.sites:
        ins = [split[i] for i in s.inputs]
        if s.kind is _Kind.LINEAR:
            c = choices[s.name]
            if c not in s.choice_ticks or ins[0] != (c is Sharding.ROWWISE):
                return None
            split[s.name] = c is Sharding.COLWISE
            total += s.choice_ticks[c]
            if c in _COLWISE and s.inputs[0] not in reduced:
                reduced.add(s.inputs[0])
                total += sites[s.inputs[0]].grad_reduce_ticks
        elif s.kind is _Kind.FEATURE:
            split[s.name] = any(ins)
            if split[s.name] and not all(split[i] for i in s.same_shape):
                return None
            total += s.split_ticks if split[s.name] else s.full_ticks
        else:
            if any(ins):
                return None
            split[s.name] = False
            total += s.full_ticks
    return total


def split_nodes(problem: TpProblem, choices: dict[str, Sharding | None]) -> tuple[set[str], set[str]]:
    """Under valid ``choices``: the nodes that do a 1/tp share of their work on each rank
    (split Linears, ops on split values), and those whose saved activations are split
    (ops on split values, rowwise Linears: a colwise one saves its whole input)."""
    split: dict[str, bool] = {}
    work: set[str] = set()
    saved: set[str] = set()
    for s in problem.sites:
        if s.kind is _Kind.LINEAR:
            c = choices.get(s.name)
            split[s.name] = c is Sharding.COLWISE
            if c is not None:
                work.add(s.name)
            if c in (Sharding.ROWWISE, Sharding.ROWWISE_SLICE):
                saved.add(s.name)
        else:
            split[s.name] = s.kind is _Kind.FEATURE and any(split.get(i, False) for i in s.inputs)
            if split[s.name]:
                work.add(s.name)
                saved.add(s.name)
    return work, saved


# Dry run --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DryRunFailure:
    """Why a sharded layer cannot run: the op, and its inputs that were split (the values
    to forbid splitting: one alone, or several together; none: the whole assignment)."""

    node: str
    split_inputs: frozenset[str]
    reason: str


DryRun = Callable[[dict[str, Sharding], int], "DryRunFailure | None"]


def find_sharding(stage_module: fx.GraphModule, inputs: list[torch.Tensor], *,
                  measurement: Measurement | None = None, cost: TpCostModel | None = None,
                  work_limit_s: float = 10.0, workers: int = 1, seed: int = 0,
                  dry_run_fn: DryRun | None = None) -> dict[str, Sharding]:
    """How tensor-parallel ranks split the Linears of one layer; see [Note: tensor-parallel ILP].

    Args:
        stage_module: one layer's graph module.
        inputs: meta tensors it runs on (one sample's worth).
        measurement: ``planner.measure.measure(stage_module, inputs)`` when already taken.
        cost: the cost model; ``TpCostModel.for_device()`` (A100, fp32, tp 2) by default.
        work_limit_s, workers, seed: CP-SAT's, per solve (``solve``).
        dry_run_fn: ``(sharding, tp) -> failure or None``, the check of a solution;
            ``dry_run`` of the graph by default.

    Returns:
        Module path -> Sharding; modules left out stay replicated.
    """
    cost = cost or TpCostModel.for_device()
    problem = build_problem(stage_module, inputs, cost, measurement)
    return solve_checked(stage_module, inputs, problem, work_limit_s=work_limit_s, workers=workers,
                         seed=seed, dry_run_fn=dry_run_fn).sharding(problem)


def solve_checked(stage_module: fx.GraphModule, inputs: list[torch.Tensor], problem: TpProblem, *,
                  dry_run_fn: DryRun | None = None, **solver_args: Any) -> TpSolution:
    """``solve``, then dry-run the answer on the meta device (``dry_run``, or
    ``dry_run_fn``); forbid what fails and solve again."""
    check = dry_run_fn or (lambda sharding, tp: dry_run(stage_module, inputs, sharding, tp))
    splits: set[str] = set()
    together: list[frozenset[str]] = []
    assignments: list[dict[str, Sharding | None]] = []
    for attempt in range(1, _MAX_SOLVES + 1):
        solution = solve(problem, forbidden_splits=frozenset(splits), forbidden_together=tuple(together),
                         forbidden_assignments=tuple(assignments), **solver_args)
        sharding = solution.sharding(problem)
        failure = check(sharding, problem.tp) if sharding else None
        if failure is None:
            return TpSolution(choices=solution.choices, objective_ticks=solution.objective_ticks,
                              time_s=solution.time_s, status=solution.status, solves=attempt)
        if len(failure.split_inputs) == 1:
            splits |= failure.split_inputs
        elif failure.split_inputs:
            together.append(failure.split_inputs)
        else:
            assignments.append(solution.choices)
    replicated = {s.name: None for s in problem.linears}
    ticks = evaluate(problem, replicated)
    return TpSolution(choices=replicated, objective_ticks=ticks, time_s=ticks * problem.tick_s, status="feasible",
                      solves=_MAX_SOLVES)


def dry_run(stage_module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding],
            tp: int) -> DryRunFailure | None:
    """Run the layer as one rank holds it, next to the unsplit layer, on the meta device.

    Returns:
        None if every op ran on shapes it can handle, else where and why it failed.
    """
    reference = _run(stage_module, inputs)
    try:
        sharded_module = shard_on_meta(stage_module, sharding, tp)
    except TpError as exc:
        return DryRunFailure(node="", split_inputs=frozenset(), reason=str(exc))
    sharded: dict[str, Any] = {}
    try:
        _run(sharded_module, inputs, sharded)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        node = next(n for n in stage_module.graph.nodes if n.name not in sharded)
        return _failure(node, reference, sharded, f"{type(exc).__name__}: {exc}")
    for node in stage_module.graph.nodes:
        reason = _split_dim_misuse(node, reference, sharded)
        if reason:
            return _failure(node, reference, sharded, reason)
    output = next(n for n in stage_module.graph.nodes if n.op == "output")
    if not check_sharded_shapes(reference[output.name], sharded[output.name]):
        return _failure(output, reference, sharded, "a split value reaches the layer's output")
    return None


def _failure(node: fx.Node, reference: dict, sharded: dict, reason: str) -> DryRunFailure:
    split_inputs = frozenset(a.name for a in node.all_input_nodes
                             if a.name in sharded and _split_dims(reference[a.name], sharded[a.name]))
    return DryRunFailure(node=node.name, split_inputs=split_inputs, reason=reason)


def _split_dims(full: Any, local: Any) -> list[int]:
    """Dimensions (negative) in which a rank's value is smaller than the unsplit one."""
    if isinstance(full, (tuple, list)) and isinstance(local, (tuple, list)):
        return sorted({d for f, l in zip(full, local) for d in _split_dims(f, l)})
    if not (isinstance(full, torch.Tensor) and isinstance(local, torch.Tensor)) or full.dim() != local.dim():
        return []
    return [d - full.dim() for d in range(full.dim()) if full.shape[d] != local.shape[d]]


def _split_dim_misuse(node: fx.Node, reference: dict, sharded: dict) -> str | None:
    """Why ``node`` computes something else on a split input than on the unsplit one, if it does."""
    if node.op not in ("call_function", "call_method") or not node.all_input_nodes:
        return None
    first = node.args[0] if node.args else None
    if isinstance(first, (tuple, list)):  # cat, stack: a sequence of tensors
        first = first[0] if first else None
    if not isinstance(first, fx.Node):
        return None
    split = _split_dims(reference[first.name], sharded[first.name])
    if not split:
        return None
    full = reference[first.name]
    if node.target in _DIM_ARGUMENT:
        position, default = _DIM_ARGUMENT[node.target]
        dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)
        if dim is None or (isinstance(dim, int) and dim - (full.dim() if dim >= 0 else 0) in split):
            return f"{node.target if isinstance(node.target, str) else node.target.__name__} acts along the split dimension"
    if node.target in _MATMULS and -1 in split:
        return "matmul contracts the split dimension"
    if node.target is F.scaled_dot_product_attention and set(split) - {-3, -4}:
        return "attention over a split sequence or head dimension"
    if node.target in ("view", "reshape", torch.reshape):
        return _view_misuse(full, reference[node.name], sharded[node.name], split)
    return None


def _view_misuse(full_in: torch.Tensor, full_out: torch.Tensor, local_out: torch.Tensor, split: list[int]) -> str | None:
    """A view keeps each rank's slice contiguous only if the split dimension stays the
    outermost of the dimensions it is merged with or cut into ([B, T, h] -> [B, T, heads,
    head_dim] splits the heads; [B, T, head_dim, heads] would interleave them)."""
    reason = "the view moves the split dimension inside another"
    if len(split) != 1:
        return reason
    before = math.prod(full_in.shape[: split[0] + full_in.dim()])
    starts = {j - full_out.dim() for j in range(full_out.dim()) if math.prod(full_out.shape[:j]) == before}
    out_split = _split_dims(full_out, local_out)
    return None if len(out_split) == 1 and out_split[0] in starts else reason


def _run(module: fx.GraphModule, inputs: list[torch.Tensor], record: dict[str, Any] | None = None, *,
         grad: bool = False) -> dict[str, Any]:
    """Run ``module`` on meta ``inputs``; each node's value by name. With ``grad``, inputs
    require gradients where they do in training, and so do the values made from them."""
    values = {} if record is None else record

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.set_grad_enabled(grad):
        _Recorder(module).run(*[t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in inputs])
    return values


def _is_tensors(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_is_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


def _nbytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


# The layer as one rank holds it ---------------------------------------------------------------------------------

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


def shard_on_meta(stage_module: fx.GraphModule, sharding: dict[str, Sharding], tp: int) -> fx.GraphModule:
    """A meta-device copy of the layer as one tensor-parallel rank holds it.

    Raises:
        TpError: a split dimension is not divisible by ``tp``.
    """
    sharded = copy.deepcopy(stage_module)
    for path, how in sharding.items():
        parent_path, _, name = path.rpartition(".")
        parent = sharded.get_submodule(parent_path) if parent_path else sharded
        module = getattr(parent, name)
        local = local_embedding(module, tp, path) if how is Sharding.VOCAB_EMBEDDING else local_linear(module, how, tp, path)
        setattr(parent, name, local)
    sharded.recompile()
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


# [Note: vocab-parallel layers]
# Beside the ILP's Linears, two modules split over the vocabulary, as Megatron splits
# them (Shoeybi et al. 2019, section 3): an ``nn.Embedding`` that looks up the model's
# input tokens (a position embedding, indexed by computed positions, stays whole, as in
# Megatron: splitting its few rows would cost an all-reduce for nothing; each rank holds V / tp rows,
# looks up the tokens in its range, and the partial outputs are all-reduced: one
# forward all-reduce of the output, nothing in the backward, whose input is token ids)
# and, on the model's last layer, the Linear whose output is the model's output and as
# wide as one of its Embeddings' vocabularies, a language model's head (each
# rank computes V / tp logits, which go split into the loss: [Note: vocab-parallel
# loss] in runtime/executor.py; forward, three all-reduces of one number per token in
# the cross-entropy; backward, the all-reduce of the Linear's input gradient, as any
# colwise Linear). Both cut the vocabulary-sized work, parameters, gradients,
# optimizer state and logits by tp. A weight tied to another module (GPT-2's wte and
# lm_head) splits only where every module holding it splits alike: the tracer decides
# ([Note: tied vocab-parallel weights] in planner/trace.py) and passes the others in
# ``tied``. The vocabulary must divide by 16 (``VOCAB_MULTIPLE``).
# A vocabulary splits only where 16 divides it: every tensor-parallel degree a node's
# devices allow (2, 4, 8, 16) then divides it too, so the split never rules a degree out
# for the whole model. GPT-2's 50257 stays whole; Megatron pads its vocabulary to a
# multiple of 128 x tp (--make-vocab-size-divisible-by) for the same reason.
VOCAB_MULTIPLE = 16


def splits_vocabulary(size: int) -> bool:
    """Whether a vocabulary of ``size`` rows may split over tensor-parallel ranks."""
    return size % VOCAB_MULTIPLE == 0


def vocab_sharding(gm: fx.GraphModule, *, last_layer: bool, tied: set[int], vocabularies: set[int] = frozenset()
                   ) -> dict[str, Sharding]:
    """The vocab-parallel modules of one layer ([Note: vocab-parallel layers]).

    Args:
        last_layer: the layer's output is the model's output (what the loss reads).
        tied: ids of parameters the model shares between modules.
        vocabularies: the sizes of the model's Embeddings: an output Linear splits only
            where its width is one of them (a language model's head, whose loss is a
            cross-entropy over the vocabulary; a regression or classifier head stays whole).
    """
    out: dict[str, Sharding] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(module := gm.get_submodule(str(node.target)), nn.Embedding):
            looks_up_tokens = isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
            if looks_up_tokens and id(module.weight) not in tied and module.padding_idx is None and module.max_norm is None \
                    and splits_vocabulary(module.num_embeddings):
                out[str(node.target)] = Sharding.VOCAB_EMBEDDING
    if last_layer:
        (result,) = [n for n in gm.graph.nodes if n.op == "output"]
        head = result.args[0]
        if isinstance(head, fx.Node) and head.op == "call_module":
            module = gm.get_submodule(str(head.target))
            if isinstance(module, nn.Linear) and id(module.weight) not in tied and module.bias is None \
                    and module.out_features in vocabularies and splits_vocabulary(module.out_features):
                out[str(head.target)] = Sharding.VOCAB_HEAD
    return out


def layer_collectives(module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding]
                      ) -> tuple[tuple[str, str, float], ...]:
    """The collectives one micro-batch of the layer so sharded issues, as the runtime
    issues them (runtime.shard; [Note: tensor-parallel ILP], the table): forward, one
    per rowwise Linear's output and colwise_gather Linear's output; backward, one
    all-reduce per tensor that colwise Linears read ([Note: one all-reduce per shared
    input] in runtime/shard.py) and one all-gather per rowwise_slice input, where the
    input needs a gradient. Each is (pass, collective, bytes per sample): pass
    "forward" or "backward", collective "all_reduce" or "all_gather", bytes the whole
    tensor's (the all-reduced buffer, the gathered result)."""
    values = _run(module, inputs, grad=True)
    out: list[tuple[str, str, float]] = []
    colwise_inputs: dict[str, float] = {}
    for node in module.graph.nodes:
        if node.op == "call_module" and sharding.get(str(node.target)) is Sharding.VOCAB_EMBEDDING:
            out.append(("forward", "all_reduce", float(_nbytes(values[node.name]))))
        site = linear_site(module, node)
        how = sharding.get(site.path) if site is not None else None
        if how is None:
            continue
        x = values[site.input.name]
        input_grad = float(_nbytes(x)) if getattr(x, "requires_grad", False) else 0.0
        output = float(_nbytes(values[node.name]))
        if how in (Sharding.ROWWISE, Sharding.ROWWISE_SLICE):
            out.append(("forward", "all_reduce", output))
        if how is Sharding.COLWISE_GATHER:
            out.append(("forward", "all_gather", output))
        if how in (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.VOCAB_HEAD) and input_grad:
            colwise_inputs[site.input.name] = input_grad
        if how is Sharding.VOCAB_HEAD:  # the cross-entropy's max, sum of exponentials and target logit, per token
            tokens = values[node.name].numel() / values[node.name].shape[-1]
            out.extend([("forward", "all_reduce", 4.0 * tokens)] * 3)
        if how is Sharding.ROWWISE_SLICE and input_grad:
            out.append(("backward", "all_gather", input_grad))
    out.extend(("backward", "all_reduce", nbytes) for nbytes in colwise_inputs.values())
    return tuple(out)


def forward_all_reduces(sharding: dict[str, Sharding]) -> int:
    """All-reduces one forward pass of a layer so sharded runs: one per rowwise Linear."""
    return sum(1 for how in sharding.values() if how in (Sharding.ROWWISE, Sharding.ROWWISE_SLICE))
