"""Resharding resume: a checkpoint written by one plan's program is loaded by the program
of another plan of the same model, optimizer state included, and the run ends where one
uninterrupted single-process run ends ([Note: resharding resume] in runtime/checkpoint.py).

The slow test runs real programs under torchrun on CPU with gloo, in a tree of resumes
from one checkpoint directory (copied for each branch), so that five runs with AdamW
(its moments resharded with the parameters) cover the issue's three changes of layout:

    dp 2 x pp 2 (1F1B, layers 1 + 3), steps 1-2 ──► tp 2, steps 3-4
                                              └─► tp 2 x pp 2 (1F1B), steps 3-4 ──► dp 2 with ZeRO-3, steps 5-6
                                                                               └─► interleaved pp 2 (v 2), steps 5-6

Every run's final parameters and every loss are compared with the single-process
reference of as many steps, within the float tolerance of tests/test_distributed.py.
The other tests check the refusals: another model's checkpoint, one that lacks tensors,
one written with another optimizer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_one_line_error, hetpar
from conftest import TORCHRUN_TIMEOUT_S, build_plan, run_torchrun, subprocess_env
from hetpar.planner.resume import find_resume_point
from hetpar.rewriters import compile_plan
from hetpar.runtime.checkpoint import CheckpointError, Checkpointer, list_complete, resume_point, saved_tensors
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.precision import LossScaler
from hetpar.runtime.shard import Chunks
from hetpar.runtime.training import read_metrics
from test_distributed import GPT_ARGS, LR, MLP_ARGS, assert_matches_reference, interleaved_plan, reference_run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS_PER_RUN = 2


def layouts(gpt_path: Path) -> dict[str, object]:
    """The plans of the tree, each for a global batch of 8."""
    return {
        "dp2xpp2": build_plan(gpt_path, GPT_ARGS, splits=[[0], [1, 2, 3]], data_parallel=2, num_microbatches=2),
        "tp2": build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], tensor_parallel=2, tp_blocks=True,
                          num_microbatches=4),
        "tp2xpp2": build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True,
                              num_microbatches=4),
        "dp2-zero3": build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2,
                                zero_stage=3),
        "interleaved": interleaved_plan(gpt_path, GPT_ARGS, chunks=[[0], [1], [2], [3]], pipeline_ranks=2,
                                        num_microbatches=4),
    }


# (plan, the run it resumes from or None, the step it ends at)
TREE = [
    ("dp2xpp2", None, 2),
    ("tp2", "dp2xpp2", 4),
    ("tp2xpp2", "dp2xpp2", 4),
    ("dp2-zero3", "tp2xpp2", 6),
    ("interleaved", "tp2xpp2", 6),
]


@pytest.mark.slow
def test_a_checkpoint_resumes_in_other_layouts_like_one_uninterrupted_run(tmp_path, gpt_path):
    # AdamW: its moments are resharded with the parameters (SGD's parameters alone are a subset of that).
    optimizer = "adamw"
    plans = layouts(gpt_path)
    assert {p.global_batch_size for p in plans.values()} == {8}
    assert plans["interleaved"].virtual_stages == 2 and plans["dp2xpp2"].schedule.value == "1f1b"
    torch.manual_seed(1234)
    init_state = load_model_file(gpt_path, GPT_ARGS).build_model().state_dict()
    torch.save(init_state, tmp_path / "init.pt")
    for name, parent, steps in TREE:
        plan, out, ckpt = plans[name], tmp_path / name, tmp_path / f"{name}-ckpt"
        compile_plan(plan, out)
        args = ["--steps", str(steps), "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--save-final", "final.pt",
                "--metrics", "m.jsonl", "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS_PER_RUN),
                "--dist-timeout-s", "60"]
        if parent is None:
            args += ["--init-from", str(tmp_path / "init.pt")]
        else:  # the parent's checkpoints and metrics, as if this plan ran on in its place
            shutil.copytree(tmp_path / f"{parent}-ckpt", ckpt)
            shutil.copyfile(tmp_path / parent / "m.jsonl", out / "m.jsonl")
        result = run_torchrun(out / "train.py", plan.cluster.world_size, args)
        assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
        if parent is not None:
            resumed = steps - STEPS_PER_RUN
            assert f"hetpar: resuming from {ckpt / f'step-{resumed:08d}'} (step {resumed})" in result.stderr, name
        records = read_metrics(out / "m.jsonl")
        assert [r["step"] for r in records] == list(range(1, steps + 1)), name
        final = torch.load(out / "final.pt", weights_only=True)
        _, ref_state = reference_run(plan, init_state, optimizer, steps)
        assert_matches_reference(plan, init_state, optimizer, steps, [r["loss"] for r in records], final, ref_state)
        # hetpar plan --resume-from finds it, and takes the program's model (built on meta, sharded) for this one
        assert find_resume_point(gpt_path, GPT_ARGS, ckpt).step == steps, name
        diff = max(float((final[k] - v).abs().max()) for k, v in ref_state.items())
        print(f"{optimizer} {name} after {steps} steps: max |final - reference| = {diff:.3g}")


# ----------------------------------------------------------------------------- refusals


def tiny_checkpoint(directory: Path, model: torch.nn.Module, optimizer: str = "adamw") -> Checkpointer:
    """One step of ``model`` under ``optimizer``, checkpointed into ``directory``."""
    opt = torch.optim.AdamW(model.parameters()) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    opt.step()
    checkpoints = Checkpointer(directory, every=1, keep=1, model=model, run={"optimizer": optimizer})
    checkpoints.maybe_save(1, model, opt, LossScaler(enabled=False))
    return checkpoints


def mlp(width: int, depth: int = 2) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))


def restore_into(directory: Path, model: torch.nn.Module, optimizer: str = "adamw") -> int:
    opt = torch.optim.AdamW(model.parameters()) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = Checkpointer(directory, every=1, keep=1, model=model, run={"optimizer": optimizer})
    return checkpoints.restore(model, opt, LossScaler(enabled=False))


def test_interleaved_chunks_are_saved_under_the_models_names(tmp_path):
    """A rank's chunks (``Chunks``: keys ``0.weight``, ``1.weight``) hold layers 0 and 2 of
    a model; saved, the keys are the model's (``0.weight``, ``2.weight``), and a plain
    module with those names (another plan's stage) loads them, AdamW state included."""
    torch.manual_seed(0)
    whole = mlp(4, depth=3)
    chunks = Chunks([torch.nn.Sequential(whole[0]), torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity(), whole[2])])
    opt = torch.optim.AdamW(chunks.parameters())
    whole(torch.randn(2, 4)).sum().backward()
    opt.step()
    Checkpointer(tmp_path, every=1, keep=1).maybe_save(1, chunks, opt, LossScaler(enabled=False))
    saved = saved_tensors(list_complete(tmp_path)[0])
    assert sorted(k for k in saved if k.startswith("model.")) == ["model.0.bias", "model.0.weight", "model.2.bias",
                                                                   "model.2.weight"]
    assert "optim.state.2.weight.exp_avg" in saved
    stage = mlp(4, depth=3)
    stage[1] = torch.nn.Identity()  # another plan's stage of layers 0 and 2
    stage_opt = torch.optim.AdamW(stage.parameters())
    assert Checkpointer(tmp_path, every=1, keep=1).restore(stage, stage_opt, LossScaler(enabled=False)) == 1
    assert torch.equal(stage[2].weight, whole[2].weight)
    assert torch.equal(stage_opt.state[stage[2].weight]["exp_avg"], opt.state[whole[2].weight]["exp_avg"])
    back = Chunks([torch.nn.Sequential(mlp(4)[0]), torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity(),
                                                                         mlp(4)[1])])
    assert Checkpointer(tmp_path, every=1, keep=1).restore(back, torch.optim.AdamW(back.parameters()),
                                                           LossScaler(enabled=False)) == 1
    assert torch.equal(back[1][2].weight, whole[2].weight)


