"""Data-parallel sync methods on a cluster with a slow inter-node link (issue: slow links).

    .venv/bin/python benchmarks/sync_bench.py > out/sync_bench.md

Plans a GPT on nodes joined by one slow NIC each. Table 1: one layout (data parallelism
across the nodes, ZeRO 0) estimated under each sync method: what each method alone
changes. Table 2: the search run once per sync method pinned (as ``hetpar plan
--grad-compression M``, ``--aggregation R`` or ``--sync-every K`` would) and once with
``--allow-lossy-sync``: the plan it picks and the step the estimate predicts for it.
Deterministic: the same tables on any machine (search times aside).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from dataclasses import replace  # noqa: E402

from hetpar.planner.api import plan_graph  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.estimate import estimate  # noqa: E402
from hetpar.planner.explain import estimate_config  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.planner.strategies import DataParallelSync, cost_method, matrix_width  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
MODEL = dict(n_layers=24, hidden=2048, heads=16, seq_len=2048, vocab=51200)  # GPT-3 1.3B (Brown et al. 2020, Table 2.1)
CLUSTER = "4x8xA100-80GB@10gx1"  # four 8-GPU nodes, one 10 Gb/s NIC each
BATCH = 512
METHODS = [
    ("exact all-reduce", DataParallelSync()),
    ("bf16", DataParallelSync(grad_compression="bf16")),
    ("powersgd:1", DataParallelSync(grad_compression="powersgd:1")),
    ("powersgd:4", DataParallelSync(grad_compression="powersgd:4")),
    ("topk:0.01", DataParallelSync(grad_compression="topk:0.01")),
    ("topk:0.001", DataParallelSync(grad_compression="topk:0.001")),
    ("sign", DataParallelSync(grad_compression="sign")),
    ("trimmed-mean:1", DataParallelSync(aggregation="trimmed-mean:1")),
    ("krum:1", DataParallelSync(aggregation="krum:1")),
    ("local SGD, K=8", DataParallelSync(sync_every=8)),
    ("local SGD, K=8 across nodes", DataParallelSync(sync_every=8, sync_scope="node")),
    ("--allow-lossy-sync", DataParallelSync(allow_lossy=True)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=CLUSTER)
    args = parser.parse_args()
    graph = trace_model(load_model_file(GPT, MODEL))
    cluster = parse_cluster(args.cluster)
    options = SearchOptions(global_batch_size=BATCH, dtype="bf16")
    print(f"GPT 1.3B, global batch {BATCH}, bf16, on {args.cluster}\n")
    same_layout(graph, cluster, options)
    print("\n| sync | plan picked | step (s) | dp comm (s) | samples/s | vs exact | search (s) |")
    print("|---|---|---|---|---|---|---|")
    exact = None
    for name, sync in METHODS:
        t0 = time.perf_counter()
        plan = plan_graph(graph, cluster, options, sync=sync)
        elapsed = time.perf_counter() - t0
        p = plan.predicted
        exact = exact or p.step_time_s
        layout = (f"dp {plan.data_parallel} tp {plan.stages[0].tensor_parallel} pp {plan.pipeline_parallel}, "
                  f"mb {plan.micro_batch_size}x{plan.num_microbatches} {plan.schedule.value}, "
                  f"layers {'/'.join(str(len(s.layers)) for s in plan.stages)}")
        if name == "--allow-lossy-sync":
            layout += f", picks {plan.grad_compression}"
        print(f"| {name} | {layout} | {p.step_time_s:.3f} | {p.dp_comm_time_s:.3f} | {p.throughput_samples_per_s:.1f} | "
              f"{exact / p.step_time_s:.2f}x | {elapsed:.1f} |")


def same_layout(graph, cluster, options: SearchOptions) -> None:
    """Table 1: the best plan with data parallelism over every node (dp = nodes, tp = node width,
    pp 1, ZeRO 0), estimated under each method."""
    nodes, width = len(cluster.groups) and cluster.world_size // 8, 8
    base = plan_graph(graph, cluster, replace(options, dp=nodes, tp=width, pp=1, zero=0))
    config = estimate_config(base, graph)
    print(f"Same layout for every method: dp {nodes} (one replica per node) x tp {width}, "
          f"micro-batch {base.micro_batch_size}x{base.num_microbatches}, ZeRO 0\n")
    print("| sync | step (s) | dp comm (s) | vs exact |")
    print("|---|---|---|---|")
    exact = None
    for name, sync in METHODS[:-1]:
        method = cost_method(sync.grad_compression or "none", sync.aggregation, sync.sync_every, sync.sync_scope,
                             optimizer="adamw", width=matrix_width(graph.layers))
        t = estimate(graph, cluster, replace(config, sync=method)).time
        exact = exact or t.step_s
        print(f"| {name} | {t.step_s:.3f} | {t.dp_comm_s:.3f} | {exact / t.step_s:.2f}x |")


if __name__ == "__main__":
    main()
