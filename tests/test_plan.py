"""ParallelPlan validates its degrees and round-trips through JSON."""

import dataclasses
import json

import pytest

from hetpar.planner.errors import PlanFileError as PlanError
from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan
from hetpar.vocabulary import Schedule, Sharding


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
        solver=SolverInfo(status="optimal", search_time_s=0.1),
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


def test_data_parallel_options_round_trip_and_old_plans_load(tmp_path):
    stages = [dataclasses.replace(s, zero_stage=z, recompute=r)
              for s, z, r in zip(make_plan().stages, (1, 3), ("full", "selective"))]
    plan = make_plan(stages=stages, replica_batch_shares=[3, 1])
    plan.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json") == plan
    assert plan.replica_micro_batch_sizes == [3, 1] and make_plan().replica_micro_batch_sizes == [2, 2]
    old = json.loads(make_plan().to_json())
    for s in old["stages"]:
        del s["zero_stage"], s["recompute"]
    del old["grad_compression"], old["replica_batch_shares"]
    loaded = ParallelPlan.from_dict(old)
    assert (loaded.stages[0].zero_stage, loaded.stages[0].recompute, loaded.grad_compression) == (0, "none", "none")


@pytest.mark.parametrize("change,message", [
    (dict(zero_stage=4), r"stage 0: zero_stage\(4\) must be one of 0, 1, 2, 3"),
    (dict(recompute="some"), r"stage 0: recompute 'some' must be one of 'none', 'selective', 'full'"),
])
def test_stage_options_are_checked(change, message):
    with pytest.raises(PlanError, match=message):
        StagePlan(index=0, layers=[0], device_type="cpu", tensor_parallel=1, ranks=[[0]], **change)


def test_replica_shares_need_not_sum_to_a_multiple_of_dp():
    """Three samples of every five to replica 0: the global batch is num_microbatches * 5, micro_batch_size the
    mean rounded down (a replica count that does not divide the batch, as heterogeneous clusters have)."""
    plan = make_plan(replica_batch_shares=[3, 2], global_batch_size=10)
    assert plan.replica_micro_batch_sizes == [3, 2]
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan


@pytest.mark.parametrize("change,message", [
    (dict(grad_compression="int8"), r"grad_compression 'int8' must be one of none\|bf16\|fp16\|powersgd:R\|topk:F\|sign"),
    (dict(grad_compression="topk:0"), r"grad_compression 'topk:0' must be one of .* 0 < F <= 1"),
    (dict(grad_compression="powersgd:x"), r"grad_compression 'powersgd:x' must be one of"),
    (dict(aggregation="krum"), r"aggregation 'krum' must be one of mean\|trimmed-mean:B\|median\|krum:F"),
    (dict(aggregation="median:1"), r"aggregation 'median:1' must be one of"),
    (dict(aggregation="trimmed-mean:1"), r"aggregation trimmed-mean:1 needs at least 3 data-parallel replicas, the plan has 2"),
    (dict(aggregation="krum:1"), r"aggregation krum:1 needs at least 4 data-parallel replicas, the plan has 2"),
    (dict(aggregation="median", grad_compression="bf16"), r"grad_compression 'bf16' and aggregation 'median' do not combine"),
    (dict(sync_every=4, grad_compression="sign"), r"grad_compression 'sign' and sync_every 4 do not combine"),
    (dict(sync_every=0), r"sync_every 0 must be an integer >= 1"),
    (dict(sync_scope="rack", sync_every=2), r"sync_scope 'rack' must be one of all, node"),
    (dict(sync_scope="node"), r"sync_scope 'node' applies to local SGD; give sync_every K > 1 with it"),
    (dict(sync_every=2, replica_batch_shares=[3, 1]), r"sync_every 2 needs equal replica batch shares"),
    (dict(rebalance_every=-1), r"rebalance_every -1 must be an integer >= 0"),
    (dict(rebalance_every=2), r"rebalance_every needs one pipeline stage \(the plan has 2\)"),
    (dict(replica_batch_shares=[3]), r"replica_batch_shares \[3\] must hold one micro-batch size >= 1 per replica"),
    (dict(replica_batch_shares=[4, 0]), r"must hold one micro-batch size >= 1 per replica, data_parallel is 2"),
    (dict(replica_batch_shares=[3, 2]), r"sum\(replica_batch_shares \[3, 2\]\) \* num_microbatches\(\d+\) = \d+ != "
                                        r"global_batch_size"),
    (dict(replica_batch_shares=[5, 3], global_batch_size=16), r"micro_batch_size\(2\) must be their mean, rounded down"),
])
def test_plan_options_are_checked(change, message):
    with pytest.raises(PlanError, match=message):
        make_plan(**change)