def test_the_marker_records_the_model_and_the_run(tmp_path):
    tiny_checkpoint(tmp_path, mlp(4))
    marker = list_complete(tmp_path)[0].marker
    assert marker["model"]["tensors"] == 4 and len(marker["model"]["sha256"]) == 64
    assert marker["run"] == {"optimizer": "adamw"}
    assert restore_into(tmp_path, mlp(4)) == 1


@pytest.mark.parametrize(("other", "reason"), [
    (lambda: mlp(6), "its 0.weight is [4, 4], this model's [6, 6]"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)),
     "its tensor 1.weight is not this model's (2 of its 4 are not)"),
    (lambda: mlp(4, depth=3), "it has 4 tensors, this model 6 (it lacks 2.weight)"),
], ids=["reshaped", "renamed", "deeper"])
def test_another_models_checkpoint_is_refused(tmp_path, other, reason):
    tiny_checkpoint(tmp_path, mlp(4))
    with pytest.raises(CheckpointError) as refused:
        restore_into(tmp_path, other())
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'step-00000001'} was written for another model: {reason}; give --checkpoint-dir a "
        "directory of this model's checkpoints (or an empty one to start from step 0)")
    with pytest.raises(CheckpointError, match=re.escape(f"was written for another model: {reason}")):
        resume_point(tmp_path, other())


