"""Layers timed chained, as `hetpar profile --model` times them, against the program's own step.

    .venv/bin/torchrun --standalone --nproc_per_node=2 benchmarks/chained_layers.py

In every worker at once (as the profile runs): the reference model's data-parallel
training step through hetpar's executor (profiler/reference.py reference_step_time) and
the same model's layers chained (layer_times), then the small validation GPT's layers
chained at micro-batch 8, twice each. Rank 0 prints the ratio of the step's seconds per
micro-batch to the chained layers' (the "program factor" the measured layers leave out)
and the GPT's chained forward and backward, to set beside `hetpar validate`'s stage
table for a plan of that model (docs/benchmarks/validate_cpu-2core_2026-12-03.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetpar.profiler import reference_model  # noqa: E402
from hetpar.profiler.layers import layer_times  # noqa: E402
from hetpar.profiler.reference import reference_step_time  # noqa: E402

SMALL_GPT = {"n_layers": 4, "hidden": 128}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for _ in range(2):
        steps = reference_step_time(dist.get_world_size(), repeats=10, device=torch.device("cpu"))["steps"]
        chained = layer_times(reference_model.__file__, {}, [reference_model.BATCH["cpu"]], repeats=10)
        gpt = layer_times(str(ROOT / "examples/gpt.py"), SMALL_GPT, [8], repeats=10)
        if dist.get_rank() == 0:
            layers_s = sum(fwd + bwd for layer in chained["layers"] for _, fwd, bwd in layer["times"])
            (m0, s0, *_), (m1, s1, *_) = steps[0], steps[-1]
            slope = (s1 - s0) / (m1 - m0)
            fwd = sum(layer["times"][0][1] for layer in gpt["layers"])
            bwd = sum(layer["times"][0][2] for layer in gpt["layers"])
            print(f"reference model: step {s0 * 1e3:.2f} ms at 1 micro-batch, {slope * 1e3:.2f} ms per further one; "
                  f"chained layers {layers_s * 1e3:.2f} ms; factor {s0 / layers_s:.3f} at 1, {slope / layers_s:.3f} per "
                  f"micro-batch | small GPT chained at micro-batch 8: forward {fwd * 1e3:.2f} ms, backward {bwd * 1e3:.2f} ms",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
