"""Compiled programs train exactly like one process: real torchrun runs on CPU with gloo,
compared with a single-process reference loop on losses and parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import subprocess
import sys

from conftest import TORCHRUN_TIMEOUT_S, build_plan, run_torchrun, subprocess_env
from rewriters import compile_plan
from runtime.model_file import load_model_file

STEPS = 3
LR = {"sgd": 0.1, "adamw": 1e-2}
GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
MLP_ARGS = {"depth": 2, "width": 32, "in_features": 16, "out_features": 8}

# A model whose stage boundaries carry an integer tensor (no gradient) and a skip
# connection that passes through the middle stage untouched.
SKIPNET = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.emb = nn.Embedding(16, width)

    def forward(self, h, ids):
        return h + self.down(torch.tanh(self.up(h))) + self.emb(ids)


class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x, ids):
        h = self.inp(x)
        skip = h
        for block in self.blocks:
            ids = (ids + 1) % 16
            h = block(h, ids)
        return self.out(h + skip)


def build_model(width=16, depth=3):
    return Net(width, depth)


def example_inputs(batch_size, **_):
    return (torch.zeros(batch_size, 8), torch.zeros(batch_size, dtype=torch.long))


def batches(batch_size, seed, **_):
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, 8, generator=gen)
        ids = torch.randint(0, 16, (batch_size,), generator=gen)
        yield (x, ids), torch.randn(batch_size, 4, generator=gen)
"""


def reference_run(plan, init_state: dict, optimizer: str, steps: int = STEPS
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop the sharded run must match: whole model, whole global
    batch, one step per batch, the model file's loss."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    model = model_file.build_model()
    model.load_state_dict(init_state)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR[optimizer]) if optimizer == "sgd" else torch.optim.AdamW(params, lr=LR[optimizer])
    data = model_file.batches(plan.global_batch_size, 0)
    losses = []
    for _ in range(steps):
        inputs, targets = next(data)
        opt.zero_grad()
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


class Compared(NamedTuple):
    """A compiled run and the reference: losses and final state_dicts, and the run's stderr."""

    losses: list[float]
    final: dict
    ref_losses: list[float]
    ref_state: dict
    stderr: str


