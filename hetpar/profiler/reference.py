"""The reference training workload (profiler/reference_model.py), timed as a loop and as
the generated program's training step, with and without tensor parallelism.

cost_models/calibrate.py compares these times with what the layer cost model and the
estimator charge for the same model ([Note: calibrated fits]), so every function here
runs the model as a program of that device would: on a GPU under autocast to
``clock.compute_dtype`` with the fused AdamW of runtime.training, on a CPU in fp32.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from hetpar.profiler import reference_model
from hetpar.profiler.clock import DTYPES, autocast, compute_dtype, median_sections_s, median_time_s, synchronize
from hetpar.vocabulary import Optimizer, Schedule

REFERENCE_MICROBATCHES = (1, 2, 4)  # micro-batch counts of the reference steps


def reference_args(device: torch.device) -> dict[str, str]:
    """The reference model's model args for a worker on ``device``."""
    return {"size": reference_model.size_for(device.type)}


def reference_times(*, repeats: int, device: torch.device) -> dict:
    """Forward and forward-plus-backward seconds of profiler/reference_model.py at its
    ``BATCH``: a training workload with a known layer profile, so that
    cost_models/calibrate.py can fit what training kernels reach of the microbenchmark
    rates.

    Returns:
        ``{"batch_size", "fwd_s", "fwd_bwd_s", "dtype", "model_args"}``.
    """
    args, dtype = reference_args(device), compute_dtype(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = reference_model.build_model(**args)
    batch = reference_model.BATCH[args["size"]]
    (x,) = (t.to(device) for t in reference_model.example_inputs(batch, **args))

    def forward() -> torch.Tensor:
        with autocast(device, dtype):
            return model(x)

    def train_step() -> None:
        forward().float().sum().backward()

    fwd = median_time_s(forward, repeats=repeats, device=device)
    both = median_time_s(train_step, repeats=repeats, device=device)
    return {"batch_size": batch, "fwd_s": fwd, "fwd_bwd_s": both, "dtype": dtype, "model_args": args}


def reference_step_time(world: int, *, repeats: int, device: torch.device) -> dict:
    """Seconds of a whole training step of profiler/reference_model.py as the generated
    program runs one, data-parallel over all ``world`` workers (collective): the model
    as one fx stage through hetpar's executor, micro-batches of ``BATCH`` samples, the
    gradient all-reduce under the last backward (none for one worker), AdamW, the
    reported loss's all-reduce (waited for at once, where the program waits a step
    later); at each of ``REFERENCE_MICROBATCHES`` micro-batches, timed in sections:
    [micro-batches, the schedule's forwards and backwards, the wait for the gradient
    all-reduce (0 for one worker), the optimizer step] (medians). cost_models/calibrate.py
    compares them with what the estimator charges ([Note: calibrated fits])."""
    from hetpar.runtime.data_parallel import AllReduce

    stage, model_file, args = _reference_stage(device)
    sync = AllReduce(list(stage.module.parameters()), dist.group.WORLD, world) if world > 1 else None
    steps, passes = _timed_reference_steps(stage, model_file, sync, device, repeats=repeats, wait_section=True)
    return {"steps": steps, "passes": passes, "batch_size": reference_model.BATCH[args["size"]], "workers": world,
            "dtype": compute_dtype(device), "model_args": args}


def tp_probe_degree(world: int) -> int:
    """The tensor-parallel degree at which ``world`` workers time DTensor: groups of 2,
    all at once, as a data-parallel x tensor-parallel-2 program runs them (all workers
    in one group when ``world`` is odd). Over 4 workers on 2 cores, one 4-rank group
    times the host's scheduling more than DTensor: each collective waits until all four
    ranks have run, two at a time."""
    return 2 if world % 2 == 0 else world


def _tp_mesh(world: int):
    """This worker's group of ``tp_probe_degree(world)`` ranks (consecutive ranks), on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = tp_probe_degree(world)
    if tp == world:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def reference_tp_step_time(world: int, tp_sharding: dict[str, str], *, repeats: int) -> dict:
    """Seconds of a whole training step of profiler/reference_model.py with tensor
    parallelism over groups of ``tp_probe_degree(world)`` CPU workers, all at once, as
    the generated program runs one (the sharding the planner chose for it, DTensor
    through runtime.shard, hetpar's executor, AdamW over the sharded parameters, the
    reported loss's all-reduce), at each of ``REFERENCE_MICROBATCHES`` micro-batches of
    ``BATCH`` samples, timed in sections: [micro-batches, the schedule's forwards and
    backwards, the optimizer step] (medians; cost_models/calibrate.py, [Note:
    calibrated fits])."""
    from hetpar.runtime import shard

    cpu = torch.device("cpu")
    stage, model_file, args = _reference_stage(cpu)
    shard.apply_tensor_parallel(stage.module, _tp_mesh(world), tp_sharding)
    steps, _ = _timed_reference_steps(stage, model_file, None, cpu, repeats=repeats, wait_section=False)
    return {"steps": steps, "batch_size": reference_model.BATCH[args["size"]], "tp": tp_probe_degree(world)}


def _reference_stage(device: torch.device):
    """profiler/reference_model.py built (seed 0) on ``device`` and cut as one whole-model
    fx stage, its model file and its model args."""
    from hetpar.runtime import shard
    from hetpar.runtime.graph import trace_layers
    from hetpar.runtime.model_file import load_model_file

    args = reference_args(device)
    torch.manual_seed(0)
    model_file = load_model_file(Path(reference_model.__file__), args)
    with torch.device(device):
        model = model_file.build_model()
    names = list(trace_layers(model, example_inputs=model_file.example_inputs(1)).layer_names)
    stage = shard.cut_stage(model, model_file, reference_model.BATCH[args["size"]], (0, len(names) - 1), names)
    stage.module.to(device)
    return stage, model_file, args


def _timed_reference_steps(stage, model_file, sync, device: torch.device, *, repeats: int,
                           wait_section: bool) -> tuple[list[list[float]], list[list[float]]]:
    """The stage's training step at each of ``REFERENCE_MICROBATCHES``: the 1F1B schedule
    of one stage through hetpar's executor, AdamW, the reported loss's all-reduce. Each
    section ends in a ``synchronize`` ([Note: profiler timing]); the executor times the
    forwards and backwards with CUDA events on a GPU ([Note: device timing] in
    runtime/timing.py).

    Returns:
        (steps, passes): medians of [micro-batches, forwards and backwards, (with
        ``wait_section``) the wait for ``sync``'s all-reduce, optimizer step], and of
        [micro-batches, the forwards, the backwards].
    """
    from hetpar.runtime import executor, schedule, timing
    from hetpar.runtime.distributed import Peers
    from hetpar.runtime.training import make_optimizer

    none = Peers(recv_activations_from=None, send_activations_to=(), recv_grads_from=None, send_grads_to=())
    optimizer = make_optimizer(Optimizer.ADAMW, stage.module.parameters(), 1e-6)
    batch = reference_model.BATCH[model_file.model_args["size"]]
    steps, passes = [], []
    for m in REFERENCE_MICROBATCHES:
        pipeline = {0: executor.StageExecutor(stage=stage, peers=none, loss_fn=lambda out, _: out.square().mean(),
                                              num_microbatches=m, device=device,
                                              compute_dtype=DTYPES[compute_dtype(device)],
                                              before_backward=sync.before_backward if sync else None)}
        actions = schedule.make_schedule(Schedule.ONE_F_ONE_B, 1, m, 1)[0]
        data = [(tuple(t.to(device) for t in model_file.example_inputs(batch)), torch.zeros((), device=device))
                for _ in range(m)]

        def train_step() -> list[float]:
            optimizer.zero_grad(set_to_none=True)
            split = timing.StepTimer(device)
            synchronize(device)
            start = time.perf_counter()
            loss = executor.run_actions(pipeline, actions, data, device, times=split)
            synchronize(device)
            computed = time.perf_counter()
            split.settle()
            if sync:
                sync.reduce()
            synchronize(device)
            synced = time.perf_counter()
            optimizer.step()
            synchronize(device)
            stepped = time.perf_counter()
            reported = loss.reshape(1).clone()
            dist.all_reduce(reported)
            float(reported)
            return [computed - start, *([synced - computed] if wait_section else []), stepped - synced, *split.steps[0]]

        dist.barrier()
        *sections, fwd, bwd = median_sections_s(train_step, repeats=repeats)
        steps.append([m, *sections])
        passes.append([m, fwd, bwd])
    return steps, passes


class _TinyTPBlock(nn.Module):
    """Three ops (colwise linear, relu, rowwise linear) as tensor parallelism shards an MLP."""

    OPS, ALL_REDUCES = 3, 2  # the rowwise output in forward, the colwise input gradient in backward

    def __init__(self, width: int, world: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width * world)
        self.down = nn.Linear(width * world, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tp_op_overhead(world: int, *, blocks: int, repeats: int) -> dict[str, float]:
    """Seconds per op, forward plus backward, of tiny blocks sharded with DTensor over
    groups of ``tp_probe_degree(world)`` CPU workers, all at once.

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
