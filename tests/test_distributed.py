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
from hetpar.rewriters import compile_plan
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.training import read_metrics

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


def _to(value, dtype: torch.dtype):
    """``value`` (a tensor or nested tuple/list of them) with its floating tensors in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, dtype) for v in value)
    return value


def reference_run(plan, init_state: dict, optimizer: str, steps: int = STEPS, dtype: torch.dtype = torch.float32,
                  grads: list | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop the sharded run must match: whole model, whole global
    batch, one step per batch, the model file's loss. ``dtype`` float64 gives the same
    algorithm with rounding errors far below float32's ([Note: float tolerance]).
    ``grads``: each step's gradients are appended to it, by state_dict key."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    model = model_file.build_model().to(dtype)
    model.load_state_dict(init_state)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR[optimizer]) if optimizer == "sgd" else torch.optim.AdamW(params, lr=LR[optimizer])
    data = model_file.batches(plan.global_batch_size, 0)
    losses = []
    for _ in range(steps):
        inputs, targets = _to(next(data), dtype)
        opt.zero_grad()
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        if grads is not None:
            by_storage = {p.data_ptr(): p.grad for p in params if p.grad is not None}
            grads.append({k: by_storage[v.data_ptr()].detach().clone() for k, v in model.state_dict().items()
                          if v.data_ptr() in by_storage})
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def assert_matches_reference(plan, init_state: dict, optimizer: str, steps: int, losses: list[float],
                             final: dict[str, torch.Tensor], ref_state: dict[str, torch.Tensor]) -> None:
    """Assert that a sharded run's losses and final parameters equal the single-process
    reference within float32's own rounding ([Note: float tolerance]); ``ref_state`` is
    the float32 reference's final state (``reference_run``).

    [Note: float tolerance]
    A sharded run sums the same terms as one process in another order (micro-batches,
    tensor-parallel partial sums, all-reduces), so both are float32 roundings of one
    exact result, and neither is more right than the other. The reference is run twice,
    in float32 and in float64 (exact to float32's eyes); the distance between the two
    measures how far float32 rounding moves each parameter tensor on this machine's
    kernels, for this model, optimizer and data. The sharded run must lie within a small
    multiple of that distance of the float64 run, plus a floor of a few float32 ulps of
    the tensor's magnitude. SGD is held to that element by element. AdamW divides by
    sqrt(v), so an element's update moves with its gradient's relative error: where
    rounding can flip the gradient's sign, by up to the distance two trajectories of
    Adam's updates can part in a step (2 * lr * (1 - beta1) / sqrt(1 - beta2), Kingma and
    Ba 2015, section 2.1); elsewhere by that distance times the relative error. Which
    elements those are depends on the data and on how this machine's kernels round, not
    on a count: both references record each step's gradients, and an element may pass the
    multiple by Adam's distance times the sum over the steps of min(1, SPREAD_MULTIPLE *
    the tensor's float32 gradient rounding (the largest difference between the two
    references' gradients) / the element's float64 gradient) (``adam_sensitivity``).
    """
    _, exact_losses, exact_state, sensitivity = exact_references(plan, init_state, optimizer, steps)
    assert_within_rounding(optimizer, steps, losses, final, ref_state, exact_losses, exact_state, sensitivity)


def exact_references(plan, init_state: dict, optimizer: str, steps: int = STEPS):
    """The float32 reference's final state, the float64 run's losses and final state, and
    under AdamW each element's ``adam_sensitivity`` (else None): what ``assert_within_rounding``
    takes ([Note: float tolerance])."""
    ref_grads: list | None = [] if optimizer == "adamw" else None
    exact_grads: list | None = [] if optimizer == "adamw" else None
    _, ref_state = reference_run(plan, init_state, optimizer, steps, grads=ref_grads)
    exact_losses, exact_state = reference_run(plan, _to_state(init_state, torch.float64), optimizer, steps,
                                              dtype=torch.float64, grads=exact_grads)
    sensitivity = adam_sensitivity(ref_grads, exact_grads) if ref_grads is not None else None
    return ref_state, exact_losses, exact_state, sensitivity


def adam_sensitivity(ref_grads: list[dict[str, torch.Tensor]], exact_grads: list[dict[str, torch.Tensor]]
                     ) -> dict[str, torch.Tensor]:
    """Per element, how many of Adam's largest steps float32 rounding may move it by
    ([Note: float tolerance]): summed over the steps, min(1, SPREAD_MULTIPLE * the
    tensor's float32 gradient rounding (the float32 reference's gradient against the
    float64 one's, largest over the tensor) / the element's float64 gradient)."""
    out: dict[str, torch.Tensor] = {}
    for ref, exact in zip(ref_grads, exact_grads):
        for key, g in exact.items():
            if key not in ref:
                continue
            noise = SPREAD_MULTIPLE * (ref[key].double() - g).abs().max()
            share = torch.where(g.abs() > noise, noise / g.abs().clamp_min(torch.finfo(torch.float64).tiny), 1.0)
            out[key] = out.get(key, 0.0) + share
    return out


def assert_within_rounding(optimizer: str, steps: int, losses: list[float], final: dict[str, torch.Tensor],
                           ref_state: dict[str, torch.Tensor], exact_losses: list[float],
                           exact_state: dict[str, torch.Tensor], sensitivity: dict[str, torch.Tensor] | None = None
                           ) -> None:
    """The check of [Note: float tolerance], given the float32 reference's final state and
    the float64 run's losses and final state (of any single-process algorithm); under
    AdamW, ``sensitivity`` (``adam_sensitivity``) says which elements rounding can move
    far, where the references recorded their gradients."""
    assert list(final) == list(ref_state), "saved keys differ from build_model().state_dict()"
    # A loss is a mean over the batch: well conditioned, float32 keeps it to a few ulps.
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(exact_losses, dtype=torch.float64),
                               rtol=1e-4, atol=0)
    for key, exact in exact_state.items():
        if not exact.is_floating_point():
            assert torch.equal(final[key], ref_state[key]), key
            continue
        spread = (ref_state[key].double() - exact).abs().max().item()
        floor = 8 * torch.finfo(torch.float32).eps * max(exact.abs().max().item(), 1.0)
        atol = SPREAD_MULTIPLE * spread + floor
        error = (final[key].double() - exact).abs()
        if optimizer == "adamw":
            assert sensitivity is not None, "under AdamW the check needs the references' gradients (exact_references)"
            # a parameter without a gradient (never used) keeps its float32 bound
            allowed = atol + ADAM_STEP_BOUND * LR["adamw"] * sensitivity.get(key, torch.zeros_like(exact))
            beyond = error > allowed
            assert not beyond.any(), (f"{key}: {int(beyond.sum())} of {exact.numel()} elements beyond their rounding "
                                      f"(largest excess {(error - allowed).max().item():.3g}, spread {spread:.3g})")
            continue
        torch.testing.assert_close(final[key].double(), exact, atol=atol, rtol=0,
                                   msg=lambda m, key=key, spread=spread: f"{key}: {m} (float32 reference spread {spread:.3g})")


def _to_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: _to(v, dtype) for k, v in state.items()}


# How many times farther from the float64 run than the float32 reference a sharded run
# may be ([Note: float tolerance]): its rounding is of the same kind, in another order.
SPREAD_MULTIPLE = 4
# Two AdamW trajectories part by at most twice its largest update per step, in units of
# lr: (1 - beta1) / sqrt(1 - beta2) with torch's defaults (0.9, 0.999) ([Note: float tolerance]).
ADAM_STEP_BOUND = 2 * (1 - 0.9) / (1 - 0.999) ** 0.5


class Compared(NamedTuple):
    """A compiled run and the float32 reference: losses and final state_dicts, the run's
    stderr and the initial state both started from."""

    losses: list[float]
    final: dict
    ref_losses: list[float]
    ref_state: dict
    stderr: str
    init_state: dict


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
    assert all(r["kind"] in ("step", "stages") for r in lines)  # [Note: metrics file]
    records = read_metrics(out / "m.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    split_experts = any(s.expert_parallel > 1 for s in plan.stages)  # rank 0 reports its routing's load ([Note: expert load])
    optional = {"tokens_per_s", "mfu", *(["expert_imbalance"] if split_experts else [])}  # tokens/s: a model of token ids
    assert all(set(r) - optional == {"kind", "step", "loss", "step_time_s", "samples_per_s", "time_left_s", "lr"}
               for r in records)
    stages = [r["stages"] for r in read_metrics(out / "m.jsonl", "stages")]  # each pipeline rank's times
    assert len(stages) == 1 and [s["stage"] for s in stages[0]] == list(range(plan.pipeline_parallel))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in records)
    final = torch.load(out / "final.pt", weights_only=True)
    ref_losses, ref_state = reference_run(plan, init_state, optimizer)
    return Compared([r["loss"] for r in records], final, ref_losses, ref_state, result.stderr, init_state)


def assert_trains_like_one_process(plan, tmp_path: Path, optimizer: str = "sgd", *, plain_python: bool = False
                                   ) -> str:
    """Compile ``plan``, run it and check it against one process; returns the run's stderr."""
    run = run_compiled(plan, tmp_path, optimizer, plain_python=plain_python)
    assert_matches_reference(plan, run.init_state, optimizer, STEPS, run.losses, run.final, run.ref_state)
    assert run.ref_losses[-1] != run.ref_losses[0]  # the run trained
    return run.stderr


