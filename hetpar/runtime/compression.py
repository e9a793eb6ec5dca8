"""Top-k and sign compression of data-parallel gradients, with error feedback.

[Note: error feedback]
A compressor that drops part of a gradient (top-k keeps the largest fraction F of each
bucket's elements; sign keeps one bit per element and the bucket's mean magnitude)
would lose that part for good. With error feedback each replica keeps what it did not
send as a residual and adds it to the next step's gradient before compressing, so every
element's mass is sent eventually (Seide et al., Interspeech 2014, for 1-bit SGD;
Stich et al., NeurIPS 2018, for top-k; Karimireddy et al., ICML 2019, for scaled sign).
The residual is per replica and per bucket (buckets keep their layout from step to
step: runtime.buckets) and is not checkpointed: a resumed run starts it at zero.

Neither payload adds up in an all-reduce (top-k's indices differ per replica; packed
bits do not sum), so replicas all-gather them and each decodes and averages all
``dp`` payloads: top-k sends F * (4-byte value + 4-byte index) per element, sign 1/8
byte per element plus 4 bytes per bucket. planner costs them as all-gathers of those
sizes. At F = 1 top-k sends every element in order with no residual: plain all-reduce.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hetpar.runtime.buckets import GradientSync, all_gather_rows, flatten, grad_buckets, local, unflatten
from hetpar.vocabulary import CompressionKind

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32)


def topk_compress(flat: torch.Tensor, residual: torch.Tensor | None, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude elements of ``flat + residual`` and what is left.

    Returns:
        (indices as int32, their values, the new residual: ``flat + residual`` with the
        sent elements zeroed). With ``k`` equal to the length, indices are 0..n-1.
    """
    corrected = flat.clone() if residual is None else flat + residual
    if k >= corrected.numel():
        indices = torch.arange(corrected.numel(), device=corrected.device)
    else:
        indices = corrected.abs().topk(k, sorted=False).indices
    values = corrected[indices]
    corrected[indices] = 0
    return indices.to(torch.int32), values, corrected


def topk_decompress(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The mean over replicas of their sparse payloads: ``indices`` and ``values`` are
    (replicas, k); replica by replica in order, each element summed then / replicas."""
    dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
    for idx, vals in zip(indices, values):
        dense.index_add_(0, idx.long(), vals)
    return dense.div_(indices.shape[0])


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as uint8, 8 elements per byte (element i at bit i % 8), zero-padded."""
    padded = torch.zeros(math.ceil(bits.numel() / 8) * 8, dtype=torch.int32, device=bits.device)
    padded[: bits.numel()] = bits.to(torch.int32)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """``pack_bits`` undone: the first ``numel`` bits as a bool tensor."""
    bits = (packed.to(torch.int32).unsqueeze(-1) & _BIT_WEIGHTS.to(packed.device)) != 0
    return bits.reshape(-1)[:numel]


def sign_compress(flat: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled sign of ``flat + residual``: each element becomes +s or -s, s its mean magnitude.

    Returns:
        (packed sign bits, 1 = non-negative; the scale s as a 1-element tensor; the new
        residual: ``flat + residual`` minus what the bits and s decode to).
    """
    corrected = flat if residual is None else flat + residual
    scale = corrected.abs().mean().reshape(1)
    positive = corrected >= 0
    decoded = torch.where(positive, scale, -scale)
    return pack_bits(positive), scale, corrected - decoded


def sign_decompress(packed: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The mean over replicas of their decoded signs: ``packed`` is (replicas, bytes), ``scales`` (replicas, 1)."""
    dense = torch.zeros(numel, dtype=scales.dtype, device=scales.device)
    for bits, scale in zip(packed, scales):
        dense += torch.where(unpack_bits(bits, numel), scale, -scale)
    return dense.div_(packed.shape[0])


class ErrorFeedbackSync(GradientSync):
    """Top-k (``fraction``) or sign compression over the data-parallel group; see [Note: error feedback]."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, kind: str, fraction: float = 1.0):
        self.params, self.group, self.kind, self.fraction = list(params), group, kind, fraction
        self.residuals: dict[int, torch.Tensor] = {}  # bucket index -> what this replica has not sent yet

    def __str__(self) -> str:
        what = f"top-{self.fraction:g}" if self.kind == CompressionKind.TOPK else "scaled sign"
        return f"{what} compression with error feedback, all-gathered over {self.group.size()} replicas"

    def reduce(self) -> None:
        for i, bucket in enumerate(grad_buckets(self.params)):
            grads = [local(p.grad) for p in bucket]
            flat = flatten(grads)
            if self.kind == CompressionKind.TOPK:
                k = max(1, math.ceil(self.fraction * flat.numel()))
                indices, values, self.residuals[i] = topk_compress(flat, self.residuals.get(i), k)
                dense = topk_decompress(all_gather_rows(indices, self.group), all_gather_rows(values, self.group), flat.numel())
            else:
                bits, scale, self.residuals[i] = sign_compress(flat, self.residuals.get(i))
                dense = sign_decompress(all_gather_rows(bits, self.group), all_gather_rows(scale, self.group), flat.numel())
            unflatten(dense, grads)


__all__ = ["ErrorFeedbackSync", "pack_bits", "sign_compress", "sign_decompress", "topk_compress", "topk_decompress",
           "unpack_bits"]
