"""Plans for compiled stages ([Note: compiled stages]): on by default where every device is
a GPU, predicted with fused kernels, recorded in the plan, and followed by the program."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from conftest import ROOT
from hetpar.cli import app
from hetpar.planner.plan import ParallelPlan
from hetpar.rewriters import compile_plan

GPT = str(ROOT / "examples" / "gpt.py")
SMALL = ["-a", "n_layers=2", "-a", "hidden=64", "-a", "heads=4", "-a", "seq_len=16", "-a", "vocab=64"]


def plan(tmp_path, cluster: str, *extra: str) -> ParallelPlan:
    out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    result = CliRunner().invoke(app, ["plan", GPT, *SMALL, "-c", cluster, "-b", "8", "--micro-batch-size", "4",
                                      "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return ParallelPlan.load(out)


def test_gpu_plans_are_compiled_by_default_and_predicted_faster_than_eager(tmp_path):
    compiled, eager = plan(tmp_path, "1x1xH200-141GB"), plan(tmp_path, "1x1xH200-141GB", "--no-compile")
    assert compiled.compiled and not eager.compiled
    assert compiled.predicted.step_time_s < eager.predicted.step_time_s
    assert ParallelPlan.from_dict(json.loads(compiled.to_json())).compiled


def test_cpu_and_npu_plans_are_eager_by_default(tmp_path):
    assert not plan(tmp_path, "1x1xcpu").compiled
    assert not plan(tmp_path, "1x1xAscend910B").compiled
    assert plan(tmp_path, "1x1xcpu", "--compile").compiled


def test_the_program_compiles_its_stages_as_planned(tmp_path):
    for flag, planned in (("--compile", "planned=True"), ("--no-compile", "planned=False")):
        out = tmp_path / flag
        compile_plan(plan(tmp_path, "1x1xH200-141GB", flag), out)
        assert planned in (out / "train.py").read_text()


def test_estimate_counts_fused_kernels_when_compiled():
    args = ["estimate", GPT, *SMALL, "-c", "1x1xA100-80GB", "-b", "8", "--dp", "1", "--tp", "1", "--pp", "1",
            "--micro-batch-size", "4", "--json"]
    times = {}
    for flag in ("--compile", "--no-compile"):
        result = CliRunner().invoke(app, [*args, flag])
        assert result.exit_code == 0, result.output
        times[flag] = json.loads(result.stdout[result.stdout.index("{"):])["predicted"]["step_time_s"]
    assert times["--compile"] < times["--no-compile"]
