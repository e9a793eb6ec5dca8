"""The layers of a user's model file, timed as the generated program runs them
(``hetpar profile --model``), and its modules timed by hooks (benchmarks/layer_bench.py)."""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from hetpar.profiler.clock import CPU, autocast, mark, seconds_between, synchronize
from hetpar.vocabulary import DType, Optimizer


def layer_times(model_path: str, model_args: dict, batch_sizes: list[int], *, repeats: int, device: torch.device = CPU,
                dtype: str = DType.FP32) -> dict:
    """Forward and backward seconds of each of the planner's layers of a model file, at
    each micro-batch size in ``batch_sizes`` (medians over ``repeats``), on ``device``
    under autocast to ``dtype`` (fp32: none).

    The layers are cut one per stage as the generated program cuts stages
    (runtime/graph.py) and run in a chain as its executor runs them: each layer's
    floating-point inputs are leaves that take the gradient its backward hands on, the
    last layer computes the model file's loss on synthetic targets. So a layer's time is
    what the program spends in it, graph module and autograd included, and the times of
    all layers add up to a training micro-batch's compute without any communication.
    Between repeats an AdamW step runs over the model, as between training steps: its
    traffic leaves the caches as cold as the program finds them (back-to-back repeats
    would find the weights cached and time the layers faster than the program runs
    them: docs/benchmarks/validate_cpu-2core_2026-12-03.md).
    cost_models/calibrate.py turns them into the profile's ``layer_corrections``
    ([Note: measured layers] in cost_models/compute.py).

    Returns:
        ``{"model": file name, "model_args", "dtype", "layers": [{"name", "times":
        [[micro-batch, fwd_s, bwd_s], ...]}, ...]}`` in layer order.
    """
    from hetpar.runtime.model_file import load_model_file
    from hetpar.runtime.training import make_optimizer

    spec = load_model_file(Path(model_path), model_args)
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build_model()
    names: list[str] = []
    times: list[list[list[float]]] = []
    optimizer = make_optimizer(Optimizer.ADAMW, model.parameters(), 1e-9)
    for batch in batch_sizes:
        names, stages, inputs, targets = layer_stages(model, spec, batch, device)
        samples = []
        for _ in range(repeats + 2):
            samples.append(chained_pass_s(stages, inputs, targets, spec.loss, device=device, dtype=dtype))
            optimizer.step()  # as between training steps: the optimizer's traffic leaves the caches cold
            optimizer.zero_grad(set_to_none=True)
        samples = samples[2:]
        times.append([[statistics.median(run[i][p] for run in samples) for p in (0, 1)] for i in range(len(stages))])
        model.zero_grad(set_to_none=True)
    return {"model": Path(model_path).name, "model_args": model_args, "dtype": dtype,
            "layers": [{"name": name, "times": [[b, *times[k][i]] for k, b in enumerate(batch_sizes)]}
                       for i, name in enumerate(names)]}


def layer_stages(model: nn.Module, spec, batch: int, device: torch.device = CPU) -> tuple[list[str], list, tuple, object]:
    """(layer names, one stage per layer, inputs, targets) of ``model`` on a synthetic
    batch of ``batch`` samples from its model file ``spec``, the batch on ``device``."""
    from hetpar.runtime.graph import build_stage, record_values, trace_layers

    inputs, targets = next(iter(spec.batches(batch, 0)))
    inputs = tuple(t.to(device) for t in inputs)
    layered = trace_layers(model, example_inputs=inputs)
    values = record_values(layered, inputs)
    stages = [build_stage(layered, values, i, i) for i in range(layered.num_layers)]
    return list(layered.layer_names), stages, inputs, targets.to(device)


def chained_pass_s(stages, inputs: tuple, targets, loss_fn, *, device: torch.device = CPU,
                   dtype: str = DType.FP32) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each one-layer stage in one training micro-batch;
    the parameters' gradients accumulate as one backward of the whole model's would.
    Each layer's time lies between two ``mark``s, read after one synchronize at the
    pass's end ([Note: profiler timing] in profiler/clock.py)."""
    fwd, kept, received = [], [], ()
    synchronize(device)
    for stage in stages:
        leaves = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in received)
        start = mark(device)
        with autocast(device, dtype):
            out = stage.module(*[inputs[i] for i in stage.model_inputs], *leaves)
            if stage.is_last:
                out = loss_fn(out, targets)
        fwd.append((start, mark(device)))
        kept.append((leaves, out))
        received = out if not stage.is_last else ()
    bwd, grads = [None] * len(stages), None
    for i in reversed(range(len(stages))):
        leaves, out = kept[i]
        start = mark(device)
        if stages[i].is_last:
            out.backward()
        else:
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [l.grad if l.is_floating_point() else None for l in leaves]
        bwd[i] = (start, mark(device))
    synchronize(device)
    return [(seconds_between(*f), seconds_between(*b)) for f, b in zip(fwd, bwd)]


def module_times(model: nn.Module, inputs: tuple, *, repeats: int) -> list[dict]:
    """Forward and backward seconds of each child module of ``model`` on the CPU, by
    hooks, median over repeats.

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
