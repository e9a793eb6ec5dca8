"""hetpar explain: the estimate of a plan and its schedule drawn as SVG."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.errors import PlanFileError as PlanError
from hetpar.planner.explain import explain_plan, timeline_svg
from hetpar.planner.options import SearchOptions

GPT_ARGS = {"n_layers": 4, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 64}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    model = tmp_path_factory.mktemp("m") / "gpt.py"
    shutil.copy("examples/gpt.py", model)
    options = SearchOptions(global_batch_size=8, dtype="fp32", pp=2, dp=2, micro_batch_size=1)
    return plan_model(model, parse_cluster("1x4xcpu"), options, model_args=GPT_ARGS)


def test_explanation_draws_every_action_of_every_stage(plan):
    result = explain_plan(plan)
    svg = timeline_svg(result.estimate.timeline, ["stage 0", "stage 1"], "t")
    titles = re.findall(r"<title>(\d)([FBW])(\d+) ", svg)
    m = plan.num_microbatches
    for stage in (0, 1):
        for kind in "FB":
            assert sorted(int(mb) for s, k, mb in titles if s == str(stage) and k == kind) == list(range(m))
    assert svg.count("<text") >= 2 + 2  # title, axis, stage labels
    assert result.estimate.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)


def test_changed_model_file_is_refused(plan, tmp_path):
    changed = tmp_path / "gpt.py"
    changed.write_text(open(plan.model.file).read() + "\n# edited\n")
    moved = plan.__class__(**{**plan.__dict__, "model": plan.model.__class__(**{**plan.model.__dict__, "file": str(changed)})})
    with pytest.raises(PlanError, match="changed since planning"):
        explain_plan(moved)


def test_cli_writes_svg_and_json(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    svg = tmp_path / "t.svg"
    result = subprocess.run([sys.executable, "-m", "hetpar", "explain", str(path), "--timeline", str(svg), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "hetpar.estimate"
    assert svg.read_text().startswith("<svg")


def test_a_plan_with_unequal_replica_shares_is_explained_at_its_predicted_pace(tmp_path):
    """Replicas of A100s take more samples than replicas of V100s (planner.hetero_dp); explaining the plan
    estimates each replica at its own share, so it reports the plan's prediction, not the slowest type's pace."""
    from hetpar.planner.capture import trace_model
    from hetpar.planner.strategies import hetero_dp_plan
    from hetpar.runtime.model_file import load_model_file

    model = tmp_path / "gpt.py"
    shutil.copy("examples/gpt.py", model)
    args = {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 512}
    graph = trace_model(load_model_file(model, args))
    plan = hetero_dp_plan(graph, parse_cluster("1x2xA100-80GB+1x2xV100-32GB"),
                          SearchOptions(global_batch_size=64, dtype="fp16", workers=1, time_limit_s=5, pp=1))
    assert len(set(plan.replica_batch_shares)) > 1
    again = explain_plan(plan).estimate
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert again.time.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert [s.ranks for s in again.stages] == [s.ranks for s in plan.stages]
