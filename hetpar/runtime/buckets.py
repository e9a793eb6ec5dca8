"""Gradients in buckets: the flat buffers every data-parallel sync method reduces, and the
base of those methods (``GradientSync``). runtime.data_parallel picks a method per stage.

Buckets hold at most ``BUCKET_CAP_BYTES`` of one dtype, in parameter order, and keep
their layout from step to step (every replica runs the same graph, so the same
parameters have gradients every step), which per-bucket state (PowerSGD's and top-k's
error feedback) relies on.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class GradientSync:
    """Nothing to agree on: the stage has one replica."""

    def __str__(self) -> str:
        return "one replica"

    def before_backward(self, last: bool) -> None:
        """Called before each backward of a step; ``last`` for the step's final one."""

    def reduce(self) -> None:
        """Called after the step's schedule, before the optimizer step."""

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, last: bool) -> None:
        """Called after the optimizer step of step ``step`` (1-based); ``last`` on the run's final step."""


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_buckets(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients, grouped by gradient dtype into buckets of at most
    ``BUCKET_CAP_BYTES`` (a larger parameter gets a bucket of its own), in order."""
    grads = ((p, local(p.grad)) for p in params if p.grad is not None)
    return pack((p, g.dtype, g.numel() * g.element_size()) for p, g in grads)


def pack(entries: Iterable[tuple[nn.Parameter, torch.dtype, int]]) -> list[list[nn.Parameter]]:
    """(parameter, dtype, bytes) in order, packed per dtype into buckets of at most
    ``BUCKET_CAP_BYTES`` (a larger parameter gets a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    open_bucket: dict[torch.dtype, tuple[list[nn.Parameter], int]] = {}
    for p, dtype, nbytes in entries:
        bucket, size = open_bucket.get(dtype, (None, 0))
        if bucket is None or size + nbytes > BUCKET_CAP_BYTES:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(p)
        open_bucket[dtype] = (bucket, size + nbytes)
    return buckets


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every group member's ``t`` stacked in group order: (members, *t.shape).

    torch 2.13 names this collective ``all_gather_single`` (``all_gather_into_tensor``
    is deprecated there); older releases have only the latter. The output is gathered
    flat, the layout gloo requires.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = torch.empty(group.size() * t.numel(), dtype=t.dtype, device=t.device)
    gather(out, t.contiguous().reshape(-1), group=group)
    return out.view(group.size(), *t.shape)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated into one new flat tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor], divisor: int = 1) -> None:
    """Copy ``flat`` back into ``tensors``, divided by ``divisor`` on the way (one pass)."""
    offset = 0
    for t in tensors:
        part = flat[offset : offset + t.numel()].view_as(t)
        if divisor == 1:
            t.copy_(part)
        else:
            torch.div(part, divisor, out=t)
        offset += t.numel()


__all__ = ["BUCKET_CAP_BYTES", "GradientSync", "all_gather_rows", "flatten", "grad_buckets", "local", "pack", "unflatten"]
