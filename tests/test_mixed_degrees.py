"""Replicas of one stage at different tensor-parallel degrees ([Note: replicas of different
degrees] in hetpar/runtime/mixed_sync.py): the plan format, the program under torchrun
against one process, the estimate and the heterogeneous data-parallel search."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import ROOT, build_plan
from hetpar.planner.errors import PlanFileError
from hetpar.planner.plan import ParallelPlan
from hetpar.vocabulary import Sharding
from test_distributed import GPT_ARGS

GQA = ROOT / "tests" / "models" / "gqa_fused.py"
VOCAB = {Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD}


def relaid(plan: ParallelPlan, rows: list[list[int]], shares: list[int]) -> ParallelPlan:
    """``plan`` (one stage, two replicas) with its replicas on ``rows`` of ranks and taking ``shares``."""
    (stage,) = plan.stages
    world = sum(len(r) for r in rows)
    stage = dataclasses.replace(stage, tensor_parallel=len(rows[0]), ranks=rows)
    cluster = dataclasses.replace(plan.cluster, spec=f"1x{world}xcpu", world_size=world, device_types=["cpu"] * world)
    return dataclasses.replace(plan, stages=[stage], cluster=cluster, replica_batch_shares=shares,
                               global_batch_size=sum(shares) * plan.num_microbatches,
                               micro_batch_size=sum(shares) // len(shares))


def gpt_plan() -> ParallelPlan:
    path = ROOT / "examples" / "gpt.py"
    return build_plan(path, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)


def gqa_plan() -> ParallelPlan:
    """tests/models/gqa_fused.py planned at dp 2 x tp 2 (its fused projections part-laid), two micro-batches of 2."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, tp=2, dp=2, pp=1)
    return plan_model(GQA, parse_cluster("1x4xcpu"), options, model_args={})


def test_a_plan_of_mixed_degrees_round_trips_and_says_each_replicas_degree():
    plan = relaid(gpt_plan(), [[0], [1, 2]], [1, 3])
    (stage,) = plan.stages
    assert stage.replica_degrees == [1, 2] and stage.mixed_degrees and stage.tensor_parallel == 1
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan


@pytest.mark.parametrize("change, message", [
    ({"zero_stage": 1}, "run without zero_stage > 0"),
    ({"tensor_parallel": 2}, r"replica 0 needs tensor_parallel\(2\) ranks, got 1"),
])
def test_a_mixed_stage_refuses_what_its_sync_cannot_run(change, message):
    plan = relaid(gpt_plan(), [[0], [1, 2]], [1, 3])
    with pytest.raises(PlanFileError, match=message):
        dataclasses.replace(plan.stages[0], **change)


def test_a_mixed_plan_refuses_compressed_or_robust_syncs():
    plan = relaid(gpt_plan(), [[0], [1, 2]], [2, 2])
    with pytest.raises(PlanFileError, match="tensor-parallel degrees \\[1, 2\\]: they run with plain data parallelism"):
        dataclasses.replace(plan, grad_compression="fp16")


def test_ranks_must_cover_the_world_once_with_mixed_degrees():
    plan = relaid(gpt_plan(), [[0], [1, 2]], [1, 3])
    with pytest.raises(PlanFileError, match="world_size"):
        dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, world_size=4, device_types=["cpu"] * 4))


@pytest.mark.slow
def test_gpt_replicas_at_tp_1_and_tp_2_train_like_one_process(tmp_path):
    """Rank 0 alone (tp 1) takes one sample of every three, ranks 1-2 (tp 2) two: a global batch of 6 over two
    replicas whose shares' sum is odd."""
    from test_distributed import assert_trains_like_one_process

    plan = relaid(gpt_plan(), [[0], [1, 2]], [1, 2])
    assert (plan.global_batch_size, plan.micro_batch_size) == (6, 1)
    stderr = assert_trains_like_one_process(plan, tmp_path, "sgd")
    assert "tp 1/2, all-reduce over 2 replicas of tensor-parallel degrees [1, 2], gradients whole" in stderr


