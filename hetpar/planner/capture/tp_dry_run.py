"""Check a sharding by running the layer as one rank holds it, on the meta device; solve again on failure.

``find_sharding`` is the tensor-parallel finder's entry: the ILP of [Note: tensor-parallel
ILP] (tp_ilp), its answer dry-run next to the unsplit layer (``dry_run``), and what
fails forbidden before the next solve (``solve_checked``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from hetpar.planner.capture.measure import Measurement
from hetpar.planner.capture.tp_ilp import TpCostModel, TpProblem, TpSolution, build_problem, evaluate, solve
from hetpar.planner.capture.tp_meta import ShapeError, check_sharded_shapes, shard_on_meta
from hetpar.planner.capture.tp_ops import DIM_ARGUMENT, MATMULS, REPEAT_INTERLEAVE, TpError, cuts, linear_parts, linear_site, run_graph
from hetpar.vocabulary import Sharding

_MAX_SOLVES = 32  # dry-run failures tolerated before the layer stays replicated


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
        measurement: ``planner.capture.measure.measure(stage_module, inputs)`` when already taken.
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
    """Run the layer as one rank holds it, next to the unsplit layer, on the meta device,
    on two samples ([Note: dry runs of two samples]).

    Returns:
        None if every op ran on shapes it can handle, else where and why it failed.
    """
    inputs = [_two_samples(t) for t in inputs]
    reference = run_graph(stage_module, inputs)
    try:
        sharded_module = shard_on_meta(stage_module, sharding, tp, inputs)
    except ShapeError as exc:
        return DryRunFailure(node=exc.node, split_inputs=frozenset({exc.split_input} - {""}), reason=str(exc))
    except TpError as exc:
        return DryRunFailure(node="", split_inputs=frozenset(), reason=str(exc))
    sharded: dict[str, Any] = {}
    try:
        run_graph(sharded_module, inputs, sharded)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        node = next(n for n in stage_module.graph.nodes if n.name not in sharded)
        return _failure(node, reference, sharded, f"{type(exc).__name__}: {exc}")
    part_cuts = _part_cuts(stage_module, sharding, reference)
    for node in stage_module.graph.nodes:
        reason = _split_dim_misuse(node, reference, sharded, part_cuts)
        if reason:
            return _failure(node, reference, sharded, reason)
    output = next(n for n in stage_module.graph.nodes if n.op == "output")
    if not check_sharded_shapes(reference[output.name], sharded[output.name]):
        return _failure(output, reference, sharded, "a split value reaches the layer's output")
    return None


# [Note: dry runs of two samples]
# The tracer measures a layer on one sample, but a split that only holds for one does
# not hold: a view merging the batch with split heads ([B, H/tp, T, D] -> [B*H/tp, T, D],
# attention written out as Megatron-LM's baddbmm over the batch) keeps each rank's
# slice contiguous at B = 1 and interleaves it at B > 1, and the program, which checks
# its stages at the real micro-batch, would refuse the plan. So the dry run runs the
# layer on two samples: every input whose leading dimension is one sample's becomes
# two (same shape otherwise), for the unsplit and the split layer alike.
def _two_samples(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != 1:
        return t
    return torch.empty((2, *t.shape[1:]), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


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


def _part_cuts(gm: fx.GraphModule, sharding: dict[str, Sharding], reference: dict) -> dict[str, set[int]]:
    """Node name -> the feature offsets of its parts, for each part-laid colwise Linear
    ([Note: part-laid Linears] in runtime/parts.py)."""
    parts = linear_parts(gm, sharding, reference)
    out = {}
    for node in gm.graph.nodes:
        site = linear_site(gm, node)
        if site is not None and site.path in parts:
            offsets = [0]
            for p in parts[site.path]:
                offsets.append(offsets[-1] + p)
            out[node.name] = set(offsets)
    return out


def _split_dim_misuse(node: fx.Node, reference: dict, sharded: dict, part_cuts: dict[str, set[int]] | None = None
                      ) -> str | None:
    """Why ``node`` computes something else on a split input than on the unsplit one, if
    it does. A split of a part-laid Linear's output at its parts is what the layout is
    for (``part_cuts``: ``_part_cuts``)."""
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
    offsets = (part_cuts or {}).get(first.name)
    if offsets is not None and cuts(node, full.shape[-1], full.dim()) == offsets:
        return None
    if node.target in DIM_ARGUMENT:
        position, default = DIM_ARGUMENT[node.target]
        dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)
        if dim is None or (isinstance(dim, int) and dim - (full.dim() if dim >= 0 else 0) in split):
            return f"{node.target if isinstance(node.target, str) else node.target.__name__} acts along the split dimension"
    if node.target in REPEAT_INTERLEAVE:
        repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if not isinstance(repeats, int) or not isinstance(dim, int):
            return "repeat_interleave of a split value by a tensor, or flattened"
    if node.target in MATMULS and -1 in split:
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
