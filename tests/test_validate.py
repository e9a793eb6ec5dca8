"""hetpar validate: predicted against measured step time of a plan run on this host."""

import json
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, hetpar

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
SMALL_GPT = ["--model-arg", "n_layers=2", "--model-arg", "hidden=32", "--model-arg", "seq_len=8", "--model-arg", "vocab=64"]


def test_missing_plan_and_bad_steps_are_one_line_errors(tmp_path):
    for result, fragment in ((hetpar("validate", str(tmp_path / "nope.json")), "nope.json"),):
        assert result.returncode != 0 and "Traceback" not in result.stderr
        lines = [l for l in result.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.slow
def test_validate_json_on_a_tiny_plan(tmp_path):
    plan = tmp_path / "plan.json"
    planned = hetpar("plan", GPT, *SMALL_GPT, "-c", "1x2xcpu", "-b", "4", "--dp", "2", "-o", str(plan))
    assert planned.returncode == 0, planned.stderr
    result = hetpar("validate", str(plan), "--steps", "3", "--json", "--timeout", "240")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["predicted_step_time_s"] > 0 and data["measured_step_time_s"] > 0
    expected = (data["predicted_step_time_s"] - data["measured_step_time_s"]) / data["measured_step_time_s"]
    assert data["relative_error"] == pytest.approx(expected)
    assert data["measured_steps"] == 3 and len(data["step_times_s"]) == 5
    bad = hetpar("validate", str(plan), "--steps", "0")
    assert bad.returncode != 0 and "--steps" in bad.stderr and "Traceback" not in bad.stderr


def test_a_plan_for_other_devices_is_refused_before_running(tmp_path):
    plan = tmp_path / "plan.json"
    planned = hetpar("plan", GPT, *SMALL_GPT, "-c", "1x2xA100-80GB", "-b", "4", "--dp", "2", "-o", str(plan))
    assert planned.returncode == 0, planned.stderr
    assert_one_line_error(hetpar("validate", str(plan), "--steps", "1"), "A100-80GB", "this host")


@pytest.mark.slow
def test_validate_reports_each_pipeline_ranks_forward_and_backward(tmp_path):
    plan = tmp_path / "plan.json"
    planned = hetpar("plan", GPT, *SMALL_GPT, "-c", "1x2xcpu", "-b", "8", "--pp", "2", "--micro-batch-size", "2", "-o", str(plan))
    assert planned.returncode == 0, planned.stderr
    predicted = json.loads(plan.read_text())["predicted"]
    assert len(predicted["stage_fwd_s"]) == len(predicted["stage_bwd_s"]) == 2
    result = hetpar("validate", str(plan), "--steps", "3", "--json", "--timeout", "240")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [s["stage"] for s in data["stages"]] == [0, 1]
    for s in data["stages"]:
        assert s["predicted_fwd_s"] == predicted["stage_fwd_s"][s["stage"]]
        assert s["measured_fwd_s"] > 0 and s["measured_bwd_s"] > 0
        # A rank's compute (4 micro-batches, receives' waits left out) fits inside its steps.
        assert 4 * (s["measured_fwd_s"] + s["measured_bwd_s"]) <= 1.5 * max(data["step_times_s"])
    assert "per micro-batch" in result.stderr