def test_a_checkpoint_without_the_tensors_a_rank_needs_is_refused(tmp_path):
    """Without a model signature (a checkpoint of an older hetpar) the keys decide."""
    model = mlp(4)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(tmp_path, every=1, keep=1).maybe_save(1, model[:1], torch.optim.AdamW(model[:1].parameters()),
                                                       LossScaler(enabled=False))
    with pytest.raises(CheckpointError, match=r"lacks 8 of the tensors this plan needs \(first: model.1.bias\)"):
        Checkpointer(tmp_path, every=1, keep=1).restore(model, opt, LossScaler(enabled=False))


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    tiny_checkpoint(tmp_path, mlp(4), optimizer="sgd")
    with pytest.raises(CheckpointError, match="written with --optimizer sgd, whose state --optimizer adamw cannot "
                                              "take; resume with --optimizer sgd"):
        restore_into(tmp_path, mlp(4), optimizer="adamw")


@pytest.mark.slow
def test_the_program_refuses_another_models_checkpoint_in_one_line(tmp_path, mlp_path):
    """A one-process program (plain python) pointed at another model's checkpoints: it stops
    before training with exit code 2 and one line saying so, no traceback."""
    tiny_checkpoint(tmp_path / "ckpt", torch.nn.Sequential(torch.nn.Linear(4, 4)))
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]])
    compile_plan(plan, tmp_path / "build")
    result = subprocess.run([sys.executable, "train.py", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
                            cwd=tmp_path / "build", env=subprocess_env(), capture_output=True, text=True,
                            timeout=TORCHRUN_TIMEOUT_S)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    refusals = [line for line in result.stderr.splitlines() if "checkpoint" in line]
    assert refusals == [f"hetpar: checkpoint {tmp_path / 'ckpt' / 'step-00000001'} was written for another model: "
                        "its 0.weight is [4, 4], this model's [32, 16]; give --checkpoint-dir a directory "
                        "of this model's checkpoints (or an empty one to start from step 0)"], result.stderr
    assert "step 1/1" not in result.stderr


# ----------------------------------------------------------------------------- hetpar plan --resume-from


def test_plan_resume_from_says_which_step_the_new_plan_continues_from(tmp_path, mlp_path):
    model = load_model_file(mlp_path, {}).build_model()
    opt = torch.optim.AdamW(model.parameters())
    run = {"optimizer": "adamw", "seed": 0, "global_batch_size": 8}
    checkpoints = Checkpointer(tmp_path / "ckpt", every=2, keep=3, model=model, run=run)
    for step in (2, 4):
        checkpoints.maybe_save(step, model, opt, LossScaler(enabled=False))
    (tmp_path / "ckpt" / "step-00000004" / ".metadata").unlink()  # the newest is incomplete: step 2 it is
    result = hetpar("plan", str(mlp_path), "--cluster", "1x2xcpu", "--global-batch", "8", "--resume-from", "ckpt",
                    "-o", "plan.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hetpar: continues from step 2 (ckpt/step-00000002, written by 1 process): compile this plan and run it " \
           "with --checkpoint-dir ckpt --optimizer adamw; it trains from step 3\n" in result.stderr
    assert (tmp_path / "plan.json").is_file()


def test_plan_resume_from_refuses_another_models_checkpoint(tmp_path, mlp_path):
    tiny_checkpoint(tmp_path / "ckpt", mlp(4))
    result = hetpar("plan", str(mlp_path), "--cluster", "1x2xcpu", "--global-batch", "8", "--resume-from", "ckpt",
                    cwd=tmp_path)
    assert_one_line_error(result, "--resume-from: checkpoint ckpt/step-00000001 was written for another model: "
                                  "its tensor 1.weight is not this model's", "plan the model that wrote it")
    assert not (tmp_path / "plan.json").exists()
