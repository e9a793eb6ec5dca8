"""Two-zone clusters and the time/energy trade-off (issue 23).

    .venv/bin/python benchmarks/zones_energy_bench.py > out/zones_energy_bench.md

Table 1: a GPT planned on one zone of A100 nodes, on two such zones joined by a WAN
link (cost_models/collectives.py, [Note: collectives across zones]) at two link speeds,
with plain data parallelism and with local SGD (``--sync-every 8 --sync-scope node``),
and on the same devices as one site: what crossing the WAN costs and what the plan does
about it. Table 2: the same GPT on a mixed A100 + V100 cluster, the fastest plan
(``--objective time``) against ``--objective energy`` at throughput floors of 75%, 50%
and 25% of it: the sub-cluster each picks, its step, and joules per step and per sample
([Note: energy model] in cost_models/energy.py). Deterministic: the same tables on any
machine (search times aside).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpar.cost_models.cluster import cluster_from_dict, parse_cluster  # noqa: E402
from hetpar.planner.api import plan_graph  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.planner.strategies import DataParallelSync, Objective, with_energy  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
MODEL = dict(n_layers=24, hidden=1024, heads=16, seq_len=1024, vocab=51200)  # GPT-3 350M's shape (Brown et al. 2020, Table 2.1), 1k context
BATCH = 64
ZONE = "1x8xA100-80GB"
MIXED = "1x8xA100-80GB+1x8xV100-32GB"


def two_zones(gbps: float, latency_ms: float):
    group = {"nodes": 1, "devices_per_node": 8, "device": "A100-80GB"}
    return cluster_from_dict({"group": [{**group, "zone": "west"}, {**group, "zone": "east"}],
                              "link": [{"zones": ["west", "east"], "gbps": gbps, "latency_ms": latency_ms}]},
                             spec=f"2 zones x {ZONE}, {gbps:g} Gb/s {latency_ms:g} ms")


def layout(plan) -> str:
    tps = sorted({s.tensor_parallel for s in plan.stages})
    return (f"dp {plan.data_parallel} tp {'/'.join(map(str, tps))} pp {plan.pipeline_parallel}, "
            f"micro-batch {plan.micro_batch_size}x{plan.num_microbatches} {plan.schedule.value}")


def main() -> None:
    graph = trace_model(load_model_file(GPT, MODEL))
    options = SearchOptions(global_batch_size=BATCH, dtype="fp16", workers=1)
    local_sgd = DataParallelSync(sync_every=8, sync_scope="node")
    print(f"GPT {MODEL}, global batch {BATCH}, fp16; hetpar plan, hetero-DP off.\n")
    print("| cluster | sync | plan | step | samples/s | dp comm | pp comm | search |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(parse_cluster(ZONE), None), (two_zones(100, 20), None), (two_zones(100, 20), local_sgd),
            (two_zones(10, 40), None), (two_zones(10, 40), local_sgd), (parse_cluster("2x8xA100-80GB"), None)]
    for cluster, sync in rows:
        start = time.perf_counter()
        plan = plan_graph(graph, cluster, options, hetero_dp="off", sync=sync)
        p = plan.predicted
        print(f"| {cluster.spec} | {'local SGD every 8, node' if sync else 'all-reduce'} | {layout(plan)} | "
              f"{p.step_time_s * 1e3:.1f} ms | {p.throughput_samples_per_s:.1f} | {p.dp_comm_time_s * 1e3:.1f} ms | "
              f"{p.pp_comm_time_s * 1e3:.1f} ms | {time.perf_counter() - start:.0f} s |")
    mixed = parse_cluster(MIXED)
    fastest = with_energy(plan_graph(graph, mixed, options, hetero_dp="off"), mixed)
    print(f"\nMixed cluster {MIXED}; power_w from the profiles' datasheet TDPs, waiting at 30% of it.\n")
    print("| objective | floor (samples/s) | devices used | plan | step | samples/s | J/step | J/sample | search |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [("time", 0.0)] + [("energy", share * fastest.predicted.throughput_samples_per_s) for share in (0.75, 0.5, 0.25)]
    for kind, floor in rows:
        start = time.perf_counter()
        plan = fastest if kind == "time" else plan_graph(graph, mixed, options, hetero_dp="off",
                                                         objective=Objective(kind="energy", min_throughput_samples_per_s=floor))
        p = plan.predicted
        print(f"| {kind} | {floor:.1f} | {plan.cluster.spec} | {layout(plan)} | {p.step_time_s * 1e3:.1f} ms | "
              f"{p.throughput_samples_per_s:.1f} | {p.energy_j_per_step:.0f} | {p.energy_j_per_step / BATCH:.2f} | "
              f"{time.perf_counter() - start:.0f} s |")


if __name__ == "__main__":
    main()
