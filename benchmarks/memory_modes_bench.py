"""Predicted against measured activation memory per rank, for sequence parallelism,
context parallelism and the recompute modes, on CPU (issue 32).

    .venv/bin/python benchmarks/memory_modes_bench.py                        # both models, every mode
    .venv/bin/python benchmarks/memory_modes_bench.py --models gpt --modes none,selective,full

For each model and mode, ``hetpar.planner.plan_model`` plans one pipeline stage with the
mode's degrees pinned (dp 1, pp 1, one micro-batch of ``--micro-batch`` rows, fp32) and
``planner.estimate`` predicts the rank's memory ([Note: activations kept per
micro-batch] in cost_models/memory.py). Then every rank of the plan builds its stage as
the compiled program does (``shard.cut_stage`` with the plan's recompute, tensor-,
context- and sequence-parallel settings, ``shard.apply_tensor_parallel``), runs one
micro-batch forward, the model file's loss and backward under torch.profiler with
``profile_memory``, and reads every CPU allocation and free of the step (the c10 CPU
allocator reports each one with its size). Parameter gradients are dropped as soon as
they are accumulated, so that the curve holds the activations and the step's
temporaries only. Two numbers per rank, each against its prediction:

- kept: bytes allocated in the forward (and the loss) and still alive when backward
  starts, less what the loss alone keeps (its log-softmax, [B, T, V]: the model graph
  has no loss layer, so no prediction counts it; measured on its own and reported).
  Predicted: ``activation_bytes_per_microbatch`` (what the layers keep for backward).
- peak: the most bytes alive above the step's start, forward to the end of backward,
  less the loss's. Predicted: the estimate's ``activations_bytes`` (kept, plus under
  recompute the workspace of rebuilding the largest layer).

Weights, gradients and optimizer state are left out on both sides: they are formulas of
the parameter count (checked elsewhere), and here a small share of the total.

Ranks run under torchrun (gloo, OMP_NUM_THREADS=1), one mode at a time; modes of one
rank run in this process. Results: docs/benchmarks/memory-modes_cpu-2core_2026-12-06.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "benchmarks" / "models" / "llama.py"  # a Hugging Face LlamaForCausalLM from a config
# Activations dominate: seq 512 x hidden 128 per row against 2 blocks of 0.2M parameters;
# a small vocabulary keeps the loss's [B, T, V] log-softmax (not predicted) small.
MODELS = {
    "gpt": (GPT, {"n_layers": 2, "hidden": 128, "heads": 4, "seq_len": 512, "vocab": 64}),
    "llama": (LLAMA, {"n_layers": 2, "hidden": 128, "heads": 4, "kv_heads": 4, "ffn": 344, "vocab": 64,
                      "seq_len": 512}),
}
# mode -> (tp, cp, sequence parallel, recompute)
MODES = {
    "tp2": (2, 1, False, "none"),
    "tp2_sp": (2, 1, True, "none"),
    "cp2": (1, 2, False, "none"),
    "cp2_tp2_sp": (2, 2, True, "none"),
    "none": (1, 1, False, "none"),
    "selective": (1, 1, False, "selective"),
    "full": (1, 1, False, "full"),
}
MICRO_BATCH = 2


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted activation bytes (fp32, one micro-batch in flight)."""

    kept_bytes: float  # activation_bytes_per_microbatch
    workspace_bytes: float  # recompute_workspace_bytes
    activations_bytes: float  # the estimate's stage memory term: kept + workspace here


def mode_plan(model: Path, args: dict, mode: str, micro_batch_size: int = MICRO_BATCH):
    """The planner's plan of one stage with ``mode``'s degrees pinned."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    tp, cp, sp, recompute = MODES[mode]
    options = SearchOptions(global_batch_size=micro_batch_size, dtype="fp32", schedule="1f1b", dp=1, tp=tp, pp=1, cp=cp,
                            micro_batch_size=micro_batch_size, recompute=recompute,
                            sequence_parallel="on" if sp else "off")
    plan = plan_model(model, parse_cluster(f"1x{tp * cp}xcpu"), options, model_args=args)
    stage = plan.stages[0]
    got = (stage.tensor_parallel, plan.context_parallel, stage.sequence_parallel, stage.recompute)
    if got != (tp, cp, sp, recompute) or plan.micro_batch_size != micro_batch_size:
        raise SystemExit(f"{mode}: the planner made tp, cp, sp, recompute {got}, micro-batch {plan.micro_batch_size}")
    return plan


def predict(plan) -> Prediction:
    """What ``planner.estimate`` predicts for the plan's (only) stage, and its two parts."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.cost_models.memory import (
        activation_bytes_per_microbatch,
        recompute_workspace_bytes,
    )
    from hetpar.planner.capture.trace import trace_model
    from hetpar.planner.estimate import estimate
    from hetpar.planner.explain import estimate_config
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file(plan.model.file, plan.model.args))
    config = estimate_config(plan, graph)
    memory = estimate(graph, parse_cluster(plan.cluster.spec), config).stages[0].memory
    local = graph.at_context(config.cp)  # as estimate and planner.estimate.memory.rank_memory count one rank
    layers = [l.with_sequence_parallel() for l in local.layers] if config.sp_of(0) else local.layers
    common = {"tp": config.tp, "micro_batch_size": config.micro_batch_size, "dtype": config.dtype, "recompute": config.recompute_of(0)}
    kept = activation_bytes_per_microbatch(layers, input_bytes=local.input_bytes, **common)
    workspace = recompute_workspace_bytes(layers, **common)
    return Prediction(kept_bytes=kept, workspace_bytes=workspace, activations_bytes=memory.activations_bytes)


