"""Peak host memory per rank of the generated program at start-up, by layout.

    .venv/bin/python benchmarks/memory_bench.py                  # a 1.04B-parameter GPT
    .venv/bin/python benchmarks/memory_bench.py --n-layers 38    # 1.95B (one full fp32 copy: 7.8 GB)

Each rank builds the model on the meta device, cuts its stages and computes only its
own tensors ([Note: building only this rank's tensors] in runtime/materialize.py). This
runs the compiled program of examples/gpt.py (``n_layers`` blocks of width ``hidden``,
vocabulary ``vocab``) with ``--steps 0`` under torchrun on CPU (gloo), for each layout:

- ``whole``: one rank holding the whole model (what every rank built before);
- ``pp2``: two ranks, pipeline stages of equal parameter count (embeddings and the
  first blocks; the other blocks, the final norm and the head);
- ``tp2``: two ranks, one stage, the blocks split Megatron-style and the head
  column-wise (its output gathered), the embeddings replicated;
- ``pp2xtp2``: four ranks, both.

``--one-stage FILE --layers FIRST,LAST`` instead builds one stage of any model file in
this process, as a rank does (log, cut, materialise), and reports its peak: a rank of
a model too large for the host, e.g. the last of 8 pipeline stages of a 6.7B Llama
(25 GiB in float32; ``--one-stage benchmarks/models/llama.py --layers 29,33 -a seq_len=64``).

Each rank runs inside a small wrapper that, when the program exits, writes the rank's
``ru_maxrss`` (the peak resident set of the process, every byte it touched: Python,
torch, the model's tensors) and its wall time. The table gives each layout's largest
rank, against one full float32 copy of the model's parameters (4 bytes each). Runs are
one after the other, so the host holds one layout at a time: ``whole`` needs about one
full copy plus 0.35 GB, ``pp2xtp2`` four processes of 0.35 GB and a quarter of the
model; keep ``--n-layers`` so that fits (the default needs at most 5.8 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan  # noqa: E402
from hetpar.vocabulary import Schedule, Sharding  # noqa: E402
from hetpar.rewriters import compile_plan  # noqa: E402
from hetpar.runtime.model_file import file_fingerprint  # noqa: E402
from hetpar.runtime.cli import free_port  # noqa: E402

GPT = ROOT / "examples" / "gpt.py"
BLOCK_TP = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.fc": "colwise", "mlp.proj": "rowwise"}

# Runs the program in this process (runpy) and records the rank's peak RSS when it ends.
PROBE = '''
import json, os, resource, runpy, sys, time
program, out = sys.argv[1], sys.argv[2]
sys.argv = [program, *sys.argv[3:]]
start = time.perf_counter()
try:
    runpy.run_path(program, run_name="__main__")
finally:
    with open(out, "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "wall_s": time.perf_counter() - start,
                            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}) + "\\n")
'''


def gpt_params(n_layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """examples/gpt.py's parameter count."""
    block = 12 * hidden * hidden + 13 * hidden  # q, k, v, o; fc, proj (+ biases); two LayerNorms
    return n_layers * block + 2 * vocab * hidden + seq_len * hidden + 2 * hidden


def _plan(layout: str, args: argparse.Namespace) -> ParallelPlan:
    n = args.n_layers
    names = ["tok_emb+pos_emb", *(f"blocks.{i}" for i in range(n)), "ln_f+lm_head"]
    layers = list(range(n + 2))
    cut = 1 + n // 2  # the embeddings weigh about what the head does
    tp = 2 if "tp2" in layout else 1
    splits = [layers] if "pp2" not in layout else [layers[:cut], layers[cut:]]
    stages, rank = [], 0
    for s, split in enumerate(splits):
        sharding: dict[str, Sharding] = {}
        for layer in split if tp > 1 else ():
            if names[layer].startswith("blocks."):
                sharding.update({f"{names[layer]}.{path}": Sharding(kind) for path, kind in BLOCK_TP.items()})
            elif layer == n + 1:
                sharding["lm_head"] = Sharding("colwise_gather")
        stages.append(StagePlan(index=s, layers=split, device_type="cpu", tensor_parallel=tp,
                                ranks=[list(range(rank, rank + tp))], tp_sharding=sharding))
        rank += tp
    model_args = {"n_layers": n, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab, "seq_len": args.seq_len}
    return ParallelPlan(
        model=ModelRef(file=str(GPT), args=model_args, fingerprint=file_fingerprint(GPT), layer_names=names),
        cluster=ClusterRef(spec=f"1x{rank}xcpu", world_size=rank, device_types=["cpu"] * rank),
        global_batch_size=2, micro_batch_size=1, num_microbatches=2, schedule=Schedule("1f1b"), data_parallel=1,
        dtype="fp32", stages=stages,
        predicted=Predicted(step_time_s=0.1, throughput_samples_per_s=10.0, peak_memory_bytes=[0] * len(stages)),
        solver=SolverInfo(status="pinned", search_time_s=0.0),
    )


