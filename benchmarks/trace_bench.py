"""Trace time and peak memory of ``hetpar trace`` for GPT models from 125M to 1T parameters.

    .venv/bin/python benchmarks/trace_bench.py                      # markdown table to stdout
    .venv/bin/python benchmarks/trace_bench.py -o out/trace_bench.md --hf

Each model is traced by ``hetpar trace MODEL --json`` in a fresh process (so the
import of torch, the build of the model on the meta device and the measurement all
count), which reports its own peak resident memory (``ru_maxrss``). The table also
checks the trace: parameters against the module's exact count, and forward FLOPs
against the closed form for matmuls and attention (Narayanan et al. 2021, Eq. 3
shape: ``24 s h^2 + 4 s^2 h`` per block plus ``2 s h V`` for the head, its causal
attention on the pairs it computes: ``4 s^2 h x (s + 1) / 2s``).

``--hf`` adds transformers' Llama-2 7B, captured with torch.export on meta.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "benchmarks" / "models" / "llama.py"
SEQ_LEN = 2048
VOCAB = 50257  # GPT-2/GPT-3 BPE vocabulary


@dataclass(frozen=True)
class GPTConfig:
    name: str
    n_layers: int
    hidden: int
    heads: int
    source: str

    def args(self) -> dict[str, int]:
        return {"n_layers": self.n_layers, "hidden": self.hidden, "heads": self.heads, "seq_len": SEQ_LEN, "vocab": VOCAB}


# GPT-3 sizes (Brown et al. 2020, Table 2.1); 1.3B and 13B with the head sizes Megatron
# uses (d_head 128), the 1T model as in Narayanan et al. 2021, Table 1.
CONFIGS = [
    GPTConfig("GPT 125M", 12, 768, 12, "GPT-3 Small"),
    GPTConfig("GPT 1.3B", 24, 2048, 16, "GPT-3 XL"),
    GPTConfig("GPT 13B", 40, 5120, 40, "GPT-3 13B"),
    GPTConfig("GPT 175B", 96, 12288, 96, "GPT-3"),
    GPTConfig("GPT 1T", 128, 25600, 160, "Megatron 1T"),
]

# Runs the CLI in-process and reports its own peak RSS, so nothing else counts.
_RUN = """
import resource, sys
from hetpar.cli import main
sys.argv = ["hetpar", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    if exc.code:
        raise
print(f"peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


def trace(model: Path, args: dict[str, int]) -> tuple[dict, float, int]:
    """(hetpar trace --json report, wall seconds, peak RSS bytes) of one fresh process."""
    cmd = [sys.executable, "-c", _RUN, "trace", str(model), "--json"]
    for key, value in args.items():
        cmd += ["--model-arg", f"{key}={value}"]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"hetpar trace {model.name} {args} failed:\n{result.stderr[-2000:]}")
    peak = int(result.stderr.rsplit("peak_rss_kib=", 1)[1].split()[0]) * 1024
    return json.loads(result.stdout), wall, peak


def gpt_params(c: GPTConfig) -> int:
    """examples/gpt.py: q/k/v/o without bias, MLP with bias, two LayerNorms per block."""
    h = c.hidden
    return c.n_layers * (12 * h * h + 9 * h) + (VOCAB + SEQ_LEN) * h + 2 * h + VOCAB * h


def gpt_fwd_flops(c: GPTConfig) -> float:
    h, s = c.hidden, SEQ_LEN
    return c.n_layers * (24 * s * h * h + 2 * s * (s + 1) * h) + 2 * s * h * VOCAB  # causal attention


def row(name: str, source: str, report: dict, wall: float, peak: int, params: int | None, flops: float | None) -> str:
    totals = report["totals"]
    param_check = "exact" if params is None or totals["params"] == params else f"off by {totals['params'] - params:+,}"
    flop_error = "" if flops is None else f"{100 * (totals['fwd_flops'] / flops - 1):+.3f}%"
    return (f"| {name} | {source} | {len(report['layers'])} | {report['capture']} | {report['measured_layers']} | "
            f"{totals['params'] / 1e9:,.2f} B ({param_check}) | {totals['fwd_flops'] / 1e12:,.1f} | {flop_error} | "
            f"{wall:.1f} | {peak / 2**30:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, help="also write the table to this markdown file")
    parser.add_argument("--hf", action="store_true", help="add transformers' Llama-2 7B (needs transformers)")
    options = parser.parse_args()
    lines = [
        "| model | config | layers | capture | measured layers | parameters | fwd TFLOP / sample | FLOPs vs closed form | "
        "trace time (s) | peak RSS (GiB) |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        report, wall, peak = trace(GPT, config.args())
        lines.append(row(config.name, config.source, report, wall, peak, gpt_params(config), gpt_fwd_flops(config)))
        print(lines[-1], file=sys.stderr)
    if options.hf:
        report, wall, peak = trace(LLAMA, {})
        lines.append(row("Llama-2 7B", "transformers, seq 4096", report, wall, peak, None, None))
    table = "\n".join(lines)
    print(table)
    if options.output:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        options.output.write_text(table + "\n")


if __name__ == "__main__":
    main()
