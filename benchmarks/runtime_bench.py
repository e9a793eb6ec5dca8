"""Generated program vs hand-written torch: step time of the same plan, CPU gloo.

    .venv/bin/python benchmarks/runtime_bench.py --steps 30 --repeats 3

Two plans on examples/mlp.py (a residual MLP, ``nn.Sequential``): DP=2 (whole model on
each rank, 4 micro-batches accumulated per step) and PP=2 (1F1B, 4 micro-batches, the
blocks split in half). Each runs as the program ``hetpar compile`` writes and as a
hand-written torch program for the same plan: ``DistributedDataParallel`` with
``no_sync`` for DP, ``torch.distributed.pipelining`` (``PipelineStage`` +
``Schedule1F1B``) for PP. Both step AdamW (torch's defaults, lr 1e-3), and both time
each step with ``time.perf_counter`` from taking the batch to after the optimizer
step; the first ``--warmup`` steps are dropped and the median of the rest is one
run's step time. Runs alternate (generated, hand-written)
``--repeats`` times; the reported number is the median over runs, and the ratio is
generated / hand-written of those medians, all in this one invocation. Every
subprocess is bounded by ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan  # noqa: E402
from hetpar.vocabulary import Schedule  # noqa: E402
from hetpar.rewriters import compile_plan  # noqa: E402
from hetpar.runtime.model_file import file_fingerprint  # noqa: E402
from hetpar.runtime.training import read_metrics  # noqa: E402
from hetpar.runtime.cli import free_port  # noqa: E402

MLP = ROOT / "examples" / "mlp.py"

HAND_WRITTEN = '''
import json, os, statistics, sys, time
import torch, torch.distributed as dist, torch.nn as nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlp

mode, steps, m, mbs, depth, width, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = mlp.build_model(depth=depth, width=width)
loss_fn = nn.MSELoss()
gen = torch.Generator().manual_seed(0)
times = []
if mode == "dp":
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = torch.randn(m * mbs, 32, generator=gen), torch.randn(m * mbs, 8, generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(m):
            xi, yi = x[i * mbs:(i + 1) * mbs], y[i * mbs:(i + 1) * mbs]
            if i < m - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(xi), yi) / m).backward()
            else:
                (loss_fn(ddp(xi), yi) / m).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
else:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    cut = 1 + depth // 2
    part = nn.Sequential(*list(model)[:cut]) if rank == 0 else nn.Sequential(*list(model)[cut:])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = torch.randn(m * mbs, 32, generator=gen), torch.randn(m * mbs, 8, generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        times.append(time.perf_counter() - t0)
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(times, f)
dist.barrier()
dist.destroy_process_group()
'''


def _torchrun(program: Path, args: list[str], timeout_s: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(program), *args]
    result = subprocess.run(cmd, cwd=program.parent, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"{program.name} failed:\n{result.stderr[-3000:]}")


def _plan(kind: str, depth: int, width: int, mbs: int, m: int) -> ParallelPlan:
    args = {"depth": depth, "width": width}
    names = ["0"] + [str(i) for i in range(1, depth + 1)] + [f"{depth + 1}+{depth + 2}"]
    layers = list(range(depth + 2))
    if kind == "dp":
        stages = [StagePlan(index=0, layers=layers, device_type="cpu", tensor_parallel=1, ranks=[[0], [1]])]
        dp = 2
    else:
        cut = 1 + depth // 2
        stages = [StagePlan(index=0, layers=layers[:cut], device_type="cpu", tensor_parallel=1, ranks=[[0]]),
                  StagePlan(index=1, layers=layers[cut:], device_type="cpu", tensor_parallel=1, ranks=[[1]])]
        dp = 1
    return ParallelPlan(
        model=ModelRef(file=str(MLP), args=args, fingerprint=file_fingerprint(MLP), layer_names=names),
        cluster=ClusterRef(spec="1x2xcpu", world_size=2, device_types=["cpu", "cpu"]),
        global_batch_size=dp * mbs * m, micro_batch_size=mbs, num_microbatches=m, schedule=Schedule.ONE_F_ONE_B,
        data_parallel=dp, dtype="fp32", stages=stages,
        predicted=Predicted(step_time_s=0.0, throughput_samples_per_s=0.0, peak_memory_bytes=[0] * len(stages)),
        solver=SolverInfo(status="pinned", search_time_s=0.0),
    )


def _median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def bench(kind: str, work: Path, opts: argparse.Namespace) -> dict:
    """Median step times of the generated and the hand-written program for one plan."""
    # The hand-written DP program sees each replica's share: m micro-batches of mbs rows.
    plan = _plan(kind, opts.depth, opts.width, opts.micro_batch_size, opts.microbatches)
    build = work / kind
    compile_plan(plan, build)
    (build / "hand.py").write_text(HAND_WRITTEN)
    generated, hand = [], []
    for run in range(opts.repeats):
        metrics = build / f"m{run}.jsonl"
        args = ["--steps", str(opts.steps), "--optimizer", "adamw", "--lr", "1e-3", "--metrics", metrics.name]
        _torchrun(build / "train.py", args, opts.timeout_s)
        times = [r["step_time_s"] for r in read_metrics(metrics)]
        generated.append(_median_after_warmup(times, opts.warmup))
        out = build / f"h{run}.json"
        _torchrun(build / "hand.py", [kind, str(opts.steps), str(opts.microbatches), str(opts.micro_batch_size),
                                      str(opts.depth), str(opts.width), out.name], opts.timeout_s)
        hand.append(_median_after_warmup(json.loads(out.read_text()), opts.warmup))
    g, h = statistics.median(generated), statistics.median(hand)
    return {"plan": kind, "generated_ms": g * 1e3, "hand_written_ms": h * 1e3, "ratio": g / h,
            "generated_runs_ms": [t * 1e3 for t in generated], "hand_written_runs_ms": [t * 1e3 for t in hand]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--plans", default="dp,pp")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetpar-runtime-bench-") as tmp:
        for kind in opts.plans.split(","):
            row = bench(kind, Path(tmp), opts)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
