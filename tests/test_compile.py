"""rewriters.compile_plan: the emitted program and launcher, and refusals that leave nothing behind."""

from __future__ import annotations

import ast
import json
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_plan, run_torchrun, subprocess_env
from hetpar.rewriters import CompileError, compile_plan
from hetpar.rewriters.torchrun import program_source

GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
STDLIB_IMPORTS = {"time", "pathlib", "dataclasses"}


@pytest.fixture
def pp_tp_plan(model_copy):
    return build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True,
                      num_microbatches=4)


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()))


def constants(path: Path) -> dict[str, str]:
    """Top-level NAME = value assignments of a program, as source text."""
    tree = ast.parse(path.read_text())
    return {
        node.targets[0].id: ast.get_source_segment(path.read_text(), node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
    }


def test_compile_writes_program_launcher_and_model_copy(tmp_path, pp_tp_plan, model_copy):
    out = tmp_path / "build" / "gpt"
    written = compile_plan(pp_tp_plan, out)
    assert written == [out / name for name in ("train.py", "launch.sh", "slurm.sbatch", "pytorchjob.yaml", "gpt.py")]
    assert (out / "gpt.py").read_bytes() == model_copy.read_bytes()
    assert os.access(out / "launch.sh", os.X_OK)
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt"]  # no temporary directory left


def test_docstring_has_the_torchrun_line_and_the_stage_table(tmp_path, pp_tp_plan):
    compile_plan(pp_tp_plan, tmp_path / "out")
    doc = module_docstring(tmp_path / "out" / "train.py")
    assert "torchrun --nproc_per_node=4 train.py" in doc
    table = [line.strip() for line in doc.splitlines() if "|" in line]
    assert table == [
        "stage | layers                         | ranks[d][t] | device | tp",
        "0     | 0-1: tok_emb+pos_emb, blocks.0 | [[0, 1]]    | cpu    | 2",
        "1     | 2-3: blocks.1, ln_f+lm_head    | [[2, 3]]    | cpu    | 2",
    ]


def test_constants_name_the_plan_fields(tmp_path, pp_tp_plan):
    compile_plan(pp_tp_plan, tmp_path / "out")
    program = tmp_path / "out" / "train.py"
    found = constants(program)
    assert {k: found[k] for k in ("WORLD_SIZE", "DATA_PARALLEL", "MICRO_BATCH_SIZE", "NUM_MICROBATCHES",
                                  "GLOBAL_BATCH_SIZE", "SCHEDULE", "MODEL_FILE", "DTYPE")} == {
        "WORLD_SIZE": "4", "DATA_PARALLEL": "1", "MICRO_BATCH_SIZE": "2", "NUM_MICROBATCHES": "4",
        "GLOBAL_BATCH_SIZE": "8", "SCHEDULE": "'1f1b'", "MODEL_FILE": "'gpt.py'", "DTYPE": "torch.float32",
    }
    text = program.read_text()
    for field in ("plan.cluster.world_size", "plan.data_parallel", "plan.micro_batch_size", "plan.num_microbatches",
                  "plan.global_batch_size", "plan.stages", "plan.schedule"):
        assert f"# {field}" in text
    assert "'blocks.1.attn.o': 'rowwise'" in text and "'blocks.0.mlp.fc': 'colwise'" in text
    assert "ranks=[[2, 3]]" in text


def test_program_imports_only_torch_runtime_and_the_stdlib(tmp_path, pp_tp_plan):
    compile_plan(pp_tp_plan, tmp_path / "out")
    tree = ast.parse((tmp_path / "out" / "train.py").read_text())
    tops, ours = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            tops.add(node.module.split(".")[0])
            if node.module.startswith("hetpar"):
                ours.add(node.module)
    assert tops <= {"torch", "hetpar"} | STDLIB_IMPORTS
    assert ours <= {"hetpar.runtime", "hetpar.runtime.distributed", "hetpar.runtime.model_file"}
    assert len((tmp_path / "out" / "train.py").read_text().splitlines()) <= 170  # one screenful and a half


def test_program_help_shows_its_docstring(tmp_path, pp_tp_plan):
    compile_plan(pp_tp_plan, tmp_path / "out")
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=tmp_path / "out", env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torchrun --nproc_per_node=4 train.py" in result.stdout
    for option in ("--steps", "--lr", "--optimizer", "--seed", "--init-from", "--save-final", "--metrics"):
        assert option in result.stdout


def test_changed_model_file_is_refused_and_nothing_is_written(tmp_path, pp_tp_plan, model_copy):
    model_copy.write_text(model_copy.read_text() + "\n# edited\n")
    out = tmp_path / "build" / "gpt"
    with pytest.raises(CompileError, match=r"^model file .*gpt\.py changed since planning; re-run hetpar plan$"):
        compile_plan(pp_tp_plan, out)
    assert not (tmp_path / "build").exists()


def test_missing_model_file_is_refused(tmp_path, pp_tp_plan, model_copy):
    model_copy.unlink()
    with pytest.raises(CompileError, match=r"^model file .*gpt\.py not found"):
        compile_plan(pp_tp_plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failure_while_writing_leaves_the_old_build_untouched(tmp_path, pp_tp_plan, monkeypatch):
    out = tmp_path / "out"
    compile_plan(pp_tp_plan, out)
    (out / "final.pt").write_text("user output")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken_copy(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copyfile", broken_copy)
    changed = dataclasses.replace(pp_tp_plan, num_microbatches=2, global_batch_size=4)
    with pytest.raises(OSError, match="disk full"):
        compile_plan(changed, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_recompiling_replaces_the_program_and_keeps_other_files(tmp_path, pp_tp_plan):
    out = tmp_path / "out"
    compile_plan(pp_tp_plan, out)
    (out / "final.pt").write_text("user output")
    changed = dataclasses.replace(pp_tp_plan, num_microbatches=2, global_batch_size=4)
    compile_plan(changed, out)
    assert constants(out / "train.py")["NUM_MICROBATCHES"] == "2"
    assert (out / "final.pt").read_text() == "user output"


def test_unknown_dtype_is_refused(tmp_path, pp_tp_plan):
    with pytest.raises(CompileError, match="plan dtype 'int8'"):
        compile_plan(dataclasses.replace(pp_tp_plan, dtype="int8"), tmp_path / "out")


def test_bf16_plan_autocasts(tmp_path, pp_tp_plan):
    compile_plan(dataclasses.replace(pp_tp_plan, dtype="bf16"), tmp_path / "out")
    assert constants(tmp_path / "out" / "train.py")["DTYPE"] == "torch.bfloat16"


def test_tf32_plan_turns_tf32_matmuls_on_and_an_fp32_plan_leaves_torchs_defaults(tmp_path, pp_tp_plan):
    """[Note: TF32]: float32 tensors without autocast either way; a tf32 plan's program
    turns TF32 matmuls and convolutions on, for CUDA devices, before any layer runs."""
    compile_plan(dataclasses.replace(pp_tp_plan, dtype="tf32"), tmp_path / "tf32")
    compile_plan(dataclasses.replace(pp_tp_plan, dtype="fp32"), tmp_path / "fp32")
    tf32, fp32 = ((tmp_path / d / "train.py").read_text() for d in ("tf32", "fp32"))
    assert constants(tmp_path / "tf32" / "train.py")["DTYPE"] == "torch.float32"
    assert "autocast" not in tf32 and "autocast" not in fp32
    assert "precision.allow_tf32(device)" in tf32 and "allow_tf32" not in fp32
    assert tf32.index("precision.allow_tf32(device)") < tf32.index("materialize.materialize_stages")

    from hetpar.runtime.precision import allow_tf32

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        allow_tf32(torch.device("cpu"))  # no TF32 off CUDA: nothing changes
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        allow_tf32(torch.device("cuda", 0))
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def fake_torchrun(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``torchrun`` prints its arguments instead of starting anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "torchrun").write_text('#!/bin/sh\necho torchrun "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_launcher_runs_torchrun_on_one_host(tmp_path, pp_tp_plan):
    out = tmp_path / "out"
    compile_plan(pp_tp_plan, out)
    result = subprocess.run([str(out / "launch.sh"), "--steps", "3"], env=fake_torchrun(tmp_path),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"torchrun --nproc_per_node=4 {out / 'train.py'} --steps 3"
    result = subprocess.run([str(out / "launch.sh")], env={**fake_torchrun(tmp_path / "again"), "MASTER_PORT": "29600"},
                            capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == f"torchrun --nproc_per_node=4 --master_port=29600 {out / 'train.py'}"


def test_launcher_on_several_hosts(tmp_path, model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, spec="2x2xcpu"))
    out = tmp_path / "out"
    compile_plan(plan, out)
    assert "NODE_RANK=1: ranks 2-3 (cpu)" in (out / "launch.sh").read_text()
    assert "On 2 hosts of 2 processes" in module_docstring(out / "train.py")
    env = fake_torchrun(tmp_path)
    result = subprocess.run([str(out / "launch.sh")], env={**env, "NNODES": "2", "NODE_RANK": "1",
                            "MASTER_ADDR": "node0"}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --master_addr=node0 --master_port=29500 {out / 'train.py'}"
    )
    missing = subprocess.run([str(out / "launch.sh")], env={**env, "NNODES": "2"}, capture_output=True, text=True,
                             timeout=30)
    assert missing.returncode != 0 and "set NODE_RANK" in missing.stderr


def test_wrong_world_size_is_one_line_and_exit_code(tmp_path, model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=1)
    compile_plan(plan, tmp_path / "out")
    result = run_torchrun(tmp_path / "out" / "train.py", 1, ["--steps", "1"], timeout_s=120)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hetpar:")]
    assert ours == [
        "hetpar: this program was compiled for world size 2 but torchrun started 1 process; "
        "run: torchrun --nproc_per_node=2 train.py"
    ]
    assert "runtime/cli.py" not in result.stderr  # no traceback from our code


def test_interleaved_plan_checks_itself_round_trips_and_compiles(tmp_path, gpt_path):
    from dataclasses import replace

    from hetpar.planner.errors import PlanFileError as PlanError
    from hetpar.planner.plan import ClusterRef, ParallelPlan
    from hetpar.vocabulary import Schedule

    flat = build_plan(gpt_path, GPT_ARGS, splits=[[0], [1], [2], [3]], num_microbatches=4)
    stages = [replace(s, ranks=flat.stages[s.index % 2].ranks) for s in flat.stages]
    cluster = ClusterRef(spec="1x2xcpu", world_size=2, device_types=["cpu"] * 2)
    plan = replace(flat, stages=stages, schedule=Schedule.INTERLEAVED, virtual_stages=2, cluster=cluster)
    assert plan.pipeline_parallel == 2
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan
    with pytest.raises(PlanError, match=r"num_microbatches\(3\) to be a multiple of pp\(2\)"):
        replace(plan, num_microbatches=3, global_batch_size=6)
    with pytest.raises(PlanError, match="needs schedule 'interleaved'"):
        replace(plan, schedule=Schedule.ONE_F_ONE_B)
    with pytest.raises(PlanError, match="stage 3 is chunk 1 of pipeline rank 1"):
        replace(plan, stages=[*stages[:3], replace(stages[3], ranks=[[0]])])
    old = json.loads(flat.to_json())
    del old["virtual_stages"]
    assert ParallelPlan.from_dict(old).virtual_stages == 1  # plans written before the field load unchanged
    text = program_source(plan)
    assert "VIRTUAL_STAGES = 2" in text and "PIPELINE_RANKS = 2" in text


def test_zero_bubble_refuses_zero_stages(gpt_path):
    from hetpar.planner.errors import PlanFileError as PlanError

    with pytest.raises(PlanError, match="schedule 'zb' needs zero_stage 0"):
        build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, schedule="zb", zero_stage=2)
