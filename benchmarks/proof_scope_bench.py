"""The search's objective against the prediction it prints (issue 34, "one model, one optimum").

    .venv/bin/python benchmarks/proof_scope_bench.py > out/proof_scope.md

Plans, as ``hetpar plan`` does (``planner.api.plan_model``), search_bench.py's homogeneous
and mixed GPT clusters, AMP's mixed cluster (3x4 V100-16GB + 1x4 T4-16GB, GPT-2 medium's
shape, batch 32, fp16) and a smaller one of the same devices, and prints for each the
linear step time the search proved optimal (``solver.best_objective_s``) and what that
candidate simulates to, the chosen plan's linear step time (``solver.objective_s``; the
search simulates its finalists on a mixed cluster and keeps the fastest, [Note:
finalists re-ranked]) and simulated prediction (``predicted.step_time_s``), and the
``proof:`` line ``hetpar plan`` prints ([Note: what the proof bounds] in
hetpar/planner/plan.py). Predictions
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
    yield (AMP[0], AMP[1], "2x4xV100-16GB+1x4xT4-16GB", 16, "fp16")


def main() -> None:
    print("| model | cluster | batch | dtype | status | proved optimum (linear) | its simulated step | plan's linear | "
          "predicted (printed) | apart | finalists | wall s | proof line |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, args, cluster, batch, dtype in cases():
        t0 = time.perf_counter()
        plan = plan_model(GPT, parse_cluster(cluster),
                          SearchOptions(global_batch_size=batch, dtype=dtype), model_args=args)
        wall = time.perf_counter() - t0
        info, step = plan.solver, plan.predicted.step_time_s
        objective, best = info.objective_s, info.best_objective_s or info.objective_s
        optimum_step = step if objective == best else next(
            a["simulated_step_s"] for a in plan.alternatives if a.get("step_time_s") == best and "simulated_step_s" in a)
        apart = f"{(step - objective) / objective:+.1%}" if objective > 0 else "-"
        print(f"| {name} | {cluster} | {batch} | {dtype} | {info.status} | {best:.4g} s | {optimum_step:.4g} s | "
              f"{objective:.4g} s | {step:.4g} s | {apart} | {info.finalists} | {wall:.1f} | "
              f"{proof_scope(plan) or '(agree within 2%)'} |", flush=True)


if __name__ == "__main__":
    main()
