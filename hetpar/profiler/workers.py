"""The profiling workers: ``host_measurements`` spawns them, each runs every benchmark.

What a training worker sees is measured, not what the host could do flat out: the
benchmarks run in ``world`` spawned workers at once, as torchrun's workers of one host
run, each on its own GPU (NCCL) or, on a CPU, with one thread each when there are
several (gloo). One worker measures its device alone: no collectives, late receives or
tensor-parallel probes, which need a peer.
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetpar.profiler import collectives, micro
from hetpar.profiler.clock import compute_dtype, matmul_dtypes, worker_device
from hetpar.profiler.layers import layer_times
from hetpar.profiler.reference import reference_step_time, reference_times, reference_tp_step_time, tp_op_overhead
from hetpar.runtime.cli import free_port

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
COLLECTIVE_INNER = {"cpu": 1, "cuda": 10}  # back-to-back collectives per timed region


def _compute_benchmarks(plan: dict, device: torch.device, progress: Callable[[str], None]) -> dict:
    """Matmul, copy, elementwise, per-op overhead, optimizer, attention and the reference
    workload, as one worker sees them (see ``host_measurements``)."""
    repeats, sizes = plan["repeats"], micro.SIZES[device.type]
    out: dict = {"matmul": {}}
    for dtype in matmul_dtypes(device):
        progress(f"{dtype} matmul")
        out["matmul"][dtype] = [list(p) for p in micro.matmul_times(plan["matmul_sizes"], dtype, repeats=repeats,
                                                                     device=device, region_flops=sizes.region_flops)]
    if sizes.rows_curves:
        progress("matmul by rows")
        out["matmul_rows"] = micro.matmul_row_times(repeats=repeats)
        out["matmul_rows_narrow"] = {"width": micro.MATMUL_NARROW_WIDTH,
                                     **micro.matmul_row_times(width=micro.MATMUL_NARROW_WIDTH, repeats=repeats)}
    progress("memory bandwidth")
    out["copy"] = list(micro.copy_bandwidth(sizes.copy_bytes, repeats=repeats, device=device, inner=sizes.copy_inner))
    progress("elementwise")
    out["elementwise"] = list(micro.elementwise_times(sizes.elementwise_numel, repeats=repeats, device=device))
    progress("per-op overhead")
    out["op_overhead"] = micro.op_overhead_times(blocks=50, repeats=3 * repeats, device=device)
    progress("optimizer step")
    out["optimizer"] = micro.optimizer_times(repeats=repeats, device=device, big_numel=sizes.optimizer_numel)
    if device.type == "cuda":
        progress("attention")
        out["attention"] = micro.attention_times(compute_dtype(device), repeats=repeats, device=device,
                                                 region_flops=sizes.region_flops)
    progress("reference training workload")
    out["reference"] = reference_times(repeats=repeats, device=device)
    return out


def _peer_benchmarks(plan: dict, rank: int, world: int, device: torch.device, progress: Callable[[str], None]) -> dict:
    """What needs two or more workers: collectives; on CPU workers the late pipeline
    receives and the tensor-parallel dispatch too."""
    out: dict = {"collectives": {}}
    progress(f"collectives between {world} workers")
    for name in COLLECTIVES:
        out["collectives"][name] = []
        for nbytes in plan["sizes_bytes"]:
            numel = max(world, nbytes // 4 // world * world)
            seconds = collectives.bench_collective(name, numel, rank, world, plan["repeats"], device=device,
                                                   inner=COLLECTIVE_INNER[device.type])
            out["collectives"][name].append([numel * 4.0, seconds])
    if device.type == "cpu":  # a gloo rendezvous and DTensor's host work; NCCL's kernels need no host thread
        progress("late pipeline receives")
        out["late_receive"] = collectives.late_receive_times(rank, collectives.LATE_RECEIVE_REPEATS)
        progress("tensor-parallel per-op overhead")
        out["tp_op_overhead"] = tp_op_overhead(world, blocks=10, repeats=plan["repeats"])
    return out


def progress_steps(world: int, device: torch.device, *, model: bool, tensor_parallel: bool) -> int:
    """How many progress lines one pass of ``host_measurements`` writes (for a progress bar)."""
    gpu = device.type == "cuda"
    compute = len(matmul_dtypes(device)) + (0 if gpu else 1) + 5 + (1 if gpu else 0)
    peers = (1 + (0 if gpu else 2)) if world > 1 else 0
    return compute + peers + 2 + int(model) + int(tensor_parallel)


def _worker(rank: int, world: int, port: int, plan: dict, out_dir: str) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_tensor collectives
    if world > 1:
        torch.set_num_threads(1)  # as torchrun starts each of several workers
    device = worker_device(plan["device"], rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120), device_id=device if cuda else None)
    progress_file = Path(out_dir) / "progress.txt"

    def progress(what: str) -> None:
        if rank == 0:
            with open(progress_file, "a") as f:
                f.write(what + "\n")

    try:
        dist.barrier()
        results = _compute_benchmarks(plan, device, progress)
        dist.barrier()
        if world > 1:
            results.update(_peer_benchmarks(plan, rank, world, device, progress))
        progress("per-step overhead")
        results["step_overhead_s"] = collectives.step_overhead_s(plan["repeats"] * 2, device=device)
        if plan.get("model"):
            progress("layers of the model")
            results["model_layers"] = layer_times(plan["model"]["path"], plan["model"]["args"], plan["model"]["batch_sizes"],
                                                  repeats=plan["repeats"], device=device, dtype=compute_dtype(device))
        progress("reference training step through the program's runtime")
        results["reference_step"] = reference_step_time(world, repeats=plan["repeats"], device=device)
        if plan.get("tp_sharding"):
            progress("reference training step with tensor parallelism")
            results["reference_tp_step"] = reference_tp_step_time(world, plan["tp_sharding"], repeats=plan["repeats"])
        if rank == 0:
            (Path(out_dir) / "results.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


class WorkerFailed(RuntimeError):
    """A worker of ``host_measurements`` raised; the message is its error's last line."""


