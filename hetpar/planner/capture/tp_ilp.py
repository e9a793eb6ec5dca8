"""Choose, per Linear module of a layer, how tensor-parallel ranks split it: an ILP.

The model, its solve and its brute-force check; tp_dry_run checks an answer and solves again.

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
element-wise arithmetic, views, attention over whole heads: the FEATURE_WISE_*
sets of tp_ops) and must reach a rowwise Linear; anything else (a norm over features, a
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

A Linear whose output is cut into parts (a fused q/k/v split by widths, a fused
gate/up chunked) is colwise part by part: each rank holds its slice of every part
([Note: part-laid Linears] in runtime/parts.py), offered when every part divides by
tp; the dry run runs the layer with its shape constants made local ([Note: local
shape constants]), so a head count that does not divide refuses the split there.

The model cannot see every way a split can go wrong (a view that splits the head
dimension instead of the heads, a chunk over the split features), so the chosen
layer is run on the meta device as one rank holds it, recording each value's shape
next to the unsplit run's. A failure forbids what caused it (the split input of the
failing op, or else the whole assignment) and the model is solved again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.fx as fx
from ortools.sat.python import cp_model

from hetpar.cost_models.devices import DeviceProfile, get_device
from hetpar.planner.capture.measure import Measurement, measure
from hetpar.planner.capture.tp_ops import (
    FEATURE_WISE_ATEN, FEATURE_WISE_FUNCTIONS, FEATURE_WISE_METHODS, FEATURE_WISE_MODULES, LinearSite, TpError, find_parts,
    is_tensors, linear_site, run_graph, tensor_nbytes,
)
from hetpar.vocabulary import Sharding
from hetpar.planner.solver import cp_solver, to_ticks
from hetpar.vocabulary import DType

_SPLIT_CHOICES = (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.ROWWISE, Sharding.ROWWISE_SLICE)
_COLWISE = (Sharding.COLWISE, Sharding.COLWISE_GATHER)  # input replicated, its gradient a partial sum
_CHOICES: tuple[Sharding | None, ...] = (None, *_SPLIT_CHOICES)  # None: replicated


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
    def for_device(cls, device: DeviceProfile | str = "A100-80GB", *, dtype: str = DType.FP32, tp: int = 2,
                   latency: bool = False) -> TpCostModel:
        """The model of ``tp`` devices of one node. The default, an A100 in fp32 (the
        dtype the trace measures in), is the reference the trace plans layers for."""
        profile = get_device(device) if isinstance(device, str) else device
        return cls(tp=tp, matmul_flops_per_s=profile.achievable_matmul_flops(dtype),
                   memory_bytes_per_s=profile.mem_bw_bytes_per_s, link_bytes_per_s=profile.node_link_bw_bytes_per_s,
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
        measurement: ``planner.capture.measure.measure(gm, inputs)`` when already taken.
    """
    counts = (measurement or measure(gm, inputs)).nodes
    values = run_graph(gm, inputs, grad=True)
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
        tensors = tuple(a.name for a in node.all_input_nodes if is_tensors(values.get(a.name)))
        if kind is _Kind.LINEAR:
            site = linear_site(gm, node)
            path, tensors = site.path, (site.input.name,)
            x, y = values[tensors[0]], values[node.name]
            parts = find_parts(node, site.out_features, y.dim()) if isinstance(y, torch.Tensor) else (site.out_features,)
            linear_s[node.name] = _linear_seconds(site, seconds[node.name], tensor_nbytes(x), tensor_nbytes(y),
                                                  getattr(x, "requires_grad", False), cost, parts)
            if getattr(x, "requires_grad", False):
                grad_reduce_s[tensors[0]] = cost.all_reduce_s(tensor_nbytes(x))
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
                    cost: TpCostModel, parts: tuple[int, ...] = ()) -> dict[Sharding | None, float]:
    """One rank's time for each choice a Linear can take (left out where its features do
    not divide). The backward collectives on the input gradient run only if the input
    needs one (not for data); a colwise input's all-reduce is charged to the input
    value instead, once for all the colwise Linears that read it (``grad_reduce_ticks``).
    A fused projection cut into ``parts`` is colwise part by part ([Note: part-laid
    Linears] in runtime/parts.py), so every part must divide; gathered, it is one block."""
    tp = cost.tp
    split = compute_s / tp
    grad_all_gather = cost.all_gather_s(in_bytes) if input_grad else 0.0
    options: dict[Sharding | None, float] = {None: compute_s}
    if all(p % tp == 0 for p in parts or (linear.out_features,)):
        options[Sharding.COLWISE] = split
    if linear.out_features % tp == 0:
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
        return _Kind.FEATURE if isinstance(gm.get_submodule(str(node.target)), FEATURE_WISE_MODULES) else _Kind.OTHER
    if node.op == "call_function" and (node.target in FEATURE_WISE_FUNCTIONS or node.target in FEATURE_WISE_ATEN):
        return _Kind.FEATURE
    if node.op == "call_method" and node.target in FEATURE_WISE_METHODS:
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
        work_limit_s, workers, seed: CP-SAT's deterministic seconds, workers and seed ([Note: deterministic search] in planner.solver).

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
