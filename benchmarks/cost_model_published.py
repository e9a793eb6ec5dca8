"""Cost model vs published measurements: ``planner.estimate`` on the configurations of large training runs.

    .venv/bin/python benchmarks/cost_model_published.py              # the table, with the shipped constant
    .venv/bin/python benchmarks/cost_model_published.py --fit        # refit TRAINING_KERNEL_EFFICIENCY
    .venv/bin/python benchmarks/cost_model_published.py --write docs/benchmarks/cost-model-published_<hardware>_<date>.md

Every row is a configuration a paper or a public benchmark table gives with its
measured throughput; the estimate gets exactly that configuration (model shape,
degrees, micro-batch, schedule, recompute, ZeRO) and predicts the step time. Measured
step times follow from what was published:

- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC21) print achieved TFLOP/s per GPU, X, counted with their
  Eq. 3, F = 96 B s l h^2 (1 + s / 6h + V / 16lh) per step (recompute included);
  step = F / (n X). Table 1's micro-batch sizes and virtual stages are those of the
  paper's artifact, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (fp16, full
  recompute "--recompute-method uniform", interleaved schedule where it sets
  --num-layers-per-virtual-pipeline-stage). Table 2 gives micro-batches; its PTD-P
  schedule is not stated and is taken from the same artifact's runs of those shapes
  (175B, t=8, p=12: 2 layers per virtual stage as run_figure_12.sh; 530B, t=8, p=35: 1
  layer per virtual stage as run_table_1.sh). Its ZeRO-3 rows are DeepSpeed ZeRO-3
  without model parallelism; full recompute assumed, as Eq. 3 counts it.
- MosaicML llm-foundry, scripts/train/benchmarking/README.md, "A100 80GB with 1600 Gbps
  node-node interconnect (RoCE)": tokens per second of MPT models under FSDP
  FULL_SHARD (ZeRO-3), bf16, activation checkpointing as listed; step = global batch
  tokens / measured tokens per second.

Megatron-LM fused its elementwise chains by hand (scale-mask-softmax, bias-GeLU,
bias-dropout-add kernels), so its rows are estimated with compiled stages, hetpar's model
of fused elementwise chains ([Note: compiled stages] in cost_models/compute.py) and the
CLI's default on NVIDIA GPUs; DeepSpeed's ZeRO-3 rows are Megatron's model too. MosaicML's
rows stay eager (``--no-compile``), as they were estimated before: the table does not say
they were compiled.

Megatron splits the word embedding and the output layer over tensor-parallel ranks
(vocabulary-parallel; Shoeybi et al. 2019, section 3); hetpar's tracer splits the
model's tied pair the same way ([Note: tied vocab-parallel weights] in planner/capture/trace.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.cost_models.compute import TRAINING_KERNEL_EFFICIENCY  # noqa: E402
from hetpar.planner.api import compiled_graph  # noqa: E402
from hetpar.planner.estimate import Estimate, EstimateConfig, estimate  # noqa: E402
from hetpar.planner.capture import trace_model  # noqa: E402
from hetpar.planner.model_graph import ModelGraph  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402

MODEL_FILE = "benchmarks/published/gpt.py"
SECTION = "## Cost model vs published measurements"
NARAYANAN = "Narayanan et al. 2021"
MOSAIC = "MosaicML llm-foundry"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One published configuration and its measured step time."""

    source: str
    label: str
    model: dict
    nodes: int  # of 8 A100-80GB, 8 x 200 Gb/s NICs each (Selene's DGX A100; MosaicML's 1600 Gbps RoCE)
    global_batch: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "full"
    zero: int = 0
    dtype: str = "fp16"
    measured_step_s: float
    published: str  # the number as printed
    fit: bool  # in the set the constant is fitted on; the others test it
    compiled: bool = False  # fused elementwise kernels: compiled stages stand in for them (see published_rows)
    work: float  # what the published rate counts per step: FLOPs (Narayanan) or tokens (MosaicML)
    unit: str  # "TFLOP/s/GPU" or "tokens/s"

    def as_published(self, step_s: float) -> str:
        """A step time in the units the source printed."""
        if self.unit == "tokens/s":
            return f"{self.work / step_s:.0f} tokens/s"
        return f"{self.work / step_s / self.gpus / 1e12:.0f} TFLOP/s/GPU"

    @property
    def gpus(self) -> int:
        return self.nodes * 8