def test_compression_and_zero_do_not_mix():
    stages = [dataclasses.replace(make_plan().stages[0], zero_stage=2), make_plan().stages[1]]
    with pytest.raises(PlanError, match=r"grad_compression 'fp16' needs zero_stage 0 on every stage .* stage 0 has "
                                        r"zero_stage 2"):
        make_plan(stages=stages, grad_compression="fp16")


def test_sync_options_round_trip(tmp_path):
    """Each data-parallel sync option is a plan field that survives the JSON file."""
    for change in (dict(grad_compression="topk:0.01"), dict(grad_compression="powersgd:4"),
                   dict(sync_every=8, sync_scope="node")):
        plan = make_plan(**change)
        plan.save(tmp_path / "plan.json")
        assert ParallelPlan.load(tmp_path / "plan.json") == plan
    one_stage = [StagePlan(index=0, layers=[0, 1, 2, 3], device_type="cpu", tensor_parallel=2, ranks=[[0, 1], [2, 3]])]
    plan = make_plan(stages=one_stage, rebalance_every=5, replica_batch_shares=[3, 1])
    plan.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json").rebalance_every == 5


@pytest.mark.parametrize("field, value, message", [
    ("schedule", "zb2", r"plan schedule 'zb2' must be one of '1f1b', 'gpipe', 'interleaved', 'zb'"),
    ("tp_sharding", "diagonal", r"stage 0 tp_sharding of 'blocks.0.fc' 'diagonal' must be one of 'colwise', "),
])
def test_a_name_outside_the_vocabulary_is_refused_in_one_line(tmp_path, field, value, message):
    data = json.loads(make_plan().to_json())
    if field == "schedule":
        data["schedule"] = value
    else:
        data["stages"][0]["tp_sharding"] = {"blocks.0.fc": value}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message) as caught:
        ParallelPlan.load(path)
    assert "\n" not in str(caught.value)


def test_the_output_says_what_the_proof_bounds_where_the_prediction_differs():
    """[Note: what the proof bounds]: within 2% the numbers agree and nothing is said;
    beyond, one line names the number the proof is about."""
    from hetpar.planner.plan import proof_scope

    def with_numbers(objective_s, step_s, status="optimal", best_s=0.0, finalists=1):
        plan = make_plan()
        return dataclasses.replace(plan, solver=SolverInfo(status=status, search_time_s=1.0, objective_s=objective_s,
                                                           objective_gap=0.03, best_objective_s=best_s,
                                                           finalists=finalists),
                                   predicted=dataclasses.replace(plan.predicted, step_time_s=step_s))

    assert proof_scope(with_numbers(0.1790, 0.1790 * 1.019)) is None
    note = proof_scope(with_numbers(0.1790, 0.1541))
    assert note.startswith("proof: optimal for the search's linear step time, 179.00 ms") and "14% lower" in note
    assert note.endswith("it ranks no other candidate")
    assert "within 3.0%" in proof_scope(with_numbers(2.0, 2.5, status="feasible")) and "25% higher" in \
        proof_scope(with_numbers(2.0, 2.5, status="feasible"))
    assert proof_scope(with_numbers(0.1790, 0.1541, status="heuristic")) is None
    # re-ranked ([Note: finalists re-ranked]): the linear optimum is the best, but another finalist simulates faster
    assert proof_scope(with_numbers(0.1790, 0.1541, best_s=0.1790, finalists=4)).endswith(
        "no other of the search's 4 finalists simulates faster")
    chosen = proof_scope(with_numbers(0.1800, 0.1790, best_s=0.1790, finalists=4))
    assert chosen.startswith("proof: optimal for the search's linear step time, 179.00 ms for another candidate; "
                             "this plan's is 180.00 ms") and chosen.endswith("fastest of the search's 4 finalists")
