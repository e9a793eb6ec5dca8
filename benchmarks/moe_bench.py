"""Mixture-of-experts plans against published MoE training figures.

    python benchmarks/moe_bench.py

Plans Hugging Face's Mixtral 8x7B (its default config, 4096 tokens per sample, bf16,
global batch 256) on clusters of A100-80GB and H100-80GB, searched and with expert
parallelism pinned to 1, and prints each plan's layout, predicted tokens/s per GPU,
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

SEQ, BATCH = 4096, 256
CLUSTERS = ("4x8xA100-80GB", "8x8xH100-80GB")


def main() -> None:
    model_file = load_model_file(ROOT / "tests/models/hf_default_zoo.py", {"family": "mixtral", "size": "default", "seq": SEQ})
    graph = trace_model(model_file)
    flops = sum(l.fwd_flops + l.bwd_flops for l in graph.layers)
    print(f"Mixtral 8x7B: {sum(l.params for l in graph.layers) / 1e9:.1f}B parameters, "
          f"{flops / 1e12:.1f} TFLOP per sample of {SEQ} tokens (forward and backward)")
    print("| cluster | ep | plan | search | tokens/s per GPU | TFLOP/s per GPU | MFU | all-to-all per step |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in CLUSTERS:
        cluster = parse_cluster(spec)
        peak = cluster.profile(cluster.device_types()[0]).peak_flops("bf16")
        for ep in (None, 1):
            start = time.perf_counter()
            plan = plan_graph(graph, cluster, SearchOptions(global_batch_size=BATCH, dtype="bf16", ep=ep, compiled=True))
            seconds = time.perf_counter() - start
            p, world = plan.predicted, cluster.world_size
            per_gpu = flops * BATCH / p.step_time_s / world
            layout = (f"dp {plan.data_parallel} ep {plan.stages[0].expert_parallel} tp {plan.stages[0].tensor_parallel} "
                      f"pp {plan.pipeline_parallel}, mb {plan.micro_batch_size} x {plan.num_microbatches} {plan.schedule.value}")
            print(f"| {spec} | {'searched' if ep is None else 'pinned 1'} | {layout} | {seconds:.1f} s, {plan.solver.status} | "
                  f"{BATCH * SEQ / p.step_time_s / world:,.0f} | {per_gpu / 1e12:.0f} | {per_gpu / peak:.1%} | "
                  f"{p.ep_comm_time_s * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