def run(layout: str, work: Path, args: argparse.Namespace) -> dict:
    """One layout's program with --steps 0: each rank's peak RSS and wall time."""
    plan = _plan(layout, args)
    build = work / layout
    compile_plan(plan, build)
    (build / "probe.py").write_text(PROBE)
    out = build / "rss.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), f"--nproc_per_node={plan.cluster.world_size}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "probe.py", "train.py", str(out), "--steps", "0", "--seed", "0"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=build, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{result.stderr[-3000:]}")
    ranks = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    return {"layout": layout, "ranks": plan.cluster.world_size, "wall_s": time.perf_counter() - start,
            "maxrss_bytes": [r["maxrss_bytes"] for r in ranks], "rank_wall_s": [r["wall_s"] for r in ranks]}


def one_stage(path: Path, layers: tuple[int, int], model_args: dict) -> dict:
    """Build layers ``layers`` of ``path``'s model as a rank does, in this process."""
    import resource

    import torch

    from hetpar.runtime import shard
    from hetpar.runtime.graph import trace_layers
    from hetpar.runtime.materialize import build_on_meta, materialize_stages
    from hetpar.runtime.model_file import load_model_file

    model_file = load_model_file(path, model_args)
    torch.manual_seed(0)
    start = time.perf_counter()
    model, log = build_on_meta(model_file.build_model)
    logged = time.perf_counter()
    example = tuple(t.to("meta") for t in model_file.example_inputs(1))
    names = list(trace_layers(model, example_inputs=example).layer_names)
    stage = shard.cut_stage(model, model_file, 1, layers, names)
    materialize_stages(model, stage.module, log)
    return {"params": sum(p.numel() for p in model.parameters()), "stage_params": sum(p.numel() for p in stage.module.parameters()),
            "log_s": logged - start, "wall_s": time.perf_counter() - start,
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layouts", default="whole,pp2,tp2,pp2xtp2", help="comma-separated: whole, pp2, tp2, pp2xtp2")
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--one-stage", type=Path, metavar="FILE", help="build one stage of this model file in-process")
    parser.add_argument("--layers", default="0,0", help="with --one-stage: first,last layer of the stage")
    parser.add_argument("-a", "--model-arg", action="append", default=[], help="with --one-stage: key=value")
    args = parser.parse_args()
    if args.one_stage:
        from hetpar.runtime.model_file import parse_model_args

        first, last = (int(x) for x in args.layers.split(","))
        r = one_stage(args.one_stage, (first, last), parse_model_args(args.model_arg))
        print(json.dumps(r) if args.json else
              f"{r['params'] / 1e9:.2f}B parameters (full fp32 copy {4 * r['params'] / 2**30:.1f} GiB), layers {first}-{last}: "
              f"{r['stage_params'] / 1e9:.2f}B ({4 * r['stage_params'] / 2**30:.2f} GiB); peak RSS "
              f"{r['maxrss_bytes'] / 2**30:.2f} GiB = {r['maxrss_bytes'] / (4 * r['params']):.3f} of a full copy; "
              f"log {r['log_s']:.0f} s, total {r['wall_s']:.0f} s")
        return
    params = gpt_params(args.n_layers, args.hidden, args.vocab, args.seq_len)
    full = 4 * params
    results = []
    with tempfile.TemporaryDirectory(prefix="hetpar-memory-") as tmp:
        for layout in args.layouts.split(","):
            results.append(run(layout, Path(tmp), args))
    if args.json:
        print(json.dumps({"params": params, "full_fp32_bytes": full, "results": results}, indent=2))
        return
    print(f"GPT {params / 1e9:.2f}B parameters: one full fp32 copy = {full / 2**30:.2f} GiB")
    print(f"{'layout':8} {'ranks':>5} {'peak RSS per rank (GiB)':>28} {'max / full copy':>16} {'start-up (s)':>13}")
    for r in results:
        rss = " ".join(f"{b / 2**30:.2f}" for b in r["maxrss_bytes"])
        print(f"{r['layout']:8} {r['ranks']:>5} {rss:>28} {max(r['maxrss_bytes']) / full:>16.2f} "
              f"{max(r['rank_wall_s']):>13.1f}")


if __name__ == "__main__":
    main()
