"""Data parallelism of a stage: how the replicas of a stage agree on its gradients.

``wrap`` picks one, from the stage's ``zero_stage`` and the plan's ``grad_compression``,
``aggregation`` and ``sync_every`` (runtime.sync_spec):

- ``AllReduce``: one all-reduce (SUM, then / dp) per bucket of flattened gradients,
  after the step's schedule has run. DTensor (tensor-parallel) parameters contribute
  their local shards, which the same tp index of every replica holds.
- ``CompressedAllReduce``: the same buckets, reduced by a DDP communication hook
  (``fp16_compress_hook``, ``bf16_compress_hook`` or ``powerSGD_hook``); see
  [Note: comm hooks without DDP].
- ``ErrorFeedbackSync`` (runtime.compression): top-k or sign compression, all-gathered.
- ``RobustAggregate`` (runtime.robust): trimmed mean, median or Krum of the gathered gradients.
- ``LocalSGD`` (runtime.local_sgd): parameters and optimizer state averaged every K steps.
- ``FullyShard``: ZeRO 1-3 through FSDP2; see [Note: ZeRO through FSDP2].
- ``MixedDegreeSync`` (runtime.mixed_sync): a stage whose replicas differ in
  tensor-parallel degree; see [Note: replicas of different degrees].
- ``ExpertParallelSync``: a stage whose experts are split over its replicas
  (``expert_parallel`` > 1): the other parameters as ``AllReduce``, the experts'
  gradients over the replicas holding the same experts; see [Note: expert parallelism]
  in runtime/experts.py. Only with the plain all-reduce (``check_expert_parallel``).

``wrap`` also applies the faults a test asks for through ``HETPAR_TEST_FAULTS``
(runtime.faults, [Note: test faults]); a program carries no test hooks of its own.

Each is told, before every backward of the step, whether it is the last one
(``before_backward``), reduces after the schedule (``reduce``) and hears of each
optimizer step (``after_step``).

[Note: comm hooks without DDP]
A DDP communication hook is a function ``hook(state, bucket) -> Future[Tensor]`` that
reduces one ``dist.GradBucket`` (a flat buffer of several gradients). hetpar does not
wrap stages in ``DistributedDataParallel``: DDP's reducer expects each forward to be
followed by its own backward and asserts under pipeline schedules that run several
forwards first (measured on torch 2.13: GPipe and interleaved fail, only 1F1B works).
Instead hetpar builds the buckets itself after the schedule and calls torch's hook
functions on them through ``_Bucket``, an object with GradBucket's documented methods
(``index``, ``buffer``, ``set_buffer``, ``gradients``, ``parameters``, ``is_last``),
which is all the hooks use (GradBucket has no Python constructor). Buckets hold at
most ``BUCKET_CAP_BYTES`` of one dtype, in parameter order, and keep their layout from
step to step, which PowerSGD's per-bucket error feedback relies on. Compression is
lossy by design: fp16 rounds each gradient to 11 significant bits, bf16 to 8; PowerSGD
replaces each gradient matrix by a rank-r approximation after ``start_powerSGD_iter``
steps of plain all-reduce and feeds the error back in the next step. Their state
(PowerSGD's error feedback and low-rank factors) is not checkpointed: a resumed run
starts them afresh.

[Note: ZeRO through FSDP2]
``torch.distributed.fsdp.fully_shard`` shards a stage's parameters over its
data-parallel mesh (a DTensor ``Shard(0)`` per parameter), gathers them for compute
and reduce-scatters the gradients, so each replica keeps 1/dp of the parameters,
gradients and optimizer state at rest and steps its shard. The ZeRO stages map onto
its knobs:

| zero | reshard_after_forward | gradients reduce-scattered | parameters during the step |
|---|---|---|---|
| 1 | False | once, after the last backward (unsharded gradients accumulate) | gathered once per step |
| 2 | False | after every micro-batch's backward (sharded gradients accumulate) | gathered once per step |
| 3 | True | after every micro-batch's backward | gathered for each forward and each backward |

Limits, honestly: FSDP2 frees gathered parameters after the step, so ZeRO-1 and -2
keep parameters sharded between steps too (the parameter all-gather of the next step
plus the gradient reduce-scatter move what one all-reduce moves); ZeRO-1 holds full
gradients during the step, ZeRO-2 and -3 only their shards. Under ZeRO-1 and -2 the
whole stage is one FSDP unit. Under ZeRO-3 each module the stage calls as a module
(``fsdp_units``: in a traced stage the fx graph's ``call_module`` targets that hold
parameters, a Linear, a norm, an embedding, also where recompute moved the calls into
layer functions; in a Hugging Face module stage each decoder block) is a unit of its
own, gathered before its forward and its backward and resharded after each, its
gradient reduce-scattered when its backward ends; the stage's other parameters (a tied
weight, one read by ``get_attr``) form the stage's own unit. So a ZeRO-3 rank holds a
few modules' full weights at a time, within the two layers' that cost_models/memory.py
counts ([Note: ZeRO stages]), not the whole stage's. Under
sequence parallelism too: a unit's pre-forward hook hands the module its inputs as new
tensor objects (FSDP2's ``RegisterPostBackwardFunction``), so a colwise Linear knows its
input was gathered over the sequence by the storage, not by an attribute of the tensor
(``gathered_for_colwise`` in runtime/sequence.py); otherwise its gradient would be
all-reduced over tp on top of the gather's reduce-scatter.
A stage with tensor parallelism is sharded over a 2-D (dp, tp) mesh.

[Note: offload through FSDP2]
A stage whose plan says ``offload`` (ZeRO-3 only; over one row of ranks FSDP2 runs over a
mesh of the rank alone, runtime.distributed) passes FSDP2 a ``CPUOffloadPolicy``:
its shard of the parameters, their gradients and so the optimizer state live in host
memory. Each all-gather first copies the shard to the device, each reduce-scattered
gradient shard is copied back and accumulated on the host, and the optimizer steps the
host tensors on the CPUs (torch's fused AdamW where the optimizer is AdamW: the
for-each one moves several times fewer bytes a second on CPU tensors,
benchmarks/cpu_adam_rate.py). Pinned host memory (the copies
then run asynchronously) where the stage computes on an accelerator; plain memory on
CPU workers, which the planner never offloads ([Note: offload costs] in
cost_models/offload.py) but which run such a plan as written.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import fx
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hetpar.runtime.buckets import BUCKET_CAP_BYTES, GradientSync, grad_buckets, local, pack, unflatten
from hetpar.runtime.compression import ErrorFeedbackSync
from hetpar.runtime.distributed import Groups, StageSpec
from hetpar.runtime.experts import expert_parameters
from hetpar.runtime.faults import from_environment as faults_from_environment
from hetpar.runtime.local_sgd import LocalSGD
from hetpar.runtime.mixed_sync import MixedDegreeSync
from hetpar.runtime.recompute import graph_before_recompute
from hetpar.runtime.robust import RobustAggregate
from hetpar.runtime.sync_spec import check_sync, parse_aggregation, parse_compression
from hetpar.vocabulary import AggregationKind, CompressionKind, SyncScope

class AllReduce(GradientSync):
    """Average gradients over the data-parallel group with SUM all-reduces, then / dp.

    Parameters without a gradient are skipped; every replica of a stage runs the same
    graph, so they skip the same ones. ``group`` None is this rank alone: the gradients
    are only divided (the experts of a stage whose every replica holds other experts).
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, data_parallel: int):
        self.params = list(params)
        self.group = group
        self.data_parallel = data_parallel
        # [Note: all-reduce under the last backward]
        self._backwards = 0  # backward passes of this step so far
        self._expected: int | None = None  # accumulations per parameter this step, once the last backward starts
        self._counts: dict[int, int] = {}
        self._launched: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []
        self._launched_ids: set[int] = set()
        self._flat: dict[tuple[int, ...], torch.Tensor] = {}  # ids of a bucket's parameters -> its buffer
        overlap = all(p.requires_grad and not isinstance(p, DTensor) for p in self.params)
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params] if overlap else []
        self._pending = _planned_buckets(self.params) if overlap else []

    def __str__(self) -> str:
        return f"all-reduce over {self.data_parallel} replicas"

    def before_backward(self, last: bool) -> None:
        self._backwards += 1
        if last and self._handles:
            self._expected = self._backwards
            for p in self.params:
                self._accumulated(p, count=False)  # a bucket may be complete already (weights accumulated earlier)

    def _accumulated(self, param: nn.Parameter, count: bool = True) -> None:
        if count:
            self._counts[id(param)] = self._counts.get(id(param), 0) + 1
        if self._expected is None:
            return
        while self._pending and all(self._counts.get(id(p), 0) >= self._expected for p in self._pending[0]):
            self._launch(self._pending.pop(0))

    def _packed(self, bucket: list[nn.Parameter], grads: list[torch.Tensor]) -> torch.Tensor:
        """``grads`` (of ``bucket``'s parameters) concatenated into the bucket's buffer,
        which lives as long as the stage, as DDP's do: a fresh tensor of tens of MiB each
        step costs page faults on a CPU."""
        key = tuple(id(p) for p in bucket)
        numel = sum(g.numel() for g in grads)
        flat = self._flat.get(key)
        if flat is None or flat.numel() != numel or flat.dtype != grads[0].dtype:
            flat = self._flat[key] = torch.empty(numel, dtype=grads[0].dtype, device=grads[0].device)
        return torch.cat([g.reshape(-1) for g in grads], out=flat)

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        flat = self._packed(bucket, [p.grad for p in bucket])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True) if self.group else None
        self._launched.append((bucket, flat, work))
        self._launched_ids.update(id(p) for p in bucket)

    def reduce(self) -> None:
        for bucket, flat, work in self._launched:
            if work is not None:
                work.wait()
            unflatten(flat, [p.grad for p in bucket], divisor=self.data_parallel)
        rest = [p for p in self.params if id(p) not in self._launched_ids]
        for bucket in grad_buckets(rest):
            grads = [local(p.grad) for p in bucket]
            flat = self._packed(bucket, grads)
            if self.group is not None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            unflatten(flat, grads, divisor=self.data_parallel)
        self._backwards, self._expected, self._counts = 0, None, {}
        self._launched, self._launched_ids = [], set()
        self._pending = _planned_buckets(self.params) if self._handles else []


