"""Microbenchmarks of one worker's device: matmuls, memory, per-op overhead, optimizer, attention.

Each function measures one thing and returns raw numbers (seconds, bytes, FLOPs); the
fitting into a device profile lives in cost_models/calibrate.py, so that it can be
tested on synthetic measurements. Timings are medians over repeats ([Note: profiler
timing] in profiler/clock.py): the machine may be shared, and a median ignores the
neighbour who ran a build during one repeat. ``Sizes`` says how big each benchmark is
on a CPU and on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from hetpar.profiler.clock import CPU, DTYPES, median_time_s
from hetpar.vocabulary import Optimizer, Precision


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How big the microbenchmarks are on one kind of device: big enough that a GPU's
    kernels are not launch-bound and its caches do not hold the buffers, small enough
    that a CPU profile takes a minute."""

    region_flops: float  # small matmuls repeat in one timed region until it holds this many FLOPs
    copy_bytes: int  # the buffer copied for the memory bandwidth
    copy_inner: int  # copies per timed region
    elementwise_numel: int
    optimizer_numel: int  # elements of each of the optimizer probe's 4 large tensors
    rows_curves: bool  # the fp32 Linear row curves (CPU: [Note: matmul rows] in planner.capture)


SIZES = {
    "cpu": Sizes(region_flops=4e7, copy_bytes=64 << 20, copy_inner=1, elementwise_numel=1 << 22,
                 optimizer_numel=1 << 20, rows_curves=True),
    # 1 GiB buffers are 20 times an H200's 50 MiB L2; the row curves are fp32 matmuls of
    # 512 columns, which on a GPU time kernel launches (charged as op_overhead_s) and say
    # nothing of the bf16 kernels a GPU program runs.
    "cuda": Sizes(region_flops=1e12, copy_bytes=1 << 30, copy_inner=10, elementwise_numel=1 << 28,
                  optimizer_numel=1 << 25, rows_curves=False),
}


def matmul_times(sizes: list[int], dtype: str, *, repeats: int, device: torch.device = CPU,
                 region_flops: float = 4e7) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of an ``n x n @ n x n`` matmul for each n in ``sizes``.

    ``dtype`` "tf32" is fp32 tensors with TF32 tensor cores allowed (float32 matmul
    precision "high", on a GPU that has them); "fp32" times them at "highest", torch's
    default.
    """
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == Precision.TF32 else "highest")
    try:
        out = []
        for n in sizes:
            a = torch.randn(n, n, dtype=DTYPES[dtype], device=device)
            b = torch.randn(n, n, dtype=DTYPES[dtype], device=device)
            flops = 2.0 * n**3
            inner = max(1, int(region_flops // flops))
            out.append((flops, median_time_s(lambda: torch.mm(a, b), repeats=repeats, device=device, inner=inner)))
        return out
    finally:
        torch.set_float32_matmul_precision(previous)


MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the row counts of ``matmul_row_times``
# K = N of the rows curve (cost_models/compute.py ROWS_CURVE_WIDTH) and of the narrow one.
MATMUL_WIDTH, MATMUL_NARROW_WIDTH = 512, 128


def matmul_row_times(rows: tuple[int, ...] = MATMUL_ROWS, *, width: int = MATMUL_WIDTH,
                     repeats: int) -> dict[str, list[list[float]]]:
    """Seconds of a Linear's matmuls at each row count M, fp32 on the CPU, K = N =
    ``width``, laid out as nn.Linear runs them (the weight N x K, a bias).

    ``forward``: ``x @ w.T + b`` (addmm). ``backward``: the input gradient ``g @ w`` and
    the weight gradient ``g.T @ x`` together. cost_models/calibrate.py divides the rates
    by the fitted peak ([Note: matmul rows] in planner.capture).

    Returns:
        ``{"forward": [[M, flops, s], ...], "backward": [[M, flops, s], ...]}``.
    """
    k = n = width
    w, b = torch.randn(n, k), torch.randn(n)
    out: dict[str, list[list[float]]] = {"forward": [], "backward": []}
    for m in rows:
        x, g = torch.randn(m, k), torch.randn(m, n)
        inner = max(1, int(4e6 // (m * k * n)))
        fwd = median_time_s(lambda: torch.nn.functional.linear(x, w, b), repeats=repeats, inner=inner)
        bwd = median_time_s(lambda: (torch.mm(g, w), torch.mm(g.t(), x)), repeats=repeats, inner=inner)
        out["forward"].append([float(m), 2.0 * m * k * n, fwd])
        out["backward"].append([float(m), 4.0 * m * k * n, bwd])
    return out


def copy_bandwidth(nbytes: int, *, repeats: int, device: torch.device = CPU, inner: int = 1) -> tuple[float, float]:
    """(bytes moved, seconds) of copying an ``nbytes`` buffer: it is read once and written once."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2.0 * nbytes, median_time_s(lambda: dst.copy_(src), repeats=repeats, device=device, inner=inner)


