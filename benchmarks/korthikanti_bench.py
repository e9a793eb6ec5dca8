"""Sequence parallelism and selective recompute against Korthikanti et al. 2022's Table 5 (issue 32).

    .venv/bin/python benchmarks/korthikanti_bench.py               # the tables, about 1 minute on 2 cores
    .venv/bin/python benchmarks/korthikanti_bench.py --no-plan     # only the estimates
    .venv/bin/python benchmarks/korthikanti_bench.py --check       # only the published numbers against each other

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv 2205.05198) train Megatron GPTs of 22B, 175B, 530B and 1T parameters
on DGX A100 80GB nodes (8 x 200 Gb/s HDR InfiniBand each) with sequence 2048,
micro-batch 1, tensor parallelism 8 and data parallelism 1 (their Table 3), and time one
iteration with full activation recompute and with their "present work", sequence
parallelism plus selective recompute (their Table 5). Each row here is typed as that
configuration and scored with ``hetpar estimate`` in both modes, e.g. (175B):

    hetpar estimate benchmarks/published/gpt.py -a n_layers=96 -a hidden=12288 -a heads=96 \\
        -a vocab=51200 -a seq_len=2048 -a bias=true -a dropout=0.1 --cluster 8x8xA100-80GB@200gx8 \\
        -b 64 --dp 1 --tp 8 --pp 8 --micro-batch-size 1 --sp --recompute selective --dtype fp16

(and ``--no-sp --recompute full`` for the baseline); then ``hetpar plan`` searches the
same model, cluster and global batch freely (``--sp auto``, recompute searched per stage):

    hetpar plan benchmarks/published/gpt.py -a n_layers=96 ... --cluster 8x8xA100-80GB@200gx8 -b 64 --dtype fp16 --json

Both go through the library calls those commands make (``planner.estimate.estimate``,
``planner.api.plan_graph``), the model traced once per row.

Where the numbers come from (docs/benchmarks/korthikanti_cpu-2core_2026-12-06.md says
what could and could not be checked):

- The present-work MFU of all four rows is in NVIDIA/Megatron-LM's README from commit
  2e90a342f5 (2022-05-19, "Update numbers in README": 22B 41.5%, 175B 51.4%, 530B 56.0%,
  1T 56.3%, "measured using a data parallel size of one", citing arXiv 2205.05198).
- The model shapes, GPU counts and global batches of Table 3 and the iteration times of
  Table 5 were not found as text in any source this project can read; the values below
  are recalled. The present-work times agree with the README's MFU through the paper's
  model-FLOPs formula (72 B s l h^2 (1 + s/6h + V/12hl), peak 312 TFLOP/s per A100) to
  the printed digits (checked by ``--check``), which confirms the shapes, GPU counts,
  batches and present-work times together; the full-recompute times are checked only
  by the abstract's "530B ... 2240 A100 ... MFU 54.2%, 29% faster than the 42.1% using
  recomputation" (a data-parallel run, not Table 5's), which Table 5's 530B row
  (49.05 s -> 37.83 s, 29.7%) matches.
- The schedule is not in Table 3; 1F1B (no interleaving) is assumed, and the present-work
  estimate is also given with the interleaved schedule of the same shape in SC'21's
  artifact (examples/sc21/run_table_1.sh: 2 chunks at p 8, 3 for 530B at p 35, 1 for 1T).
  fp16 as in Megatron's GPT runs of the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.api import compiled_graph, plan_graph  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.estimate import Estimate, EstimateConfig, estimate  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.planner.plan import ParallelPlan  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

MODEL_FILE = "benchmarks/published/gpt.py"
SEQ, VOCAB = 2048, 51200
ATTENTION = ["unfused"]  # --attention: the paper's Megatron-LM wrote attention out (CoreAttention), keeping its s x s scores
A100_PEAK_FLOP_S = 312e12  # A100 dense fp16/bf16 tensor-core peak, NVIDIA A100 datasheet; the paper's MFU denominator


@dataclass(frozen=True, kw_only=True)
class Row:
    """One model of Korthikanti et al. Table 3 with its Table 5 iteration times."""

    label: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    full_recompute_s: float  # Table 5, "full recompute"
    present_work_s: float  # Table 5, "present work": sequence parallelism + selective recompute
    readme_mfu: float  # Megatron-LM README (2e90a342f5), present work, dp 1
    sc21_virtual: int  # chunks per rank of the same t, p in SC'21's run_table_1.sh (the interleaved variant)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return self.gpus // 8

    @property
    def model_args(self) -> dict:
        return dict(n_layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=VOCAB, seq_len=SEQ, bias=True, dropout=0.1,
                    attention=ATTENTION[0])

    @property
    def cluster(self) -> str:
        return f"{self.nodes}x8xA100-80GB@200gx8"

    def model_flops(self) -> float:
        """The paper's model FLOPs per iteration (no recompute): 72 B s l h^2 (1 + s/6h + V/12hl)."""
        b, s, l, h = self.global_batch, SEQ, self.layers, self.hidden
        return 72 * b * s * l * h**2 * (1 + s / (6 * h) + VOCAB / (12 * h * l))

    def mfu(self, step_s: float) -> float:
        return self.model_flops() / (step_s * self.gpus * A100_PEAK_FLOP_S)


