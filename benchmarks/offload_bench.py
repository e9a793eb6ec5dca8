"""Offload where memory binds (issue 32, item 4): what the search plans with and without it.

    .venv/bin/python benchmarks/offload_bench.py

For each case, the search (``planner.api.plan_graph``, the library's defaults) runs with
``--offload off`` and with the default ``auto`` ([Note: offload search] in
hetpar/planner/search/solve.py): without offload it returns a plan or the one-line misfit,
with it the plan, which stages offload their ZeRO-3 shard, the predicted step and how
much of it is data-parallel communication, the host link (the offload transfers) and the
optimizer step on the host CPUs ([Note: offload costs] in hetpar/cost_models/offload.py).
Predictions for clusters this project does not have; only the wall times depend on the
machine.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.api import plan_graph  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.errors import PlanningError  # noqa: E402
from hetpar.planner.estimate import estimate  # noqa: E402
from hetpar.planner.explain import estimate_config  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

GPT = ROOT / "benchmarks" / "published" / "gpt.py"
SHAPES = {  # GPT-3's shapes (Brown et al. 2020, Table 2.1), sequence 2048
    "6.7B": dict(n_layers=32, hidden=4096, heads=32, vocab=51200, seq_len=2048),
    "13B": dict(n_layers=40, hidden=5120, heads=40, vocab=51200, seq_len=2048),
}
CASES = [
    ("6.7B", "1x4xV100-16GB", 8),
    ("6.7B", "1x2xA100-40GB", 8),
    ("13B", "1x4xA100-40GB", 16),
    ("13B", "1x2xGH200-96GB", 8),
]


def describe(plan) -> str:
    s = plan.stages
    stages = ", ".join(f"tp {x.tensor_parallel}{' sp' if x.sequence_parallel else ''} {x.recompute} zero {x.zero_stage}"
                       f"{' offload' if x.offload else ''}" for x in s)
    return f"dp {plan.data_parallel} x pp {plan.pipeline_parallel}, mb {plan.micro_batch_size} x {plan.num_microbatches}: {stages}"


def main() -> None:
    print("| model | cluster | batch | without offload | with `--offload auto` | predicted step | dp comm | host link | "
          "optimizer on host | peak per device | wall s |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    graphs = {}
    for name, cluster_spec, batch in CASES:
        graph = graphs.setdefault(name, trace_model(load_model_file(str(GPT), SHAPES[name])))
        cluster = parse_cluster(cluster_spec)
        options = SearchOptions(global_batch_size=batch, dtype="bf16" if "V100" not in cluster_spec else "fp16")
        try:
            plain = plan_graph(graph, cluster, dataclasses.replace(options, offload="off"))
            without = f"{describe(plain)}; {plain.predicted.step_time_s:.3f} s"
        except PlanningError as exc:
            without = str(exc).split(";")[0]
        t0 = time.perf_counter()
        plan = plan_graph(graph, cluster, options)
        wall = time.perf_counter() - t0
        breakdown = estimate(graph, cluster, estimate_config(plan, graph)).time
        print(f"| {name} | {cluster_spec} | {batch} | {without} | {describe(plan)} | {plan.predicted.step_time_s:.3f} s | "
              f"{breakdown.dp_comm_s:.3f} s | {breakdown.host_comm_s:.3f} s | {breakdown.optimizer_s:.3f} s | "
              f"{max(plan.predicted.peak_memory_bytes) / 2**30:.1f} GiB | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
