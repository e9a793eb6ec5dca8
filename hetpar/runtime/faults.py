"""Faults injected on purpose, for tests of what guards against them: a replica that
sends garbage gradients (runtime.robust) and one that computes slowly (runtime.rebalance).

[Note: test faults]
A generated program holds no test hooks. A test asks for faults through the environment
of the processes it starts, which ``data_parallel.wrap`` reads (``from_environment``)
when it sets up a stage's replicas:

    HETPAR_TEST_FAULTS="bad-gradients=3"          rank 3 sends noise (std 100) as its gradients
    HETPAR_TEST_FAULTS="slowdown=1:0.005"         rank 1 sleeps 5 ms per sample in each forward
    HETPAR_TEST_FAULTS="bad-gradients=3,slowdown=1:0.005"   both

A run without the variable is untouched; a value that does not read this way stops the
program at start-up with a ValueError naming the variable.
"""

from __future__ import annotations

import os
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


FAULTS_ENV = "HETPAR_TEST_FAULTS"


def from_environment(module: nn.Module, rank: int) -> None:
    """Make this rank faulty if ``HETPAR_TEST_FAULTS`` names it; see [Note: test faults].

    Raises:
        ValueError: the variable is set but does not read as the Note says.
    """
    text = os.environ.get(FAULTS_ENV, "").strip()
    if text:
        inject(module, rank, **parse_faults(text))


def parse_faults(text: str) -> dict:
    """``bad-gradients=RANK,slowdown=RANK:SECONDS`` (either, or both) as ``inject``'s keywords."""
    faults: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        try:
            if key == "bad-gradients":
                faults["bad_gradients"] = int(value)
            elif key == "slowdown":
                rank, _, seconds = value.partition(":")
                faults["slowdown"] = (int(rank), float(seconds))
                if faults["slowdown"][0] < 0 or not faults["slowdown"][1] >= 0:
                    raise ValueError
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{FAULTS_ENV}={text!r}: expected bad-gradients=RANK and/or slowdown=RANK:SECONDS, "
                             f"comma-separated (e.g. slowdown=1:0.005)") from None
    return faults


def _noise_like(grad: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    shape = grad.to_local().shape if isinstance(grad, DTensor) else grad.shape
    noise = (torch.randn(shape, generator=generator) * BAD_GRADIENT_STD).to(grad.dtype)
    if isinstance(grad, DTensor):
        return DTensor.from_local(noise.to(grad.to_local().device), grad.device_mesh, grad.placements)
    return noise.to(grad.device)


def _rows(args: tuple) -> int:
    """The micro-batch's rows: the first dimension of the first tensor input."""
    return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), 0)


__all__ = ["BAD_GRADIENT_STD", "FAULTS_ENV", "from_environment", "inject", "parse_faults"]
