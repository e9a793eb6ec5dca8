"""Three readings of an eager layer's memory traffic, on Sailor's GH200 runs and on hetpar's own runs on one H100 and one H200.

    .venv/bin/python benchmarks/kernel_roofline_probe.py      # about 20 s on 2 cores

hetpar's layer time ([Note: layer time] in hetpar/cost_models/compute.py) charges a layer's
matmul FLOPs at the matmul rate and its elementwise traffic at a floor, the bytes it saves
for backward written once and read once; an eager layer also takes no less than the bytes
its kernels read and write take to move ([Note: bytes bound]). The probe prices the same
runs three ways:

- "floor only": without the bound, as hetpar did before 2026-12-07;
- "hetpar": as hetpar does now, the floor or the bound, whichever is longer;
- "roofline per kernel": each traced node (planner.capture's per-node counts, [Note: what a
  kernel costs]) at the larger of its FLOPs at the matmul rate and its bytes at the memory
  rate, summed over the layer's nodes for the forward and the input gradient, plus the
  launches; the weight-gradient time stays. Tensor parallelism scales each node's FLOPs as
  the layer's FLOPs scale and its bytes as the layer's saved bytes do (which nodes split
  is not recorded per node). A stricter reading than the bound: a layer's memory-bound
  kernels cannot borrow the time its compute-bound ones leave over.

Sailor's runs are typed as benchmarks/sailor_bench.py types them (TF32 matmuls, attention
written out in fp32, eager); hetpar's own runs are those of
docs/benchmarks/gpu-validate_h100_2026-12-05.md and gpu-validate_h200_2026-12-04.md
(examples/gpt.py at 350M and 1.3B, bf16, one fused attention call, eager), a check that a
reading does not break what the floor gets right. The readings replace ``layer_timing``
inside planner.estimate.step_costs for the probe's runs only.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sailor_bench  # noqa: E402
from hetpar.cost_models import compute  # noqa: E402
from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.estimate import EstimateConfig, estimate, step_costs  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402


def floor_timing(layer, device, *, tp, micro_batch_size, dtype, kernel_efficiency=None):
    """``layer_timing`` without [Note: bytes bound]: the layer's kernels' bytes left out."""
    return compute.layer_timing(replace(layer, fwd_bytes_accessed=0.0, bwd_bytes_accessed=0.0), device, tp=tp,
                                micro_batch_size=micro_batch_size, dtype=dtype, kernel_efficiency=kernel_efficiency)


def roofline_timing(kernels: dict[str, list[tuple[float, float, float, float]]]):
    """A ``layer_timing`` whose forward and input gradient sum their nodes' rooflines."""

    def timing(layer, device, *, tp, micro_batch_size, dtype, kernel_efficiency=None):
        base = floor_timing(layer, device, tp=tp, micro_batch_size=micro_batch_size, dtype=dtype,
                            kernel_efficiency=kernel_efficiency)
        efficiency = kernel_efficiency or compute.training_efficiency(device)
        flop_rate = device.peak_flops(dtype) * device.matmul_efficiency * efficiency
        byte_rate = device.mem_bw_bytes_per_s * compute.HBM_STREAM_EFFICIENCY * efficiency
        flops_scale = layer.flops_at(tp)[0] / layer.fwd_flops if layer.fwd_flops else 1.0
        split = layer.tp_split_saved_bytes / layer.saved_activation_bytes if layer.saved_activation_bytes else 0.0
        bytes_scale = (1 - split + split / tp) * compute.dtype_bytes(dtype) / 4
        m = micro_batch_size

        def seconds(flops: float, nbytes: float) -> float:
            return max(flops * flops_scale * m / flop_rate, nbytes * bytes_scale * m / byte_rate)

        launch = (getattr(device, "op_overhead_s", None) or compute.DEFAULT_OP_OVERHEAD_S) * layer.num_ops
        fwd = sum(seconds(f, b) for f, b, _, _ in kernels.get(layer.name, []))
        bwd = sum(seconds(f, b) for _, _, f, b in kernels.get(layer.name, []))
        return replace(base, fwd_s=fwd + launch, bwd_input_s=max(bwd - base.bwd_weight_s, 0.0) + launch)

    return timing


# hetpar's own programs on one GPU (the gpu-validate documents): device, model, micro-batch, recompute, measured ms
GPU_RUNS = [("H100-80GB", "350M", 4, "none", 89.3), ("H100-80GB", "350M", 16, "none", 234.3),
            ("H100-80GB", "350M", 16, "full", 283.0), ("H100-80GB", "1.3B", 4, "none", 183.2),
            ("H100-80GB", "1.3B", 8, "none", 321.5), ("H100-80GB", "1.3B", 8, "full", 390.2),
            ("H200-141GB", "350M", 4, "none", 117.7), ("H200-141GB", "350M", 16, "none", 208.7),
            ("H200-141GB", "350M", 16, "full", 254.5), ("H200-141GB", "1.3B", 4, "none", 164.2),
            ("H200-141GB", "1.3B", 8, "none", 290.4), ("H200-141GB", "1.3B", 8, "full", 355.9)]