# [Note: all-reduce under the last backward]
# As DDP does, the gradient all-reduce of a data-parallel stage starts while its last
# backward still runs: buckets of parameters in reverse order (the order backward
# finishes them), each launched asynchronously once every parameter in it has
# accumulated its gradient as many times as the step has backward passes (one per
# micro-batch; under zero-bubble schedules the weight passes accumulate, so the count
# still ends at the last one). ``reduce`` waits for them and all-reduces whatever
# never completed a bucket (parameters without gradients are skipped, as before), in
# a fixed order: every replica runs the same graph, so the launches come in the same
# order on every rank. Stages holding DTensor parameters (tensor parallelism) keep the
# plain all-reduce after the schedule.
def _planned_buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Buckets of at most ``BUCKET_CAP_BYTES`` over the parameters in reverse order, by dtype."""
    return pack((p, p.dtype, p.numel() * p.element_size()) for p in reversed(params))


class ExpertParallelSync(GradientSync):
    """The gradients of a stage whose experts are split over its replicas: the experts'
    summed over the replicas that hold the same experts (``Groups.expert_dp_group``), the
    others' over all replicas, both divided by dp; see [Note: expert parallelism] in
    runtime/experts.py."""

    def __init__(self, params: Iterable[nn.Parameter], experts: list[nn.Parameter], groups: Groups,
                 data_parallel: int, expert_parallel: int):
        ids = {id(p) for p in experts}
        self.dense = AllReduce([p for p in params if id(p) not in ids], groups.dp_group, data_parallel)
        self.experts = AllReduce(experts, groups.expert_dp_group, data_parallel)
        self.expert_parallel = expert_parallel

    def __str__(self) -> str:
        holders = self.dense.data_parallel // self.expert_parallel
        experts = f"all-reduced over {holders} replicas" if holders > 1 else "each replica holds its own"
        return (f"all-reduce over {self.dense.data_parallel} replicas, experts split over ep {self.expert_parallel} "
                f"({experts})")

    def before_backward(self, last: bool) -> None:
        self.dense.before_backward(last)
        self.experts.before_backward(last)

    def reduce(self) -> None:
        self.dense.reduce()
        self.experts.reduce()


def check_expert_parallel(stage: StageSpec, compression: str, aggregation: str, sync_every: int) -> None:
    """Refuse what does not combine with experts split over replicas (``expert_parallel``
    > 1): only the plain all-reduce knows the experts' own data-parallel group.

    Raises:
        ValueError: one line naming the plan field to change.
    """
    if stage.expert_parallel == 1:
        return
    refused = [what for what, used in (
        (f"zero_stage {stage.zero_stage}", stage.zero_stage > 0),
        (f"grad_compression {compression}", parse_compression(compression).kind != CompressionKind.NONE),
        (f"aggregation {aggregation}", parse_aggregation(aggregation).robust),
        (f"sync_every {sync_every} (local SGD)", sync_every > 1),
    ) if used]
    if refused:
        raise ValueError(f"stage with layers {stage.layers}: expert_parallel({stage.expert_parallel}) works with the "
                         f"plain gradient all-reduce only, not with {refused[0]}; re-run hetpar plan without one or "
                         f"the other")


class _Bucket:
    """What a DDP comm hook uses of ``dist.GradBucket``; see [Note: comm hooks without DDP]."""

    def __init__(self, index: int, count: int, params: list[nn.Parameter]):
        self._index, self._count, self._params = index, count, params
        self._grads = [local(p.grad) for p in params]
        self._buffer = torch.cat([g.reshape(-1) for g in self._grads])

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of the buffer shaped like each gradient (PowerSGD compresses them in place)."""
        views, offset = [], 0
        for g in self._grads:
            views.append(self._buffer[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return views


class CompressedAllReduce(GradientSync):
    """Average gradients with a DDP communication hook; see [Note: comm hooks without DDP]."""

    def __init__(self, params: Iterable[nn.Parameter], hook: Callable, state: Any):
        self.params = list(params)
        self.hook = hook
        self.state = state

    def __str__(self) -> str:
        return f"all-reduce over {_group_of(self.state).size()} replicas through {self.hook.__name__}"

    def reduce(self) -> None:
        buckets = grad_buckets(self.params)
        for i, params in enumerate(buckets):
            bucket = _Bucket(i, len(buckets), params)
            reduced = self.hook(self.state, bucket).wait()
            unflatten(reduced, [local(p.grad) for p in params])


class FullyShard(GradientSync):
    """ZeRO through FSDP2; see [Note: ZeRO through FSDP2]."""

    def __init__(self, module: nn.Module, mesh: Any, zero_stage: int, offload: bool = False):
        self.zero_stage = zero_stage
        self.offload = offload
        self.replicas = mesh.size()
        # [Note: offload through FSDP2]: pinned host memory only beside an accelerator
        policy = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload else OffloadPolicy()
        self.units = fsdp_units(module) if zero_stage == 3 else []
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
        self.module: FSDPModule = fully_shard(module, mesh=mesh, reshard_after_forward=zero_stage == 3,
                                              offload_policy=policy)

    def __str__(self) -> str:
        where = ", the shard in host memory" if self.offload else ""
        units = f", {len(self.units)} modules gathered one at a time" if self.units else ""
        over = f"over {self.replicas} replicas" if self.replicas > 1 else "on one replica"
        return f"ZeRO-{self.zero_stage} through FSDP2 {over}{units}{where}"

    def before_backward(self, last: bool) -> None:
        self.module.set_is_last_backward(last)
        self.module.set_requires_gradient_sync(last or self.zero_stage >= 2)
        self.module.set_reshard_after_backward(last or self.zero_stage == 3)


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The sub-modules a ZeRO-3 stage gathers one at a time ([Note: ZeRO through FSDP2]): those
    its fx graph calls as modules (``call_module``) that hold parameters, read by no
    ``get_attr`` and share none with another (a unit inside another is left to it); a
    Hugging Face module stage's decoder blocks (its ``fsdp_units()``). Empty otherwise."""
    if callable(getattr(module, "fsdp_units", None)):
        return module.fsdp_units()
    graphs = [m for m in module.modules() if isinstance(m, fx.GraphModule)]
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    units: list[nn.Module] = []
    for graph in graphs:
        nodes = graph_before_recompute(graph).nodes  # a recomputed stage calls its modules from layer functions
        fetched = [n.target for n in nodes if n.op == "get_attr"]
        for target in sorted({n.target for n in nodes if n.op == "call_module"}):
            sub = graph.get_submodule(target)
            params = list(sub.parameters())
            if not params or any(f == target or f.startswith(target + ".") for f in fetched):
                continue
            if any(owners[id(p)] > 1 for p in params) or any(sub is u or _inside(sub, u) for u in units):
                continue
            units.append(sub)
    return units


def _inside(module: nn.Module, other: nn.Module) -> bool:
    return any(module is m for m in other.modules())


def _group_of(state: Any) -> dist.ProcessGroup:
    return state.process_group if isinstance(state, powerSGD_hook.PowerSGDState) else state


def wrap(
    module: nn.Module,
    stage: StageSpec,
    groups: Groups,
    compression: str = CompressionKind.NONE,
    aggregation: str = AggregationKind.MEAN,
    sync_every: int = 1,
    sync_scope: str = SyncScope.ALL,
    *,
    powersgd_rank: int = 1,
    powersgd_start_step: int = 2,
) -> GradientSync:
    """Set up the data parallelism of this rank's stage. Call it after tensor
    parallelism and before the optimizer is made: FSDP2 replaces the parameters.

    Args:
        module: the stage module.
        stage: this rank's stage (its ``zero_stage``).
        groups: this rank's groups (its data-parallel group and mesh; with
            ``sync_scope`` "node", its data-parallel group inside the node).
        compression: the plan's ``grad_compression`` (runtime.sync_spec).
        aggregation: the plan's ``aggregation``: "mean", or a robust rule (runtime.robust).
        sync_every: the plan's ``sync_every``: local SGD when > 1 (runtime.local_sgd).
        sync_scope: the plan's ``sync_scope``: "all", or "node" (gradients all-reduced
            inside a node every step).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` where the plan's
            compression is "powersgd" without a rank.
        powersgd_start_step: steps of plain all-reduce before PowerSGD compresses
            (PowerSGDState's ``start_powerSGD_iter``; at least 2).

    Raises:
        ValueError: an unknown option, or options that do not combine (sync_spec.check_sync),
            or a malformed ``HETPAR_TEST_FAULTS``.
    """
    method = _sync_method(module, stage, groups, compression, aggregation, sync_every, sync_scope,
                          powersgd_rank=powersgd_rank, powersgd_start_step=powersgd_start_step)
    faults_from_environment(module, dist.get_rank())  # tests only: [Note: test faults]
    return method


def _sync_method(module: nn.Module, stage: StageSpec, groups: Groups, compression: str, aggregation: str,
                 sync_every: int, sync_scope: str, *, powersgd_rank: int, powersgd_start_step: int) -> GradientSync:
    comp, agg = parse_compression(compression), parse_aggregation(aggregation)
    dp = groups.dp_group.size() if groups.dp_group is not None else 1
    check_sync(compression, aggregation, sync_every, sync_scope, data_parallel=dp, zero_stages=[stage.zero_stage],
               equal_shares=True)
    check_expert_parallel(stage, compression, aggregation, sync_every)
    if stage.mixed_degrees:  # replicas of different tensor-parallel degrees: [Note: replicas of different degrees]
        if (comp.kind, agg.robust, sync_every) != (CompressionKind.NONE, False, 1):
            raise ValueError("replicas of different tensor-parallel degrees sync with a plain all-reduce: no gradient "
                             "compression, robust aggregation or local SGD")
        return MixedDegreeSync(module, stage, groups)
    if groups.dp_group is None and not (stage.offload and groups.dp_mesh is not None):
        return GradientSync()
    params = list(module.parameters())
    if stage.expert_parallel > 1:
        return ExpertParallelSync(params, expert_parameters(module), groups, dp, stage.expert_parallel)
    if stage.zero_stage > 0:
        return FullyShard(module, groups.dp_mesh, stage.zero_stage, stage.offload)
    if sync_every > 1:
        node = groups.dp_node_group if sync_scope == SyncScope.NODE else None
        inside = AllReduce(params, node, node.size()) if node is not None else GradientSync()
        return LocalSGD(params, groups.dp_group, sync_every, inside)
    if agg.robust:
        return RobustAggregate(params, groups.dp_group, agg.kind, agg.param)
    if comp.kind in (CompressionKind.FP16, CompressionKind.BF16):
        hook = default_hooks.fp16_compress_hook if comp.kind == CompressionKind.FP16 else default_hooks.bf16_compress_hook
        return CompressedAllReduce(params, hook, groups.dp_group)
    if comp.kind == CompressionKind.POWERSGD:
        state = powerSGD_hook.PowerSGDState(
            process_group=groups.dp_group,
            matrix_approximation_rank=comp.rank or powersgd_rank,
            start_powerSGD_iter=powersgd_start_step,
            random_seed=0,  # the same random start on every replica
        )
        return CompressedAllReduce(params, powerSGD_hook.powerSGD_hook, state)
    if comp.gathers:
        return ErrorFeedbackSync(params, groups.dp_group, comp.kind, comp.fraction or 1.0)
    return AllReduce(params, groups.dp_group, dp)


__all__ = ["AllReduce", "BUCKET_CAP_BYTES", "CompressedAllReduce", "ExpertParallelSync", "FullyShard", "GradientSync",
           "check_expert_parallel", "wrap"]
