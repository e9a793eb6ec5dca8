"""Predicted activation memory against what a CPU rank allocates, for the recompute modes
(one process), sequence parallelism and context parallelism (torchrun): issue 32's
"predicted peak memory for sp, cp and recompute modes checked against measured peaks".

The measurement is benchmarks/memory_modes_bench.py's: every CPU allocation and free of
one micro-batch's forward, loss and backward under torch.profiler, the stage cut as the
compiled program cuts it (results and the reasons for each gap:
docs/benchmarks/memory-modes_cpu-2core_2026-12-06.md).

[Note: memory modes tolerance]
Why 10%, from the arithmetic rather than from this machine:
- "kept" (bytes alive when backward starts) against ``activation_bytes_per_microbatch``:
  both count the same tensors, each storage once, in fp32 at the same shapes; the
  profile sees the allocator's bytes exactly (no fragmentation on the CPU allocator, no
  sampling). What only the measurement holds is small and named: the loss's log-softmax
  ([B, T, V], measured on its own and subtracted), the targets and positions (int64
  [B, T]), 0-d scalars: under 0.1% here. Allocations a gloo thread frees are left out
  (the profile cannot see when). So kept agrees to about 1%; 10% is the issue's bound,
  ten times that.
- "peak" against the estimate's ``activations_bytes``, which holds, beside the kept
  tensors and recompute's workspace, the widest activation gradient of a layer's
  backward ([Note: activations kept per micro-batch] in cost_models/memory.py; here the
  MLP's hidden one, [B, T/cp, 4h/tp] fp32, ``widest_gradient_bytes``). Under sequence
  parallelism without recompute the backward also holds the colwise input it gathers
  again, [B, T, h], which the estimate leaves out; the test adds it by hand.
- Under context parallelism the runtime attends chunk by chunk under a lower-right
  causal bias ([Note: context parallelism] in hetpar/runtime/context.py): on CUDA the
  flash kernel keeps no mask; on CPU one additive [L, (c + 1) L] mask per chunk shape is
  made once, in the first (warm-up) step, and shared by every layer, so the measured step
  allocates none, as the estimate counts none.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("memory_modes_bench", ROOT / "benchmarks" / "memory_modes_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclass looks its module up
_spec.loader.exec_module(bench)

# Activations dominate: 2 blocks of 50k parameters against [2, 256, 64] activations.
ARGS = {"n_layers": 2, "hidden": 64, "heads": 4, "seq_len": 256, "vocab": 64}
MICRO_BATCH = bench.MICRO_BATCH
TOLERANCE = 0.10  # [Note: memory modes tolerance]


def widest_gradient_bytes(tp: int = 1, cp: int = 1) -> int:
    """The MLP's hidden activation's gradient, [B, T/cp, 4h/tp] fp32: what backward holds
    beside the saved tensors and the estimate leaves out ([Note: memory modes tolerance])."""
    return MICRO_BATCH * ARGS["seq_len"] // cp * 4 * ARGS["hidden"] // tp * 4


def assert_within(measured: float, predicted: float, what: str) -> None:
    assert abs(measured - predicted) <= TOLERANCE * measured, f"{what}: measured {measured}, predicted {predicted}"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_one_rank_recompute_modes_keep_and_peak_as_predicted(one_rank, recompute):
    """At tp 1: what each mode keeps for backward within 10% of the prediction, and the peak
    within 10% of the estimate's activations, the widest gradient included."""
    plan = bench.mode_plan(bench.GPT, ARGS, recompute)
    predicted = bench.predict(plan)
    measured = bench.measure(plan)
    assert measured["unpaired_bytes"] == 0  # one process: every free is recorded
    assert_within(measured["kept_bytes"], predicted.kept_bytes, f"{recompute} kept")
    assert_within(measured["peak_bytes"], predicted.activations_bytes, f"{recompute} peak")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_estimate_holds_the_widest_gradient_once(recompute):
    """Beside what a rank keeps and recompute's workspace, the estimate holds one
    activation gradient: the MLP's hidden one, [B, T, 4h] fp32, found by the tracer."""
    predicted = bench.predict(bench.mode_plan(bench.GPT, ARGS, recompute))
    assert predicted.activations_bytes - predicted.kept_bytes - predicted.workspace_bytes == widest_gradient_bytes()


def test_recompute_modes_keep_less_in_the_predicted_order(one_rank):
    kept = {mode: bench.measure(bench.mode_plan(bench.GPT, ARGS, mode))["kept_bytes"] for mode in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"]


def _ranks(tmp_path: Path, mode: str) -> tuple[list[dict], bench.Prediction]:
    row = bench.run_mode("gpt", mode, tmp_path, timeout_s=120, model_args=ARGS)
    return row["ranks"], bench.Prediction(**row["predicted"])


@pytest.mark.slow
def test_sequence_parallel_ranks_keep_and_peak_as_predicted(tmp_path):
    """tp 2 with sequence parallelism: every saved activation divides by tp ([Note: sequence
    parallelism costs]); each rank's kept bytes within 10% of the prediction."""
    ranks, predicted = _ranks(tmp_path, "tp2_sp")
    for r in ranks:
        assert_within(r["kept_bytes"], predicted.kept_bytes, f"rank {r['rank']} kept")
        # and backward's regather of a colwise input, [B, T, h], which the estimate leaves out
        regather = MICRO_BATCH * ARGS["seq_len"] * ARGS["hidden"] * 4
        assert_within(r["peak_bytes"], predicted.activations_bytes + regather,
                      f"rank {r['rank']} peak")


@pytest.mark.slow
def test_context_parallel_ranks_keep_and_peak_as_predicted(tmp_path):
    """cp 2: each rank's kept bytes are the prediction (its share of the sequence, the
    gathered keys and values, its joined attention output), with no attention mask per
    layer on CPU either."""
    ranks, predicted = _ranks(tmp_path, "cp2")
    for r in ranks:
        assert_within(r["kept_bytes"], predicted.kept_bytes, f"rank {r['rank']} kept")
        assert_within(r["peak_bytes"], predicted.activations_bytes, f"rank {r['rank']} peak")