# label, heads, hidden, layers, t, p, GPUs, global batch (Table 3); full recompute s, present work s (Table 5);
# README MFU; SC'21 virtual stages. Recalled, see the module docstring.
ROWS = [
    Row(label="22B", heads=64, hidden=6144, layers=48, tp=8, pp=1, gpus=8, global_batch=4,
        full_recompute_s=1.42, present_work_s=1.10, readme_mfu=0.415, sc21_virtual=1),
    Row(label="175B", heads=96, hidden=12288, layers=96, tp=8, pp=8, gpus=64, global_batch=64,
        full_recompute_s=18.13, present_work_s=13.75, readme_mfu=0.514, sc21_virtual=2),
    Row(label="530B", heads=128, hidden=20480, layers=105, tp=8, pp=35, gpus=280, global_batch=280,
        full_recompute_s=49.05, present_work_s=37.83, readme_mfu=0.560, sc21_virtual=3),
    Row(label="1T", heads=160, hidden=25600, layers=128, tp=8, pp=64, gpus=512, global_batch=512,
        full_recompute_s=94.42, present_work_s=71.49, readme_mfu=0.563, sc21_virtual=1),
]


def estimate_row(graph, row: Row, *, present_work: bool, virtual: int = 1) -> Estimate:
    """``hetpar estimate`` of the published configuration: full recompute, or sequence parallelism + selective."""
    config = EstimateConfig(
        global_batch_size=row.global_batch, dp=row.dp, tp=row.tp, pp=row.pp, micro_batch_size=1, dtype="fp16",
        schedule="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual,
        recompute="selective" if present_work else "full", sequence_parallel=present_work,
    )
    return estimate(graph, parse_cluster(row.cluster), config)


def plan_row(graph, row: Row) -> ParallelPlan:
    """``hetpar plan`` on the same model, cluster and batch, compiled stages as the CLI's default; everything else searched."""
    options = SearchOptions(global_batch_size=row.global_batch, dtype="fp16", compiled=True)
    return plan_graph(graph, parse_cluster(row.cluster), options)


def _runs(values: list) -> str:
    """Per-stage values as runs: ``selective x34, full`` for 34 stages selective then one full."""
    out, prev, n = [], None, 0
    for v in values + [object()]:
        if v == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}" + (f" x{n}" if n > 1 else ""))
        prev, n = v, 1
    return ", ".join(out)


def describe(plan: ParallelPlan) -> str:
    pp = len(plan.stages) // plan.virtual_stages
    physical = plan.stages[:pp]
    tps = _runs([s.tensor_parallel for s in physical])
    cp = _runs([s.context_parallel for s in physical])
    zero = _runs([s.zero_stage for s in physical])
    sched = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (f"dp {plan.data_parallel}, tp {tps}, pp {pp}" + ("" if all(s.context_parallel == 1 for s in physical) else f", cp {cp}")
            + f", mb {plan.micro_batch_size} x {plan.num_microbatches}, {sched}, ZeRO {zero}")


