"""Ranks against their planned device types (runtime.devices): matching torch's device
names to profile names, HETPAR_DEVICE_TYPE, the one-line stop and its override, and the
node-rank check of launch.sh on a mixed cluster."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import build_plan, run_torchrun, subprocess_env
from hetpar.rewriters import compile_plan
from hetpar.runtime import devices
from hetpar.runtime.devices import FoundDevice, matches

GIB = 2**30
MLP_ARGS = {"depth": 2, "width": 16, "in_features": 8, "out_features": 4}


def gpu(name: str, gib: float) -> FoundDevice:
    return FoundDevice(name=name, memory_bytes=int(gib * GIB))


# torch.cuda.get_device_properties(...).name and total_memory as GPUs report them
@pytest.mark.parametrize("planned, found, same", [
    ("A100-80GB", gpu("NVIDIA A100-SXM4-80GB", 79.15), True),
    ("A100-80GB", gpu("NVIDIA A100 80GB PCIe", 79.15), True),
    ("A100-80GB", gpu("NVIDIA A100-SXM4-40GB", 39.39), False),
    ("A100-40GB", gpu("NVIDIA A100-SXM4-40GB", 39.39), True),
    ("A100-80GB", gpu("NVIDIA RTX A1000", 7.6), False),
    ("V100-32GB", gpu("Tesla V100-SXM2-32GB", 31.74), True),
    ("V100-16GB", gpu("Tesla V100-SXM2-32GB", 31.74), False),
    ("T4-16GB", gpu("Tesla T4", 14.75), True),
    ("H100-80GB", gpu("NVIDIA H100 80GB HBM3", 79.1), True),
    ("H200-141GB", gpu("NVIDIA H200", 139.8), True),
    ("H200-141GB", gpu("NVIDIA H200 1g.18gb", 16.5), False),  # a MIG slice
    ("H200-141GB", gpu("NVIDIA GH200 480GB", 94.5), False),
    ("GH200-96GB", gpu("NVIDIA GH200 480GB", 94.5), True),
    ("MI300X", gpu("AMD Instinct MI300X", 191.5), True),
    ("MI250X", gpu("AMD Instinct MI300X", 191.5), False),
    ("Ascend910B", FoundDevice(name="Ascend910B2"), True),
    ("Ascend910", FoundDevice(name="Ascend910B2"), False),
    ("cpu", FoundDevice(name="cpu"), True),
    ("A100-80GB", FoundDevice(name="cpu"), False),
    ("cpu", gpu("NVIDIA H200", 139.8), False),
    ("A100-80GB", FoundDevice(name="a100-80gb", source=devices.ENV_VAR), True),
    ("A100-80GB", FoundDevice(name="A100", source=devices.ENV_VAR), False),  # declared names are exact
    ("V100-32GB", FoundDevice(name="A100-80GB", source=devices.ENV_VAR), False),
])
def test_found_devices_match_profile_names(planned, found, same):
    assert matches(planned, found) is same


def test_environment_declares_the_device_before_detection(monkeypatch):
    monkeypatch.setenv(devices.ENV_VAR, " V100-32GB ")
    found = devices.this_device(torch.device("cpu"))
    assert (found.name, found.source, found.host) == ("V100-32GB", devices.ENV_VAR, socket.gethostname())
    monkeypatch.delenv(devices.ENV_VAR)
    assert devices.this_device(torch.device("cpu")).name == "cpu"


def test_plans_on_cpus_only_do_not_use_an_accelerator():
    assert not devices.needs_accelerator(["cpu", "cpu"])
    assert devices.needs_accelerator(["cpu", "A100-80GB"])


PLANNED = ["A100-80GB"] * 2 + ["V100-32GB"] * 2
SWAPPED = [gpu("Tesla V100-SXM2-32GB", 31.74)] * 2 + [gpu("NVIDIA A100-SXM4-80GB", 79.15)] * 2


def test_mismatch_names_the_first_rank_its_types_and_the_fixes():
    found = [dataclasses.replace(f, host=f"node{r // 2}") for r, f in enumerate(SWAPPED)]
    wrong = devices.mismatches(PLANNED, found)
    assert [w.rank for w in wrong] == [0, 1, 2, 3]
    assert devices.mismatch_message(wrong, 4, PLANNED, allowed=False) == (
        "rank 0 on host node0 is planned for A100-80GB but runs on V100-32GB (Tesla V100-SXM2-32GB, 31.7 GiB) "
        "(4 of 4 ranks differ); start the host of the n-th node of the cluster spec with node rank n "
        "(NODE_RANK for launch.sh, the node order for Slurm), set HETPAR_DEVICE_TYPE on hosts whose device is "
        "misdetected, or pass --allow-device-mismatch to run anyway"
    )
    one = devices.mismatches(PLANNED, [*SWAPPED[2:], FoundDevice(name="cpu"), SWAPPED[0]])
    assert devices.mismatch_message(one, 4, PLANNED, allowed=True) == (
        "warning: rank 2 is planned for V100-32GB but runs on cpu; running anyway (--allow-device-mismatch), "
        "so the plan's predicted times do not hold"
    )
    assert devices.mismatches(PLANNED, [*SWAPPED[2:], *SWAPPED[:2]]) == []


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_check_stops_with_one_line_and_leaves_the_group(one_rank_group, capsys, monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    devices.check_device_types(["cpu"], torch.device("cpu"), allow_mismatch=False)  # this host: passes
    with pytest.raises(SystemExit) as stopped:
        devices.check_device_types(["A100-80GB"], torch.device("cpu"), allow_mismatch=False)
    assert stopped.value.code == 2 and not dist.is_initialized()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetpar: rank 0 on host ") and "planned for A100-80GB" in lines[0]


def test_check_with_the_override_warns_and_goes_on(one_rank_group, capsys, monkeypatch):
    monkeypatch.setenv(devices.ENV_VAR, "V100-32GB")
    devices.check_device_types(["A100-80GB"], torch.device("cpu"), allow_mismatch=True)
    assert dist.is_initialized()
    assert capsys.readouterr().err.splitlines() == [
        f"hetpar: warning: rank 0 on host {socket.gethostname()} is planned for A100-80GB but runs on V100-32GB "
        "(from HETPAR_DEVICE_TYPE); running anyway (--allow-device-mismatch), so the plan's predicted times do not hold"
    ]


def on_types(plan, spec: str, types: list[str]):
    return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, spec=spec, device_types=types))


def test_program_on_another_host_type_stops_without_a_traceback(tmp_path, mlp_path):
    """``python train.py`` of a one-process plan for cpu, on a host that says it is an A100."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]])
    compile_plan(plan, tmp_path / "out")
    env = {**subprocess_env(), devices.ENV_VAR: "A100-80GB"}
    result = subprocess.run([sys.executable, "train.py", "--steps", "1"], cwd=tmp_path / "out", env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"hetpar: rank 0 on host {socket.gethostname()} is planned for cpu but runs on A100-80GB "
        "(from HETPAR_DEVICE_TYPE); start the host of the n-th node of the cluster spec with node rank n "
        "(NODE_RANK for launch.sh, the node order for Slurm), set HETPAR_DEVICE_TYPE on hosts whose device is "
        "misdetected, or pass --allow-device-mismatch to run anyway"
    ]


