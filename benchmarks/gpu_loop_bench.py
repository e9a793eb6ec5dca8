"""A hand-written training loop on one GPU, the yardstick for the generated program.

Times the loop a GPU user writes for a model file's model: bf16 autocast, the model
file's loss, gradient accumulation over micro-batches, AdamW; three ways: eager with
torch's default AdamW, eager with fused AdamW, and torch.compile with fused AdamW
(torchtitan's default). Every step ends in ``torch.cuda.synchronize()``; the result is
the median step after warm-up steps. One JSON line per variant on stdout:

    python benchmarks/gpu_loop_bench.py examples/gpt.py -a n_layers=24 -a hidden=2048 -a heads=16 \\
        -a seq_len=1024 -a vocab=50304 --micro-batch-size 8 --microbatches 2

``scripts/gpu_check.sh`` runs it next to ``hetpar validate`` of the same configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hetpar.runtime.model_file import load_model_file, parse_model_args  # noqa: E402


def time_loop(model, model_file, batches, *, fused: bool, compiled: bool, microbatches: int, steps: int,
              warmup: int, events: bool = False) -> dict:
    """Median seconds per step of the hand-written loop, and the first step's (compile time).
    With ``events``, a CUDA event pair around each forward and backward, as the generated
    program's StepTimer records them: the price of timing actions."""
    device = torch.device("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None, foreach=None if fused else True)
    forward = torch.compile(model) if compiled else model
    times = []
    for _ in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        marks = []
        for inputs, targets in batches:
            marks.append(_event(events))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model_file.loss(forward(*inputs), targets) / microbatches
            marks.append(_event(events))
            loss.backward()
            marks.append(_event(events))
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del optimizer
    return {"step_time_s": statistics.median(times[warmup:]), "first_step_s": times[0]}


def _event(enabled: bool):
    if not enabled:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("-a", "--model-arg", action="append", default=[])
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="eager,fused,compiled",
                        help="eager, fused, compiled, fused-events (fused with CUDA events around each pass)")
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_loop_bench: needs a CUDA device")
    model_file = load_model_file(Path(ns.model), parse_model_args(ns.model_arg))
    torch.manual_seed(0)
    model = model_file.build_model().cuda()
    data = model_file.batches(ns.micro_batch_size, 0)
    batches = []
    for _ in range(ns.microbatches):
        inputs, targets = next(data)
        batches.append((tuple(t.cuda() for t in inputs), targets.cuda()))
    for variant in ns.variants.split(","):
        result = time_loop(model, model_file, batches, fused=variant != "eager", compiled=variant == "compiled",
                           microbatches=ns.microbatches, steps=ns.steps, warmup=ns.warmup,
                           events=variant == "fused-events")
        print(json.dumps({"variant": variant, "micro_batch_size": ns.micro_batch_size,
                          "microbatches": ns.microbatches, **result}), flush=True)


if __name__ == "__main__":
    main()
