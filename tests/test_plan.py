"""ParallelPlan validates its degrees and round-trips through JSON."""

import json

import pytest

from planner.plan import ClusterRef, ModelRef, ParallelPlan, PlanError, Predicted, Schedule, Sharding, SolverInfo, StagePlan


def make_plan(**overrides):
    fields = dict(
        model=ModelRef(file="/m.py", args={"n_layers": 2}, fingerprint="sha256:00", layer_names=["emb", "b0", "b1", "head"]),
        cluster=ClusterRef(spec="1x4xcpu", world_size=4, device_types=["cpu"] * 4),
        global_batch_size=8,
        micro_batch_size=2,
        num_microbatches=2,
        schedule=Schedule.ONE_F_ONE_B,
        data_parallel=2,
        dtype="fp32",
        stages=[
            StagePlan(index=0, layers=[0, 1], device_type="cpu", tensor_parallel=1, ranks=[[0], [1]]),
            StagePlan(index=1, layers=[2, 3], device_type="cpu", tensor_parallel=1, ranks=[[2], [3]],
                      tp_sharding={"b1.fc": Sharding.COLWISE}),
        ],
        predicted=Predicted(step_time_s=0.5, throughput_samples_per_s=16.0, peak_memory_bytes=[100, 200]),
        solver=SolverInfo(status="optimal", wall_time_s=0.1),
    )
    fields.update(overrides)
    return ParallelPlan(**fields)


def test_round_trip_keeps_real_numbers(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["stages"][0]["layers"] == [0, 1]
    assert data["stages"][1]["ranks"] == [[2], [3]]
    assert data["schedule"] == "1f1b"
    assert ParallelPlan.load(path) == plan


def test_degrees_error_names_every_factor():
    with pytest.raises(PlanError, match=r"dp\(3\) \* tp\(1\) \* pp\(2\) = 6 != world_size\(4\)"):
        make_plan(data_parallel=3)


def test_batch_error_names_every_factor():
    with pytest.raises(PlanError, match=r"micro_batch_size\(2\) \* num_microbatches\(3\) = 12 != global_batch_size\(8\)"):
        make_plan(num_microbatches=3)


def test_non_contiguous_layers_rejected():
    with pytest.raises(PlanError, match="not contiguous"):
        StagePlan(index=0, layers=[0, 2], device_type="cpu", tensor_parallel=1, ranks=[[0]])


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    ('{"hello": 1}', "not a hetpar plan"),
    ('{"kind": "hetpar.plan", "schema_version": 99}', "schema_version 99"),
    ('{"kind": "hetpar.plan", "schema_version": 1, "stages": []}', "malformed"),
])
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        ParallelPlan.load(path)


def test_missing_plan_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan"):
        ParallelPlan.load(tmp_path / "nope.json")