@pytest.mark.slow
def test_torchrun_rank_on_the_wrong_type_stops_every_rank_and_the_override_trains(tmp_path, mlp_path, monkeypatch):
    """2 ranks on this CPU host; the plan puts rank 1 on an A100. Both ranks stop with the
    one line; with --allow-device-mismatch they train, warning once."""
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=2)
    plan = on_types(plan, "1x1xcpu+1x1xA100-80GB", ["cpu", "A100-80GB"])
    compile_plan(plan, tmp_path / "out")
    stopped = run_torchrun(tmp_path / "out" / "train.py", 2, ["--steps", "1"], timeout_s=120)
    assert stopped.returncode != 0
    ours = [line for line in stopped.stderr.splitlines() if line.startswith("hetpar:")]
    assert ours == [
        f"hetpar: rank 1 on host {socket.gethostname()} is planned for A100-80GB but runs on cpu; start the host "
        "of the n-th node of the cluster spec with node rank n (NODE_RANK for launch.sh, the node order for Slurm), "
        "set HETPAR_DEVICE_TYPE on hosts whose device is misdetected, or pass --allow-device-mismatch to run anyway"
    ]
    assert "runtime/devices.py" not in stopped.stderr  # no traceback from our code (torchrun prints its own)
    allowed = run_torchrun(tmp_path / "out" / "train.py", 2, ["--steps", "1", "--allow-device-mismatch"],
                           timeout_s=120)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert allowed.stderr.count("hetpar: warning: rank 1") == 1 and "step 1/1" in allowed.stderr


@pytest.mark.slow
def test_plan_for_a100s_runs_on_this_host_declared_as_a100(tmp_path, mlp_path, monkeypatch):
    """How a plan for another device type runs here: the host says it is one."""
    monkeypatch.setenv(devices.ENV_VAR, "A100-80GB")
    plan = on_types(build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2), "1x2xA100-80GB",
                    ["A100-80GB"] * 2)
    compile_plan(plan, tmp_path / "out")
    result = run_torchrun(tmp_path / "out" / "train.py", 2, ["--steps", "1"], timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hetpar: warning" not in result.stderr


def fake_torchrun_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/sh\necho torchrun "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", devices.ENV_VAR)}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "NNODES": "2", "MASTER_ADDR": "node0"}


def test_launch_sh_on_a_mixed_cluster_checks_the_declared_type_of_its_node_rank(tmp_path, gpt_path):
    model = tmp_path / "src" / "gpt.py"
    model.parent.mkdir()
    shutil.copyfile(gpt_path, model)
    gpt_args = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
    plan = build_plan(model, gpt_args, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2)
    compile_plan(on_types(plan, "1x2xA100-80GB+1x2xV100-32GB", ["A100-80GB"] * 2 + ["V100-32GB"] * 2), tmp_path / "out")
    env = fake_torchrun_env(tmp_path)

    def launch(node_rank: str, declared: str | None) -> subprocess.CompletedProcess:
        extra = {devices.ENV_VAR: declared} if declared else {}
        return subprocess.run([str(tmp_path / "out" / "launch.sh")], env={**env, "NODE_RANK": node_rank, **extra},
                              capture_output=True, text=True, timeout=30)

    assert launch("1", "v100-32gb").stdout.startswith("torchrun --nnodes=2 --node_rank=1")
    assert launch("1", None).returncode == 0  # undeclared: train.py detects
    wrong = launch("0", "V100-32GB")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip() == (
        "launch.sh: NODE_RANK=0 is planned for A100-80GB but HETPAR_DEVICE_TYPE=V100-32GB; "
        "node ranks by type: A100-80GB: 0; V100-32GB: 1"
    )
