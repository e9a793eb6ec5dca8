"""Offloading a ZeRO-3 stage's shard to host memory (issue 32, item 4): its costs against
[Note: offload costs]' closed forms, the search turning to it only where memory binds,
the refusals, and a program that runs it training like one process under torchrun."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, build_plan, subprocess_env
from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.devices import get_device
from hetpar.cost_models.memory import OPTIMIZER_BYTES_PER_PARAM
from hetpar.cost_models.offload import host_optimizer_s, offload_refusal, offload_transfer_s
from hetpar.planner.api import plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanFileError, PlanningError
from hetpar.planner.estimate import EstimateConfig, EstimateError, estimate
from hetpar.planner.options import SearchOptions
from hetpar.runtime.capture import capture
from hetpar.runtime.data_parallel import fsdp_units
from hetpar.runtime.model_file import load_model_file
from test_distributed import MLP_ARGS, assert_trains_like_one_process

GPT = ROOT / "benchmarks" / "published" / "gpt.py"
GPT_6_7B = {"n_layers": 32, "hidden": 4096, "heads": 32, "vocab": 51200, "seq_len": 2048}  # GPT-3 6.7B's shape
SMALL = {"n_layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}


@pytest.fixture(scope="module")
def gpt_6_7b():
    return trace_model(load_model_file(str(GPT), GPT_6_7B))


def test_the_profiles_that_state_a_host_offload_and_the_others_say_why_not():
    for name in ("A100-80GB", "H100-80GB", "GH200-96GB", "V100-16GB"):
        device = get_device(name)
        assert offload_refusal(device) is None, name
        assert device.sources["host_link_bw_bytes_per_s"] and device.sources["host_mem_bw_bytes_per_s"]
    assert "host memory already" in offload_refusal(get_device("cpu"))
    assert "host_link_bw_bytes_per_s" in offload_refusal(get_device("A10-24GB"))
    # Grace Hopper's chip-to-chip link is the fastest host link of all, PCIe Gen3 the slowest
    links = {n: get_device(n).host_link_bw_bytes_per_s for n in ("GH200-96GB", "H100-80GB", "A100-80GB", "V100-16GB")}
    assert list(links) == sorted(links, key=links.get, reverse=True)


def test_the_estimate_charges_the_host_link_and_the_host_optimizer_and_frees_the_shard(gpt_6_7b):
    cluster = parse_cluster("1x4xV100-16GB")
    base = dict(global_batch_size=8, dp=2, tp=2, pp=1, micro_batch_size=2, dtype="fp16", zero_stage=3,
                recompute="selective", sequence_parallel=True)
    plain = estimate(gpt_6_7b, cluster, EstimateConfig(**base))
    offloaded = estimate(gpt_6_7b, cluster, EstimateConfig(**base, offload=True))
    device = get_device("V100-16GB")
    shard = sum(l.params_at(2) for l in gpt_6_7b.layers) / 2
    assert offloaded.time.optimizer_s == pytest.approx(host_optimizer_s(shard, "adamw", device), rel=1e-9)
    assert offloaded.time.optimizer_s == pytest.approx(shard * OPTIMIZER_BYTES_PER_PARAM["adamw"] / 19.2e9, rel=1e-9)
    to_device, both_ways = offload_transfer_s(shard, "fp16", device)
    assert both_ways == pytest.approx(2 * to_device) and to_device == pytest.approx(shard * 2 / 15.5e9)
    microbatches = 8 // (2 * 2)
    assert offloaded.time.host_comm_s == pytest.approx(microbatches * (to_device + both_ways), rel=1e-9)
    assert offloaded.time.dp_comm_s == pytest.approx(plain.time.dp_comm_s, rel=1e-9) and plain.time.host_comm_s == 0
    assert offloaded.predicted.host_comm_time_s == offloaded.time.host_comm_s
    [p_mem], [o_mem] = [s.memory for s in plain.stages], [s.memory for s in offloaded.stages]
    assert o_mem.optimizer_bytes == 0 and p_mem.optimizer_bytes > 0
    assert o_mem.weights_bytes < p_mem.weights_bytes and o_mem.activations_bytes == p_mem.activations_bytes


def test_the_search_offloads_only_where_nothing_fits_without(gpt_6_7b):
    """6.7B parameters in fp16 with AdamW are 107 GB of training state; 4 V100-16GB hold 64 GiB."""
    options = SearchOptions(global_batch_size=8, dtype="fp16")
    cluster = parse_cluster("1x4xV100-16GB")
    with pytest.raises(PlanningError, match="no plan fits in memory"):
        plan_graph(gpt_6_7b, cluster, dataclasses.replace(options, offload="off"))
    plan = plan_graph(gpt_6_7b, cluster, options)
    assert any(s.offload for s in plan.stages) and all(s.zero_stage == 3 for s in plan.stages if s.offload)
    assert max(plan.predicted.peak_memory_bytes) <= get_device("V100-16GB").memory_bytes
    roomy = plan_graph(gpt_6_7b, parse_cluster("1x8xV100-32GB"), options)  # fits: no offload searched
    assert not any(s.offload for s in roomy.stages)


def test_one_gpu_offloads_the_state_it_cannot_hold(gpt_6_7b):
    """6.7B in fp16 with AdamW is 107 GB of training state; one A100 holds 80 GB. Over one row
    ZeRO-3 shards nothing: the whole state lives in host memory and each module is gathered
    from there (the one-GPU case of ZeRO-Offload)."""
    options = SearchOptions(global_batch_size=8, dtype="fp16")
    cluster = parse_cluster("1x1xA100-80GB")
    with pytest.raises(PlanningError, match="no plan fits in memory"):
        plan_graph(gpt_6_7b, cluster, dataclasses.replace(options, offload="off"))
    plan = plan_graph(gpt_6_7b, cluster, options)
    [stage] = plan.stages
    assert plan.data_parallel == 1 and stage.offload and stage.zero_stage == 3
    assert plan.predicted.peak_memory_bytes[0] <= get_device("A100-80GB").memory_bytes


def test_over_one_row_the_estimate_charges_the_host_link_and_no_collective(gpt_6_7b):
    cluster, device = parse_cluster("1x1xA100-80GB"), get_device("A100-80GB")
    config = EstimateConfig(global_batch_size=4, dp=1, tp=1, pp=1, micro_batch_size=1, dtype="fp16", zero_stage=3,
                            recompute="full", offload=True)
    result = estimate(gpt_6_7b, cluster, config)
    params = sum(l.params_at(1) for l in gpt_6_7b.layers)
    to_device, both_ways = offload_transfer_s(params, "fp16", device)
    assert result.time.host_comm_s == pytest.approx(4 * (to_device + both_ways), rel=1e-9)  # 4 micro-batches
    assert result.time.dp_comm_s == 0  # no replica to gather from or sync with
    assert result.time.optimizer_s == pytest.approx(host_optimizer_s(params, "adamw", device), rel=1e-9)
    [memory] = [s.memory for s in result.stages]
    assert memory.optimizer_bytes == 0
    # on the device: two layers' gathered weights (running and prefetched) and one layer's gradient
    largest = max(l.params_at(1) for l in gpt_6_7b.layers)
    assert memory.weights_bytes == pytest.approx(2 * largest * 2) and memory.gradients_bytes == pytest.approx(largest * 2)


def test_over_one_row_zero_3_is_offered_only_with_offload():
    from hetpar.planner.search.candidates import stage_modes

    for offload, expected in (("on", {(3, True)}), ("off", {(0, False)}), ("auto", {(0, False)})):
        modes = stage_modes(SearchOptions(global_batch_size=8, dtype="fp16", offload=offload), dp=1, schedule="1f1b")
        assert {(m.zero_stage, m.offload) for m in modes} == expected, offload
    offered = SearchOptions(global_batch_size=8, dtype="fp16", offload_offered=True)
    assert {(m.zero_stage, m.offload) for m in stage_modes(offered, dp=1, schedule="1f1b")} == {(0, False), (3, True)}
    assert not stage_modes(SearchOptions(global_batch_size=8, dtype="fp16", offload="on"), dp=1, schedule="zb")  # FSDP2 cannot run it


def test_a_plan_file_offloads_a_stage_of_one_row(mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], zero_stage=3)
    assert dataclasses.replace(plan.stages[0], offload=True).offload


def test_offload_pins_that_cannot_run_are_refused_in_one_line(gpt_6_7b):
    options = SearchOptions(global_batch_size=8, dtype="fp16", offload="on")
    for cluster, words in (("1x4xcpu", "host memory already"), ("1x4xA10-24GB", "states no host"),):
        with pytest.raises(PlanningError, match=words) as err:
            plan_graph(gpt_6_7b, parse_cluster(cluster), options)
        assert "\n" not in str(err.value)
    with pytest.raises(PlanningError, match="--zero 3"):
        plan_graph(gpt_6_7b, parse_cluster("1x4xV100-16GB"), dataclasses.replace(options, zero=2))
    with pytest.raises(EstimateError, match="--zero 3"):
        estimate(gpt_6_7b, parse_cluster("1x4xV100-16GB"),
                 EstimateConfig(global_batch_size=8, dp=4, tp=1, pp=1, micro_batch_size=1, dtype="fp16", offload=True))


def test_a_plan_file_offloads_only_a_zero_3_stage(mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, zero_stage=2)
    with pytest.raises(PlanFileError, match="zero_stage 3"):
        dataclasses.replace(plan.stages[0], offload=True)
    with pytest.raises(PlanFileError, match="true or false"):
        dataclasses.replace(plan.stages[0], zero_stage=3, offload="yes")


def test_the_cli_refuses_offload_on_cpu_workers_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hetpar", "plan", str(GPT), *sum((["-a", f"{k}={v}"] for k, v in SMALL.items()), []),
                             "--cluster", "1x2xcpu", "-b", "4", "--offload", "on", "-o", str(tmp_path / "p.json")],
                            capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--offload on" in result.stderr and "host memory already" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_zero_3_gathers_each_called_module_on_its_own():
    """[Note: ZeRO through FSDP2]: every Linear, norm and embedding the traced GPT calls is a unit."""
    model = load_model_file(str(GPT), SMALL).build_model()
    graph, _ = capture(model)
    units = fsdp_units(graph)
    owners: dict[int, int] = {}
    for m in graph.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    linears = [m for m in graph.modules() if isinstance(m, torch.nn.Linear) and owners[id(m.weight)] == 1]
    assert len(linears) >= 2 * 4 and all(any(m is u for u in units) for m in linears)  # q/k/v/proj/fc... per block
    ids = [id(p) for u in units for p in u.parameters()]
    assert len(ids) == len(set(ids))  # no parameter in two units
    assert sum(p.numel() for u in units for p in u.parameters()) > 0.8 * sum(p.numel() for p in graph.parameters())


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_zero_3_gathers_the_same_modules_of_a_recomputed_stage(mode):
    """Recompute moves a layer's module calls into a checkpointed function; the units stay."""
    from hetpar.runtime.graph import trace_layers
    from hetpar.runtime.recompute import apply_recompute

    layered = trace_layers(load_model_file(str(GPT), SMALL).build_model())
    before = [id(u) for u in fsdp_units(layered.gm)]
    apply_recompute(layered.gm, layered.node_layer, mode)
    assert not any(n.op == "call_module" for n in layered.gm.graph.nodes)  # the calls left the stage graph
    assert len(before) > 8 and [id(u) for u in fsdp_units(layered.gm)] == before


