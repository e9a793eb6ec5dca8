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
    """``plan`` (one stage, two replicas) with its replicas on ``rows`` of ranks and taking ``shares``; the
    vocabulary splits dropped (a mixed stage keeps its embedding and head whole)."""
    (stage,) = plan.stages
    world = sum(len(r) for r in rows)
    stage = dataclasses.replace(stage, tensor_parallel=len(rows[0]), ranks=rows,
                                tp_sharding={k: v for k, v in stage.tp_sharding.items() if v not in VOCAB})
    cluster = dataclasses.replace(plan.cluster, spec=f"1x{world}xcpu", world_size=world, device_types=["cpu"] * world)
    return dataclasses.replace(plan, stages=[stage], cluster=cluster, replica_batch_shares=shares)


def gpt_plan() -> ParallelPlan:
    path = ROOT / "examples" / "gpt.py"
    return build_plan(path, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)


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
    """Rank 0 alone (tp 1) takes one sample of every four, ranks 1-2 (tp 2) three."""
    from test_distributed import assert_trains_like_one_process

    plan = relaid(gpt_plan(), [[0], [1, 2]], [1, 3])
    stderr = assert_trains_like_one_process(plan, tmp_path, "sgd")
    assert "tp 1/2, all-reduce over 2 replicas of tensor-parallel degrees [1, 2], gradients whole" in stderr


@pytest.mark.slow
def test_fused_qkv_replicas_at_tp_2_and_tp_1_train_like_one_process_under_adamw(tmp_path):
    """A GPT whose one Linear makes q, k and v (part-laid at tp 2, whole at tp 1): the gradients meet in the
    user's layout ([Note: part-laid Linears] in hetpar/runtime/parts.py)."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions
    from test_distributed import assert_trains_like_one_process

    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, tp=2, dp=2, pp=1)
    plan = plan_model(GQA, parse_cluster("1x4xcpu"), options, model_args={})
    assert plan.stages[0].tp_parts and plan.num_microbatches == 2
    assert_trains_like_one_process(relaid(plan, [[0, 1], [2]], [3, 1]), tmp_path, "adamw")
