"""Rank setup: the process group, where this rank sits in the plan, its groups and peers.

[Note: rank layout]
A program lists its stages as ``StageSpec``s. ``ranks[d][t]`` is the global rank of
data-parallel replica d, tensor-parallel index t of a stage. A rank belongs to exactly
one stage. Its tensor-parallel group is its replica's row ``ranks[d]``; its
data-parallel group is the column ``ranks[*][t]`` (the ranks that hold the same shard
of the same stage). ``dist.new_group`` is collective over the whole world, so every
rank creates every group, stage by stage, in the same order, and keeps its own.

A stage whose replicas differ in tensor-parallel degree (``len(ranks[d])``) has no
data-parallel columns: its one data-parallel group holds the replicas' first ranks
``ranks[*][0]`` ([Note: replicas of different degrees] in runtime/mixed_sync.py).

Pipeline peers are the ranks of the neighbouring stage in the same replica. When both
stages have the same tensor-parallel degree, index t talks to index t. Otherwise a
receiver with index t reads from the sender with index ``t % tp_sender`` (tensors
between stages are replicated over the tensor-parallel ranks, so any sender has
them), and each sender sends to every receiver that reads from it.

A stage with ZeRO (``zero_stage > 0``) and tensor parallelism also gets a 2-D
DeviceMesh ``(dp, tp)`` built from the same two groups: FSDP2 shards DTensor
parameters only when their tensor-parallel mesh and its data-parallel mesh are
slices of one parent mesh.

A stage with ``expert_parallel`` ep > 1 also gets, per tensor-parallel index t, its
expert-parallel groups ``ranks[g*ep + j][t]`` for j < ep (runs of ep consecutive
replicas; the group is a 1-D DeviceMesh whose coordinate j is the replica's d % ep) and
its expert-data-parallel groups ``ranks[d][t]`` for d = j, j + ep, j + 2 ep, ... (the
replicas that hold the same experts); see [Note: expert parallelism] in
runtime/experts.py.

A plan with ``context_parallel`` cp > 1 has ``data_parallel * cp`` rows: row d is data
replica ``d // cp`` (``Placement.data_replica``, whose rows of each batch it reads) and
context index ``d % cp`` (``Placement.context_index``). Its context-parallel group, per
tensor-parallel index t, is the run ``ranks[g*cp + j][t]`` for j < cp, a 1-D DeviceMesh
``cp`` (``Groups.cp_mesh``); the data-parallel column still holds all dp * cp rows. See
[Note: context parallelism] in runtime/context.py.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One pipeline stage of a compiled plan (mirrors the plan's ``StagePlan``)."""

    layers: tuple[int, int]  # first and last layer index, inclusive
    device_type: str  # the plan's device type (informational; the runtime device comes from the backend)
    tensor_parallel: int
    ranks: list[list[int]]  # ranks[d][t]
    tp_sharding: dict[str, str] = field(default_factory=dict)  # module path -> "colwise" | "rowwise"
    tp_parts: dict[str, list[int]] = field(default_factory=dict)  # module path -> part sizes (runtime.parts)
    zero_stage: int = 0  # 0: all-reduce; 1-3: ZeRO through FSDP2 (runtime.data_parallel)
    recompute: str = "none"  # "none" | "selective" | "full" (runtime.recompute)
    expert_parallel: int = 1  # experts split over runs of this many replicas (runtime.experts)
    sequence_parallel: bool = False  # the residual stream sharded over the tp ranks' sequence (runtime.sequence)
    context_parallel: int = 1  # every sequence split over runs of this many replicas (runtime.context)
    offload: bool = False  # the ZeRO-3 shard in host memory (runtime.data_parallel, [Note: offload through FSDP2])

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks[0]) != self.tensor_parallel or not all(self.ranks):
            raise ValueError(f"stage with layers {self.layers}: replica 0 needs tensor_parallel({self.tensor_parallel}) "
                             f"ranks and every replica at least one")
        if self.mixed_degrees and (self.zero_stage or self.expert_parallel > 1 or self.context_parallel > 1
                                   or self.sequence_parallel or self.offload):
            raise ValueError(f"stage with layers {self.layers}: replicas of tensor-parallel degrees "
                             f"{[len(r) for r in self.ranks]} run with ZeRO 0 and without ep, cp, sp or offload")
        if self.expert_parallel < 1 or len(self.ranks) % self.expert_parallel:
            raise ValueError(f"stage with layers {self.layers}: expert_parallel({self.expert_parallel}) must divide its "
                             f"{len(self.ranks)} data-parallel replicas")
        if self.context_parallel < 1 or len(self.ranks) % self.context_parallel:
            raise ValueError(f"stage with layers {self.layers}: context_parallel({self.context_parallel}) must divide "
                             f"its {len(self.ranks)} rows of ranks")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(f"stage with layers {self.layers}: sequence_parallel needs tensor_parallel > 1")
        if self.offload and self.zero_stage != 3:
            raise ValueError(f"stage with layers {self.layers}: offload needs zero_stage 3")


    def degree(self, replica: int) -> int:
        """Replica ``replica``'s tensor-parallel degree: ``len(ranks[replica])``."""
        return len(self.ranks[replica])

    @property
    def mixed_degrees(self) -> bool:
        """Whether the replicas differ in tensor-parallel degree ([Note: replicas of different degrees] in
        runtime/mixed_sync.py)."""
        return len({len(r) for r in self.ranks}) > 1


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one rank sits: its stage, data-parallel replica and tensor-parallel index."""

    rank: int
    stage: int
    replica: int  # the row of ranks[d][t]: with context parallelism, not the data replica
    tp_index: int
    context_parallel: int = 1  # the plan's cp: rows per data replica

    @property
    def data_replica(self) -> int:
        """The data-parallel replica whose rows of each batch this rank reads."""
        return self.replica // self.context_parallel

    @property
    def context_index(self) -> int:
        """This rank's index in its context-parallel group (0 without context parallelism)."""
        return self.replica % self.context_parallel


