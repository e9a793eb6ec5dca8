"""Mixture-of-experts layers: the modules of experts hetpar recognises.

[Note: the experts contract]
A module of experts is one ``nn.Module`` that

- has an integer attribute ``num_experts`` (E, at least 2);
- holds its experts' weights as its own parameters, each with E in its first
  dimension (expert e's weights are the slice ``[e]`` of each), at least one of them a
  stack of matrices (3-D; a router's [E, H] weight is not one), and no child module
  holds parameters (an activation module may be a child);
- is called as ``experts(hidden, top_k_index, top_k_weights)``, with ``hidden`` of
  shape [N, H] (N tokens), ``top_k_index`` [N, k] (the experts each token chose) and
  ``top_k_weights`` [N, k], and returns [N, H]: for each token, the sum over its k
  choices of the weight times that expert applied to the token.

Hugging Face's mixture-of-experts families hold their experts this way in transformers
5 (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``DeepseekV3Experts``, ``GptOssExperts``), and ``examples/moe_gpt.py`` writes one in
plain torch. The contract is what lets the planner count an expert's work from the
routing rather than from a data-dependent loop, and the program split the experts over
ranks: each rank keeps the slices of its own experts and runs the module's own forward
on the tokens sent to them ([Note: expert parallelism]).

[Note: expert parallelism]
A stage with ``expert_parallel`` ep > 1 (the plan's ``StagePlan.expert_parallel``)
splits every module of experts it holds over ep of its data-parallel replicas.

Layout. The replicas ``ranks[d][t]`` of the stage fall into runs of ep consecutive
replicas, ``g*ep .. g*ep + ep - 1``; with the same tensor-parallel index t, such a run
is an expert-parallel group (runtime.distributed builds it as a 1-D DeviceMesh, ``ep``
its one axis). Replica d holds experts ``[j E/ep, (j + 1) E/ep)`` of each module of E
experts, j = d % ep: each of the module's parameters becomes a DTensor ``Shard(0)``
over the group's mesh, of the whole shape [E, ...]. Materialisation, checkpoints and
the final state_dict therefore see the model's own names and shapes and take each
rank's slice as they take a tensor-parallel shard (runtime.materialize, runtime.
checkpoint), and a checkpoint written at one ep resumes at any other. Tensor
parallelism never splits experts: with tp > 1, the tp ranks of a replica hold the same
experts, receive the same tokens and compute the same results, each in the group of
its own index t.

Dispatch (``apply_expert_parallel`` replaces the module's forward). Each (token,
choice) pair is one row; the rows are sorted by the rank that holds their expert
(``expert // (E/ep)``), the counts exchanged, then the rows and their experts' local
numbers exchanged with ``all_to_all_single`` (uneven splits). Each rank runs the
module's own forward on the rows it received, with its own slices of the parameters
and ``num_experts`` = E/ep during the call, one choice per row of weight 1; the results
travel back by the reverse all-to-all, are put back in (token, choice) order,
multiplied by the routing weights where the tokens live, and summed over the k
choices. Every step of it is a permutation, a product by an exact 1, or the module's
own arithmetic, so the result equals the unsplit module's up to the order in which
the k choices are summed. The exchanges are autograd functions whose backward is the
reverse exchange, so gradients reach the tokens' ranks (the router's weights and the
layers before) and the experts' ranks (their parameters) alike. A rank that receives
no rows still runs its forward and gives its experts zero gradients, so every replica
of the group holds a gradient for every parameter (the gradient all-reduces skip
parameters without one).

Gradients (runtime.data_parallel). The backward of the exchange already sums, into a
rank's experts, the gradients of every token of its group that chose them. Replicas
with the same j (and t) hold the same experts, one per group: the expert-data-parallel
group, of dp/ep replicas. Expert gradients are all-reduced (summed) over it and divided
by dp, the other parameters' over all dp replicas and divided by dp as without experts:
both are then the gradient of the mean loss over the global batch, as one process
computes it. Only this plain all-reduce is implemented: ZeRO, gradient compression,
robust aggregation and local SGD are refused with ep > 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a module of experts ([Note: the experts contract])."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return False
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() < 2 or p.shape[0] != count for p in own) or all(p.dim() < 3 for p in own):
        return False
    return all(next(child.parameters(), None) is None for child in module.children())


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of experts in ``model``, by path, in module order."""
    return [(path, m) for path, m in model.named_modules() if is_experts(m)]


