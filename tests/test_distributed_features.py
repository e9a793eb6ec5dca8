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
    stderr = assert_trains_like_one_process(with_stages(plan, zero_stage=[1]), tmp_path, optimizer="adamw")
    assert "hetpar: stage 0 (layers 0-3): tp 1, ZeRO-1 through FSDP2 over 2 replicas, recompute none" in stderr


@pytest.mark.slow
def test_zero_2_and_3_with_recompute_in_a_gpipe_pipeline(tmp_path, mlp_path):
    """dp 2 x pp 2, GPipe (every forward before any backward): stage 0 ZeRO-2 with full
    recompute, stage 1 ZeRO-3 with selective recompute."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2,
                      schedule="gpipe")
    plan = with_stages(plan, zero_stage=[2, 3], recompute=["full", "selective"])
    stderr = assert_trains_like_one_process(plan, tmp_path)
    assert "hetpar: stage 0 (layers 0-1): tp 1, ZeRO-2 through FSDP2 over 2 replicas, recompute full" in stderr
    # a block (norm, up, down), the final norm and the head: one FSDP unit each, under recompute too
    assert ("hetpar: stage 1 (layers 2-3): tp 1, ZeRO-3 through FSDP2 over 2 replicas, 5 modules gathered one at a "
            "time, recompute selective") in stderr


@pytest.mark.slow
def test_heterogeneous_data_parallel_shares_by_pipeline_2(tmp_path, mlp_path):
    """Replica 0 takes 3 of every 4 samples, replica 1 one: the weighted gradient average
    is the full batch's mean gradient, in a 1F1B pipeline whose replicas cut their
    stages for different micro-batch sizes."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], data_parallel=2, num_microbatches=2)
    plan = dataclasses.replace(plan, replica_batch_shares=[3, 1])
    assert plan.global_batch_size == 8
    assert_trains_like_one_process(plan, tmp_path)


def max_param_diff(final: dict, ref_state: dict) -> float:
    return max(float((final[k] - v).abs().max()) for k, v in ref_state.items())


@pytest.mark.slow
def test_fp16_autocast_with_loss_scaling_tracks_float32(tmp_path, gpt_path):
    """fp16 compute, fp32 master weights, dynamic loss scale 2**16 in a pipeline. Compared
    with the float32 reference, so only as close as fp16's 11 bits allow."""
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=2, dtype="fp16")
    losses, final, ref_losses, ref_state, *_ = run_compiled(plan, tmp_path, "sgd")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    assert max_param_diff(final, ref_state) < 2e-3  # measured 4e-6


@pytest.mark.slow
def test_fp16_gradient_compression_trains_within_fp16_rounding(tmp_path, mlp_path):
    """Lossy by design: each averaged gradient is rounded to fp16 (11 significant bits)."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2)
    losses, final, ref_losses, ref_state, stderr, _ = run_compiled(
        dataclasses.replace(plan, grad_compression="fp16"), tmp_path, "sgd")
    assert "all-reduce over 2 replicas through fp16_compress_hook" in stderr
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    assert max_param_diff(final, ref_state) < 5e-3  # measured 9e-4


@pytest.mark.slow
def test_powersgd_compresses_after_its_warm_up(tmp_path, mlp_path):
    """Lossy by design: PowerSGD all-reduces plainly for --powersgd-start-step (2) steps,
    then sends a rank-1 approximation of each gradient matrix. So the losses (each taken
    before its step's update) match the reference exactly, and the parameters after the
    compressed third update differ from it, by a fraction of one update."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2)
    losses, final, ref_losses, ref_state, stderr, _ = run_compiled(
        dataclasses.replace(plan, grad_compression="powersgd"), tmp_path, "sgd")
    assert "all-reduce over 2 replicas through powerSGD_hook" in stderr
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert 1e-4 < max_param_diff(final, ref_state) < 0.1  # measured 2.9e-2 (lr 0.1); exact all-reduce: < 1e-5


@pytest.mark.slow
def test_zero_3_over_tensor_parallel_shards(tmp_path, gpt_path):
    """dp 2 x tp 2: FSDP2 shards the DTensor (tensor-parallel) parameters over a 2-D mesh."""
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)
    stderr = assert_trains_like_one_process(with_stages(plan, zero_stage=[3]), tmp_path)
    assert ("hetpar: stage 0 (layers 0-3): tp 2, ZeRO-3 through FSDP2 over 2 replicas, 20 modules gathered one at a "
            "time, recompute none") in stderr