@dataclass(frozen=True, kw_only=True)
class Peers:
    """The ranks a stage exchanges pipeline tensors with; see [Note: rank layout]."""

    recv_activations_from: int | None  # previous stage; None on the first stage
    send_activations_to: tuple[int, ...]  # next stage
    recv_grads_from: int | None  # next stage; None on the last stage
    send_grads_to: tuple[int, ...]  # previous stage


@dataclass(frozen=True, kw_only=True)
class Groups:
    """This rank's process groups; None where the group would hold only this rank."""

    tp_mesh: DeviceMesh | None  # 1-D mesh over ranks[d] of this rank's stage
    dp_group: dist.ProcessGroup | None  # ranks[*][t] of this rank's stage
    # mesh over the dp group (a slice of the (dp, tp) mesh under ZeRO with tp > 1); over this rank alone for a
    # stage that offloads over one row (dp_group None)
    dp_mesh: DeviceMesh | None = None
    dp_node_group: dist.ProcessGroup | None = None  # the dp group's ranks on this rank's node, when asked for
    ep_mesh: DeviceMesh | None = None  # 1-D mesh over this rank's expert-parallel group (expert_parallel > 1)
    expert_dp_group: dist.ProcessGroup | None = None  # the replicas holding this rank's experts, when more than one
    cp_mesh: DeviceMesh | None = None  # 1-D mesh over this rank's context-parallel group (context_parallel > 1)