def run_compiled(plan, tmp_path: Path, optimizer: str, *, plain_python: bool = False) -> Compared:
    """Compile ``plan``, run it under torchrun (or as ``python train.py``) and the
    reference in this process."""
    out = tmp_path / "build"
    compile_plan(plan, out)
    model_file = load_model_file(plan.model.file, plan.model.args)
    torch.manual_seed(1234)
    init_state = model_file.build_model().state_dict()
    torch.save(init_state, out / "init.pt")
    args = ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--init-from", "init.pt",
            "--save-final", "final.pt", "--metrics", "m.jsonl"]
    if plain_python:
        result = subprocess.run([sys.executable, "train.py", *args], cwd=out, env=subprocess_env(),
                                capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    else:
        result = run_torchrun(out / "train.py", plan.cluster.world_size, args)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    records = [r for r in lines if "step" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    stages = [r["stages"] for r in lines if "stages" in r]  # the last line: each pipeline rank's times
    assert len(stages) == 1 and [s["stage"] for s in stages[0]] == list(range(plan.pipeline_parallel))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in records)
    final = torch.load(out / "final.pt", weights_only=True)
    ref_losses, ref_state = reference_run(plan, init_state, optimizer)
    return Compared([r["loss"] for r in records], final, ref_losses, ref_state, result.stderr)


def assert_trains_like_one_process(plan, tmp_path: Path, optimizer: str = "sgd", *, plain_python: bool = False
                                   ) -> str:
    """Returns the run's stderr."""
    losses, final, ref_losses, ref_state, stderr = run_compiled(plan, tmp_path, optimizer, plain_python=plain_python)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert list(final) == list(ref_state), "saved keys differ from build_model().state_dict()"
    for key, ref in ref_state.items():
        torch.testing.assert_close(final[key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    assert ref_losses[-1] != ref_losses[0]  # the run trained
    return stderr


@pytest.mark.slow
def test_one_process_with_microbatches_runs_without_torchrun(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], num_microbatches=4)
    assert_trains_like_one_process(plan, tmp_path, plain_python=True)


@pytest.mark.slow
def test_data_parallel_2(tmp_path, mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_tensor_parallel_2(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], tensor_parallel=2, tp_blocks=True, num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_pipeline_2_one_f_one_b_4_microbatches(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=4, schedule="1f1b")
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_data_parallel_2_by_pipeline_2(tmp_path, mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2,
                      schedule="gpipe")
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_adamw_gpt_pipeline_and_tensor_parallel(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")


@pytest.mark.slow
def test_stages_of_different_tp_with_int_and_skip_tensors(tmp_path):
    model_path = tmp_path / "skipnet.py"
    model_path.write_text(SKIPNET)
    block1_tp = {"blocks.1.up": "colwise", "blocks.1.down": "rowwise"}
    # layers: inp, blocks.0, blocks.1, blocks.2, out; tp 1 -> 2 -> 1 over the stage boundaries
    plan = build_plan(model_path, {}, splits=[[0, 1], [2], [3, 4]], tensor_parallel=[1, 2, 1],
                      tp_sharding=[{}, block1_tp, {}], num_microbatches=3, schedule="1f1b")
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_data_parallel_2_by_tensor_parallel_2(tmp_path, gpt_path):
    # Data-parallel averaging of DTensor gradients goes through their local shards.
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(dp=2, pp=2, tp=1), dict(dp=1, pp=2, tp=2)], ids=["dp2xpp2", "tp2xpp2"])
def test_plans_from_the_planner_train_like_one_process(tmp_path, gpt_path, pins):
    """End to end: hetpar's own search (its layer split and the TP sharding it found) compiled and run."""
    from cost_models.cluster import parse_cluster
    from planner.api import plan_model
    from planner.search import SearchOptions

    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, **pins)
    plan = plan_model(gpt_path, parse_cluster("1x4xcpu"), options, model_args=GPT_ARGS)
    assert plan.pipeline_parallel == 2 and plan.data_parallel == pins["dp"]
    if pins["tp"] > 1:
        assert any(s.tp_sharding for s in plan.stages)
    assert_trains_like_one_process(plan, tmp_path)


def interleaved_plan(model_path: Path, model_args: dict, *, chunks: list[list[int]], pipeline_ranks: int,
                     data_parallel: int = 1, num_microbatches: int):
    """A plan with ``len(chunks) // pipeline_ranks`` virtual stages: stage s holds layers
    ``chunks[s]`` on the ranks of stage ``s % pipeline_ranks``."""
    from dataclasses import replace

    from planner.plan import ClusterRef, Schedule

    flat = build_plan(model_path, model_args, splits=chunks, data_parallel=data_parallel,
                      num_microbatches=num_microbatches)
    world = pipeline_ranks * data_parallel
    stages = [replace(s, ranks=flat.stages[s.index % pipeline_ranks].ranks) for s in flat.stages]
    return replace(flat, stages=stages, schedule=Schedule.INTERLEAVED,
                   virtual_stages=len(chunks) // pipeline_ranks,
                   cluster=ClusterRef(spec=f"1x{world}xcpu", world_size=world, device_types=["cpu"] * world))


@pytest.mark.slow
def test_pipeline_2_zero_bubble_4_microbatches(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=4, schedule="zb")
    assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")


@pytest.mark.slow
def test_data_parallel_2_by_zero_bubble_pipeline_2(tmp_path, gpt_path):
    # The gradient all-reduce starts under the last backward; with zero-bubble the
    # weight gradients accumulate in later W actions, which the all-reduce must wait for.
    # SGD: AdamW's division by sqrt(v) blows a 1e-7 difference of summation order up past atol.
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=4, schedule="zb")
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_pipeline_2_interleaved_2_chunks_per_rank(tmp_path, gpt_path):
    # layers: embedding, blocks.0, blocks.1, head; rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    plan = interleaved_plan(gpt_path, GPT_ARGS, chunks=[[0], [1], [2], [3]], pipeline_ranks=2, num_microbatches=4)
    assert plan.pipeline_parallel == 2 and plan.virtual_stages == 2
    assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")


@pytest.mark.slow
def test_data_parallel_2_by_interleaved_pipeline_2(tmp_path, mlp_path):
    plan = interleaved_plan(mlp_path, MLP_ARGS, chunks=[[0], [1], [2], [3]], pipeline_ranks=2, data_parallel=2,
                            num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_uneven_split_of_1_and_3_layers_one_f_one_b(tmp_path, gpt_path):
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0], [1, 2, 3]], num_microbatches=3, schedule="1f1b")
    assert_trains_like_one_process(plan, tmp_path)


# A Hugging Face Llama (tests/models/hf_zoo.py's config) that torch.fx cannot trace: the
# program cuts its stages from a torch.export graph.
HF_LLAMA = """
import torch
import torch.nn.functional as F
import transformers as tf

VOCAB, SEQ = 128, 16


def build_model(n_layers=2):
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=128,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                              use_cache=False))


def example_inputs(batch_size, **_):
    return (torch.zeros(batch_size, SEQ, dtype=torch.long),)


def loss_fn(outputs, targets):
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs[0]  # a CausalLMOutput when run whole
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(batch_size, seed, **_):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
        yield (tokens[:, :-1],), tokens[:, 1:]
"""


@pytest.mark.slow
def test_exported_hugging_face_llama_pipeline_2(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import conftest
    from runtime.graph import trace_layers

    model_path = tmp_path / "hfllama.py"
    model_path.write_text(HF_LLAMA)

    def exported_layer_names(path, args):
        model_file = load_model_file(path, args)
        layered = trace_layers(model_file.build_model(), example_inputs=model_file.example_inputs(2))
        assert layered.capture == "export"  # torch.fx cannot trace transformers' Llama
        return list(layered.layer_names)

    monkeypatch.setattr(conftest, "layer_names", exported_layer_names)
    plan = build_plan(model_path, {}, splits=[[0, 1], [2, 3]], num_microbatches=2, schedule="1f1b")
    assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")