def grouped_mm_shape(a: torch.Size, b: torch.Size, groups: int) -> tuple[int, ...]:
    """The shape ``torch._grouped_mm(a, b, offs)`` returns for operands of shapes ``a``
    and ``b`` and ``groups`` offsets; see [Note: grouped_mm on meta]."""
    if len(a) == 2 and len(b) == 3:  # rows of a grouped, one matrix of b per group
        return (a[0], b[2])
    if len(a) == 3 and len(b) == 2:  # columns of b grouped
        return (a[1], b[1])
    if len(a) == 2 and len(b) == 2:  # the shared dimension grouped: one product per group
        return (groups, a[0], b[1])
    return (a[0], a[1], b[2])  # a batch of products


# [Note: grouped_mm on meta]
# ``torch.nn.functional.grouped_mm`` (``aten._grouped_mm``) multiplies float32 on the CPU
# in torch 2.13, but its meta function accepts bfloat16 only, so a float32 model that
# uses it (examples/moe_gpt.py, Hugging Face's experts on the CPU) cannot run on the meta
# device, where hetpar measures models and cuts stages. hetpar registers a meta function
# that gives the output's shape for any floating dtype, as the kernels do; the operands'
# other checks are the real kernel's, at run time. The registration lives as long as
# the process and only once hetpar.runtime.experts is imported.
def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    groups = offs.shape[0] if offs is not None else 1
    shape = grouped_mm_shape(mat_a.shape, mat_b.shape, groups)
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


_META_LIBRARY = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
    _META_LIBRARY.impl("_grouped_mm", _grouped_mm_meta, "Meta")


class ExpertParallelError(Exception):
    """The experts of a stage cannot be split as the plan says; the message says why."""


# ----------------------------------------------------------------------------- expert parallelism


