"""The hetpar command as a user meets it: real subprocesses, clear one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, hetpar

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
SMALL_GPT = ["--model-arg", "n_layers=2", "--model-arg", "hidden=32", "--model-arg", "seq_len=8", "--model-arg", "vocab=64"]


def test_version_and_help():
    assert hetpar("--version").stdout.startswith("hetpar ")
    help_text = hetpar("--help").stdout
    for command in ("plan", "compile", "trace", "devices"):
        assert command in help_text


def test_the_command_line_loads_neither_torch_nor_the_solver_until_a_command_needs_them():
    # Every command's options and one-line errors come from modules that import neither:
    # `hetpar --help` and a bad argument answer at once (commands import them in their bodies).
    code = "import sys, hetpar.cli; print(sorted(m for m in ('torch', 'ortools', 'pandas') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command, default", [
    ("plan", "[default: 1f1b, zb and interleaved are searched; gpipe only when pinned]"),
    ("estimate", "[default: fp32 on cpu, bf16 else, fp16 where a device lacks bf16]"),
])
def test_help_shows_defaults_in_brackets(command, default):
    """A help text's ``[default: ...]`` is text, not rich markup that swallows it."""
    done = subprocess.run([sys.executable, "-m", "hetpar", command, "--help"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert default in " ".join(done.stdout.split())


def test_plan_writes_a_valid_plan(tmp_path):
    out = tmp_path / "plan.json"
    result = hetpar("plan", GPT, "--cluster", "1x2xcpu", "--global-batch", "8", *SMALL_GPT, "-o", str(out))
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["kind"] == "hetpar.plan" and plan["cluster"]["world_size"] == 2
    assert plan["solver"]["status"] == "optimal"
    assert plan["data_parallel"] * plan["micro_batch_size"] * plan["num_microbatches"] == 8
    assert "predicted step" in result.stderr


def test_plan_json_goes_to_stdout_and_pins_hold(tmp_path):
    result = hetpar("plan", GPT, "--cluster", "1x4xcpu", "--global-batch", "8", *SMALL_GPT,
                    "--pp", "2", "--tp", "2", "--schedule", "1f1b", "--recompute", "full", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert len(plan["stages"]) == 2 and plan["stages"][0]["tensor_parallel"] == 2
    assert {s["recompute"] for s in plan["stages"]} == {"full"}
    assert plan["stages"][0]["tp_sharding"] or plan["stages"][1]["tp_sharding"]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("args,fragments", [
    (["plan", "nope.py", "--cluster", "1x2xcpu", "--global-batch", "8"], ["'nope.py' not found"]),
    (["plan", GPT, "--cluster", "2xA100x", "--global-batch", "8"], ["--cluster", "2x8xA100-80GB"]),
    (["plan", GPT, "--cluster", "1x8xA10", "--global-batch", "8"], ["A10", "A100-80GB"]),
    (["plan", GPT, "--cluster", "1x2xcpu", "--global-batch", "7", "--dp", "2"], ["--global-batch 7", "dp(2)"]),
    (["plan", GPT, "--cluster", "1x2xcpu", "--global-batch", "8", "--dp", "3"], ["--dp 3", "world size (2)"]),
    (["plan", GPT, "--cluster", "1x4xcpu", "--global-batch", "8", "--dp", "2", "--tp", "2", "--pp", "2"], ["dp(2) * tp(2) * pp(2) = 8 != world_size(4)"]),
    (["plan", GPT, "--cluster", "1x2xcpu", "--global-batch", "8", "--model-arg", "layers=3"], ["takes no argument 'layers'"]),
])
def test_bad_plan_input(tmp_path, args, fragments):
    result = hetpar(*args, "-o", str(tmp_path / "plan.json"), cwd=tmp_path)
    assert_one_line_error(result, *fragments)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source,fragment", [
    ("import torch\nraise ValueError('bad config')\n", "failed to import at line 2: ValueError: bad config"),
    ("import torch\ndef example_inputs(b):\n    return (torch.zeros(b, 2),)\n", "defines no build_model()"),
])
def test_bad_model_file(tmp_path, source, fragment):
    model = tmp_path / "model.py"
    model.write_text(source)
    result = hetpar("plan", str(model), "--cluster", "1x2xcpu", "--global-batch", "8", "-o", str(tmp_path / "plan.json"))
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("content,fragment", [
    ("{\"half\": ", "not valid JSON"),
    ("{\"model\": \"resnet\", \"layers\": 3}", "not a hetpar plan"),
])
def test_compile_rejects_corrupt_or_foreign_plans(tmp_path, content, fragment):
    plan = tmp_path / "plan.json"
    plan.write_text(content)
    result = hetpar("compile", str(plan), "-o", str(tmp_path / "build"))
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "build").exists()