@pytest.mark.slow
def test_fused_qkv_replicas_at_tp_2_and_tp_1_train_like_one_process_under_adamw(tmp_path):
    """A GPT whose one Linear makes q, k and v (part-laid at tp 2, whole at tp 1): the gradients meet in the
    user's layout ([Note: part-laid Linears] in hetpar/runtime/parts.py)."""
    from test_distributed import assert_trains_like_one_process

    plan = gqa_plan()
    assert plan.stages[0].tp_parts and plan.num_microbatches == 2
    assert VOCAB <= set(plan.stages[0].tp_sharding.values())  # embedding and head split over the vocabulary at tp 2
    assert_trains_like_one_process(relaid(plan, [[0, 1], [2]], [3, 1]), tmp_path, "adamw")


@pytest.mark.slow
def test_a_checkpoint_of_mixed_degrees_holds_the_users_tensors_and_resumes_mixed(tmp_path):
    """Replicas at tp 2 (part-laid) and tp 1 write one checkpoint of the model's own tensors (read by one
    process it equals --save-final), and the same plan resumes from it as one process's 4 steps."""
    import torch

    from test_fused_projections import save_then_resume

    plan = relaid(gqa_plan(), [[0, 1], [2]], [3, 1])
    final, saved = save_then_resume(plan, plan, GQA, tmp_path)
    assert final.keys() <= saved.keys()  # the checkpoint also holds the buffers
    for key in final:
        assert torch.equal(saved[key], final[key]), key


@pytest.mark.slow
def test_a_searched_plan_of_mixed_degrees_trains_like_one_process(tmp_path):
    """hetpar's own choice on a CPU worker beside two three times slower ones, in two replicas: the worker at
    tp 1, the slow pair at tp 2 ([Note: heterogeneous data parallelism], step 5), run for real."""
    from hetpar.cost_models.cluster import Cluster
    from hetpar.planner.api import plan_graph
    from hetpar.planner.capture import trace_model
    from hetpar.planner.options import SearchOptions
    from hetpar.runtime.model_file import load_model_file
    from test_distributed import assert_trains_like_one_process
    from test_hetero_dp import slow_cpu_cluster

    one = slow_cpu_cluster()
    fast, slow = one.groups
    cluster = Cluster(spec="1x1xcpu+1x2xcpu-slow", groups=(fast, dataclasses.replace(slow, devices_per_node=2)))
    graph = trace_model(load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS))
    plan = plan_graph(graph, cluster, SearchOptions(global_batch_size=8, dtype="fp32", workers=1, dp=2), hetero_dp="on")
    assert [s.replica_degrees for s in plan.stages] == [[1, 2]] * len(plan.stages)
    assert plan.replica_batch_shares[0] > plan.replica_batch_shares[1]
    assert_trains_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_a_pipeline_of_replicas_at_tp_1_and_tp_2_trains_like_one_process_under_adamw(tmp_path):
    """pp 2: replica 0 runs its two stages on ranks 0 and 1 at tp 1, replica 1 on ranks 2-3 and 4-5 at tp 2;
    activations and gradients travel inside each replica ([Note: rank layout] in hetpar/runtime/distributed.py)."""
    from test_distributed import assert_trains_like_one_process

    plan = build_plan(ROOT / "examples" / "gpt.py", GPT_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, tensor_parallel=2,
                      tp_blocks=True, num_microbatches=2)
    rows = [[[0], [2, 3]], [[1], [4, 5]]]
    stages = [dataclasses.replace(s, tensor_parallel=1, ranks=r) for s, r in zip(plan.stages, rows)]
    cluster = dataclasses.replace(plan.cluster, spec="1x6xcpu", world_size=6, device_types=["cpu"] * 6)
    plan = dataclasses.replace(plan, stages=stages, cluster=cluster, replica_batch_shares=[1, 2], global_batch_size=6,
                               micro_batch_size=1)
    stderr = assert_trains_like_one_process(plan, tmp_path, "adamw")
    assert "stage 1 (layers 2-3): tp 1/2, all-reduce over 2 replicas of tensor-parallel degrees [1, 2]" in stderr
