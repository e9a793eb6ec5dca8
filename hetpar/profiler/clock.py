"""Clocks of the profiling workers: timings that are true on a CPU and on a GPU.

[Note: profiler timing]
On a CPU an operation has finished when its call returns, so ``time.perf_counter()``
around it is its time. On a GPU a call only queues kernels and the host runs ahead: a
host clock read before the device has finished measures the launches. So every timed
region here starts and ends with ``synchronize`` (a no-op on a CPU): the device is idle
when the clock starts and has run the region's last kernel when it stops. A region
holds many calls (``inner``) so that the two waits cost little against it, and warm-up
calls run first (cuBLAS handles, the caching allocator, kernel selection). Times of the
parts of one pass (each layer's forward and backward) are CUDA events recorded on the
compute stream (``mark``), read after one synchronize at the pass's end, so timing them
adds no wait inside the pass.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from hetpar.vocabulary import Precision

CPU = torch.device("cpu")

DTYPES = {Precision.FP32: torch.float32, Precision.TF32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def fingerprint() -> str:
    """This host as a profile key: CPU model, core count, torch version and GPU name.

    Returns:
        e.g. ``"AMD EPYC 7B13 x2 cores, torch 2.13.0+cpu, no GPU"``.
    """
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu} x{os.cpu_count()} cores, torch {torch.__version__}, {gpu}"


def worker_device(kind: str, local_rank: int) -> torch.device:
    """The device a profiling worker computes on: its own GPU on CUDA, else the CPU."""
    return torch.device("cuda", local_rank) if kind == "cuda" else CPU


def compute_dtype(device: torch.device) -> str:
    """The dtype a training program runs its kernels in on ``device``: bf16 autocast on a
    GPU that has bf16 tensor cores (compute capability 8 or more), fp16 on older ones,
    fp32 on a CPU."""
    if device.type != "cuda":
        return Precision.FP32
    return Precision.BF16 if torch.cuda.get_device_capability(device)[0] >= 8 else Precision.FP16


def matmul_dtypes(device: torch.device) -> list[str]:
    """The dtypes whose matmuls a profile times on ``device``: fp32 and bf16 on a CPU (its
    bf16 is what autocast would run); on a GPU fp32, fp16 and, with tensor cores for
    them (compute capability 8 or more), tf32 and bf16."""
    if device.type != "cuda":
        return [Precision.FP32, Precision.BF16]
    return [Precision.FP32, Precision.TF32, Precision.BF16, Precision.FP16] if torch.cuda.get_device_capability(device)[0] >= 8 else [Precision.FP32, Precision.FP16]


def autocast(device: torch.device, dtype: str):
    """``torch.autocast`` to ``dtype`` on ``device``, disabled for fp32 (as the executor runs a stage)."""
    return torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != Precision.FP32)


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mark(device: torch.device):
    """A point on the device's timeline: a CUDA event recorded on the current stream, or now."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start, end) -> float:
    """Seconds between two ``mark``s; on CUDA, once the device has passed ``end``."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3  # CUDA events measure milliseconds


def median_time_s(fn: Callable[[], object], *, repeats: int, device: torch.device = CPU, warmup: int = 2,
                  inner: int = 1) -> float:
    """Median wall time of ``inner`` calls of ``fn``, divided by ``inner``, over ``repeats``
    regions, each bracketed by ``synchronize`` ([Note: profiler timing])."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def median_sections_s(step: Callable[[], list[float]], *, repeats: int, warmup: int = 2) -> list[float]:
    """Median of each section's seconds over ``repeats`` calls of ``step``, which returns
    its sections' seconds (each section's median taken apart)."""
    for _ in range(warmup):
        step()
    samples = [step() for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*samples)]
