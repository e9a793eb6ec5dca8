"""Byzantine-robust aggregation of data-parallel gradients.

[Note: robust aggregation]
A mean lets one replica with corrupted gradients (a faulty device, a bad node) move the
average anywhere. The rules here bound its influence, at the price of gathering every
replica's gradient instead of all-reducing a sum:

- ``trimmed-mean:B``: per coordinate, drop the B largest and B smallest of the dp
  values and average the rest (Yin et al., ICML 2018); needs dp >= 2B + 1. B = 0 is the
  mean.
- ``median``: per coordinate, the median (the mean of the two middle values for even dp).
- ``krum:F``: every replica scores each replica by the summed squared distance from its
  gradient to its dp - F - 2 nearest others (Krum, Blanchard et al., NeurIPS 2017), and
  the dp - F lowest-scoring gradients are averaged (Multi-Krum, El Mhamdi et al., ICML
  2018: one gradient alone, Krum's pick, trains on a dp-th of the batch). Defined for
  dp >= F + 3; proven to resist F bad replicas for dp > 2F + 2. Distances cover the whole
  model: each rank's bucket distances are summed over every stage and tensor-parallel
  shard (one all-reduce of a dp x dp matrix over the world), so every rank picks the
  same replicas; their gradients are then averaged by an all-reduce in which the others
  contribute zeros.

Per bucket, replicas all-gather their flat gradients (dp times a bucket's bytes held at
once). All rules but the mean change the algorithm: with honest replicas the trimmed
mean and median differ from the mean gradient, and Krum uses one replica's gradient.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hetpar.runtime.buckets import GradientSync, all_gather_rows, flatten, grad_buckets, local, unflatten
from hetpar.vocabulary import AggregationKind


def coordinate_rule(stacked: torch.Tensor, kind: str, trim: int = 0) -> torch.Tensor:
    """The trimmed mean (``trim`` per side) or median of (replicas, n) per coordinate."""
    n = stacked.shape[0]
    if kind == AggregationKind.TRIMMED_MEAN:
        if trim == 0:
            return stacked.sum(0).div_(n)
        return stacked.sort(0).values[trim : n - trim].sum(0).div_(n - 2 * trim)
    if kind == AggregationKind.MEDIAN:
        ordered = stacked.sort(0).values
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    raise ValueError(f"unknown coordinate-wise rule {kind!r}")


def squared_distances(stacked: torch.Tensor) -> torch.Tensor:
    """(replicas, replicas) squared Euclidean distances between the rows of (replicas, n), in float64."""
    n = stacked.shape[0]
    out = torch.zeros((n, n), dtype=torch.float64, device=stacked.device)
    for i in range(n):
        for j in range(i + 1, n):  # one pair at a time: memory of one row, not n * n rows
            out[i, j] = out[j, i] = (stacked[i].double() - stacked[j].double()).square().sum()
    return out


def krum_choice(distances: torch.Tensor, bad: int) -> list[int]:
    """The replicas Multi-Krum averages, from a (replicas, replicas) squared-distance matrix, tolerating ``bad``.

    Each replica's score is the sum of its ``replicas - bad - 2`` smallest distances to
    the others; the ``replicas - bad`` lowest scores are chosen (the lower index among
    equals), in ascending order of index.
    """
    n = distances.shape[0]
    nearest = n - bad - 2
    others = distances + torch.diag(torch.full((n,), float("inf"), dtype=distances.dtype))
    scores = others.sort(1).values[:, :nearest].sum(1).tolist()
    return sorted(sorted(range(n), key=lambda r: (scores[r], r))[: n - bad])


class RobustAggregate(GradientSync):
    """A robust rule over the data-parallel group; see [Note: robust aggregation]."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, kind: str, param: int):
        self.params, self.group, self.kind, self.param = list(params), group, kind, param

    def __str__(self) -> str:
        rule = {AggregationKind.TRIMMED_MEAN: f"trimmed mean (B={self.param})", AggregationKind.MEDIAN: "coordinate-wise median",
                AggregationKind.KRUM: f"Multi-Krum (F={self.param})"}[self.kind]
        return f"{rule} of {self.group.size()} replicas' gathered gradients"

    def reduce(self) -> None:
        buckets = [(bucket, [local(p.grad) for p in bucket]) for bucket in grad_buckets(self.params)]
        if self.kind == AggregationKind.KRUM:
            self._krum(buckets)
            return
        for _, grads in buckets:
            unflatten(coordinate_rule(all_gather_rows(flatten(grads), self.group), self.kind, self.param), grads)

    def _krum(self, buckets: list[tuple[list[nn.Parameter], list[torch.Tensor]]]) -> None:
        n = self.group.size()
        distances = torch.zeros((n, n), dtype=torch.float64, device=self._device())
        for _, grads in buckets:
            distances += squared_distances(all_gather_rows(flatten(grads), self.group))
        dist.all_reduce(distances)  # every stage and shard of each replica: one choice on every rank
        chosen = krum_choice(distances, self.param)
        mine = dist.get_rank(self.group) in chosen
        for _, grads in buckets:
            flat = flatten(grads) if mine else torch.zeros(sum(g.numel() for g in grads), dtype=grads[0].dtype,
                                                            device=grads[0].device)
            dist.all_reduce(flat, group=self.group)
            unflatten(flat, grads, divisor=len(chosen))

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")


__all__ = ["RobustAggregate", "coordinate_rule", "krum_choice", "squared_distances"]