def check_sources() -> str:
    """The Table 5 present-work times against the README's MFU through the paper's FLOPs formula."""
    lines = ["| model | present work s (Table 5) | its MFU (72Bslh^2...) | README MFU | full recompute MFU |", "|---|---:|---:|---:|---:|"]
    for row in ROWS:
        lines.append(f"| {row.label} | {row.present_work_s:.2f} | {row.mfu(row.present_work_s):.1%} | {row.readme_mfu:.1%} | "
                     f"{row.mfu(row.full_recompute_s):.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-plan", action="store_true", help="only the estimates")
    parser.add_argument("--check", action="store_true", help="only the consistency check of the published numbers")
    parser.add_argument("--only", help="rows whose label is this")
    parser.add_argument("--attention", choices=["unfused", "sdpa"], default="unfused",
                        help="attention as the paper's Megatron-LM wrote it out (default), or one fused call")
    args = parser.parse_args()
    ATTENTION[0] = args.attention
    print(check_sources(), end="\n\n")
    if args.check:
        return
    rows = [r for r in ROWS if not args.only or r.label == args.only]
    estimates = ["| model | GPUs | t, p, d | m | full recompute: paper | hetpar | error | present work: paper | hetpar | error "
                 "| speed-up paper | hetpar | MFU hetpar | eager (--no-compile): full / present | "
                 "present work, interleaved as SC'21 | memory full / present (of 80 GiB) |",
                 "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    plans = ["| model | hetpar plan | sp on stages | recompute per stage | its step | vs paper's present work | status | search s |",
             "|---|---|---|---|---:|---:|---|---:|"]
    for row in rows:
        start = time.perf_counter()
        eager = trace_model(load_model_file(ROOT / MODEL_FILE, row.model_args))
        graph = compiled_graph(eager)  # as the CLI's default on NVIDIA GPUs
        print(f"{row.label}: traced in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        full = estimate_row(graph, row, present_work=False)
        present = estimate_row(graph, row, present_work=True)
        t_full, t_present = full.predicted.step_time_s, present.predicted.step_time_s
        e_full = estimate_row(eager, row, present_work=False).predicted.step_time_s
        e_present = estimate_row(eager, row, present_work=True).predicted.step_time_s
        eager_text = (f"{e_full:.2f} s ({e_full / row.full_recompute_s - 1:+.1%}) / "
                      f"{e_present:.2f} s ({e_present / row.present_work_s - 1:+.1%})")
        if row.sc21_virtual > 1:
            inter = estimate_row(graph, row, present_work=True, virtual=row.sc21_virtual).predicted.step_time_s
            inter_text = f"v={row.sc21_virtual}: {inter:.2f} s ({inter / row.present_work_s - 1:+.1%})"
        else:
            inter_text = "(v=1: as 1F1B)"
        mem = lambda e: f"{max(e.predicted.peak_memory_bytes) / 2**30:.0f}" + ("" if e.fits else " (does not fit)")  # noqa: E731
        estimates.append(
            f"| {row.label} | {row.gpus} | {row.tp}, {row.pp}, {row.dp} | {full.config.num_microbatches} | "
            f"{row.full_recompute_s:.2f} s | {t_full:.2f} s | {t_full / row.full_recompute_s - 1:+.1%} | "
            f"{row.present_work_s:.2f} s | {t_present:.2f} s | {t_present / row.present_work_s - 1:+.1%} | "
            f"{row.full_recompute_s / row.present_work_s - 1:+.1%} | {t_full / t_present - 1:+.1%} | {present.mfu:.1%} | "
            f"{eager_text} | {inter_text} | {mem(full)} / {mem(present)} GiB |")
        print(estimates[-1], file=sys.stderr)
        if args.no_plan:
            continue
        plan = plan_row(eager, row)
        pp = len(plan.stages) // plan.virtual_stages
        sp = sum(s.sequence_parallel for s in plan.stages[:pp])
        step = plan.predicted.step_time_s
        plans.append(
            f"| {row.label} | {describe(plan)} | {sp} of {pp} | {_runs([s.recompute for s in plan.stages])} | {step:.2f} s | "
            f"{step / row.present_work_s - 1:+.1%} (hetpar's own estimate of it: {step / t_present - 1:+.1%}) | "
            f"{plan.solver.status} | {plan.solver.search_time_s:.1f} |")
        print(plans[-1], file=sys.stderr)
    print("\n".join(estimates))
    if not args.no_plan:
        print()
        print("\n".join(plans))


if __name__ == "__main__":
    main()