# ----------------------------------------------------------------------------- measurement

_MARK = "hetpar_memory_mark"


def _allocations(prof) -> list[tuple[int, int, int, str]]:
    """Every CPU allocation (+bytes) and free (-bytes) the profile recorded, with its address,
    and the marks (address 0), in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, ""))
        elif e.name.startswith(_MARK):
            events.append((e.start_time_ns, 0, 0, e.name.removeprefix(_MARK + ":")))
    return sorted(events, key=lambda x: x[0])


def live_bytes(run) -> dict[str, int]:
    """Run ``run(mark)`` under the profiler: bytes alive above its start at each ``mark(name)``,
    the peak, and ``unpaired``: bytes of allocations whose free the profile did not record.

    The profiler records what the threads it profiles allocate and free; a tensor whose
    last reference a gloo thread drops (a collective's buffer, held by its work object)
    is freed unseen. Such allocations are left out of the curve, and their bytes reported.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    def mark(name: str) -> None:
        with record_function(f"{_MARK}:{name}"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(mark)
    events = _allocations(prof)
    unseen, opened = set(), {}  # allocations whose free went unrecorded; the open allocation at each address
    for i, (_, nbytes, ptr, name) in enumerate(events):
        if name:
            continue
        if nbytes > 0 and ptr in opened:  # the address came back before a recorded free
            unseen.add(opened[ptr])
        if nbytes > 0:
            opened[ptr] = i
        else:
            opened.pop(ptr, None)
    unseen |= set(opened.values())
    live, out, alive = 0, {"peak": 0}, {}
    for i, (_, nbytes, ptr, name) in enumerate(events):
        if name:
            out[name] = live
        elif nbytes > 0 and i not in unseen:
            alive[ptr] = nbytes
            live += nbytes
        elif nbytes < 0 and ptr in alive:
            live -= alive.pop(ptr)
        out["peak"] = max(out["peak"], live)
    out["unpaired"] = sum(events[i][1] for i in unseen)
    return out


def build_stage(plan, tp_mesh=None, cp_mesh=None):
    """This rank's stage of ``plan``'s only stage, cut as the compiled program cuts it."""
    from hetpar.runtime import shard
    from hetpar.runtime.graph import trace_layers
    from hetpar.runtime.model_file import load_model_file

    stage_plan = plan.stages[0]
    model_file = load_model_file(plan.model.file, plan.model.args)
    torch.manual_seed(0)
    model = model_file.build_model()
    names = list(trace_layers(model, example_inputs=model_file.example_inputs(1)).layer_names)
    tp = stage_plan.tensor_parallel
    stage = shard.cut_stage(model, model_file, plan.micro_batch_size, (stage_plan.layers[0], stage_plan.layers[-1]), names, tuple(plan.model.leaf_modules),
                            recompute=stage_plan.recompute, tensor_parallel=tp,
                            tp_sharding=stage_plan.tp_sharding if tp > 1 else None, cp_mesh=cp_mesh,
                            sequence_parallel=stage_plan.sequence_parallel)
    if tp > 1:
        shard.apply_tensor_parallel(stage.module, tp_mesh, stage_plan.tp_sharding, stage_plan.tp_parts)
    return model_file, stage


def measure(plan, tp_mesh=None, cp_mesh=None, cp_index: int = 0) -> dict[str, int]:
    """One micro-batch's forward, loss and backward on this rank: bytes kept when backward
    starts and the peak, each less what the loss alone keeps (``loss_bytes``, also returned)."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from hetpar.runtime.context import split_sequence
    from hetpar.runtime.model_file import first_tensor

    model_file, stage = build_stage(plan, tp_mesh, cp_mesh)
    module = stage.module
    vocab_split = "vocab_head" in plan.stages[0].tp_sharding.values() and plan.stages[0].tensor_parallel > 1
    for p in module.parameters():  # the curve holds activations and temporaries, not the gradients
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    (inputs, targets), = [next(model_file.batches(plan.micro_batch_size, 0))]
    cp = plan.context_parallel
    if cp > 1:
        inputs, targets = tuple(split_sequence(t, cp, cp_index) for t in inputs), split_sequence(targets, cp, cp_index)

    inputs = [inputs[k] for k in stage.model_inputs]

    def step(mark) -> None:
        with loss_parallel() if vocab_split else contextlib.nullcontext():  # as the program runs a split head's loss
            loss = model_file.loss(module(*inputs), targets)
            mark("kept")
            loss.backward()

    step(lambda name: None)  # a first step: lazy buffers (DTensor caches, gloo) are not the step's
    whole = live_bytes(step)
    with torch.no_grad():
        output = first_tensor(module(*inputs))  # the logits, split over the vocabulary where the head is

    def loss_only(mark) -> None:
        logits = output.detach().requires_grad_()
        with loss_parallel() if vocab_split else contextlib.nullcontext():
            loss = model_file.loss(logits, targets)
            mark("kept")
            loss.backward()

    alone = live_bytes(loss_only)
    loss_bytes = alone["kept"]  # the leaf shares the logits' storage, allocated before
    return {"kept_bytes": whole["kept"] - loss_bytes, "peak_bytes": whole["peak"] - loss_bytes, "loss_bytes": loss_bytes,
            "unpaired_bytes": whole["unpaired"]}


def worker(plan_path: Path, out: Path) -> None:
    """One rank of a plan under torchrun: its measurement, appended to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hetpar.planner.plan import ParallelPlan

    plan = ParallelPlan.load(plan_path)
    dist.init_process_group("gloo")
    tp, cp = plan.stages[0].tensor_parallel, plan.context_parallel
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))  # rank = cp index * tp + tp index
    cp_mesh = mesh["cp"] if cp > 1 else None
    result = measure(plan, mesh["tp"] if tp > 1 else None, cp_mesh, mesh.get_local_rank("cp"))
    with open(out, "a") as f:
        f.write(json.dumps({"rank": dist.get_rank(), **result}) + "\n")
    dist.destroy_process_group()


