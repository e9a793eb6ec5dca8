"""Compiled programs train exactly like one process: real torchrun runs on CPU with gloo,
compared with a single-process reference loop on losses and parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import build_plan, run_torchrun
from rewriters import compile_plan
from runtime.model_file import load_model_file

STEPS = 3
LR = {"sgd": 0.1, "adamw": 1e-2}
GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
MLP_ARGS = {"depth": 2, "width": 32, "in_features": 16, "out_features": 8}


def reference_run(plan, init_state: dict, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop the sharded run must match: whole model, whole global
    batch, one step per batch, the model file's loss."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    model = model_file.build_model()
    model.load_state_dict(init_state)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR[optimizer]) if optimizer == "sgd" else torch.optim.AdamW(params, lr=LR[optimizer])
    data = model_file.batches(plan.global_batch_size, 0)
    losses = []
    for _ in range(STEPS):
        inputs, targets = next(data)
        opt.zero_grad()
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def run_compiled(plan, tmp_path: Path, optimizer: str) -> tuple[list[float], dict, list[float], dict]:
    """Compile ``plan``, run it under torchrun and the reference in this process."""
    out = tmp_path / "build"
    compile_plan(plan, out)
    model_file = load_model_file(plan.model.file, plan.model.args)
    torch.manual_seed(1234)
    init_state = model_file.build_model().state_dict()
    torch.save(init_state, out / "init.pt")
    result = run_torchrun(
        out / "train.py",
        plan.cluster.world_size,
        ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--init-from", "init.pt",
         "--save-final", "final.pt", "--metrics", "m.jsonl"],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in records)
    final = torch.load(out / "final.pt", weights_only=True)
    ref_losses, ref_state = reference_run(plan, init_state, optimizer)
    return [r["loss"] for r in records], final, ref_losses, ref_state


def assert_trains_like_one_process(plan, tmp_path: Path, optimizer: str = "sgd") -> None:
    losses, final, ref_losses, ref_state = run_compiled(plan, tmp_path, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert list(final) == list(ref_state), "saved keys differ from build_model().state_dict()"
    for key, ref in ref_state.items():
        torch.testing.assert_close(final[key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    assert ref_losses[-1] != ref_losses[0]  # the run trained


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
