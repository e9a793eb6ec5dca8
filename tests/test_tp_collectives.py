"""The tensor-parallel runtime issues exactly the collectives the planner counts.

planner.tensor_parallel.layer_collectives lists what one micro-batch of a sharded
layer communicates, pass by pass; the estimator and the search charge those and no
others. Here two gloo workers run the layer as runtime.shard.apply_tensor_parallel
shards it, under torch.profiler, and what they issue in forward and in backward must
be that list: each collective's kind and size. In a GPT block q, k and v read one
normed value, so its gradient is all-reduced once, not once per Linear ([Note: one
all-reduce per shared input] in runtime/shard.py); the sharded step must also
compute the unsharded block's loss and gradients.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from conftest import ROOT
from hetpar.planner.capture import find_sharding, layer_collectives
from hetpar.vocabulary import Sharding
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.shard import apply_tensor_parallel

TP = 2
BATCH = 3  # samples per micro-batch: the planner counts bytes per sample
HIDDEN, SEQ = 32, 8
FP32_BYTES = 4


# Layers ----------------------------------------------------------------------------------------------------------

def gpt_block() -> nn.Module:
    return load_model_file(ROOT / "examples" / "gpt.py", {"n_layers": 1, "hidden": HIDDEN, "heads": 4}
                           ).build_model().blocks[0]


def linear_stack() -> nn.Module:
    """Four Linears with a ReLU after each: one of each sharding in ``EVERY_SHARDING``."""
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(HIDDEN, HIDDEN), nn.ReLU())))


# Split, reduced, gathered and re-split in turn: each choice's input has the layout it needs.
EVERY_SHARDING = {"0": Sharding.COLWISE, "2": Sharding.ROWWISE, "4": Sharding.COLWISE_GATHER,
                  "6": Sharding.ROWWISE_SLICE}
LAYERS = {  # name -> (module factory, shape of one sample, its sharding; None: find_sharding's)
    "gpt_block": (gpt_block, (1, SEQ, HIDDEN), None),
    "linear_stack": (linear_stack, (1, HIDDEN), EVERY_SHARDING),
}


def layer(name: str) -> fx.GraphModule:
    """The layer traced with torch.fx, with the same weights in every process."""
    torch.manual_seed(0)
    return fx.symbolic_trace(LAYERS[name][0]())


def meta_inputs(name: str) -> list[torch.Tensor]:
    """One sample on the meta device, needing a gradient as a layer inside a model does."""
    return [torch.empty(LAYERS[name][1], device="meta", requires_grad=True)]


def plan(name: str) -> tuple[dict[str, Sharding], tuple[tuple[str, str, float], ...]]:
    """The layer's sharding and the collectives ``layer_collectives`` lists for it."""
    gm, inputs = layer(name).to("meta"), meta_inputs(name)
    sharding = LAYERS[name][2] or find_sharding(gm, inputs)
    return sharding, layer_collectives(gm, inputs, sharding)


def batch(name: str) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, *LAYERS[name][1][1:], requires_grad=True)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


# The collectives a profile recorded --------------------------------------------------------------------------------

def issued_collectives(prof: profile, trace_path: Path) -> list[tuple[str, int]]:
    """(collective, bytes) of each collective that ``prof`` recorded.

    Every collective, DTensor's functional ones and a plain ``dist.all_reduce`` alike,
    runs one c10d op (``c10d::allreduce_``, ``c10d::allgather_into_tensor_coalesced_``,
    ...) on the calling thread. Its first argument is the whole buffer (the tensor
    all-reduced, or the gathered output), and only the Chrome trace keeps the shapes of
    such tensor lists. A c10d op of another kind keeps its own name, so it shows up
    as a collective the planner did not list.
    """
    prof.export_chrome_trace(str(trace_path))
    out = []
    for event in json.loads(trace_path.read_text())["traceEvents"]:
        op = event.get("name", "").removeprefix("c10d::")
        if op == event.get("name"):
            continue
        kind = "all_reduce" if "allreduce" in op else "all_gather" if "allgather" in op else op
        out.append((kind, _numel(event["args"]["Input Dims"][0]) * FP32_BYTES))
    return out


def _numel(dims: list) -> int:
    """Elements of one tensor's dims (``[3, 16]``), or of a (nested) list of them."""
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    return sum(_numel(d) for d in dims)


# One tensor-parallel rank ------------------------------------------------------------------------------------------

def _rank_steps(rank: int, shardings: dict[str, dict[str, str]], out_dir: Path) -> None:
    """For each layer (name -> its sharding): shard it over ``TP`` gloo ranks, run one
    forward and backward under the profiler, and save what was issued in each pass with
    the loss and the whole gradients."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=60))  # a missing collective fails instead of hanging
    try:
        mesh = init_device_mesh("cpu", (TP,))
        for name, sharding in shardings.items():
            module = layer(name)
            apply_tensor_parallel(module, mesh, sharding)
            x = batch(name)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as forward:
                out = module(x)
            loss = loss_of(out)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as backward:
                loss.backward()
            grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                     for n, p in module.named_parameters()}
            torch.save({
                "forward": issued_collectives(forward, out_dir / f"{name}-forward{rank}.json"),
                "backward": issued_collectives(backward, out_dir / f"{name}-backward{rank}.json"),
                "loss": loss.detach(), "input_grad": x.grad, "grads": grads,
            }, out_dir / f"{name}-rank{rank}.pt")
        dist.barrier()  # ranks leave together: see torch-cpu.md's teardown row
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> Path:
    """Every layer's step on ``TP`` ranks, from one start of the workers (which takes
    longer than the steps): the folder of their ``{name}-rank{r}.pt``."""
    out_dir = tmp_path_factory.mktemp("tp_collectives")
    shardings = {name: {p: s.value for p, s in plan(name)[0].items()} for name in LAYERS}
    mp.spawn(_rank_steps, args=(shardings, out_dir), nprocs=TP)
    return out_dir


# Tests -------------------------------------------------------------------------------------------------------------

def test_q_k_v_share_one_backward_all_reduce_in_the_plan():
    """Megatron's pattern: one all-reduce per residual branch forward, one per normed
    input backward (q, k and v's, and mlp.fc's), each of one activation."""
    sharding, collectives = plan("gpt_block")
    assert {p for p, s in sharding.items() if s is Sharding.COLWISE} == {"attn.q", "attn.k", "attn.v", "mlp.fc"}
    activation = SEQ * HIDDEN * FP32_BYTES
    expected = [("backward", "all_reduce", activation)] * 2 + [("forward", "all_reduce", activation)] * 2
    assert sorted(collectives) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_sharded_layer_issues_the_collectives_the_planner_counts(sharded_runs, name):
    _, planned = plan(name)
    reference = layer(name)
    x = batch(name)
    loss = loss_of(reference(x))
    loss.backward()
    for rank in range(TP):
        issued = torch.load(sharded_runs / f"{name}-rank{rank}.pt", weights_only=True)
        for pass_name in ("forward", "backward"):
            expected = sorted((kind, round(nbytes * BATCH)) for p, kind, nbytes in planned if p == pass_name)
            assert sorted(issued[pass_name]) == expected, f"rank {rank}, {pass_name}"
        torch.testing.assert_close(issued["loss"], loss.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(issued["input_grad"], x.grad, rtol=1e-4, atol=1e-5)
        for n, p in reference.named_parameters():
            torch.testing.assert_close(issued["grads"][n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
