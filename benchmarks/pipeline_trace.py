"""Per-action timeline of a two-stage pipeline through hetpar's executor, by schedule.

Cuts a model file into two stages (its layers halved), runs each schedule's actions
on two ranks (gloo, one thread each) as the generated program does, and prints per
rank the median compute step, the median forward and backward of one micro-batch
(less what they waited for receives), the median of each step's summed receive waits,
then the last step's timeline (action: start-end in ms from the step's start, after a barrier):

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/pipeline_trace.py
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/pipeline_trace.py --schedules gpipe,1f1b --steps 20

It separates what a schedule's step costs in compute from what it spends waiting for
the other rank's messages (docs/benchmarks/late-receive_cpu-2core_2026-12-03.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetpar.runtime import executor, schedule, shard, timing  # noqa: E402
from hetpar.runtime.distributed import Peers  # noqa: E402
from hetpar.runtime.graph import trace_layers  # noqa: E402
from hetpar.runtime.model_file import load_model_file, parse_model_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/gpt.py"))
    parser.add_argument("-a", "--model-arg", action="append", help="key=value (default: n_layers=4 hidden=128)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", default="1f1b,gpipe,1f1b,gpipe")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per schedule, after 4 warm-up steps")
    ns = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        sys.exit("pipeline_trace: run with torchrun --nproc_per_node 2")
    torch.manual_seed(0)
    spec = load_model_file(Path(ns.model), parse_model_args(ns.model_arg or ["n_layers=4", "hidden=128"]))
    model = spec.build_model()
    names = list(trace_layers(model, example_inputs=spec.example_inputs(1)).layer_names)
    half = len(names) // 2
    stage = shard.cut_stage(model, spec, ns.micro_batch_size, (0, half - 1) if rank == 0 else (half, len(names) - 1), names)
    peers = Peers(recv_activations_from=None if rank == 0 else 0, send_activations_to=(1,) if rank == 0 else (),
                  recv_grads_from=1 if rank == 0 else None, send_grads_to=() if rank == 0 else (0,))
    optimizer = torch.optim.AdamW(stage.module.parameters(), lr=1e-6)
    batches = iter(spec.batches(ns.micro_batch_size, 0))
    data = [next(batches) for _ in range(ns.microbatches)]
    stamps: list[tuple[str, int, float, float, float]] = []
    timer = timing.StepTimer(torch.device("cpu"))  # only its receives' waits are read

    def timed(kind: str, run):
        def wrapper(self, microbatch, *args, **kwargs):
            self.timer = timer
            start, seen = time.perf_counter(), len(timer.spans)
            result = run(self, microbatch, *args, **kwargs)
            waited = sum(span.seconds() for span in timer.spans[seen:] if span.excluded)
            stamps.append((kind, microbatch, start, time.perf_counter(), waited))
            return result
        return wrapper

    executor.StageExecutor.forward = timed("F", executor.StageExecutor.forward)
    executor.StageExecutor.backward = timed("B", executor.StageExecutor.backward)
    for name in ns.schedules.split(","):
        pipeline = {rank: executor.StageExecutor(stage=stage, peers=peers, loss_fn=spec.loss, num_microbatches=ns.microbatches,
                                                 device=torch.device("cpu"), index=rank)}
        actions = schedule.make_schedule(name, 2, ns.microbatches)[rank]
        steps, spent, waits = [], {"F": [], "B": []}, []
        for k in range(4 + ns.steps):
            optimizer.zero_grad(set_to_none=True)
            stamps.clear()
            timer.spans.clear()
            dist.barrier()
            start = time.perf_counter()
            executor.run_actions(pipeline, actions, data, torch.device("cpu"))
            steps.append(time.perf_counter() - start)
            optimizer.step()
            if k >= 4:
                for kind, _, begin, end, waited in stamps:
                    spent[kind].append(end - begin - waited)
                waits.append(sum(waited for *_, waited in stamps))
        t0 = stamps[0][2]
        timeline = " ".join(f"{kind}{mb}:{(a - t0) * 1e3:.1f}-{(b - t0) * 1e3:.1f}" for kind, mb, a, b, _ in stamps)
        ms = {key: statistics.median(values) * 1e3 for key, values in spent.items()}
        report = (f"rank {rank} {name:6s} step {statistics.median(steps[4:]) * 1e3:6.2f} ms, F {ms['F']:.2f}, B {ms['B']:.2f}, "
                  f"waits {statistics.median(waits) * 1e3:.2f} per step (medians); last step {timeline}")
        for r in range(2):  # rank 0's line first
            dist.barrier()
            if r == rank:
                print(report, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