def elementwise_times(numel: int, *, repeats: int, device: torch.device = CPU) -> tuple[float, float]:
    """(elements, seconds) of ``a + b`` into a preallocated output."""
    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    out = torch.empty_like(a)
    return float(numel), median_time_s(lambda: torch.add(a, b, out=out), repeats=repeats, device=device)


class _TinyBlock(nn.Module):
    """Four ops (layer_norm, linear, relu, add) on tensors small enough that dispatch dominates."""

    OPS = 4

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def op_overhead_times(*, blocks: int, repeats: int, device: torch.device = CPU) -> dict[str, float]:
    """Seconds per op of a chain of tiny training ops: forward, and forward plus backward.

    The chain is ``blocks`` tiny residual blocks (4 ops each) at width 8, batch 2: the
    arithmetic is negligible, so what is left is what every op of a training layer
    pays on top of its FLOPs and bytes (dispatch, autograd recording, the backward's
    node, allocation, and on a GPU the kernel launches). On a GPU each timed region
    runs the whole chain's launches between two synchronizes, so the time is the
    host's launch rate, as a program of small kernels sees it.
    """
    with torch.device(device):
        model = nn.Sequential(*[_TinyBlock(8) for _ in range(blocks)])
        x = torch.randn(2, 8)
    ops = blocks * _TinyBlock.OPS

    def train_step() -> None:
        model(x).sum().backward()

    fwd = median_time_s(lambda: model(x), repeats=repeats, device=device)
    both = median_time_s(train_step, repeats=repeats, device=device)
    return {"fwd_s_per_op": fwd / ops, "fwd_bwd_s_per_op": both / ops}


def optimizer_times(*, repeats: int, device: torch.device = CPU, big_numel: int = 1 << 20) -> dict[str, float]:
    """Seconds of an AdamW step (as the generated program builds it: runtime.training
    ``make_optimizer``, fused on a GPU) per parameter tensor and per parameter.

    Two steps: many tiny tensors (their elements cost nothing, so the time is the
    per-tensor loop) and a few large ones of ``big_numel`` elements (their time less the
    per-tensor share is the per-element traffic).
    """
    from hetpar.runtime.training import make_optimizer

    def step_s(tensors: int, numel: int) -> float:
        params = [nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel, device=device)
        optimizer = make_optimizer(Optimizer.ADAMW, params, 1e-3)
        return median_time_s(optimizer.step, repeats=repeats, device=device)

    tiny_tensors, big_tensors = 256, 4
    per_tensor = step_s(tiny_tensors, 8) / tiny_tensors
    big = step_s(big_tensors, big_numel)
    return {"tensor_s": per_tensor, "param_s": max(big - big_tensors * per_tensor, 0.0) / (big_tensors * big_numel),
            "optimizer": Optimizer.ADAMW}


ATTENTION_SEQS = (1024, 2048, 4096)  # sequence lengths of ``attention_times``
ATTENTION_BATCH, ATTENTION_HEADS, ATTENTION_HEAD_DIM = 4, 16, 128


def attention_times(dtype: str, *, repeats: int, device: torch.device, region_flops: float) -> dict:
    """Seconds of causal attention through ``scaled_dot_product_attention`` as the
    generated program runs a model's attention (``is_causal=True``, heads second), forward
    and forward plus backward, at each of ``ATTENTION_SEQS`` (GPU profiles: recorded,
    not fitted; no profile field holds an attention efficiency yet).

    Returns:
        ``{"dtype", "batch", "heads", "head_dim", "causal": True, "times": [[seq,
        forward FLOPs (the causal half), fwd_s, fwd_bwd_s], ...]}``.
    """
    times = []
    for seq in ATTENTION_SEQS:
        shape = (ATTENTION_BATCH, ATTENTION_HEADS, seq, ATTENTION_HEAD_DIM)
        q, k, v = (torch.randn(shape, dtype=DTYPES[dtype], device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, dtype=DTYPES[dtype], device=device)
        flops = 2.0 * ATTENTION_BATCH * ATTENTION_HEADS * seq * seq * ATTENTION_HEAD_DIM  # 4 b h s^2 d, halved
        inner = max(1, int(region_flops // (3.5 * flops)))

        def forward() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd = median_time_s(forward, repeats=repeats, device=device, inner=inner)
        both = median_time_s(lambda: forward().backward(grad), repeats=repeats, device=device, inner=inner)
        times.append([float(seq), flops, fwd, both])
    return {"dtype": dtype, "batch": ATTENTION_BATCH, "heads": ATTENTION_HEADS, "head_dim": ATTENTION_HEAD_DIM,
            "causal": True, "times": times}
