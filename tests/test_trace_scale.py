"""GPT-3 175B (and 1T) trace on this machine without allocating weights: exact parameters,
closed-form FLOPs, one block measured, peak memory of `hetpar trace` under 2 GiB."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
GIB = 2**30

# Runs the CLI in-process and reports its own peak RSS, so nothing else counts.
_RUN = """
import resource, sys
from hetpar.cli import main
sys.argv = ["hetpar", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
else:
    code = 0
print(f"peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
sys.exit(code)
"""


def run_cli(*args: str, timeout_s: float = 300) -> tuple[dict, int]:
    result = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-2000:]
    peak = int(result.stderr.rsplit("peak_rss_kib=", 1)[1].split()[0]) * 1024
    return json.loads(result.stdout), peak


def gpt_params(n_layers, hidden, vocab, seq_len):
    """examples/gpt.py: q/k/v/o without bias, MLP with bias, two LayerNorms per block."""
    block = 12 * hidden**2 + 9 * hidden
    return n_layers * block + (vocab + seq_len) * hidden + 2 * hidden + vocab * hidden


def gpt_fwd_flops(n_layers, hidden, seq_len, vocab):
    return n_layers * (24 * seq_len * hidden**2 + 2 * seq_len * (seq_len + 1) * hidden) + 2 * seq_len * hidden * vocab  # causal attention: [Note: causal attention FLOPs]


def check_gpt(n_layers, hidden, heads, seq_len, vocab):
    args = [f"n_layers={n_layers}", f"hidden={hidden}", f"heads={heads}", f"seq_len={seq_len}", f"vocab={vocab}"]
    report, peak = run_cli("trace", str(GPT), *[a for arg in args for a in ("--model-arg", arg)], "--json")
    assert report["totals"]["params"] == gpt_params(n_layers, hidden, vocab, seq_len)
    expected = gpt_fwd_flops(n_layers, hidden, seq_len, vocab)
    assert report["totals"]["fwd_flops"] == pytest.approx(expected, rel=0.02)
    assert report["totals"]["bwd_flops"] == pytest.approx(2 * expected, rel=0.02)
    assert report["measured_layers"] == 3  # embeddings, one block for all, head
    assert peak < 2 * GIB, f"peak RSS {peak / GIB:.2f} GiB"
    return report


def test_gpt3_175b_traces_in_under_2_gib():
    report = check_gpt(96, 12288, 96, 2048, 50257)
    assert len(report["layers"]) == 98
    block = report["layers"][1]
    # what a block hands on: one (seq, hidden) fp32 activation per sample
    assert block["boundary_bytes"] == 2048 * 12288 * 4


@pytest.mark.slow
def test_gpt_1t_traces_in_under_2_gib():
    check_gpt(128, 25600, 160, 2048, 50257)


@pytest.mark.slow
def test_planning_gpt3_175b_stays_under_2_gib():
    args = ["n_layers=96", "hidden=12288", "heads=96", "seq_len=2048", "vocab=50257"]
    plan, peak = run_cli("plan", str(GPT), *[a for arg in args for a in ("--model-arg", arg)], "--cluster", "8x8xA100-80GB",
                         "--global-batch", "64", "--time-limit", "5", "--json")
    assert sum(len(s["layers"]) for s in plan["stages"]) == 98
    assert peak < 2 * GIB, f"peak RSS {peak / GIB:.2f} GiB"
