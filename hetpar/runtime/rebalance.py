"""Straggler-aware data shares: replicas that compute slowly get fewer samples.

[Note: straggler-aware shares]
A heterogeneous data-parallel plan fixes each replica's micro-batch size at plan time
(``replica_batch_shares``) from the device types' predicted speeds. When one replica
turns slow at run time (thermal throttling, a noisy neighbour), every step waits for
it. With ``rebalance_every`` N, every N steps each replica's compute seconds per sample
over those steps (the median of its forward and backward time, receives' waits left
out: runtime.timing, divided by its samples; the slowest rank of the replica counts)
are reduced over the world with MAX, and every rank splits the per-micro-batch total
anew in proportion to the replicas' speeds (``split_by_speed``): the same numbers on
every rank, so the same new shares. The global batch stays the same rows, in the same
order ([Note: data order and sharding] in runtime.shard), and each replica's loss
weight follows its share (``shard.loss_weight``), so the averaged gradient stays the
mean gradient of the whole batch: training is unchanged, only who computes which rows.

Limits: plans with one pipeline stage (a stage's micro-batch shapes are fixed at
start-up, so its pipeline buffers would not follow); a replica never gets fewer than
one sample per micro-batch; shares are not checkpointed (a resumed run starts from
the plan's) and may exceed the micro-batch size the planner checked for memory.
"""

from __future__ import annotations

import statistics
import sys
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from hetpar.runtime.distributed import Placement
from hetpar.runtime.model_file import ModelFile
from hetpar.runtime.shard import loss_weight, replica_batches, replica_rows
from hetpar.runtime.timing import StepTimer


def split_by_speed(total: int, seconds_per_sample: list[float], minimum: int = 1) -> list[int]:
    """``total`` samples split in proportion to each replica's speed (1 / seconds per sample).

    Each gets at least ``minimum``; floors first, then the samples left over one each to
    the largest remainders (the lowest replica among equals). The same inputs give the
    same split on every rank.
    """
    n = len(seconds_per_sample)
    if total < minimum * n:
        raise ValueError(f"{total} samples cannot give {n} replicas {minimum} each")
    speeds = [1.0 / max(s, 1e-12) for s in seconds_per_sample]
    spare = total - minimum * n
    ideal = [spare * v / sum(speeds) for v in speeds]
    shares = [int(x) for x in ideal]
    order = sorted(range(n), key=lambda r: (-(ideal[r] - shares[r]), r))
    for r in order[: spare - sum(shares)]:
        shares[r] += 1
    return [minimum + s for s in shares]


class ReplicaShares:
    """This run's micro-batch size per replica, moved every ``every`` steps by measured
    speed; see [Note: straggler-aware shares]. ``every`` 0 keeps the plan's."""

    def __init__(self, micro_batch_sizes: list[int], num_microbatches: int, me: Placement, *, every: int = 0,
                 announce: bool = False):
        self.sizes = list(micro_batch_sizes)
        self.num_microbatches, self.me, self.every, self.announce = num_microbatches, me, every, announce
        self._per_sample_s: list[float] = []  # this rank's compute seconds per sample of each step since the last move

    @property
    def rows(self) -> range:
        """This replica's rows of every global batch, now."""
        return replica_rows(self.sizes, self.num_microbatches, self.me.replica)

    @property
    def loss_weight(self) -> float:
        """The factor on this replica's loss under the current shares (``shard.loss_weight``)."""
        return loss_weight(self.sizes, self.me.replica)

    def batches(self, model_file: ModelFile, batch_size: int, seed: int, *, start_step: int = 0
                ) -> Iterator[tuple[tuple, torch.Tensor]]:
        """This replica's rows of global batches ``start_step + 1, ...``, following the shares as they move."""
        step = start_step
        while True:
            rows = self.rows
            for batch in replica_batches(model_file, batch_size, seed, rows=rows, start_step=step):
                yield batch
                step += 1
                if self.rows != rows:
                    break

    def observe(self, step: int, timer: StepTimer, executors: Mapping[int, object] | None = None) -> None:
        """After step ``step`` has stopped (``timer.stop``): record its compute time, and
        every ``every`` steps move the shares (collective over the world) and set each
        executor's ``loss_weight`` (a program without executors reads ``loss_weight``)."""
        if not self.every:
            return
        forward_s, backward_s = timer.steps[-1] if timer.steps else (0.0, 0.0)
        self._per_sample_s.append((forward_s + backward_s) / (self.sizes[self.me.replica] * self.num_microbatches))
        if step % self.every:
            return
        measured = torch.zeros(len(self.sizes), dtype=torch.float64, device=timer.device)
        measured[self.me.replica] = statistics.median(self._per_sample_s)
        self._per_sample_s = []
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # a replica is as slow as its slowest rank
        before, self.sizes = self.sizes, split_by_speed(sum(self.sizes), measured.tolist())
        for executor in (executors or {}).values():
            executor.loss_weight = self.loss_weight
        if self.announce and before != self.sizes:
            per_sample = ", ".join(f"{s * 1e3:.3g}" for s in measured.tolist())
            print(f"hetpar: step {step}: replica micro-batch sizes {before} -> {self.sizes} "
                  f"(ms per sample: {per_sample})", file=sys.stderr, flush=True)


__all__ = ["ReplicaShares", "split_by_speed"]
