"""Microbenchmarks of this host for ``hetpar profile``: torch and the standard library only.

Each function measures one thing and returns raw numbers (seconds, bytes, FLOPs); the
fitting into a device profile lives in cost_models/calibrate.py, so that it can be
tested on synthetic measurements. Timings are medians over repeats: the machine is
shared, and a median ignores the neighbour who ran a build during one repeat.

What a training worker sees is measured, not what the host could do flat out: the
benchmarks run in ``world`` spawned workers at once, one thread each, as torchrun's
workers of one host run (``host_measurements``).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def median_time_s(fn: Callable[[], object], *, repeats: int, warmup: int = 2, inner: int = 1) -> float:
    """Median wall time of ``inner`` calls of ``fn``, divided by ``inner``, over ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def median_sections_s(step: Callable[[], list[float]], *, repeats: int, warmup: int = 2) -> list[float]:
    """Median of each section's seconds over ``repeats`` calls of ``step``, which returns
    its sections' seconds (each section's median taken apart)."""
    for _ in range(warmup):
        step()
    samples = [step() for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*samples)]


def matmul_times(sizes: list[int], dtype: str, *, repeats: int) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of an ``n x n @ n x n`` matmul for each n in ``sizes``."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, dtype=_DTYPES[dtype])
        b = torch.randn(n, n, dtype=_DTYPES[dtype])
        inner = max(1, int(2e7 // n**3))
        out.append((2.0 * n**3, median_time_s(lambda: torch.mm(a, b), repeats=repeats, inner=inner)))
    return out


MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the row counts of ``matmul_row_times``
# K = N of the rows curve (cost_models/compute.py ROWS_CURVE_WIDTH) and of the narrow one.
MATMUL_WIDTH, MATMUL_NARROW_WIDTH = 512, 128


def matmul_row_times(rows: tuple[int, ...] = MATMUL_ROWS, *, width: int = MATMUL_WIDTH,
                     repeats: int) -> dict[str, list[list[float]]]:
    """Seconds of a Linear's matmuls at each row count M, fp32, K = N = ``width``, laid
    out as nn.Linear runs them (the weight N x K, a bias).

    ``forward``: ``x @ w.T + b`` (addmm). ``backward``: the input gradient ``g @ w`` and
    the weight gradient ``g.T @ x`` together. cost_models/calibrate.py divides the rates
    by the fitted peak ([Note: matmul rows] in planner.measure).

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


def copy_bandwidth(nbytes: int, *, repeats: int) -> tuple[float, float]:
    """(bytes moved, seconds) of copying an ``nbytes`` buffer: it is read once and written once."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2.0 * nbytes, median_time_s(lambda: dst.copy_(src), repeats=repeats)


def elementwise_times(numel: int, *, repeats: int) -> tuple[float, float]:
    """(elements, seconds) of ``a + b`` into a preallocated output."""
    a, b = torch.randn(numel), torch.randn(numel)
    out = torch.empty_like(a)
    return float(numel), median_time_s(lambda: torch.add(a, b, out=out), repeats=repeats)


class _TinyBlock(nn.Module):
    """Four ops (layer_norm, linear, relu, add) on tensors small enough that dispatch dominates."""

    OPS = 4

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def op_overhead_times(*, blocks: int, repeats: int) -> dict[str, float]:
    """Seconds per op of a chain of tiny training ops: forward, and forward plus backward.

    The chain is ``blocks`` tiny residual blocks (4 ops each) at width 8, batch 2: the
    arithmetic is negligible, so what is left is what every op of a training layer
    pays on top of its FLOPs and bytes (dispatch, autograd recording, the backward's
    node, allocation).
    """
    model = nn.Sequential(*[_TinyBlock(8) for _ in range(blocks)])
    x = torch.randn(2, 8)
    ops = blocks * _TinyBlock.OPS

    def train_step() -> None:
        model(x).sum().backward()

    fwd = median_time_s(lambda: model(x), repeats=repeats)
    both = median_time_s(train_step, repeats=repeats)
    return {"fwd_s_per_op": fwd / ops, "fwd_bwd_s_per_op": both / ops}


def optimizer_times(*, repeats: int) -> dict[str, float]:
    """Seconds of an AdamW step (torch's defaults, as the generated program builds it) per
    parameter tensor and per parameter.

    Two steps: many tiny tensors (their elements cost nothing, so the time is the
    per-tensor loop) and a few large ones (their time less the per-tensor share is the
    per-element traffic).
    """
    def step_s(tensors: int, numel: int) -> float:
        params = [nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        return median_time_s(optimizer.step, repeats=repeats)

    tiny_tensors, big_tensors, big_numel = 256, 4, 1 << 20
    per_tensor = step_s(tiny_tensors, 8) / tiny_tensors
    big = step_s(big_tensors, big_numel)
    return {"tensor_s": per_tensor, "param_s": max(big - big_tensors * per_tensor, 0.0) / (big_tensors * big_numel),
            "optimizer": "adamw"}


def reference_times(*, repeats: int) -> dict[str, float]:
    """Forward and forward-plus-backward seconds of runtime/reference_model.py at its
    ``BATCH``: a small training workload with a known layer profile, so that
    cost_models/calibrate.py can fit what training kernels reach of the rates above."""
    from runtime import reference_model

    torch.manual_seed(0)
    model = reference_model.build_model()
    (x,) = reference_model.example_inputs(reference_model.BATCH)

    def train_step() -> None:
        model(x).sum().backward()

    fwd = median_time_s(lambda: model(x), repeats=repeats)
    both = median_time_s(train_step, repeats=repeats)
    return {"batch_size": reference_model.BATCH, "fwd_s": fwd, "fwd_bwd_s": both}


REFERENCE_MICROBATCHES = (1, 2, 4)  # micro-batch counts of the reference steps


def reference_step_time(world: int, *, repeats: int) -> dict:
    """Seconds of a whole training step of runtime/reference_model.py as the generated
    program runs one, data-parallel over all ``world`` workers (collective): the model
    as one fx stage through hetpar's executor, micro-batches of ``BATCH`` samples, the
    gradient all-reduce under the last backward, AdamW, the reported loss's all-reduce
    (waited for at once, where the program waits a step later); at each of
    ``REFERENCE_MICROBATCHES`` micro-batches, timed in sections: [micro-batches, the
    schedule's forwards and backwards, the wait for the gradient all-reduce, the
    optimizer step] (medians). cost_models/calibrate.py compares them with what the
    estimator charges ([Note: calibrated fits])."""
    from runtime import reference_model
    from runtime.data_parallel import AllReduce

    stage, model_file = _reference_stage()
    sync = AllReduce(list(stage.module.parameters()), dist.group.WORLD, world)
    steps, passes = _timed_reference_steps(stage, model_file, sync, repeats=repeats)
    return {"steps": steps, "passes": passes, "batch_size": reference_model.BATCH, "workers": world}


def tp_probe_degree(world: int) -> int:
    """The tensor-parallel degree at which ``world`` workers time DTensor: groups of 2,
    all at once, as a data-parallel x tensor-parallel-2 program runs them (all workers
    in one group when ``world`` is odd). Over 4 workers on 2 cores, one 4-rank group
    times the host's scheduling more than DTensor: each collective waits until all four
    ranks have run, two at a time."""
    return 2 if world % 2 == 0 else world


def _tp_mesh(world: int):
    """This worker's group of ``tp_probe_degree(world)`` ranks (consecutive ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = tp_probe_degree(world)
    if tp == world:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def reference_tp_step_time(world: int, tp_sharding: dict[str, str], *, repeats: int) -> dict:
    """Seconds of a whole training step of runtime/reference_model.py with tensor
    parallelism over groups of ``tp_probe_degree(world)`` workers, all at once, as the
    generated program runs one (the sharding the planner chose for it, DTensor through
    runtime.shard, hetpar's executor, AdamW over the sharded parameters, the reported
    loss's all-reduce), at each of
    ``REFERENCE_MICROBATCHES`` micro-batches of ``BATCH`` samples, timed in sections:
    [micro-batches, the schedule's forwards and backwards, the optimizer step]
    (medians; cost_models/calibrate.py, [Note: calibrated fits])."""
    from runtime import reference_model, shard

    stage, model_file = _reference_stage()
    shard.apply_tensor_parallel(stage.module, _tp_mesh(world), tp_sharding)
    steps, _ = _timed_reference_steps(stage, model_file, None, repeats=repeats)
    return {"steps": steps, "batch_size": reference_model.BATCH, "tp": tp_probe_degree(world)}


def _reference_stage():
    """runtime/reference_model.py built (seed 0) and cut as one whole-model fx stage, and its model file."""
    from runtime import reference_model, shard
    from runtime.graph import trace_layers
    from runtime.model_file import load_model_file

    torch.manual_seed(0)
    model_file = load_model_file(Path(reference_model.__file__), {})
    model = model_file.build_model()
    names = list(trace_layers(model, example_inputs=model_file.example_inputs(1)).layer_names)
    return shard.cut_stage(model, model_file, reference_model.BATCH, (0, len(names) - 1), names), model_file


def _timed_reference_steps(stage, model_file, sync, *, repeats: int) -> tuple[list[list[float]], list[list[float]]]:
    """The stage's training step at each of ``REFERENCE_MICROBATCHES``: the 1F1B schedule
    of one stage through hetpar's executor, AdamW, the reported loss's all-reduce.

    Returns:
        (steps, passes): medians of [micro-batches, forwards and backwards, (with
        ``sync``) the wait for its all-reduce, optimizer step], and of [micro-batches,
        the forwards, the backwards] as the executor times them apart inside the step.
    """
    from runtime import executor, reference_model, schedule, timing
    from runtime.distributed import Peers

    none = Peers(recv_activations_from=None, send_activations_to=(), recv_grads_from=None, send_grads_to=())
    optimizer = torch.optim.AdamW(stage.module.parameters(), lr=1e-6)
    steps, passes = [], []
    for m in REFERENCE_MICROBATCHES:
        pipeline = {0: executor.StageExecutor(stage=stage, peers=none, loss_fn=lambda out, _: out.square().mean(),
                                              num_microbatches=m, device=torch.device("cpu"),
                                              before_backward=sync.before_backward if sync else None)}
        actions = schedule.make_schedule("1f1b", 1, m, 1)[0]
        data = [(model_file.example_inputs(reference_model.BATCH), torch.zeros(())) for _ in range(m)]

        def train_step() -> list[float]:
            optimizer.zero_grad(set_to_none=True)
            split = timing.StepTimer(torch.device("cpu"))
            start = time.perf_counter()
            loss = executor.run_actions(pipeline, actions, data, torch.device("cpu"), times=split)
            computed = time.perf_counter()
            split.settle()
            if sync:
                sync.reduce()
            synced = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
            reported = loss.reshape(1).clone()
            dist.all_reduce(reported)
            float(reported)
            return [computed - start, *([synced - computed] if sync else []), stepped - synced, *split.steps[0]]

        dist.barrier()
        *sections, fwd, bwd = median_sections_s(train_step, repeats=repeats)
        steps.append([m, *sections])
        passes.append([m, fwd, bwd])
    return steps, passes


# --- The layers of a user's model ------------------------------------------------------


def layer_times(model_path: str, model_args: dict, batch_sizes: list[int], *, repeats: int) -> dict:
    """Forward and backward seconds of each of the planner's layers of a model file, at
    each micro-batch size in ``batch_sizes`` (medians over ``repeats``).

    The layers are cut one per stage as the generated program cuts stages
    (runtime/graph.py) and run in a chain as its executor runs them: each layer's
    floating-point inputs are leaves that take the gradient its backward hands on, the
    last layer computes the model file's loss on synthetic targets. So a layer's time is
    what the program spends in it, graph module and autograd included, and the times of
    all layers add up to a training micro-batch's compute without any communication.
    Between repeats an AdamW step runs over the model, as between training steps: its
    traffic leaves the caches as cold as the program finds them (back-to-back repeats
    ran a small GPT's layers 35% faster than the generated program does).
    cost_models/calibrate.py turns them into the profile's ``layer_corrections``
    ([Note: measured layers] in cost_models/compute.py).

    Returns:
        ``{"model": file name, "model_args", "layers": [{"name", "times": [[micro-batch,
        fwd_s, bwd_s], ...]}, ...]}`` in layer order.
    """
    from runtime.model_file import load_model_file

    spec = load_model_file(Path(model_path), model_args)
    torch.manual_seed(0)
    model = spec.build_model()
    names: list[str] = []
    times: list[list[list[float]]] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    for batch in batch_sizes:
        names, stages, inputs, targets = layer_stages(model, spec, batch)
        samples = []
        for _ in range(repeats + 2):
            samples.append(chained_pass_s(stages, inputs, targets, spec.loss))
            optimizer.step()  # as between training steps: the optimizer's traffic leaves the caches cold
            optimizer.zero_grad(set_to_none=True)
        samples = samples[2:]
        times.append([[statistics.median(run[i][p] for run in samples) for p in (0, 1)] for i in range(len(stages))])
        model.zero_grad(set_to_none=True)
    return {"model": Path(model_path).name, "model_args": model_args,
            "layers": [{"name": name, "times": [[b, *times[k][i]] for k, b in enumerate(batch_sizes)]}
                       for i, name in enumerate(names)]}


def layer_stages(model: nn.Module, spec, batch: int) -> tuple[list[str], list, tuple, object]:
    """(layer names, one stage per layer, inputs, targets) of ``model`` on a synthetic
    batch of ``batch`` samples from its model file ``spec``."""
    from runtime.graph import build_stage, record_values, trace_layers

    inputs, targets = next(iter(spec.batches(batch, 0)))
    layered = trace_layers(model, example_inputs=tuple(inputs))
    values = record_values(layered, tuple(inputs))
    stages = [build_stage(layered, values, i, i) for i in range(layered.num_layers)]
    return list(layered.layer_names), stages, tuple(inputs), targets


def chained_pass_s(stages, inputs: tuple, targets, loss_fn) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each one-layer stage in one training micro-batch;
    the parameters' gradients accumulate as one backward of the whole model's would."""
    fwd, kept, received = [], [], ()
    for stage in stages:
        leaves = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in received)
        start = time.perf_counter()
        out = stage.module(*[inputs[i] for i in stage.model_inputs], *leaves)
        if stage.is_last:
            out = loss_fn(out, targets)
        fwd.append(time.perf_counter() - start)
        kept.append((leaves, out))
        received = out if not stage.is_last else ()
    bwd, grads = [0.0] * len(stages), None
    for i in reversed(range(len(stages))):
        leaves, out = kept[i]
        start = time.perf_counter()
        if stages[i].is_last:
            out.backward()
        else:
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [l.grad if l.is_floating_point() else None for l in leaves]
        bwd[i] = time.perf_counter() - start
    return list(zip(fwd, bwd))


# --- Collectives between local workers --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_collective(name: str, numel: int, rank: int, world: int, repeats: int) -> float:
    """Median seconds of one collective of ``numel`` fp32 elements (the full tensor), rank-0's view.

    The all-reduce is timed as the generated program averages gradients
    (runtime.data_parallel.AllReduce: packed into a bucket, reduced, divided back into
    the gradients), so its fit carries those copies.
    """
    full = torch.ones(numel)
    if name == "all_reduce":
        from runtime.data_parallel import AllReduce

        params = [nn.Parameter(torch.ones(part)) for part in _parts(numel, 4)]
        for p in params:
            p.grad = torch.ones_like(p)
        averaging = AllReduce(params, dist.group.WORLD, world)

        def op() -> None:
            averaging.reduce()
    elif name == "all_gather":
        shard = torch.ones(numel // world)
        def op() -> None:
            dist.all_gather_into_tensor(full, shard)
    elif name == "reduce_scatter":
        shard = torch.empty(numel // world)
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
        start = time.perf_counter()
        op()
        elapsed = time.perf_counter() - start
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


def _step_overhead_s(rank: int, repeats: int) -> float:
    """Median seconds of a training step minus its layers: data, zero_grad, loss all-reduce, optimizer.

    A model of two tiny linears keeps the layers' share negligible; what remains is what
    the generated program does every step whatever the model (runtime/training.py).
    """
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(8, 4, generator=gen)
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


def _compute_benchmarks(plan: dict, progress: Callable[[str], None]) -> dict:
    """Matmul, copy, elementwise and per-op overhead, as one worker sees them (see ``host_measurements``)."""
    repeats = plan["repeats"]
    out: dict = {"matmul": {}}
    for dtype in plan["dtypes"]:
        progress(f"{dtype} matmul")
        out["matmul"][dtype] = [list(p) for p in matmul_times(plan["matmul_sizes"], dtype, repeats=repeats)]
    progress("matmul by rows")
    out["matmul_rows"] = matmul_row_times(repeats=repeats)
    out["matmul_rows_narrow"] = {"width": MATMUL_NARROW_WIDTH, **matmul_row_times(width=MATMUL_NARROW_WIDTH, repeats=repeats)}
    progress("memory bandwidth")
    out["copy"] = list(copy_bandwidth(64 << 20, repeats=repeats))
    progress("elementwise")
    out["elementwise"] = list(elementwise_times(1 << 22, repeats=repeats))
    progress("per-op overhead")
    out["op_overhead"] = op_overhead_times(blocks=50, repeats=3 * repeats)
    progress("optimizer step")
    out["optimizer"] = optimizer_times(repeats=repeats)
    progress("reference training workload")
    out["reference"] = reference_times(repeats=repeats)
    return out


class _TinyTPBlock(nn.Module):
    """Three ops (colwise linear, relu, rowwise linear) as tensor parallelism shards an MLP."""

    OPS, ALL_REDUCES = 3, 2  # the rowwise output in forward, the colwise input gradient in backward

    def __init__(self, width: int, world: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width * world)
        self.down = nn.Linear(width * world, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp_op_overhead(world: int, *, blocks: int, repeats: int) -> dict[str, float]:
    """Seconds per op, forward plus backward, of tiny blocks sharded with DTensor over
    groups of ``tp_probe_degree(world)`` workers, all at once.

    cost_models/calibrate.py fits ``tp_module_overhead_s`` from it: DTensor's cost per
    sharded module (redistribution, dispatch), beyond the ops and all-reduces.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_probe_degree(world)
    mesh = _tp_mesh(world)
    model = nn.Sequential(*[_TinyTPBlock(8, tp) for _ in range(blocks)])
    styles = {f"{i}.up": ColwiseParallel() for i in range(blocks)} | {f"{i}.down": RowwiseParallel() for i in range(blocks)}
    parallelize_module(model, mesh, styles)
    x = torch.randn(2, 8, requires_grad=True)

    def train_step() -> None:
        model(x).sum().backward()

    dist.barrier()
    both = median_time_s(train_step, repeats=repeats)
    return {"fwd_bwd_s_per_op": both / (blocks * _TinyTPBlock.OPS), "ops_per_block": _TinyTPBlock.OPS,
            "all_reduces_per_block": _TinyTPBlock.ALL_REDUCES, "tp": tp}


def _worker(rank: int, world: int, port: int, plan: dict, out_dir: str) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_tensor collectives
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=120))
    progress_file = Path(out_dir) / "progress.txt"

    def progress(what: str) -> None:
        if rank == 0:
            with open(progress_file, "a") as f:
                f.write(what + "\n")

    try:
        dist.barrier()
        results = _compute_benchmarks(plan, progress)
        dist.barrier()
        progress(f"collectives between {world} workers")
        results["collectives"] = {}
        for name in plan["collectives"]:
            results["collectives"][name] = []
            for nbytes in plan["sizes_bytes"]:
                numel = max(world, nbytes // 4 // world * world)
                results["collectives"][name].append([numel * 4.0, _bench_collective(name, numel, rank, world, plan["repeats"])])
        if not torch.cuda.is_available():  # a gloo rendezvous; NCCL's kernels need no host thread
            progress("late pipeline receives")
            results["late_receive"] = late_receive_times(rank, LATE_RECEIVE_REPEATS)
            progress("tensor-parallel per-op overhead")
            results["tp_op_overhead"] = _tp_op_overhead(world, blocks=10, repeats=plan["repeats"])
        progress("per-step overhead")
        results["step_overhead_s"] = _step_overhead_s(rank, plan["repeats"] * 2)
        if plan.get("model"):
            progress("layers of the model")
            results["model_layers"] = layer_times(plan["model"]["path"], plan["model"]["args"],
                                                  plan["model"]["batch_sizes"], repeats=plan["repeats"])
        progress("reference training step through the program's runtime")
        results["reference_step"] = reference_step_time(world, repeats=plan["repeats"])
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


def host_measurements(world: int, *, matmul_sizes: list[int], sizes_bytes: list[int], repeats: int,
                      tp_sharding: dict[str, str] | None = None, model: dict | None = None,
                      progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure this host from ``world`` spawned workers at once, as a training job's ranks run.

    Every worker runs the compute benchmarks at the same time, with one thread each (as
    torchrun's workers get), so the rates are what one rank reaches while the others
    compute too: shared cores, memory bandwidth and whatever else the machine runs.
    Then the workers time all-reduce, all-gather, reduce-scatter and send/recv between
    them (gloo on CPU, nccl where CUDA is present, loopback TCP) and a training step of
    a negligible model. Rank 0's numbers are returned.

    Args:
        world: number of worker processes (2 or more).
        matmul_sizes: n of the ``n x n`` matmuls.
        sizes_bytes: collective sizes (the full tensor, as nccl-tests counts it).
        repeats: timed repeats of each measurement; the median is kept.
        tp_sharding: the planner's tensor-parallel sharding of runtime/reference_model.py
            (module path -> style); with it the reference step is timed again with
            tensor parallelism (``reference_tp_step_time``).
        model: ``{"path", "args", "batch_sizes"}`` of a model file whose layers every
            worker times at once (``layer_times``), or None.
        progress: called with a description as each benchmark starts.

    Returns:
        ``{"matmul": {dtype: [[flops, s], ...]}, "copy": [bytes, s], "elementwise": [n, s],
        "op_overhead": {...}, "collectives": {name: [[nbytes, s], ...]}, "step_overhead_s": s, ...}``, with
        ``"model_layers"`` (``layer_times``) when ``model`` is given.
    """
    plan = {"collectives": ["all_reduce", "all_gather", "reduce_scatter", "p2p"], "sizes_bytes": sizes_bytes,
            "repeats": repeats, "matmul_sizes": matmul_sizes, "dtypes": ["fp32", "bf16"], "tp_sharding": tp_sharding or {}, "model": model}
    with tempfile.TemporaryDirectory(prefix="hetpar-profile-") as tmp:
        context = mp.spawn(_worker, args=(world, _free_port(), plan, tmp), nprocs=world, join=False)
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


def module_times(model: nn.Module, inputs: tuple, *, repeats: int) -> list[dict]:
    """Forward and backward seconds of each child module of ``model``, by hooks, median over repeats.

    Children are the modules one level down, with ``nn.ModuleList``/``nn.Sequential``
    containers opened (the blocks of a transformer are the units a planner splits).

    Returns:
        ``[{"name", "fwd_s", "bwd_s"}, ...]`` in call order.
    """
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 0:
            units += [(f"{name}.{i}", c) for i, c in child.named_children()]
        else:
            units.append((name, child))
    fwd: dict[str, list[float]] = {n: [] for n, _ in units}
    bwd: dict[str, list[float]] = {n: [] for n, _ in units}
    starts: dict[str, float] = {}
    handles = []
    for name, module in units:
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: starts.__setitem__(n, time.perf_counter())))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: fwd[n].append(time.perf_counter() - starts[n])))
        handles.append(module.register_full_backward_pre_hook(lambda m, g, n=name: starts.__setitem__(n + "/b", time.perf_counter())))
        handles.append(module.register_full_backward_hook(lambda m, gi, go, n=name: bwd[n].append(time.perf_counter() - starts[n + "/b"])))
    try:
        # The first module sees inputs without gradients (token ids); its backward hook then
        # times the gradient of its output, which is what we want, so torch's warning is noise.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for _ in range(repeats + 2):
            out = model(*inputs)
            (out[0] if isinstance(out, (tuple, list)) else out).float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return [{"name": n, "fwd_s": statistics.median(fwd[n][2:] or [0.0]), "bwd_s": statistics.median(bwd[n][2:] or [0.0])}
            for n, _ in units]