GPU_MODELS = {"350M": dict(n_layers=24, hidden=1024, heads=16, seq_len=1024, vocab=50304),
              "1.3B": dict(n_layers=24, hidden=2048, heads=16, seq_len=1024, vocab=50304)}


def kernels_of(graph) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per layer, each traced node's (forward FLOPs, bytes, backward FLOPs, bytes)."""
    kernels: dict[str, list[tuple[float, float, float, float]]] = {}
    for node in graph.nodes:
        kernels.setdefault(graph.layers[node.layer].name, []).append(
            (node.fwd_flops, node.fwd_bytes_accessed, node.bwd_flops, node.bwd_bytes_accessed))
    return kernels


def readings_of(kernels) -> dict:
    return {"floor only": floor_timing, "hetpar": compute.layer_timing, "roofline per kernel": roofline_timing(kernels)}


def summarise(errors: dict[str, list[float]]) -> None:
    for name, errs in errors.items():
        print(f"- {name}: median |error| {statistics.median(abs(e) for e in errs):.1%}, worst {max(abs(e) for e in errs):.1%} "
              f"over {len(errs)} measurements")


def gpu_validate() -> None:
    """The table and summary of hetpar's own programs on one H100 and one H200."""
    graphs = {name: trace_model(load_model_file(str(ROOT / "examples" / "gpt.py"), args)) for name, args in GPU_MODELS.items()}
    print("| device | model | micro-batch x 2, recompute | measured ms | " + " | ".join(f"{n} ms" for n in readings_of({})) + " |")
    print("|---|---|---|---:|" + "---:|" * 3)
    errors: dict[str, list[float]] = {name: [] for name in readings_of({})}
    original = step_costs.layer_timing
    try:
        for device, model, mb, recompute, measured in GPU_RUNS:
            config = EstimateConfig(global_batch_size=2 * mb, dp=1, tp=1, pp=1, micro_batch_size=mb, dtype="bf16", recompute=recompute)
            cells = []
            for name, timing in readings_of(kernels_of(graphs[model])).items():
                step_costs.layer_timing = timing
                predicted = estimate(graphs[model], parse_cluster(f"1x1x{device}"), config).predicted.step_time_s * 1e3
                errors[name].append(predicted / measured - 1)
                cells.append(f"{predicted:.1f} ({predicted / measured - 1:+.0%})")
            print(f"| {device} | {model} | {mb}, {recompute} | {measured} | {' | '.join(cells)} |")
    finally:
        step_costs.layer_timing = original
    print()
    summarise(errors)


def main() -> None:
    graph = sailor_bench.trace_model(sailor_bench.load_model_file(str(sailor_bench.GPT),
                                                                   {**sailor_bench.OPT_350M, **sailor_bench.AS_RAN}))
    kernels = kernels_of(graph)
    runs = [r for r in json.loads(sailor_bench.DATA.read_text())["runs"] if r["set"].startswith("clariden")]
    readings = readings_of(kernels)
    print("| run | mbs | measured s (setA / setB) | " + " | ".join(f"{name} s" for name in readings) + " |")
    print("|---|---:|---|" + "---:|" * len(readings))
    errors: dict[str, list[float]] = {name: [] for name in readings}
    original = step_costs.layer_timing
    try:
        cells = []
        for run in runs:
            cluster = parse_cluster(sailor_bench.cluster_spec(run))
            config = sailor_bench.config_of(run, sailor_bench.as_ran_dtype(run))
            row = []
            for name, timing in readings.items():
                step_costs.layer_timing = timing
                predicted = estimate(graph, cluster, config).predicted.step_time_s
                measured = [m for m in run["iter_time_s"].values() if m]
                errors[name] += [predicted / m - 1 for m in measured]
                row.append(f"{predicted:.4g} ({'/'.join(f'{predicted / m - 1:+.0%}' for m in measured)})")
            cells.append(f"| {run['run'].split('/')[-1]} | {run['mbs']} | "
                         f"{' / '.join(f'{m:.4g}' for m in run['iter_time_s'].values() if m)} | {' | '.join(row)} |")
    finally:
        step_costs.layer_timing = original
    print("\n".join(cells))
    print()
    summarise(errors)
    print()
    gpu_validate()


if __name__ == "__main__":
    main()
