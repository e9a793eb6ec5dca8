"""The gradient sync of a stage whose replicas differ in tensor-parallel degree.

[Note: replicas of different degrees]
On a mixed cluster a fast device type may run a stage at tp 1 while a slow one needs
tp 4 to keep pace (Sailor's plans do this: 3 A100 at tp 1 beside V100s at tp 4). Then
replica d of the stage holds each split parameter in ``len(ranks[d])`` pieces, and no
rank of one replica holds the same piece as a rank of another: the column all-reduce of
runtime.data_parallel has no columns. Instead, after the step's schedule:

1. every replica makes each gradient whole on every one of its ranks (a DTensor's
   ``full_tensor``: an all-gather over the replica's tp group; a part-laid Linear's rows
   put back in the user's order, ``PartLayout.to_user``), so each replica's first rank
   holds the replica's whole gradient in one layout common to every degree;
2. the first ranks ``ranks[*][0]`` (the stage's one data-parallel group,
   runtime.distributed) all-reduce the whole gradients, SUM then / dp as
   ``AllReduce`` does (replica d's loss weighs ``loss_weight`` of its share, so the
   weighted mean is the batch's gradient);
3. each first rank broadcasts the result over its tp group, and every rank keeps its
   own piece (``distribute_tensor`` without communication, in the parameter's
   placements; a part-laid Linear's rows in the rank's order, ``from_user``).

Parameters that tensor parallelism leaves whole (norms, biases of rowwise Linears) are
equal on every rank of a replica, so the first rank's stand for its replica. The bytes:
per rank, an all-gather of the stage's gradients, the all-reduce of the whole stage's
gradients over the first ranks, and a broadcast of them; planner.strategies.hetero_dp
prices the same three. Only plain data parallelism: ZeRO, compression, robust rules,
local SGD, expert and context parallelism keep one degree per stage (planner.plan).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hetpar.runtime.buckets import GradientSync, pack, unflatten
from hetpar.runtime.distributed import Groups, StageSpec
from hetpar.runtime.parts import layouts_of


class MixedDegreeSync(GradientSync):
    """Average a stage's gradients over replicas of different tensor-parallel degrees;
    see [Note: replicas of different degrees]."""

    def __init__(self, module: nn.Module, stage: StageSpec, groups: Groups):
        rank = dist.get_rank()
        replica = next(row for row in stage.ranks if rank in row)
        self.params = sorted(module.named_parameters(), key=lambda item: item[0])  # one order on every replica
        self.layouts = layouts_of(module)
        self.data_parallel = len(stage.ranks)
        self.degrees = [len(r) for r in stage.ranks]
        self.leaders = groups.dp_group if rank == replica[0] else None  # ranks[*][0]
        self.row = groups.tp_mesh.get_group() if groups.tp_mesh is not None else None
        self.row_leader = replica[0]

    def __str__(self) -> str:
        return f"all-reduce over {self.data_parallel} replicas of tensor-parallel degrees {self.degrees}, gradients whole"

    def reduce(self) -> None:
        named = [(name, p) for name, p in self.params if p.grad is not None]
        wholes = [self._whole(name, p.grad) for name, p in named]
        for bucket in pack((i, w.dtype, w.numel() * w.element_size()) for i, w in enumerate(wholes)):
            tensors = [wholes[i] for i in bucket]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if self.leaders is not None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.leaders)
            if self.row is not None:
                dist.broadcast(flat, src=self.row_leader, group=self.row)
            unflatten(flat, tensors, divisor=self.data_parallel)
        for (name, p), whole in zip(named, wholes):
            self._keep_piece(name, p, whole)

    def _whole(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` whole, in the user's layout (collective over the replica's tp group for a DTensor)."""
        if not isinstance(grad, DTensor):
            return grad.detach().clone()
        whole = grad.full_tensor()
        return self.layouts[name].to_user(whole) if name in self.layouts else whole

    def _keep_piece(self, name: str, param: nn.Parameter, whole: torch.Tensor) -> None:
        if not isinstance(param, DTensor):
            param.grad.copy_(whole)
            return
        if name in self.layouts:
            whole = self.layouts[name].from_user(whole)
        param.grad = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


__all__ = ["MixedDegreeSync"]
