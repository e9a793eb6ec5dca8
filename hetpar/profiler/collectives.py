"""What the workers time together: collectives, late pipeline receives, the per-step overhead.

Every function here is collective: each worker calls it with its rank, and every worker
gets rank 0's (or the timed rank's) numbers where it matters. Tensors live on the
worker's device (gloo on a CPU, NCCL on GPUs), and each timed region ends in a
synchronize ([Note: profiler timing] in profiler/clock.py).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hetpar.profiler.clock import CPU, synchronize
from hetpar.vocabulary import Optimizer


def bench_collective(name: str, numel: int, rank: int, world: int, repeats: int, *, device: torch.device = CPU,
                     inner: int = 1) -> float:
    """Median seconds of one collective of ``numel`` fp32 elements (the full tensor), rank-0's view.

    Each timed region holds ``inner`` back-to-back collectives after a barrier. The
    all-reduce is timed as the generated program averages gradients
    (runtime.data_parallel.AllReduce: packed into a bucket, reduced, divided back into
    the gradients), so its fit carries those copies.
    """
    full = torch.ones(numel, device=device)
    if name == "all_reduce":
        from hetpar.runtime.data_parallel import AllReduce

        params = [nn.Parameter(torch.ones(part, device=device)) for part in _parts(numel, 4)]
        for p in params:
            p.grad = torch.ones_like(p)
        averaging = AllReduce(params, dist.group.WORLD, world)

        def op() -> None:
            averaging.reduce()
    elif name == "all_gather":
        shard = torch.ones(numel // world, device=device)
        def op() -> None:
            dist.all_gather_into_tensor(full, shard)
    elif name == "reduce_scatter":
        shard = torch.empty(numel // world, device=device)
        def op() -> None:
            dist.reduce_scatter_tensor(shard, full)
    else:  # p2p: half a ping-pong between ranks 0 and 1
        def op() -> None:
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            op()
        synchronize(device)
        elapsed = (time.perf_counter() - start) / inner
        if i >= 2:
            samples.append(elapsed / 2 if name == "p2p" else elapsed)
    return statistics.median(samples)


LATE_RECEIVE_REPEATS = 60  # the waits' tail needs many: about 0.5 s
LATE_RECEIVE_BYTES = 64 * 1024  # a small model's boundary tensor (4 samples x 32 tokens x 128 wide, fp32)
LATE_RECEIVE_LEAD_S = 0.002  # the receiver computes this long after the send before it posts its receive
LATE_RECEIVE_SENDER_BUSY_S = 0.006  # the sender computes this long after its send
LATE_RECEIVE_WIDTH = 128  # n of the n x n matmuls both compute: dispatch-bound, as a small model's ops are


def compute_for(seconds: float, a: torch.Tensor) -> None:
    """Keep this thread computing ``a @ a`` for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def late_receive_times(rank: int, repeats: int) -> dict:
    """Rank 1's waits for a message from rank 0 whose receive it posts after the send,
    while rank 0 computes: the case of [Note: late receives] in runtime/schedule.py.
    CPU workers (gloo) only: the wait is a host thread's rendezvous, which NCCL's kernels
    do not have.

    Rank 0 sends ``LATE_RECEIVE_BYTES`` and computes for ``LATE_RECEIVE_SENDER_BUSY_S``;
    rank 1 computes for ``LATE_RECEIVE_LEAD_S``, then receives and times the wait. Other
    ranks only keep the barriers. Their waits have a long tail (a fifth to over half over 1
    ms on the development host), so the mean is what a pipeline step pays.

    Returns:
        ``{"mean_s", "median_s", "bytes", "repeats"}``, the same on every rank.
    """
    a = torch.randn(LATE_RECEIVE_WIDTH, LATE_RECEIVE_WIDTH)
    message = torch.ones(LATE_RECEIVE_BYTES // 4)
    waits = []
    for k in range(repeats + 2):
        dist.barrier()
        if rank == 0:
            sent = dist.isend(message, 1, tag=k)
            compute_for(LATE_RECEIVE_SENDER_BUSY_S, a)
            sent.wait()
        elif rank == 1:
            compute_for(LATE_RECEIVE_LEAD_S, a)
            start = time.perf_counter()
            dist.irecv(message, 0, tag=k).wait()
            if k >= 2:
                waits.append(time.perf_counter() - start)
    stats = torch.tensor([statistics.mean(waits), statistics.median(waits)] if waits else [0.0, 0.0], dtype=torch.float64)
    dist.broadcast(stats, src=1)
    return {"mean_s": float(stats[0]), "median_s": float(stats[1]), "bytes": LATE_RECEIVE_BYTES, "repeats": repeats}


def _parts(numel: int, count: int) -> list[int]:
    """``numel`` split into ``count`` near-equal positive sizes (fewer when it is smaller)."""
    count = max(1, min(count, numel))
    return [numel // count + (1 if i < numel % count else 0) for i in range(count)]


def step_overhead_s(repeats: int, *, device: torch.device = CPU) -> float:
    """Median seconds of a training step minus its layers: data, zero_grad, loss all-reduce, optimizer.

    A model of two tiny linears keeps the layers' share negligible; what remains is what
    the generated program does every step whatever the model (runtime/training.py): the
    batch drawn on the host and copied to ``device``, the optimizer it builds
    (``make_optimizer``), the reported loss's all-reduce read back on the host, which
    waits for the device.
    """
    from hetpar.runtime.training import make_optimizer

    with torch.device(device):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = make_optimizer(Optimizer.ADAMW, model.parameters(), 1e-3)
    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(8, 4, generator=gen).to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        float(reported)
        if i >= 2:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)
