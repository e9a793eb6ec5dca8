"""Elastic jobs: ``hetpar compile --elastic MIN:MAX`` launch files (torchrun
``--nnodes=MIN:MAX`` with the c10d rendezvous), and the program that, started on other
nodes than planned, stops with the command that re-plans and resumes
([Note: elastic launch] in rewriters/launchers.py, [Note: membership change] in
runtime/cli.py).

Shell scripts run against a fake ``torchrun`` that prints what it would start; the slow
test starts a program for two nodes under a real ``torchrun --nnodes=1:2`` that meets
with one, and runs the ``hetpar plan`` command it prints."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import assert_one_line_error, hetpar
from conftest import build_plan, free_port, subprocess_env
from hetpar.rewriters import compile_plan
from hetpar.rewriters.torchrun import CompileError
from hetpar.runtime.checkpoint import Checkpointer
from hetpar.runtime.cli import Replan, replan_message
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.precision import LossScaler
from test_compile_launchers import GPT_ARGS, fake_bin, on_cluster, sbatch
from test_distributed import MLP_ARGS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def a100_plan(model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2)
    return on_cluster(plan, "2x2xA100-80GB", ["A100-80GB"] * 4)


def test_launch_sh_joins_an_elastic_rendezvous(tmp_path, a100_plan):
    out = tmp_path / "out"
    compile_plan(a100_plan, out, elastic=(1, 3))
    assert subprocess.run(["sh", "-n", str(out / "launch.sh")], timeout=30).returncode == 0
    env = fake_bin(tmp_path)
    (tmp_path / "bin" / "torchrun").write_text('#!/bin/sh\necho "HETPAR_ELASTIC=$HETPAR_ELASTIC" torchrun "$@"\n')
    result = subprocess.run([str(out / "launch.sh"), "--steps", "5"], env={**env, "MASTER_ADDR": "node0"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "HETPAR_ELASTIC=1:3", "torchrun", "--nnodes=1:3", "--nproc_per_node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500", "--rdzv-id=hetpar", "--max-restarts=3", str(out / "train.py"), "--steps", "5",
    ]
    text = (out / "launch.sh").read_text()
    assert "as an elastic\n# job of 1 to 3 hosts" in text and "hetpar plan --resume-from" in text
    missing = subprocess.run([str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "set MASTER_ADDR" in missing.stderr


def test_slurm_job_elastic_keeps_going_when_a_node_fails(tmp_path, a100_plan):
    out = tmp_path / "out"
    compile_plan(a100_plan, out, elastic=(1, 2))
    text = (out / "slurm.sbatch").read_text()
    assert "#SBATCH --no-kill" in text.splitlines() and "export HETPAR_ELASTIC=1:2" in text
    assert "--kill-on-bad-exit" not in text and "Elastic (1 to 2 nodes" in text
    assert subprocess.run(["bash", "-n", str(out / "slurm.sbatch")], timeout=30).returncode == 0
    result = sbatch(out, tmp_path, 2, "--steps", "9")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torchrun", "--nnodes=1:2", "--nproc_per_node=2", "--rdzv-id=77", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500", "--max-restarts=3", str(out / "train.py"), "--steps", "9",
    ]


def test_pytorchjob_elastic_spans_the_node_range(tmp_path, a100_plan):
    yaml = pytest.importorskip("yaml")
    compile_plan(a100_plan, tmp_path / "out", elastic=(1, 4))
    text = (tmp_path / "out" / "pytorchjob.yaml").read_text()
    spec = yaml.safe_load(text)["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4, "maxRestarts": 3}
    assert spec["runPolicy"]["schedulingPolicy"]["minAvailable"] == 1  # Volcano PodGroup minMember
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2  # the plan's pods
    assert worker["template"]["spec"]["containers"][0]["env"] == [{"name": "HETPAR_ELASTIC", "value": "1:4"}]
    assert "so at least 1 pods\n# start together" in text
    assert "Elastic: the job runs\n# with 1 to 4 pods" in text and "hetpar plan --resume-from" in text


def test_elastic_needs_one_device_type_and_a_range_that_holds_the_plan(tmp_path, a100_plan):
    mixed = on_cluster(a100_plan, "1x2xA100-80GB+1x2xV100-32GB", ["A100-80GB"] * 2 + ["V100-32GB"] * 2)
    with pytest.raises(CompileError, match="--elastic: the plan mixes A100-80GB, V100-32GB"):
        compile_plan(mixed, tmp_path / "a", elastic=(1, 2))
    with pytest.raises(CompileError, match="--elastic 3:4 does not hold the plan's 2 nodes"):
        compile_plan(a100_plan, tmp_path / "b", elastic=(3, 4))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_compile_elastic_from_the_command_line(tmp_path, a100_plan):
    a100_plan.save(tmp_path / "plan.json")
    ok = hetpar("compile", "plan.json", "-o", "out", "--elastic", "2:3", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "--nnodes=2:3" in (tmp_path / "out" / "launch.sh").read_text()
    assert_one_line_error(hetpar("compile", "plan.json", "--elastic", "two", cwd=tmp_path),
                          "--elastic 'two' is not MIN:MAX, e.g. --elastic 2:4")
    assert_one_line_error(hetpar("compile", "plan.json", "--elastic", "3:4", cwd=tmp_path),
                          "--elastic 3:4 does not hold the plan's 2 nodes")


def test_the_replan_line_names_the_nodes_there_are_and_the_newest_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path / "ckpt", every=1, keep=3, model=model).maybe_save(
        40, model, torch.optim.SGD(model.parameters(), lr=0.1), LossScaler(enabled=False))
    replan = Replan(model_file="gpt.py", plan_options="--global-batch 512 --dtype bf16", device_types=["A100-80GB"] * 32,
                    checkpoint_dir=tmp_path / "ckpt")
    line = replan_message(32, 3, 8, "/work/build/train.py", replan)
    assert line == (
        "the job's nodes changed: torchrun started 24 processes (3 nodes of 8), this program is planned for 32; it stops "
        f"here. To go on with these nodes, re-plan and resume from the newest checkpoint (step 40 in {tmp_path / 'ckpt'}): "
        f"hetpar plan /work/build/gpt.py --cluster 3x8xA100-80GB --global-batch 512 --dtype bf16 --resume-from "
        f"{tmp_path / 'ckpt'} -o plan.json && hetpar compile plan.json -o build-3x8xA100-80GB, then launch the new build")
    fresh = replan_message(32, 1, 8, "train.py", dataclasses.replace(replan, checkpoint_dir=None))
    assert "start again (no --checkpoint-dir, so from step 0): hetpar plan" in fresh and "--resume-from" not in fresh


@pytest.mark.slow
def test_a_program_started_on_fewer_nodes_than_planned_says_how_to_replan_and_resume(tmp_path, mlp_path):
    """A plan for 2 nodes of 1 process, launched elastic (1:2) on one host: the c10d
    rendezvous starts with the one node there is, the program stops with exit code 2 and
    one line, and the command in it plans for that node from the checkpoint."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2)
    plan = on_cluster(plan, "2x1xcpu", ["cpu"] * 2)
    out = tmp_path / "out"
    compile_plan(plan, out, elastic=(1, 2))
    model = load_model_file(mlp_path, MLP_ARGS).build_model()
    Checkpointer(tmp_path / "ckpt", every=1, keep=1, model=model, run={"optimizer": "sgd"}).maybe_save(
        4, model, torch.optim.SGD(model.parameters(), lr=0.1), LossScaler(enabled=False))
    env = {**subprocess_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "MAX_RESTARTS": "0",
           "PET_RDZV_CONF": "last_call_timeout=1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([str(out / "launch.sh"), "--steps", "8", "--optimizer", "sgd", "--checkpoint-dir", "ckpt"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("hetpar: the job's nodes changed")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "hetpar: the job's nodes changed: torchrun started 1 process (1 node of 1), this program is planned for 2; it "
        "stops here. To go on with these nodes, re-plan and resume from the newest checkpoint (step 4 in ckpt): "
        f"hetpar plan {out / 'mlp.py'} --cluster 1x1xcpu --global-batch 4 --dtype fp32 ")
    command = re.search(r": (hetpar plan .*?) && hetpar compile", lines[0])[1]
    replanned = subprocess.run([sys.executable, "-m", *shlex.split(command)], cwd=tmp_path, env=subprocess_env(),
                               capture_output=True, text=True, timeout=300)
    assert replanned.returncode == 0, replanned.stderr
    assert "hetpar: continues from step 4 (ckpt/step-00000004, written by 1 process)" in replanned.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["cluster"]["world_size"] == 1