def test_the_adamw_check_holds_rounding_and_refuses_a_wrong_step(gpt_path):
    """The float32 reference itself passes the check against the float64 run; one element
    whose gradient rounding cannot flip, moved by a tenth of one of Adam's steps (as a lost
    gradient term would move it), fails it ([Note: float tolerance])."""
    plan = build_plan(gpt_path, GPT_ARGS, splits=[list(range(4))])
    torch.manual_seed(1234)
    init_state = load_model_file(gpt_path, GPT_ARGS).build_model().state_dict()
    ref_state, exact_losses, exact_state, sensitivity = exact_references(plan, init_state, "adamw")
    ref_losses = reference_run(plan, init_state, "adamw")[0]
    assert_within_rounding("adamw", STEPS, ref_losses, ref_state, ref_state, exact_losses, exact_state, sensitivity)
    key = "blocks.0.mlp.fc.weight"
    steady = int(sensitivity[key].argmin())  # the element rounding moves least
    assert float(sensitivity[key].flatten()[steady]) < 0.01
    wrong = {k: v.clone() for k, v in ref_state.items()}
    wrong[key].view(-1)[steady] += 0.1 * ADAM_STEP_BOUND * LR["adamw"]
    with pytest.raises(AssertionError, match=f"{key}: 1 of"):
        assert_within_rounding("adamw", STEPS, ref_losses, wrong, ref_state, exact_losses, exact_state, sensitivity)


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
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

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

    from hetpar.planner.plan import ClusterRef
    from hetpar.vocabulary import Schedule

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


