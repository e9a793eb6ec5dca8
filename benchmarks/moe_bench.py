"""Mixture-of-experts plans against published MoE training figures.

    python benchmarks/moe_bench.py

Plans Hugging Face's Mixtral 8x7B (its default config, 4096 tokens per sample, bf16,
global batch 256) on clusters of A100-80GB and H100-80GB, searched and with expert
parallelism pinned to 1, and DeepSeek-V3 (its default config, 4096 tokens, global batch
1024) on 32 x 8 H100-80GB, and prints each plan's layout, predicted tokens/s per GPU,
TFLOP/s per GPU (the traced FLOPs: attention, router and the experts a token meets) and
MFU. The published figures it is read against are in docs/benchmarks/moe_*.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.api import plan_graph  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

SEQ = 4096
# (name, model file, model args, global batch, [(cluster, expert-parallel pins)])
RUNS = [
    ("Mixtral 8x7B", "tests/models/hf_default_zoo.py", {"family": "mixtral", "size": "default", "seq": SEQ}, 256,
     [("4x8xA100-80GB", (None, 1)), ("8x8xH100-80GB", (None, 1))]),
    ("DeepSeek-V3", "tests/models/hf_moe_zoo.py", {"family": "deepseek_v3", "size": "default"}, 1024,
     [("32x8xH100-80GB", (None,))]),
]


def main() -> None:
    print("| model | cluster | ep | plan | search | tokens/s per GPU | TFLOP/s per GPU | MFU | all-to-all per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, path, args, batch, clusters in RUNS:
        model_file = load_model_file(ROOT / path, args)
        graph = trace_model(model_file)
        tokens = model_file.example_inputs(1)[0].numel()
        flops = sum(l.fwd_flops + l.bwd_flops for l in graph.layers)
        print(f"{name}: {sum(l.params for l in graph.layers) / 1e9:.1f}B parameters, "
              f"{flops / 1e12:.1f} TFLOP per sample of {tokens} tokens (forward and backward)", file=sys.stderr)
        for spec, pins in clusters:
            cluster = parse_cluster(spec)
            peak = cluster.profile(cluster.device_types()[0]).peak_flops("bf16")
            for ep in pins:
                start = time.perf_counter()
                plan = plan_graph(graph, cluster, SearchOptions(global_batch_size=batch, dtype="bf16", ep=ep, compiled=True))
                seconds = time.perf_counter() - start
                p, world = plan.predicted, cluster.world_size
                per_gpu = flops * batch / p.step_time_s / world
                layout = (f"dp {plan.data_parallel} ep {plan.stages[0].expert_parallel} tp {plan.stages[0].tensor_parallel} "
                          f"pp {plan.pipeline_parallel}, mb {plan.micro_batch_size} x {plan.num_microbatches} "
                          f"{plan.schedule.value}")
                print(f"| {name} | {spec} | {'searched' if ep is None else 'pinned 1'} | {layout} | {seconds:.1f} s, "
                      f"{plan.solver.status} | {batch * tokens / p.step_time_s / world:,.0f} | {per_gpu / 1e12:.0f} | "
                      f"{per_gpu / peak:.1%} | {p.ep_comm_time_s * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
