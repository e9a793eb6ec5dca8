"""Megatron's SC'21 Table 1 configurations typed as published, through the CLI (issue 20).

    .venv/bin/python benchmarks/published_as_typed.py [--no-plan] [--fused-qkv] > out/published_as_typed.md

For each row from 7.5B up (Narayanan et al. 2021, Table 1; benchmarks/cost_model_published.py
holds the rows): ``hetpar estimate`` with the published t, p, d, micro-batch, schedule
(interleaved with its virtual stages where the paper used it), full recompute and no
``--stage-layers`` (so Megatron's default split, [Note: default stage split]), and its
TFLOP/s per GPU (the paper's Eq. 3 FLOPs over the predicted step) against the paper's;
then ``hetpar plan`` on the same model, cluster and batch, whose predicted step should
be no slower than the published configuration's under the same cost model.
``--fused-qkv`` types the same rows with Megatron's own fused ``query_key_value``
(benchmarks/published/gpt.py's ``fused_qkv=1``; issue 30).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cost_model_published", ROOT / "benchmarks" / "cost_model_published.py")
published = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = published  # dataclasses look their module up
_spec.loader.exec_module(published)

LABELS = ("7.5B", "18.4B", "39.1B", "76.1B", "145.6B", "310.1B", "529.6B", "1008B")


def hetpar(*args: str) -> tuple[dict, float]:
    """Run ``python -m hetpar ARGS --json``; (its JSON, wall seconds)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hetpar", *args, "--json"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"hetpar {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout), time.perf_counter() - start


def model_args(row, fused_qkv: bool = False) -> list[str]:
    model = {**row.model, **({"fused_qkv": 1} if fused_qkv else {})}
    return [a for k, v in model.items() for a in ("-a", f"{k}={str(v).lower() if isinstance(v, bool) else v}")]


def estimate_args(row, fused_qkv: bool = False) -> list[str]:
    schedule = ["--schedule", row.schedule] + (["--virtual-stages", str(row.virtual)] if row.virtual > 1 else [])
    return ["estimate", published.MODEL_FILE, *model_args(row, fused_qkv), "--cluster", published.cluster_spec(row),
            "--global-batch", str(row.global_batch), "--dp", str(row.dp), "--tp", str(row.tp), "--pp", str(row.pp),
            "--micro-batch-size", str(row.micro_batch), *schedule, "--recompute", "full", "--dtype", row.dtype]


def plan_args(row, fused_qkv: bool = False) -> list[str]:
    return ["plan", published.MODEL_FILE, *model_args(row, fused_qkv), "--cluster", published.cluster_spec(row),
            "--global-batch", str(row.global_batch), "--dtype", row.dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-plan", action="store_true", help="only the estimates")
    parser.add_argument("--fused-qkv", action="store_true", help="the GPT with one fused query_key_value Linear")
    args = parser.parse_args()
    rows = [r for r in published.published_rows() if r.source.endswith("Table 1") and r.label in LABELS]
    print("| model | GPUs | t, p, d | micro-batch | schedule | predicted step | TFLOP/s/GPU predicted | paper | error |"
          + ("" if args.no_plan else " hetpar plan | its step | vs published | search s |"))
    print("|---|---:|---|---:|---|---:|---:|---:|---:|" + ("" if args.no_plan else "---|---:|---:|---:|"))
    for row in rows:
        estimated, _ = hetpar(*estimate_args(row, args.fused_qkv))
        step = estimated["predicted"]["step_time_s"]
        paper = row.work / row.measured_step_s / row.gpus / 1e12
        ours = row.work / step / row.gpus / 1e12
        schedule = row.schedule + (f" v={row.virtual}" if row.virtual > 1 else "")
        line = (f"| {row.label} | {row.gpus} | {row.tp}, {row.pp}, {row.dp} | {row.micro_batch} | {schedule} | {step:.2f} s | "
                f"{ours:.1f} | {paper:.0f} | {ours / paper - 1:+.1%} |")
        if not args.no_plan:
            planned, _ = hetpar(*plan_args(row, args.fused_qkv))
            p = planned["predicted"]["step_time_s"]
            tp = sorted({s["tensor_parallel"] for s in planned["stages"]})
            v = planned.get("virtual_stages", 1)
            what = (f"dp {planned['data_parallel']} tp {'/'.join(map(str, tp))} pp {len(planned['stages']) // v} "
                    f"mb {planned['micro_batch_size']}x{planned['num_microbatches']} {planned['schedule']}")
            solver = planned["solver"]
            status = solver["status"] + (f", gap {solver['objective_gap']:.1%}" if solver["status"] != "optimal" else "")
            line += f" {what} ({status}) | {p:.2f} s | {p / step - 1:+.1%} | {solver['search_time_s']:.1f} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