@pytest.mark.slow
@pytest.mark.slow
def test_offloaded_stages_of_one_row_train_like_one_process(tmp_path, mlp_path):
    """dp 1 x pp 2, each stage ZeRO-3 over its one rank with the state in host memory, AdamW."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=2, zero_stage=3)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(s, offload=True) for s in plan.stages])
    stderr = assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")
    for stage, units in ((0, 4), (1, 5)):  # a Linear and a block (norm, up, down); a block, the final norm, the head
        assert f"stage {stage} (layers {2 * stage}-{2 * stage + 1}): tp 1, ZeRO-3 through FSDP2 on one replica, {units} "                f"modules gathered one at a time, the shard in host memory" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_an_offloaded_tensor_parallel_stage_of_one_row_trains_like_one_process(tmp_path):
    """tp 2 x dp 1: FSDP2 over a (1, 2) mesh, the tensor-parallel shards in host memory."""
    from test_distributed import GPT_ARGS

    plan = build_plan(ROOT / "examples" / "gpt.py", GPT_ARGS, splits=[[0, 1, 2, 3]], tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2, zero_stage=3)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], offload=True)])
    stderr = assert_trains_like_one_process(plan, tmp_path, optimizer="sgd")
    assert "tp 2, ZeRO-3 through FSDP2 on one replica" in stderr, stderr[-2000:]


def test_an_offloaded_zero_3_stage_trains_like_one_process(tmp_path, mlp_path):
    """dp 2, ZeRO-3 with the shard in host memory (FSDP2's CPUOffloadPolicy), AdamW."""
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2, zero_stage=3)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], offload=True)])
    stderr = assert_trains_like_one_process(plan, tmp_path, optimizer="adamw")
    assert "ZeRO-3 through FSDP2 over 2 replicas, 9 modules gathered one at a time, the shard in host memory" in stderr