def init_distributed(timeout_s: float, *, accelerator: bool = True) -> torch.device:
    """Join the process group torchrun describes: nccl with one GPU per local rank when
    CUDA is available and ``accelerator`` (the plan's device types are not all CPUs;
    runtime.devices.needs_accelerator), gloo on CPU otherwise. See [Note: restarted workers].

    Returns:
        The device this rank computes on.
    """
    if accelerator and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = _store_of_this_attempt(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
    return device


# [Note: restarted workers]
# Under torchrun the workers meet in the agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE),
# and torch 2.13 keeps that store, keys and all, when ``--max-restarts`` restarts the
# workers. Process groups publish their addresses under fixed keys, so a restarted
# worker can read the address of the worker it replaced and fail to connect (measured:
# "Gloo connectFullMesh failed ... Connection refused" in about half of the restarts,
# with static and c10d rendezvous alike). Each attempt therefore meets under its own
# key prefix, from TORCHELASTIC_RESTART_COUNT.
def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"hetpar/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)


def locate(stages: list[StageSpec], rank: int) -> Placement:
    """This rank's stage, replica and tensor-parallel index.

    Raises:
        ValueError: no stage lists the rank.
    """
    for s, stage in enumerate(stages):
        for d, replica in enumerate(stage.ranks):
            if rank in replica:
                return Placement(rank=rank, stage=s, replica=d, tp_index=replica.index(rank),
                                 context_parallel=stage.context_parallel)
    raise ValueError(f"rank {rank} is in no stage of this program")


def build_groups(stages: list[StageSpec], me: Placement, device: torch.device, *, ranks_per_node: int | None = None
                 ) -> Groups:
    """Create every stage's tensor- and data-parallel groups on every rank (collective),
    keeping this rank's, and the expert-parallel ones of stages with ``expert_parallel`` > 1
    and the context-parallel ones of stages with ``context_parallel`` > 1;
    see [Note: rank layout]. Given ``ranks_per_node`` (global ranks ``n * ranks_per_node
    ...`` share node n), also each data-parallel group's ranks on one node (local SGD
    inside a node: runtime.local_sgd)."""
    groups = _context_groups(stages, me, device, _expert_groups(stages, me, device, _stage_groups(stages, me, device)))
    if ranks_per_node is None:
        return groups
    node_group = None
    for s, stage in enumerate(stages):
        if stage.mixed_degrees:
            continue  # synced by runtime.mixed_sync, over the whole stage every step
        for t in range(stage.tensor_parallel):
            column = [replica[t] for replica in stage.ranks]
            for node in sorted({r // ranks_per_node for r in column}):
                inside = [r for r in column if r // ranks_per_node == node]
                if len(inside) > 1:
                    group = dist.new_group(inside)
                    if (s, t) == (me.stage, me.tp_index) and me.rank in inside:
                        node_group = group
    return replace(groups, dp_node_group=node_group)


def _stage_groups(stages: list[StageSpec], me: Placement, device: torch.device) -> Groups:
    tp_group = dp_group = alone = None
    for s, stage in enumerate(stages):
        for d, replica in enumerate(stage.ranks):
            if len(replica) > 1:
                group = dist.new_group(replica)
                if (s, d) == (me.stage, me.replica):
                    tp_group = group
        if stage.mixed_degrees:  # one group of the replicas' first ranks: [Note: replicas of different degrees]
            leaders = [replica[0] for replica in stage.ranks]
            group = dist.new_group(leaders)
            if s == me.stage and me.tp_index == 0:
                dp_group = group
            continue
        for t in range(stage.tensor_parallel):
            column = [replica[t] for replica in stage.ranks]
            if len(column) > 1:
                group = dist.new_group(column)
                if (s, t) == (me.stage, me.tp_index):
                    dp_group = group
            elif stage.offload:  # ZeRO-3 over one row: FSDP2 over a mesh of this rank alone
                group = dist.new_group(column)
                if (s, t) == (me.stage, me.tp_index):
                    alone = group
    mine = stages[me.stage]
    column = [replica[me.tp_index] for replica in mine.ranks if me.tp_index < len(replica)]
    fsdp_group = dp_group if dp_group is not None else alone  # what FSDP2 shards over (alone: no dp group)
    if tp_group is not None and fsdp_group is not None and mine.zero_stage > 0:
        mesh = DeviceMesh.from_group(
            [fsdp_group, tp_group], device.type, mesh=torch.tensor(mine.ranks), mesh_dim_names=("dp", "tp")
        )
        return Groups(tp_mesh=mesh["tp"], dp_group=dp_group, dp_mesh=mesh["dp"])
    tp_mesh = DeviceMesh.from_group(tp_group, device.type, mesh=list(mine.ranks[me.replica])) if tp_group else None
    dp_mesh = DeviceMesh.from_group(fsdp_group, device.type, mesh=column) if fsdp_group else None
    return Groups(tp_mesh=tp_mesh, dp_group=dp_group, dp_mesh=dp_mesh)


def _expert_groups(stages: list[StageSpec], me: Placement, device: torch.device, groups: Groups) -> Groups:
    """``groups`` with this rank's expert-parallel mesh and expert-data-parallel group
    (collective: every rank creates every stage's); see [Note: rank layout]."""
    ep_mesh = expert_dp_group = None
    for s, stage in enumerate(stages):
        ep = stage.expert_parallel
        if ep == 1:
            continue
        for t in range(stage.tensor_parallel):
            column = [replica[t] for replica in stage.ranks]
            for g in range(0, len(column), ep):
                members = column[g : g + ep]
                group = dist.new_group(members)
                if (s, t) == (me.stage, me.tp_index) and me.rank in members:
                    ep_mesh = DeviceMesh.from_group(group, device.type, mesh=members, mesh_dim_names=("ep",))
            for j in range(ep):
                members = column[j::ep]
                if len(members) > 1:
                    group = dist.new_group(members)
                    if (s, t) == (me.stage, me.tp_index) and me.rank in members:
                        expert_dp_group = group
    return replace(groups, ep_mesh=ep_mesh, expert_dp_group=expert_dp_group)


def _context_groups(stages: list[StageSpec], me: Placement, device: torch.device, groups: Groups) -> Groups:
    """``groups`` with this rank's context-parallel mesh (collective: every rank creates
    every stage's); see [Note: rank layout]."""
    cp_mesh = None
    for s, stage in enumerate(stages):
        cp = stage.context_parallel
        if cp == 1:
            continue
        for t in range(stage.tensor_parallel):
            column = [replica[t] for replica in stage.ranks]
            for g in range(0, len(column), cp):
                members = column[g : g + cp]
                group = dist.new_group(members)
                if (s, t) == (me.stage, me.tp_index) and me.rank in members:
                    cp_mesh = DeviceMesh.from_group(group, device.type, mesh=members, mesh_dim_names=("cp",))
    return replace(groups, cp_mesh=cp_mesh)


def peers_of(stages: list[StageSpec], me: Placement) -> Peers:
    """The pipeline peers of this rank; see [Note: rank layout]."""
    tp = stages[me.stage].degree(me.replica)
    prev = stages[me.stage - 1] if me.stage > 0 else None
    nxt = stages[me.stage + 1] if me.stage + 1 < len(stages) else None

    def reader(stage: StageSpec | None) -> int | None:
        return None if stage is None else stage.ranks[me.replica][me.tp_index % stage.degree(me.replica)]

    def readers_of_me(stage: StageSpec | None) -> tuple[int, ...]:
        if stage is None:
            return ()
        return tuple(r for t, r in enumerate(stage.ranks[me.replica]) if t % tp == me.tp_index)

    return Peers(
        recv_activations_from=reader(prev),
        send_activations_to=readers_of_me(nxt),
        recv_grads_from=reader(nxt),
        send_grads_to=readers_of_me(prev),
    )


def shutdown() -> None:
    """Leave the process group cleanly: collect garbage (a process group object alive at
    exit can abort a rank), wait for every rank, then destroy the group."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


__all__ = [
    "Groups",
    "Peers",
    "Placement",
    "StageSpec",
    "build_groups",
    "init_distributed",
    "locate",
    "peers_of",
    "shutdown",
]
