"""The layer cost model against this machine: each layer's forward and backward, predicted and timed.

    .venv/bin/python -m hetpar profile -o out/layer_bench/profile-2.json
    .venv/bin/python benchmarks/layer_bench.py --measurements out/layer_bench/profile-2.measurements.json

Each model of the validation matrix (benchmarks/validate_bench.py) is traced by the
planner and built for real; the forward and backward of each of its layers are timed
by hooks in one process with one thread (profiler/layers.py ``module_times``, median
of ``--repeats``) and compared with cost_models.compute.layer_timing under a profile
fitted from the raw measurements `hetpar profile` wrote (its row curves, weight traffic
and the reference model's kernel efficiencies), without the runtime reference step:
that step scales the efficiencies by what the program adds around the layers
([Note: calibrated fits]), and only layer compute is compared here. Rows are whole models (the sum of their
layers); ``--layers`` prints every layer too. The first layer's backward is left out
when the model's input needs no gradient (the hook then times nothing useful).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hetpar.cost_models.calibrate import fit_profile  # noqa: E402
from hetpar.cost_models.compute import layer_timing  # noqa: E402
from hetpar.cost_models.devices import get_device  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.profiler import reference_model  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402
from hetpar.profiler.layers import module_times  # noqa: E402

# (name, model file, model args, micro-batch size, traced layer -> the modules it times)
CASES = [
    ("gpt-s", "examples/gpt.py", {"n_layers": 4, "hidden": 128}, 8,
     {"tok_emb+pos_emb": ["tok_emb", "pos_emb"], "ln_f+lm_head": ["ln_f", "lm_head"]}),
    ("gpt-l", "examples/gpt.py", {"n_layers": 4, "hidden": 256, "seq_len": 64}, 8,
     {"tok_emb+pos_emb": ["tok_emb", "pos_emb"], "ln_f+lm_head": ["ln_f", "lm_head"]}),
    ("mlp", "examples/mlp.py", {"depth": 8, "width": 256}, 16, {"9+10": ["9", "10"]}),
    ("mlp", "examples/mlp.py", {"depth": 8, "width": 256}, 32, {"9+10": ["9", "10"]}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measurements", type=Path, required=True, help="NAME.measurements.json that hetpar profile wrote")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", action="store_true", help="print every layer")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    measurements = {k: v for k, v in json.loads(ns.measurements.read_text()).items() if k != "reference_step"}
    reference = trace_model(load_model_file(Path(reference_model.__file__), {})).layers
    profile = fit_profile(measurements, get_device("cpu"), reference)
    print(f"kernel efficiency {profile.kernel_efficiency:.3f} forward, {profile.backward_kernel_efficiency:.3f} backward\n")
    print("| model | micro-batch | forward predicted | measured | error | backward predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path, args, batch, merged in CASES:
        model_file = load_model_file(ROOT / path, args)
        graph = trace_model(model_file)
        torch.manual_seed(0)
        timed = {m["name"]: m for m in module_times(model_file.build_model(), model_file.example_inputs(batch), repeats=ns.repeats)}
        totals = [0.0, 0.0, 0.0, 0.0]
        for i, layer in enumerate(graph.layers):
            t = layer_timing(layer, profile, tp=1, micro_batch_size=batch, dtype="fp32")
            units = merged.get(layer.name, [layer.name])
            fwd = sum(timed[u]["fwd_s"] for u in units)
            bwd = sum(timed[u]["bwd_s"] for u in units) if i > 0 else t.bwd_s  # see the module docstring
            totals = [totals[0] + t.fwd_s, totals[1] + fwd, totals[2] + t.bwd_s, totals[3] + bwd]
            if ns.layers:
                print(f"| {name} {layer.name} | {batch} | {t.fwd_s * 1e3:.3f} ms | {fwd * 1e3:.3f} ms | {t.fwd_s / fwd - 1:+.0%} "
                      f"| {t.bwd_s * 1e3:.3f} ms | {bwd * 1e3:.3f} ms | {t.bwd_s / bwd - 1:+.0%} |")
        pf, mf, pb, mb = totals
        print(f"| {name} | {batch} | {pf * 1e3:.2f} ms | {mf * 1e3:.2f} ms | {pf / mf - 1:+.1%} "
              f"| {pb * 1e3:.2f} ms | {mb * 1e3:.2f} ms | {pb / mb - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
