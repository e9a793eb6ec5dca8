"""The launch files next to train.py: launch.sh, slurm.sbatch, pytorchjob.yaml.

Shell scripts are syntax-checked (``sh -n``/``bash -n``) and run against fake
``srun``/``scontrol``/``torchrun`` that print what they would start; the manifest is
parsed as YAML."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from conftest import build_plan
from hetpar.rewriters import compile_plan

GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}


def on_cluster(plan, spec: str, device_types: list[str]):
    return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, spec=spec, device_types=device_types))


@pytest.fixture
def a100_plan(model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2)
    return on_cluster(plan, "2x2xA100-80GB", ["A100-80GB"] * 4)


@pytest.fixture
def mixed_plan(a100_plan):
    return on_cluster(a100_plan, "1x2xA100-80GB+1x2xV100-32GB", ["A100-80GB"] * 2 + ["V100-32GB"] * 2)


def fake_bin(tmp_path: Path) -> dict[str, str]:
    """An environment whose srun runs its command as node 1, scontrol lists two hosts and
    torchrun prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "torchrun": 'echo torchrun "$@"',
        "scontrol": 'printf "node0\\nnode1\\n"',
        "srun": 'while [ "${1#-}" != "$1" ]; do shift; done\nSLURM_NODEID=1 exec "$@"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "MAX_RESTARTS"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def sbatch(out: Path, tmp_path: Path, nodes: int = 2, *args: str) -> subprocess.CompletedProcess:
    env = {**fake_bin(tmp_path), "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[0-1]",
           "SLURM_SUBMIT_DIR": str(out)}
    return subprocess.run(["bash", str(out / "slurm.sbatch"), *args], env=env, capture_output=True, text=True,
                          timeout=30)


def test_scripts_are_valid_shell(tmp_path, a100_plan):
    compile_plan(a100_plan, tmp_path / "out")
    for shell, name in (("sh", "launch.sh"), ("bash", "slurm.sbatch")):
        result = subprocess.run([shell, "-n", str(tmp_path / "out" / name)], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    assert os.access(tmp_path / "out" / "slurm.sbatch", os.X_OK)


def test_launch_sh_passes_max_restarts(tmp_path, a100_plan):
    compile_plan(a100_plan, tmp_path / "out")
    env = {**fake_bin(tmp_path), "MAX_RESTARTS": "2", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node0"}
    result = subprocess.run([str(tmp_path / "out" / "launch.sh"), "--steps", "5"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torchrun", "--nnodes=2", "--node_rank=0", "--nproc_per_node=2", "--master_addr=node0", "--master_port=29500",
        "--max-restarts=2", str(tmp_path / "out" / "train.py"), "--steps", "5",
    ]


def test_slurm_job_on_one_device_type_uses_the_c10d_rendezvous(tmp_path, a100_plan):
    out = tmp_path / "out"
    compile_plan(a100_plan, out)
    text = (out / "slurm.sbatch").read_text()
    for line in ("#SBATCH --job-name=hetpar-gpt", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=2", "#SBATCH --requeue"):
        assert line in text.splitlines()
    result = sbatch(out, tmp_path, 2, "--steps", "9", "--checkpoint-dir", "/shared/ck")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torchrun", "--nnodes=2", "--nproc_per_node=2", "--rdzv-id=77", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500", "--max-restarts=3", str(out / "train.py"), "--steps", "9",
        "--checkpoint-dir", "/shared/ck",
    ]


def test_slurm_job_on_a_mixed_cluster_fixes_node_ranks(tmp_path, mixed_plan):
    out = tmp_path / "out"
    compile_plan(mixed_plan, out)
    assert "mixes A100-80GB, V100-32GB" in (out / "slurm.sbatch").read_text()
    result = sbatch(out, tmp_path, 2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=2", "--master_addr=node0", "--master_port=29500",
        "--max-restarts=0", str(out / "train.py"),
    ]


def test_slurm_job_with_the_wrong_node_count_stops(tmp_path, a100_plan):
    compile_plan(a100_plan, tmp_path / "out")
    result = sbatch(tmp_path / "out", tmp_path, 3)
    assert result.returncode == 2
    assert "3 nodes x 2 processes != world size 4 of the plan" in result.stderr


def test_slurm_job_on_cpus_asks_for_no_gpus(tmp_path, model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2)
    compile_plan(plan, tmp_path / "out")
    assert "--gpus-per-node" not in (tmp_path / "out" / "slurm.sbatch").read_text()


def test_pytorchjob_is_elastic_and_gang_scheduled(tmp_path, a100_plan):
    yaml = pytest.importorskip("yaml")
    compile_plan(a100_plan, tmp_path / "gpt-build")
    job = yaml.safe_load((tmp_path / "gpt-build" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "hetpar-gpt")
    spec = job["spec"]
    assert spec["nprocPerNode"] == "2"
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3}
    assert spec["runPolicy"]["schedulingPolicy"]["minAvailable"] == 2  # Volcano PodGroup minMember
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    assert pod["schedulerName"] == "volcano"
    container = pod["containers"][0]
    assert container["command"] == ["torchrun", "train.py"] and container["workingDir"] == "/workspace/gpt-build"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert "--checkpoint-dir" in container["args"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/checkpoints", "/dev/shm"}
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "hetpar-gpt-checkpoints"


def test_pytorchjob_for_a_mixed_cluster_says_to_use_fixed_node_ranks(tmp_path, mixed_plan):
    compile_plan(mixed_plan, tmp_path / "out")
    text = (tmp_path / "out" / "pytorchjob.yaml").read_text()
    assert "NOTE: the cluster mixes A100-80GB, V100-32GB" in text and "resources:" in text