def run_mode(model: str, mode: str, work: Path, timeout_s: float = 300, model_args: dict | None = None) -> dict:
    """Plan, predict and measure ``mode`` for ``model`` (``MODELS``' arguments, or ``model_args``): one row per rank."""
    from hetpar.runtime.cli import free_port

    path, args = MODELS[model]
    args = model_args or args
    plan = mode_plan(path, args, mode)
    prediction = predict(plan)
    world = plan.cluster.world_size
    start = time.perf_counter()
    if world == 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{work}/{model}-{mode}.store", rank=0, world_size=1)
        try:
            ranks = [{"rank": 0, **measure(plan)}]
        finally:
            dist.destroy_process_group()
    else:
        plan_path, out = work / f"{model}-{mode}.json", work / f"{model}-{mode}.jsonl"
        plan_path.write_text(plan.to_json())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               str(Path(__file__).resolve()), "--worker", str(plan_path), str(out)]
        result = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise SystemExit(f"{model} {mode} failed:\n{result.stderr[-4000:]}")
        ranks = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    return {"model": model, "mode": mode, "predicted": prediction.__dict__, "ranks": ranks,
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hetpar-memory-modes-") as tmp:
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                rows.append(run_mode(model, mode, Path(tmp)))
                if not args.json:
                    _print_row(rows[-1])
    if args.json:
        print(json.dumps(rows, indent=2))


def _print_row(row: dict) -> None:
    p = row["predicted"]
    for r in row["ranks"]:
        print(f"{row['model']:6} {row['mode']:11} rank {r['rank']}  kept {p['kept_bytes'] / 2**20:7.3f} / "
              f"{r['kept_bytes'] / 2**20:7.3f} MiB ({r['kept_bytes'] / p['kept_bytes']:.3f})   peak "
              f"{p['activations_bytes'] / 2**20:7.3f} / {r['peak_bytes'] / 2**20:7.3f} MiB "
              f"({r['peak_bytes'] / p['activations_bytes']:.3f})   loss {r['loss_bytes'] / 2**20:.3f} MiB, "
              f"unpaired {r['unpaired_bytes'] / 2**20:.3f} MiB", flush=True)


if __name__ == "__main__":
    main()