def _megatron_model(layers: int, hidden: int, heads: int) -> dict:
    """Megatron-LM's GPT as the 2021 runs ran it: attention written out (``ParallelAttention``:
    baddbmm, fused scale-mask-softmax, dropout, bmm; no fused attention kernel existed), which
    keeps the s x s scores and probabilities for backward (``attention=unfused``)."""
    return dict(n_layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048, bias=True, dropout=0.1,
                attention="unfused")


def _megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """Narayanan et al. 2021 Eq. 3: FLOPs per step, the recomputed forward included."""
    s, v = 2048, 51200
    return 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))


# label, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU; micro-batch and virtual stages from run_table_1.sh
_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]
# scheme, label, heads, hidden, layers, t, p, v, GPUs, batch, micro-batch, TFLOP/s per GPU (Table 2)
_TABLE_2 = [
    ("ZeRO-3", "174.6B", 96, 12288, 96, 1, 1, 1, 384, 1536, 4, 144),
    ("ZeRO-3", "174.6B", 96, 12288, 96, 1, 1, 1, 768, 1536, 2, 88),
    ("ZeRO-3", "174.6B", 96, 12288, 96, 1, 1, 1, 1536, 1536, 1, 44),
    ("ZeRO-3", "529.6B", 128, 20480, 105, 1, 1, 1, 640, 2560, 4, 138),
    ("ZeRO-3", "529.6B", 128, 20480, 105, 1, 1, 1, 1120, 2240, 2, 98),
    ("ZeRO-3", "529.6B", 128, 20480, 105, 1, 1, 1, 2240, 2240, 1, 48),
    ("PTD-P", "174.6B", 96, 12288, 96, 8, 12, 4, 384, 1536, 1, 153),
    ("PTD-P", "174.6B", 96, 12288, 96, 8, 12, 4, 768, 1536, 1, 149),
    ("PTD-P", "174.6B", 96, 12288, 96, 8, 12, 4, 1536, 1536, 1, 141),
    ("PTD-P", "529.6B", 128, 20480, 105, 8, 35, 3, 560, 2240, 1, 171),
    ("PTD-P", "529.6B", 128, 20480, 105, 8, 35, 3, 1120, 2240, 1, 167),
    ("PTD-P", "529.6B", 128, 20480, 105, 8, 35, 3, 2240, 2240, 1, 159),
]
# MPT size: (d_model, n_layers, n_heads), llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml
_MPT = {"70b": (8192, 80, 64), "30b": (7168, 48, 56), "13b": (5120, 40, 40), "7b": (4096, 32, 32), "3b": (2560, 32, 20),
        "1b": (2048, 24, 16), "760m": (1536, 24, 12), "350m": (1024, 24, 16), "125m": (768, 12, 12)}
# size, seq len, GPUs, micro-batch, grad accumulation, tokens/s, activation checkpointing (A100 80GB table)
_MOSAIC = [
    ("70b", 2048, 64, 8, 4, 26274, True), ("70b", 2048, 32, 2, 16, 11962, True), ("30b", 2048, 8, 3, 21, 7330, True),
    ("30b", 1024, 8, 6, 21, 7571, True), ("13b", 4096, 8, 10, 3, 16482, True), ("13b", 2048, 8, 2, 3, 18097, False),
    ("7b", 8192, 8, 8, 2, 25655, True), ("7b", 4096, 8, 16, 2, 29472, True), ("7b", 2048, 8, 6, 2, 37130, False),
    ("3b", 2048, 8, 10, 2, 86491, False), ("1b", 2048, 8, 14, 4, 164109, False), ("760m", 2048, 8, 24, 2, 259472, False),
    ("350m", 2048, 8, 32, 2, 470263, False), ("125m", 2048, 8, 40, 2, 1142641, False),
]


