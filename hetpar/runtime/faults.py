"""Faults injected on purpose, to test what guards against them: a replica that sends
garbage gradients (runtime.robust) and one that computes slowly (runtime.rebalance).
The program's ``--inject-bad-gradients RANK`` and ``--inject-slowdown RANK:SECONDS``
set them; a run without those options is untouched.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

BAD_GRADIENT_STD = 100.0  # a faulty replica's gradients: normal noise this wide, far above any trained gradient


def inject(module: nn.Module, rank: int, *, bad_gradients: int | None = None,
           slowdown: tuple[int, float] | None = None) -> None:
    """Make this rank faulty if the options name it.

    Args:
        module: this rank's stage module (or its chunks).
        rank: this process's global rank.
        bad_gradients: the rank whose every gradient is replaced by noise of
            ``BAD_GRADIENT_STD`` (a fresh draw per backward, seeded by the rank).
        slowdown: (rank, seconds): that rank sleeps ``seconds`` per sample in each
            forward of its stage, counted in its compute time as a slow device's would be.
    """
    if bad_gradients == rank:
        generator = torch.Generator().manual_seed(rank)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, gen=generator: _noise_like(g, gen))
    if slowdown is not None and slowdown[0] == rank:
        seconds = slowdown[1]
        module.register_forward_pre_hook(lambda _, args: time.sleep(seconds * _rows(args)))
        for child in module.children() if isinstance(module, nn.ModuleList) else ():
            child.register_forward_pre_hook(lambda _, args: time.sleep(seconds * _rows(args)))


def _noise_like(grad: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    shape = grad.to_local().shape if isinstance(grad, DTensor) else grad.shape
    noise = (torch.randn(shape, generator=generator) * BAD_GRADIENT_STD).to(grad.dtype)
    if isinstance(grad, DTensor):
        return DTensor.from_local(noise.to(grad.to_local().device), grad.device_mesh, grad.placements)
    return noise.to(grad.device)


def _rows(args: tuple) -> int:
    """The micro-batch's rows: the first dimension of the first tensor input."""
    return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), 0)


__all__ = ["BAD_GRADIENT_STD", "inject"]
