"""The plans of the README example and of benchmarks/search_bench.py's targets, as JSON with the
wall-clock fields removed, one file per target: a refactor that must not change behaviour
compares two snapshots byte for byte.

    .venv/bin/python scripts/plan_snapshot.py OUT_DIR       (about three minutes on 2 cores)
    diff -r BEFORE_DIR AFTER_DIR                            (no output: the same plans)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = "examples/gpt.py"
PUBLISHED_GPT = "benchmarks/published/gpt.py"
SHAPES = {  # benchmarks/search_bench.py's MODELS
    "1.3B": "n_layers=24 hidden=2048 heads=16 seq_len=2048 vocab=51200",
    "13B": "n_layers=40 hidden=5120 heads=40 seq_len=2048 vocab=51200",
    "175B": "n_layers=96 hidden=12288 heads=96 seq_len=2048 vocab=51200",
    "1T": "n_layers=128 hidden=25600 heads=160 seq_len=2048 vocab=51200",
}
# name -> (model file, model args, cluster, global batch, extra options)
TARGETS = {
    "readme": (GPT, "", "1x2xcpu", 16, []),
    "demo": (GPT, "n_layers=4 hidden=64 heads=4 seq_len=32 vocab=256", "1x2xcpu", 16, []),
    "1.3B_a100x8": (GPT, SHAPES["1.3B"], "1x8xA100-80GB", 512, []),
    "13B_a100x64": (GPT, SHAPES["13B"], "8x8xA100-80GB@200gx8", 1024, []),
    "175B_a100x1024": (GPT, SHAPES["175B"], "128x8xA100-80GB@200gx8", 1536, []),
    "1T_a100x3072": (GPT, SHAPES["1T"], "384x8xA100-80GB@200gx8", 3072, ["--dtype", "bf16"]),
    "1.3B_mixed24": (GPT, SHAPES["1.3B"], "1x8xA100-80GB+1x8xV100-32GB+1x8xT4-16GB", 256, []),
    "13B_mixed256": (GPT, SHAPES["13B"], "8x8xA100-80GB@200gx8+12x8xV100-32GB@100gx4+12x8xT4-16GB@50gx1", 1024, []),
    "39.1B_mixed512": (PUBLISHED_GPT, "n_layers=48 hidden=8192 heads=64 vocab=51200 seq_len=2048",
                       "32x8xA100-80GB@200gx8+16x8xV100-32GB@100gx4+16x8xAscend910B", 1536, ["--dtype", "fp16"]),
}
WALL_CLOCK_FIELDS = ("search_time_s", "trace_time_s")


def snapshot(name: str, out_dir: Path) -> None:
    model, args, cluster, batch, extra = TARGETS[name]
    model_args = [a for kv in args.split() for a in ("-a", kv)]
    cmd = [sys.executable, "-m", "hetpar", "plan", model, *model_args, "--cluster", cluster, "-b", str(batch), *extra, "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout)
    for field in WALL_CLOCK_FIELDS:
        plan["solver"].pop(field, None)
    (out_dir / f"{name}.json").write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {plan['solver']['status']}, predicted step {plan['predicted']['step_time_s']:.6g} s", file=sys.stderr)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TARGETS:
        snapshot(name, out_dir)


if __name__ == "__main__":
    main()