class WorkerDied(WorkerFailed):
    """A worker of ``host_measurements`` exited without finishing (a signal, an exit code).
    Once on the busy development host a worker died of SIGABRT mid-profile and the same
    profile ran clean right after (cause not found), so ``hetpar profile`` measures such a
    pass again."""


def _last_line(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def host_measurements(world: int, *, device: str = "cpu", matmul_sizes: list[int], sizes_bytes: list[int], repeats: int,
                      tp_sharding: dict[str, str] | None = None, model: dict | None = None,
                      progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure this host from ``world`` spawned workers at once, as a training job's ranks run.

    Every worker runs the compute benchmarks at the same time (on a CPU with one thread
    each when there are several, as torchrun's workers get; on CUDA each on its own GPU),
    so the rates are what one rank reaches while the others compute too: shared cores,
    memory bandwidth and whatever else the machine runs. With two or more workers they
    then time all-reduce, all-gather, reduce-scatter and send/recv between them (gloo on
    a CPU, NCCL on GPUs). Then a training step of a negligible model and the reference
    model's step. Rank 0's numbers are returned.

    Args:
        world: number of worker processes (1 or more; on CUDA at most the visible GPUs).
        device: "cuda" (worker k on GPU k, NCCL) or "cpu" (gloo).
        matmul_sizes: n of the ``n x n`` matmuls.
        sizes_bytes: collective sizes (the full tensor, as nccl-tests counts it).
        repeats: timed repeats of each measurement; the median is kept.
        tp_sharding: the planner's tensor-parallel sharding of profiler/reference_model.py
            (module path -> style), for two or more CPU workers; with it the reference
            step is timed again with tensor parallelism (``reference_tp_step_time``).
        model: ``{"path", "args", "batch_sizes"}`` of a model file whose layers every
            worker times at once (``layer_times``), or None.
        progress: called with a description as each benchmark starts.

    Returns:
        ``{"matmul": {dtype: [[flops, s], ...]}, "copy": [bytes, s], "elementwise": [n, s],
        "op_overhead": {...}, "step_overhead_s": s, ...}``, with ``"collectives": {name:
        [[nbytes, s], ...]}`` for two or more workers and ``"model_layers"``
        (``layer_times``) when ``model`` is given.
    """
    plan = {"device": device, "sizes_bytes": sizes_bytes, "repeats": repeats, "matmul_sizes": matmul_sizes,
            "tp_sharding": tp_sharding or {}, "model": model}
    with tempfile.TemporaryDirectory(prefix="hetpar-profile-") as tmp:
        context = mp.spawn(_worker, args=(world, free_port(), plan, tmp), nprocs=world, join=False)
        seen = 0
        try:
            while not context.join(timeout=0.2):
                seen = _report_progress(Path(tmp) / "progress.txt", seen, progress)
        except mp.ProcessExitedException as exc:
            raise WorkerDied(f"a profiling worker died ({_last_line(exc)})") from None
        except mp.ProcessRaisedException as exc:
            raise WorkerFailed(f"a profiling worker failed: {_last_line(exc)}") from None
        _report_progress(Path(tmp) / "progress.txt", seen, progress)
        return json.loads((Path(tmp) / "results.json").read_text())


def median_record(records: list) -> object:
    """The median, number by number, of measurement records of one shape (the same
    benchmarks at the same sizes, as ``host_measurements`` returns them): sizes, equal in
    every record, stay as they are; other values (names) are the first record's."""
    first = records[0]
    if isinstance(first, dict):
        return {key: median_record([r[key] for r in records]) for key in first}
    if isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in records):
        return [median_record(list(items)) for items in zip(*records)]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return first if all(r == first for r in records) else statistics.median(records)
    return first


def _report_progress(path: Path, seen: int, progress: Callable[[str], None]) -> int:
    if not path.is_file():
        return seen
    lines = path.read_text().splitlines()
    for line in lines[seen:]:
        progress(line)
    return len(lines)
