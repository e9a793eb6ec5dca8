"""Local SGD: replicas that step on their own gradients and average every K steps.

[Note: local SGD]
With ``sync_every`` K > 1 the replicas of a stage do not all-reduce gradients each
step. Each steps its optimizer on the gradient of its own share of the batch, and
after every K-th step (and after the run's last) all replicas average their
parameters and their optimizer state (AdamW's moments; the step count is the same
everywhere), so they leave each sync as identical copies (Lin et al., "Don't Use Large
Mini-Batches, Use Local SGD", ICLR 2020, average parameters only; averaging the state
too keeps a checkpoint taken at a sync step exact whichever replica writes it). The
gradient all-reduce of every step becomes a parameter-and-state all-reduce once per K
steps. With ``sync_scope`` "node", replicas on one node still all-reduce gradients
every step (they stay identical copies) and only the average across nodes waits K
steps. K = 1 is plain data parallelism (runtime.data_parallel never builds this then).

This changes the algorithm: between syncs the replicas follow different trajectories,
and the result after K steps is not K steps of large-batch SGD.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hetpar.runtime.buckets import GradientSync, flatten, local, pack, unflatten


class LocalSGD(GradientSync):
    """Average parameters and optimizer state over ``group`` every ``every`` steps; see [Note: local SGD].

    Args:
        node_sync: the per-step gradient sync inside this rank's node (a no-op
            ``GradientSync`` under sync_scope "all").
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, every: int, node_sync: GradientSync):
        self.params, self.group, self.every, self.node_sync = list(params), group, every, node_sync

    def __str__(self) -> str:
        inside = "" if type(self.node_sync) is GradientSync else f", {self.node_sync} inside the node every step"
        return f"local SGD: parameters and optimizer state averaged over {self.group.size()} replicas every {self.every} steps{inside}"

    def before_backward(self, last: bool) -> None:
        self.node_sync.before_backward(last)

    def reduce(self) -> None:
        self.node_sync.reduce()

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, last: bool) -> None:
        if step % self.every and not last:
            return
        with torch.no_grad():
            tensors = [local(p) for p in self.params] + _state_tensors(optimizer)
            for bucket in pack((t, t.dtype, t.numel() * t.element_size()) for t in tensors):
                flat = flatten(bucket)
                dist.all_reduce(flat, group=self.group)
                unflatten(flat, bucket, divisor=self.group.size())


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's floating-point per-parameter state but the step count, in one order on every replica."""
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            found += [local(state[k]) for k in sorted(state)
                      if k != "step" and torch.is_tensor(state[k]) and state[k].is_floating_point()]
    return found


__all__ = ["LocalSGD"]