# What the Hugging Face causal LMs below share: token ids in, next-token targets, and a
# loss that reads the CausalLMOutput's logits as a user writes it.
HF_TOKENS = """
def example_inputs(batch_size, **_):
    return (torch.zeros(batch_size, SEQ, dtype=torch.long),)


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs.logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(batch_size, seed, **_):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
        yield (tokens[:, :-1],), tokens[:, 1:]
"""


# A Hugging Face Llama as users write it (its default config, use_cache included, with
# small sizes) that torch.fx cannot trace: the planner traces it with torch.export, the
# program cuts its stages at module boundaries (runtime.module_stage), and the loss reads
# the CausalLMOutput's logits on every layout.
HF_LLAMA = """
import torch
import torch.nn.functional as F
import transformers as tf

VOCAB, SEQ = 128, 16


def build_model(n_layers=2):
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=128,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))

""" + HF_TOKENS


@pytest.fixture
def exported_layers(monkeypatch):
    """build_plan names the layers of the torch.export graph (torch.fx cannot trace transformers)."""
    pytest.importorskip("transformers")
    import conftest
    from hetpar.runtime.graph import trace_layers

    def exported_layer_names(path, args):
        model_file = load_model_file(path, args)
        layered = trace_layers(model_file.build_model(), example_inputs=model_file.example_inputs(2))
        assert layered.capture == "export"
        return list(layered.layer_names)

    monkeypatch.setattr(conftest, "layer_names", exported_layer_names)


@pytest.mark.slow
def test_exported_hugging_face_llama_pipeline_2(tmp_path, exported_layers):
    model_path = tmp_path / "hfllama.py"
    model_path.write_text(HF_LLAMA)
    plan = build_plan(model_path, {}, splits=[[0, 1], [2, 3]], num_microbatches=2, schedule="1f1b")
    stderr = assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")
    assert stderr.count("hetpar: LlamaForCausalLM: config.use_cache set to False") == 2  # once on each rank


# GPT-2 as users write it: its default config (lm_head.weight tied to transformer.wte.weight,
# use_cache on) with small sizes, and no dropout, whose random masks one process and a
# pipeline draw differently.
HF_GPT2 = """
import torch
import torch.nn.functional as F
import transformers as tf

VOCAB, SEQ = 128, 16


def build_model():
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

""" + HF_TOKENS


@pytest.mark.slow
def test_tied_gpt2_pipeline_2_keeps_its_tied_weights_equal(tmp_path, exported_layers):
    model_path = tmp_path / "hfgpt2.py"
    model_path.write_text(HF_GPT2)
    # stage 0: the embeddings and block 0 (transformer.wte.weight); stage 1: block 1 and the head (lm_head.weight)
    plan = build_plan(model_path, {}, splits=[[0, 1], [2, 3]], num_microbatches=2, schedule="1f1b")
    run = run_compiled(plan, tmp_path, "adamw")
    assert "weights tied across stages, gradients summed over their copies: transformer.wte.weight = " \
           "lm_head.weight in stages 0, 1" in run.stderr
    # Both copies are in the saved state: transformer.wte.weight only rank 0 (stage 0) saves,
    # lm_head.weight rank 1 (stage 1) too, and rank 1's keys come last (save_full_state).
    assert not torch.equal(run.final["lm_head.weight"], run.init_state["lm_head.weight"])  # trained
    assert torch.equal(run.final["transformer.wte.weight"], run.final["lm_head.weight"])
    assert_matches_reference(plan, run.init_state, "adamw", STEPS, run.losses, run.final, run.ref_state)


@pytest.mark.slow
def test_tied_gpt2_data_parallel_2_by_pipeline_2(tmp_path, exported_layers):
    # one group per replica sums its two copies: ranks 0 and 2 (replica 0), 1 and 3 (replica 1)
    model_path = tmp_path / "hfgpt2.py"
    model_path.write_text(HF_GPT2)
    plan = build_plan(model_path, {}, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2, schedule="gpipe")
    assert [s.ranks for s in plan.stages] == [[[0], [1]], [[2], [3]]]
    run = run_compiled(plan, tmp_path, "sgd")
    assert torch.equal(run.final["transformer.wte.weight"], run.final["lm_head.weight"])
    assert_matches_reference(plan, run.init_state, "sgd", STEPS, run.losses, run.final, run.ref_state)