def published_rows() -> list[Row]:
    """Every row, in table order; every other row of each table is in the fitting set, except
    the DeepSpeed ZeRO-3 rows, which no compute constant can describe (docs/benchmarks/cost-model-published_cpu-2core_2026-12-07.md)."""
    rows = []
    for i, (label, heads, hidden, layers, t, p, gpus, batch, tflops, mb, v) in enumerate(_TABLE_1):
        rows.append(Row(
            source=f"{NARAYANAN} Table 1", label=label, model=_megatron_model(layers, hidden, heads), nodes=gpus // 8,
            global_batch=batch, dp=gpus // (t * p), tp=t, pp=p, micro_batch=mb, schedule="interleaved" if v > 1 else "1f1b",
            virtual=v, measured_step_s=_megatron_flops(batch, layers, hidden) / (gpus * tflops * 1e12),
            published=f"{tflops} TFLOP/s/GPU", fit=i % 2 == 0, work=_megatron_flops(batch, layers, hidden), unit="TFLOP/s/GPU",
            compiled=True))
    for i, (scheme, label, heads, hidden, layers, t, p, v, gpus, batch, mb, tflops) in enumerate(_TABLE_2):
        rows.append(Row(
            source=f"{NARAYANAN} Table 2, {scheme}", label=label, model=_megatron_model(layers, hidden, heads), nodes=gpus // 8,
            global_batch=batch, dp=gpus // (t * p), tp=t, pp=p, micro_batch=mb, schedule="interleaved" if v > 1 else "1f1b",
            virtual=v, zero=3 if scheme == "ZeRO-3" else 0,
            measured_step_s=_megatron_flops(batch, layers, hidden) / (gpus * tflops * 1e12), published=f"{tflops} TFLOP/s/GPU",
            fit=i % 2 == 0 and scheme != "ZeRO-3", work=_megatron_flops(batch, layers, hidden), unit="TFLOP/s/GPU",
            compiled=True))
    for i, (size, seq, gpus, mb, accum, tokens_s, ckpt) in enumerate(_MOSAIC):
        hidden, layers, heads = _MPT[size]
        batch = gpus * mb * accum
        rows.append(Row(
            source=MOSAIC, label=f"MPT-{size} s={seq}",
            model=dict(n_layers=layers, hidden=hidden, heads=heads, vocab=50368, seq_len=seq, bias=False, dropout=0.0),
            nodes=gpus // 8, global_batch=batch, dp=gpus, tp=1, pp=1, micro_batch=mb, recompute="full" if ckpt else "none",
            zero=3, dtype="bf16", measured_step_s=batch * seq / tokens_s, published=f"{tokens_s} tokens/s", fit=i % 2 == 0,
            work=batch * seq, unit="tokens/s"))
    return rows


_TRACES: dict[tuple, ModelGraph] = {}


def model_graph(row: Row) -> ModelGraph:
    key = (tuple(sorted(row.model.items())), row.compiled)
    if key not in _TRACES:
        graph = trace_model(load_model_file(ROOT / MODEL_FILE, dict(row.model)))
        _TRACES[key] = compiled_graph(graph) if row.compiled else graph
    return _TRACES[key]


def stage_layers(row: Row) -> tuple[int, ...]:
    """Megatron's split: equal blocks per virtual stage, the embedding on the first, the output layer on the last."""
    chunks = row.pp * row.virtual
    per = row.model["n_layers"] // chunks
    split = [per] * chunks
    split[0] += 1
    split[-1] += 1
    return tuple(split)


def config(row: Row, kernel_efficiency: float) -> EstimateConfig:
    return EstimateConfig(
        global_batch_size=row.global_batch, dp=row.dp, tp=row.tp, pp=row.pp, micro_batch_size=row.micro_batch,
        dtype=row.dtype, schedule=row.schedule, virtual_stages=row.virtual, recompute=row.recompute, zero_stage=row.zero,
        stage_layers=stage_layers(row), kernel_efficiency=kernel_efficiency,
    )


def cluster_spec(row: Row) -> str:
    return f"{row.nodes}x8xA100-80GB@200gx8"


def run(row: Row, kernel_efficiency: float) -> Estimate:
    return estimate(model_graph(row), parse_cluster(cluster_spec(row)), config(row, kernel_efficiency))


