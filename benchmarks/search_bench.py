"""Search wall time and plan quality on large and mixed clusters (issue: the search).

    .venv/bin/python benchmarks/search_bench.py [--quick] > out/search_bench.md
    .venv/bin/python benchmarks/search_bench.py --cli [--busy] > out/search_cli.md

``--cli`` times the whole ``hetpar plan`` command of each target (trace, search, the
heterogeneous data-parallel plan on mixed clusters, prediction and printing) as a user
runs it, the median of three runs; ``--busy`` runs one other CPU-bound process beside it.

Traces each GPT on the meta device (time reported separately), then runs the search as
hetpar plan does (one CP-SAT worker, the deterministic work limit; OR-Tools 9.15 aborted
on the 13B mixed case with two: [Note: deterministic search]) and reports its wall time,
status and proven gap. For the mixed clusters it also plans (a) on the fastest device type alone and (b) with equal layers
per stage on the same devices, and reports the throughput ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.errors import PlanningError  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.planner.search import search  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
# Standard GPT shapes (GPT-3 paper Table 2.1; 1T from Narayanan et al. 2021 Table 1).
MODELS = {
    "1.3B": dict(n_layers=24, hidden=2048, heads=16, seq_len=2048, vocab=51200),
    "13B": dict(n_layers=40, hidden=5120, heads=40, seq_len=2048, vocab=51200),
    "175B": dict(n_layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200),
    "1T": dict(n_layers=128, hidden=25600, heads=160, seq_len=2048, vocab=51200),
}
HOMOGENEOUS = [
    ("1.3B", "1x8xA100-80GB", 512),
    ("13B", "8x8xA100-80GB@200gx8", 1024),
    ("175B", "128x8xA100-80GB@200gx8", 1536),
    ("1T", "384x8xA100-80GB@200gx8", 3072),
]
MIXED = [
    ("1.3B", "1x8xA100-80GB+1x8xV100-32GB+1x8xT4-16GB", "1x8xA100-80GB", 256),
    ("13B", "8x8xA100-80GB@200gx8+12x8xV100-32GB@100gx4+12x8xT4-16GB@50gx1", "8x8xA100-80GB@200gx8", 1024),
    ("13B", "16x8xA100-80GB@200gx8+24x8xV100-32GB@100gx4+24x8xT4-16GB@50gx1", "16x8xA100-80GB@200gx8", 2048),
]


# The targets through the CLI: GPT 1T on 3072 A100s, and Megatron's 39.1B GPT (tied head) on
# 512 devices of three types.
CLI = [
    ("1T", ["examples/gpt.py", "-a", "n_layers=128", "-a", "hidden=25600", "-a", "heads=160", "-a", "seq_len=2048", "-a", "vocab=51200",
            "--cluster", "384x8xA100-80GB@200gx8", "-b", "3072", "--dtype", "bf16"]),
    ("39.1B mixed", ["benchmarks/published/gpt.py", "-a", "n_layers=48", "-a", "hidden=8192", "-a", "heads=64", "-a", "vocab=51200",
                     "-a", "seq_len=2048", "--cluster", "32x8xA100-80GB@200gx8+16x8xV100-32GB@100gx4+16x8xAscend910B",
                     "-b", "1536", "--dtype", "fp16"]),
]


def cli_table(busy: bool) -> None:
    """Median wall time of ``hetpar plan`` for each CLI target, with its status and predicted step."""
    root = Path(__file__).resolve().parent.parent
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        print("| target | wall s (median of 3) | trace s | search s | status | predicted step s | command |")
        print("|---|---|---|---|---|---|---|")
        for name, args in CLI:
            walls, plan = [], None
            for _ in range(3):
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, "-m", "hetpar", "plan", *args, "--json"], cwd=root, capture_output=True, text=True)
                walls.append(time.perf_counter() - t0)
                plan = json.loads(out.stdout)
            s = plan["solver"]
            status = s["status"] + (f" ({s['reason']})" if s.get("reason") else "")
            print(f"| {name} | {statistics.median(walls):.1f} | {s['trace_time_s']:.1f} | {s['search_time_s']:.1f} | {status} | "
                  f"{plan['predicted']['step_time_s']:.2f} | `hetpar plan {' '.join(args)}` |")
    finally:
        if spinner is not None:
            spinner.kill()


def plan(model, cluster_spec, gbs, dtype, **extra):
    cluster = parse_cluster(cluster_spec)
    options = SearchOptions(global_batch_size=gbs, dtype=dtype, **extra)
    t0 = time.perf_counter()
    try:
        result = search(model, cluster, options)
    except PlanningError as exc:
        return None, time.perf_counter() - t0, str(exc)
    return result, time.perf_counter() - t0, ""


def describe(p) -> str:
    s0 = p.stages[0]
    split = "/".join(str(len(s.layers)) for s in p.stages)
    types = "/".join(s.device_type for s in p.stages)
    if len(set(s.device_type for s in p.stages)) == 1:
        types = p.stages[0].device_type
    degrees = {s.tensor_parallel for s in p.stages}
    tp = f"tp{s0.tensor_parallel}" if len(degrees) == 1 else "tp[" + "/".join(str(s.tensor_parallel) for s in p.stages) + "]"
    return f"dp{p.data_parallel} {tp} pp{p.pipeline_parallel} mb{p.micro_batch_size}x{p.num_microbatches} [{split}] {types}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the two smallest cases of each table")
    ap.add_argument("--cli", action="store_true", help="time the whole hetpar plan command of the issue's targets instead")
    ap.add_argument("--busy", action="store_true", help="with --cli: one other CPU-bound process runs meanwhile")
    args = ap.parse_args()
    if args.cli:
        cli_table(args.busy)
        return
    graphs, trace_s = {}, {}
    homogeneous = HOMOGENEOUS[:2] if args.quick else HOMOGENEOUS
    mixed = MIXED[:1] if args.quick else MIXED
    for name in {m for m, *_ in homogeneous} | {m for m, *_ in mixed}:
        t0 = time.perf_counter()
        graphs[name] = trace_model(load_model_file(GPT, MODELS[name]))
        trace_s[name] = time.perf_counter() - t0
    print("| model | cluster | devices | trace s | search s | status | gap | plan | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, spec, gbs in homogeneous:
        p, wall, err = plan(graphs[name], spec, gbs, "bf16")
        n = parse_cluster(spec).world_size
        if p is None:
            print(f"| {name} | {spec} | {n} | {trace_s[name]:.1f} | {wall:.1f} | {err} | | | |")
            continue
        print(f"| {name} | {spec} | {n} | {trace_s[name]:.1f} | {wall:.1f} | {p.solver.status} | {p.solver.objective_gap:.2%} | {describe(p)} | {p.predicted.step_time_s:.3f} |")
    print()
    print("| model | mixed cluster | devices | search s | status | gap | plan | samples/s | vs fastest type only | vs equal split |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, spec, fastest_spec, gbs in mixed:
        p, wall, err = plan(graphs[name], spec, gbs, "fp16")
        only, _, _ = plan(graphs[name], fastest_spec, gbs, "fp16")
        even, _, _ = plan(graphs[name], spec, gbs, "fp16", uniform_split=True)
        n = parse_cluster(spec).world_size
        if p is None:
            print(f"| {name} | {spec} | {n} | {wall:.1f} | {err} | | | | | |")
            continue
        tput = p.predicted.throughput_samples_per_s
        r_only = f"{tput / only.predicted.throughput_samples_per_s:.2f}x" if only else "fastest type alone does not fit"
        r_even = f"{tput / even.predicted.throughput_samples_per_s:.2f}x" if even else "no equal split fits"
        print(f"| {name} | {spec} | {n} | {wall:.1f} | {p.solver.status} | {p.solver.objective_gap:.2%} | {describe(p)} | {tput:.1f} | {r_only} | {r_even} |")


if __name__ == "__main__":
    main()