def test_trace_json_lists_layers():
    result = hetpar("trace", GPT, *SMALL_GPT, "--json", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [l["name"] for l in data["layers"]] == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+lm_head"]
    assert data["totals"]["params"] == sum(l["params"] for l in data["layers"])


def _without_timings(text: str) -> str:
    """Plan JSON with the wall-clock fields (the only ones that may differ between runs) blanked."""
    return re.sub(r'"(search|trace)_time_s": [0-9.e+-]+', r'"\1_time_s": 0', text)


def test_plan_does_not_depend_on_machine_load(tmp_path):
    """[Note: deterministic search]: the same command gives the same plan JSON, byte for byte but for its
    timings, also while another process keeps a core busy; the limit here stops CP-SAT's solves short of
    a proof (every candidate CP-SAT's: the split programme has no limit to hit)."""
    args = ("plan", GPT, "-c", "1x4xcpu", "-b", "8", "-a", "n_layers=8", "-a", "hidden=64", "-a", "seq_len=16",
            "--work-limit", "0.0005", "--split-solver", "cp-sat")
    quiet = hetpar(*args, "-o", str(tmp_path / "quiet.json"))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = hetpar(*args, "-o", str(tmp_path / "busy.json"))
    finally:
        hog.kill()
        hog.wait()
    assert quiet.returncode == 0 and busy.returncode == 0, quiet.stderr + busy.stderr
    first, second = ((tmp_path / name).read_text() for name in ("quiet.json", "busy.json"))
    assert _without_timings(first) == _without_timings(second)
    solver = json.loads(first)["solver"]
    assert solver["status"] == "feasible" and "hit the work limit of 0.0005 deterministic s; proven gap" in solver["reason"]
    assert "solver: feasible: " in " ".join(quiet.stderr.split()) and "search " in quiet.stderr and "trace " in quiet.stderr


def test_plan_pinned_pp_lays_out_stages_as_megatron_and_auto_searches(tmp_path):
    """--pp without --stage-layers: blocks evenly, embedding with the first stage, head with the last, as
    estimate lays them out ([Note: default stage split]); --stage-layers auto: the search's own split; the
    output names the rule; ranks print as ranges."""
    model = ["--model-arg", "n_layers=6", "--model-arg", "hidden=32", "--model-arg", "seq_len=8", "--model-arg", "vocab=64"]
    pinned = hetpar("plan", GPT, "--cluster", "1x4xcpu", "--global-batch", "8", *model, "--pp", "3", "--dp", "1", "--json", cwd=tmp_path)
    assert pinned.returncode == 0, pinned.stderr
    assert [len(s["layers"]) for s in json.loads(pinned.stdout)["stages"]] == [3, 2, 3]  # tok_emb + 2 | 2 | 2 + head
    assert "stage layout: Megatron (blocks evenly" in pinned.stderr
    assert re.search(r"\b0-1\b", pinned.stderr)  # stage 0's two tensor-parallel ranks as one range
    searched = hetpar("plan", GPT, "--cluster", "1x4xcpu", "--global-batch", "8", *model, "--pp", "3", "--dp", "1",
                      "--stage-layers", "auto", "--json", cwd=tmp_path)
    assert searched.returncode == 0, searched.stderr
    assert "stage layout: the search's best split under the pins (--stage-layers auto)" in searched.stderr
    assert json.loads(searched.stdout)["solver"]["objective_s"] <= json.loads(pinned.stdout)["solver"]["objective_s"] * (1 + 1e-9)