def command(row: Row) -> str:
    """The ``hetpar estimate`` line of a row (Megatron rows also need the vocabulary-parallel head; see above)."""
    c = config(row, TRAINING_KERNEL_EFFICIENCY)
    args = " ".join(f"--model-arg {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in row.model.items())
    extra = f" --schedule {c.schedule}" + (f" --virtual-stages {c.virtual_stages}" if c.virtual_stages > 1 else "")
    extra += "" if row.compiled else " --no-compile"
    return (f"hetpar estimate {MODEL_FILE} {args} --cluster {cluster_spec(row)} --global-batch {c.global_batch_size} "
            f"--dp {c.dp} --tp {c.tp} --pp {c.pp} --micro-batch-size {c.micro_batch_size}{extra} "
            f"--stage-layers {','.join(map(str, c.stage_layers))} --recompute {c.recompute} --zero {c.zero_stage} --dtype {c.dtype}")


def fit_efficiency(rows: list[Row]) -> float:
    """The kernel efficiency that minimises the squared log error over the fitting rows.

    One estimate per row at efficiency 1 splits its step into a part that scales with
    1 / efficiency (compute, bubble, optimizer) and communication that does not; the
    minimum of that model is found by golden-section search, then confirmed exactly.
    """
    parts = []
    for row in rows:
        t = run(row, 1.0).time
        comm = t.tp_comm_s + t.pp_comm_s + t.dp_comm_s
        parts.append((t.step_s - comm, comm, row.measured_step_s))

    def loss(eff: float) -> float:
        return sum(math.log((scaled / eff + comm) / measured) ** 2 for scaled, comm, measured in parts)

    lo, hi = 0.2, 1.0
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return (lo + hi) / 2


def table(rows: list[Row], kernel_efficiency: float) -> tuple[str, list[float]]:
    """The markdown table of measured vs predicted step times, and the signed errors."""
    lines = [
        "| # | source | model | GPUs | t, p, d | micro-batch x m | schedule | recompute, ZeRO | published | predicted, same units "
        "| measured step | predicted step | error | set | predicted memory (of 80 GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for i, row in enumerate(rows, 1):
        e = run(row, kernel_efficiency)
        err = e.predicted.step_time_s / row.measured_step_s - 1
        errors.append(err)
        sched = row.schedule + (f" v={row.virtual}" if row.virtual > 1 else "")
        lines.append(
            f"| {i} | {row.source} | {row.label} | {row.gpus} | {row.tp}, {row.pp}, {row.dp} | "
            f"{row.micro_batch} x {e.config.num_microbatches} | {sched} | {row.recompute}, {row.zero} | {row.published} | "
            f"{row.as_published(e.predicted.step_time_s)} | {row.measured_step_s:.2f} s | {e.predicted.step_time_s:.2f} s | "
            f"{err:+.1%} | {_set(row)} | {max(e.predicted.peak_memory_bytes) / 2**30:.0f} GiB{'' if e.fits else ', does not fit'} |"
        )
    return "\n".join(lines), errors


def _set(row: Row) -> str:
    if row.fit:
        return "fit"
    return "test (not fitted: ZeRO-3)" if row.zero == 3 and row.source.startswith(NARAYANAN) else "test"


def summary(rows: list[Row], errors: list[float]) -> str:
    def stats(selected):
        errs = [abs(e) for r, e in zip(rows, errors) if selected(r)]
        within = sum(e <= 0.10 for e in errs)
        return f"{within}/{len(errs)} within 10%, mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}"

    deepspeed = lambda r: r.zero == 3 and r.source.startswith(NARAYANAN)  # noqa: E731
    return "\n".join([
        f"- all {len(rows)} rows: {stats(lambda r: True)}",
        f"- fitting rows: {stats(lambda r: r.fit)}",
        f"- test rows: {stats(lambda r: not r.fit)}",
        f"- test rows without DeepSpeed ZeRO-3: {stats(lambda r: not r.fit and not deepspeed(r))}",
    ])


def write_section(path: Path, body: str) -> None:
    """Replace this script's section of ``path`` (from SECTION to the next "## " heading), keeping the rest."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end + 1 :] if end >= 0 else "")
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the kernel efficiency on the fitting rows and use it")
    parser.add_argument("--write", type=Path, help="replace the section of this markdown file with the results")
    parser.add_argument("--only", help="rows whose source or label contains this text")
    args = parser.parse_args()
    rows = [r for r in published_rows() if not args.only or args.only in r.source or args.only in r.label]
    start = time.perf_counter()
    efficiency = fit_efficiency([r for r in rows if r.fit]) if args.fit else TRAINING_KERNEL_EFFICIENCY
    text, errors = table(rows, efficiency)
    result = "\n".join([f"kernel efficiency {efficiency:.3f} ({'fitted now' if args.fit else 'TRAINING_KERNEL_EFFICIENCY'})",
                         "", text, "", summary(rows, errors)])
    print(result)
    if args.write:
        template = (ROOT / "benchmarks" / "published" / "section.md").read_text()
        write_section(args.write, template.replace("{{RESULTS}}", result).replace("{{COMMAND}}", command(next((r for r in rows if r.label == "145.6B"), rows[0]))))
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