@dataclass(frozen=True)
class _Split:
    """How one module of experts is split: ``count`` experts over the ``ep`` ranks of ``group``."""

    group: dist.ProcessGroup
    ep: int
    count: int

    @property
    def per_rank(self) -> int:
        return self.count // self.ep


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Split every module of experts in ``module`` (a stage, or a rank's chunks) over the
    expert-parallel group ``mesh``; see [Note: expert parallelism]. Call it on the stage
    as cut on the meta device, after tensor parallelism and before materialisation.

    Args:
        module: the stage module; its modules of experts are changed in place.
        mesh: this rank's 1-D expert-parallel mesh (``Groups.ep_mesh``), in replica order.

    Returns:
        The paths of the modules split.

    Raises:
        ExpertParallelError: a module's experts do not divide by the group's size, or it
            is split already.
    """
    ep = mesh.size()
    found = experts_modules(module)
    for path, experts in found:
        if isinstance(experts.forward, ExpertParallelForward) or \
                any(isinstance(p, DTensor) for p in experts.parameters(recurse=False)):
            raise ExpertParallelError(f"{path} is split already; apply expert parallelism once, to unsplit experts")
        if experts.num_experts % ep:
            raise ExpertParallelError(f"{path} has {experts.num_experts} experts, which expert_parallel({ep}) does "
                                      f"not divide; re-run hetpar plan with an --ep that divides it")
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.forward = ExpertParallelForward(experts, _Split(mesh.get_group(), ep, experts.num_experts))
    return [path for path, _ in found]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of the modules of experts ``apply_expert_parallel`` split in ``module``."""
    return [p for m in module.modules() if isinstance(m.forward, ExpertParallelForward)
            for p in m.parameters(recurse=False)]


class ExpertParallelForward:
    """The forward of a split module of experts (an instance attribute replacing the
    class's): rows to the experts' ranks and back ([Note: expert parallelism]).
    ``own_forward`` is the module's forward as it was, which each rank runs on the rows
    it receives."""

    def __init__(self, experts: nn.Module, split: _Split):
        self.own_forward = experts.forward
        self.split = split

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return dispatch(self.split, self._local_experts, hidden, top_k_index, top_k_weights)

    def __repr__(self) -> str:
        return f"ExpertParallelForward(ep={self.split.ep})"

    def _local_experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The module's own forward on the rows this rank received, each for one of its
        experts (``ids``, local numbers) with weight 1, using this rank's slices of the
        parameters and ``num_experts`` = E/ep during the call."""
        experts = self.own_forward.__self__
        params = dict(experts._parameters)
        slices = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in params.items() if p is not None}
        try:
            experts._parameters.update(slices)
            experts.num_experts = self.split.per_rank
            ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
            out = self.own_forward(rows, ids.unsqueeze(-1), ones)
        finally:
            experts._parameters.update(params)
            experts.num_experts = self.split.count
        # Every slice takes part in the graph, rows or none: a zero gradient at least.
        anchor = sum(t.reshape(-1)[:0].sum() for t in slices.values() if t.requires_grad)
        return out + anchor


def route(top_k_index: torch.Tensor, per_rank: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each (token, choice) row goes.

    Args:
        top_k_index: [N, k], the experts each token chose.
        per_rank: experts per rank (E / ep).
        ep: ranks of the expert-parallel group.

    Returns:
        ``order`` (the rows, numbered token * k + choice, sorted by destination rank,
        stably), ``counts`` (rows per destination rank, [ep]) and ``local_ids`` (each
        sorted row's expert, numbered on its destination rank).
    """
    expert = top_k_index.reshape(-1)
    destination = torch.div(expert, per_rank, rounding_mode="floor")
    order = torch.argsort(destination, stable=True)
    counts = torch.bincount(destination, minlength=ep)
    local_ids = (expert - destination * per_rank)[order]
    return order, counts, local_ids


class RoutingLoad:
    """The most rows this process's dispatches sent one rank of their group, over the
    uniform share, since the last ``take`` ([Note: expert load] in
    cost_models/collectives.py: the number ``hetpar plan --expert-imbalance`` takes)."""

    def __init__(self) -> None:
        self._worst: float | None = None

    def record(self, sent: list[int]) -> None:
        total = sum(sent)
        if total:
            ratio = max(sent) * len(sent) / total
            self._worst = ratio if self._worst is None else max(self._worst, ratio)

    def take(self) -> float | None:
        """The worst ratio since the last call (None: no dispatch ran), and start afresh."""
        worst, self._worst = self._worst, None
        return worst


ROUTING_LOAD = RoutingLoad()  # this process's; a step's figure goes to the metrics file (runtime.training)


def dispatch(split: _Split, local_experts, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The split module of experts applied to ``hidden`` [N, H] for the choices
    ``top_k_index`` [N, k] weighted by ``top_k_weights`` [N, k] (collective over the
    expert-parallel group); see [Note: expert parallelism]. ``local_experts(rows, ids)``
    applies this rank's experts to rows it received, one local expert number per row."""
    k = top_k_index.shape[-1]
    order, counts, local_ids = route(top_k_index, split.per_rank, split.ep)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=split.group)
    sent, received = counts.tolist(), received_counts.tolist()
    ROUTING_LOAD.record(sent)
    rows = _Exchange.apply(hidden[order // k], split.group, received, sent)
    ids = _exchange(local_ids, split.group, received, sent)
    out = local_experts(rows, ids)
    back = _Exchange.apply(out, split.group, sent, received)
    unsorted = back.index_select(0, torch.argsort(order))  # (token, choice) order again
    weighted = unsorted.view(-1, k, unsorted.shape[-1]) * top_k_weights.unsqueeze(-1).to(unsorted.dtype)
    return weighted.sum(1).to(hidden.dtype)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, received: list[int], sent: list[int]) -> torch.Tensor:
    """``x``'s rows, ``sent[r]`` of them to rank r of ``group`` in order; returns the
    ``received[r]`` rows from each rank r, in rank order."""
    out = x.new_empty((sum(received), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """``_exchange`` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, received: list[int], sent: list[int]) -> torch.Tensor:
        ctx.group, ctx.received, ctx.sent = group, received, sent
        return _exchange(x, group, received, sent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.sent, ctx.received), None, None, None


__all__ = ["ROUTING_LOAD", "ExpertParallelError", "ExpertParallelForward", "RoutingLoad", "apply_expert_parallel", "expert_parameters",
           "experts_modules", "grouped_mm_shape", "is_experts", "route"]
