"""The search's objective against the prediction it prints (issue 34, "one model, one optimum").

    .venv/bin/python benchmarks/proof_scope_bench.py > out/proof_scope.md

Plans, as ``hetpar plan`` does (``planner.api.plan_model``), search_bench.py's homogeneous
and mixed GPT clusters and AMP's mixed cluster (3x4 V100-16GB + 1x4 T4-16GB, GPT-2 medium's
shape, batch 32, fp16), and prints for each the linear step time the search proved
optimal (``solver.objective_s``), the simulated prediction (``predicted.step_time_s``),
how far apart they are, and the ``proof:`` line ``hetpar plan`` prints where they differ
by more than 2% ([Note: what the proof bounds] in hetpar/planner/plan.py). Predictions
for clusters this project does not have; only the wall times depend on the machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_bench import GPT, HOMOGENEOUS, MIXED, MODELS  # noqa: E402

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.api import plan_model  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.planner.plan import proof_scope  # noqa: E402

AMP = ("GPT-2 medium", dict(n_layers=24, hidden=1024, heads=16, seq_len=1024, vocab=50257), "3x4xV100-16GB+1x4xT4-16GB",
       32, "fp16")


def cases():
    for name, cluster, batch in HOMOGENEOUS:
        yield name, MODELS[name], cluster, batch, "bf16"
    for name, cluster, _, batch in MIXED:
        yield name, MODELS[name], cluster, batch, "fp16"
    yield AMP


def main() -> None:
    print("| model | cluster | batch | dtype | status | objective (proved) | predicted (printed) | apart | wall s | proof line |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---|")
    for name, args, cluster, batch, dtype in cases():
        t0 = time.perf_counter()
        plan = plan_model(GPT, parse_cluster(cluster),
                          SearchOptions(global_batch_size=batch, dtype=dtype), model_args=args)
        wall = time.perf_counter() - t0
        objective, step = plan.solver.objective_s, plan.predicted.step_time_s
        apart = f"{(step - objective) / objective:+.1%}" if objective > 0 else "-"
        print(f"| {name} | {cluster} | {batch} | {dtype} | {plan.solver.status} | {objective:.4g} s | {step:.4g} s | "
              f"{apart} | {wall:.1f} | {proof_scope(plan) or '(agree within 2%)'} |", flush=True)


if __name__ == "__main__":
    main()
