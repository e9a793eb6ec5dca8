"""Plan features beyond the degrees, run for real under torchrun on CPU with gloo and
compared with the single-process reference loop of tests/test_distributed.py: ZeRO 1-3
through FSDP2, per-stage recompute, heterogeneous data parallelism, mixed precision and
gradient compression."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import build_plan
from test_distributed import GPT_ARGS, MLP_ARGS, assert_trains_like_one_process, run_compiled


def with_stages(plan, **fields_per_stage):
    """``plan`` with stage fields replaced: ``zero_stage=[1, 3]`` sets stage 0 and stage 1."""
    stages = [dataclasses.replace(s, **{k: v[i] for k, v in fields_per_stage.items()}) for i, s in enumerate(plan.stages)]
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.slow
def test_zero_1_data_parallel_2_with_microbatches(tmp_path, mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2)
    assert_trains_like_one_process(with_stages(plan, zero_stage=[1]), tmp_path, optimizer="adamw")


@pytest.mark.slow
def test_zero_2_and_3_with_recompute_in_a_gpipe_pipeline(tmp_path, mlp_path):
    """dp 2 x pp 2, GPipe (every forward before any backward): stage 0 ZeRO-2 with full
    recompute, stage 1 ZeRO-3 with selective recompute."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2,
                      schedule="gpipe")
    plan = with_stages(plan, zero_stage=[2, 3], recompute=["full", "selective"])
    assert_trains_like_one_process(plan, tmp_path)
