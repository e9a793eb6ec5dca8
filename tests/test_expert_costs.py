"""Expert parallelism in the cost models, the estimate, the plan file and the search
([Note: expert parallelism costs] in hetpar/cost_models/collectives.py), on synthetic
layers whose numbers are derived by hand, and on Mixtral 8x7B as Hugging Face defines it."""

from dataclasses import replace
from pathlib import Path

import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.collectives import EXCHANGES_PER_DISPATCH, all_gather_time_s, all_to_all_time_s, p2p_time_s
from hetpar.cost_models.compute import dtype_bytes
from hetpar.cost_models.layers import LayerProfile
from hetpar.cost_models.memory import state_bytes_per_param
from hetpar.planner.api import plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanFileError, PlanningError
from hetpar.planner.estimate import EstimateConfig, EstimateError, estimate
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import PLAN_KIND, SCHEMA_VERSION, ParallelPlan
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
EXPERTS = 8
EXPERT_PARAMS = 40_000_000
ROUTED = 2 * 1024 * 4096 * 4.0  # two choices of 1024 tokens of width 4096, fp32 bytes per sample


def moe_layer(name: str) -> LayerProfile:
    return LayerProfile(name=name, fwd_flops=1e12, bwd_flops=2e12, params=EXPERT_PARAMS + 1_000_000,
                        saved_activation_bytes=1e6, boundary_bytes=1e6, num_ops=10, expert_params=EXPERT_PARAMS,
                        num_experts=EXPERTS, routed_bytes=ROUTED, expert_flops_fraction=0.8)


def moe_graph(n: int = 4) -> ModelGraph:
    return ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[moe_layer(f"l{i}") for i in range(n)])


def config(**kw) -> EstimateConfig:
    return EstimateConfig(**{**dict(global_batch_size=8, dp=4, tp=1, pp=1, micro_batch_size=1, dtype="bf16"), **kw})


# --- the all-to-all ------------------------------------------------------------------------


def test_all_to_all_on_a_measured_node_takes_its_all_gather_fit():
    cluster = parse_cluster("1x2xcpu")  # the CPU profile has measured collectives
    fit = cluster.profile("cpu").collectives["all_gather"]
    # the fit is of all-gathers over its ranks: latency + output bytes / bw; an all-to-all of a 1 MB buffer
    # sends what an all-gather of a 1 MB output sends
    assert fit.ranks == 2
    assert all_to_all_time_s(1e6, [0, 1], cluster) == pytest.approx(fit.latency_s + 1e6 / fit.bw_bytes_per_s)


def test_all_to_all_inside_a_node_moves_the_peers_share_over_the_node_link():
    cluster = parse_cluster("1x8xA100-80GB")
    nbytes = 64e6
    # each rank keeps 1/n and sends (n-1)/n: the bytes of an all-gather's output of nbytes, the same links
    for n in (2, 4, 8):
        assert all_to_all_time_s(nbytes, list(range(n)), cluster) == pytest.approx(all_gather_time_s(nbytes, list(range(n)), cluster))
    assert all_to_all_time_s(nbytes, [3], cluster) == 0.0
    assert all_to_all_time_s(0.0, [0, 1], cluster) == 0.0


def test_all_to_all_across_nodes_is_bound_by_each_devices_share_of_the_nic():
    cluster = parse_cluster("2x8xA100-80GB")
    nbytes = 64e6
    inside, across = all_to_all_time_s(nbytes, list(range(8)), cluster), all_to_all_time_s(nbytes, list(range(16)), cluster)
    assert across > 2 * inside
    # two ranks on two nodes: one message of half the bytes each way, what a point-to-point send of it costs
    assert all_to_all_time_s(nbytes, [0, 8], cluster) == pytest.approx(p2p_time_s(nbytes / 2, 0, 8, cluster), rel=1e-9)


# --- the estimate --------------------------------------------------------------------------


def test_expert_parallelism_holds_one_ep_th_of_the_experts_and_pays_its_all_to_alls_per_layer():
    model, cluster = moe_graph(), parse_cluster("1x4xA100-80GB")
    one, two = (estimate(model, cluster, config(ep=ep)) for ep in (1, 2))
    w, g, o = state_bytes_per_param("bf16")
    dropped = len(model.layers) * EXPERT_PARAMS / 2
    assert one.stages[0].memory.weights_bytes - two.stages[0].memory.weights_bytes == pytest.approx(dropped * w)
    assert one.stages[0].memory.optimizer_bytes - two.stages[0].memory.optimizer_bytes == pytest.approx(dropped * o)
    assert one.time.ep_comm_s == 0.0
    rows = all_to_all_time_s(ROUTED * dtype_bytes("bf16") / 4, [0, 1], cluster)
    counts = all_to_all_time_s(8.0 * 2, [0, 1], cluster)  # eight bytes per rank of the group
    per_layer = 2 * rows + EXCHANGES_PER_DISPATCH * counts + 2 * rows  # forward: rows there and back, counts; backward
    microbatches = 2  # global batch 8 over dp 4 at micro-batch 1
    assert two.time.ep_comm_s == pytest.approx(microbatches * len(model.layers) * per_layer)
    assert two.time.step_s == pytest.approx(two.predicted.step_time_s)
    assert two.predicted.ep_comm_time_s == two.time.ep_comm_s


def test_experts_split_over_every_replica_need_no_gradient_sync():
    model, cluster = moe_graph(), parse_cluster("1x4xA100-80GB")
    dense_only = replace(moe_graph(), layers=[replace(l, params=1_000_000, expert_params=0, num_experts=0, routed_bytes=0.0)
                                              for l in model.layers])
    all_four = estimate(model, cluster, config(ep=4))
    assert all_four.time.dp_comm_s == pytest.approx(estimate(dense_only, cluster, config()).time.dp_comm_s)
    assert estimate(model, cluster, config(ep=2)).time.dp_comm_s > all_four.time.dp_comm_s


@pytest.mark.parametrize("kw,message", [
    (dict(ep=3), "must divide dp"),
    (dict(ep=2, zero_stage=2), "ZeRO 0"),
])
def test_estimate_refuses_expert_parallelism_it_cannot_run(kw, message):
    with pytest.raises(EstimateError, match=message):
        config(**kw)


# --- plan files ---------------------------------------------------------------------------


def _plan_dict(ep=(2,), zero=0, dp=2):
    stages = [dict(index=i, layers=[i], device_type="cpu", tensor_parallel=1, ranks=[[i * dp + d] for d in range(dp)],
                   zero_stage=zero, expert_parallel=e) for i, e in enumerate(ep)]
    return dict(model=dict(file="m.py", fingerprint="", layer_names=[f"l{i}" for i in range(len(ep))]),
                cluster=dict(spec="1x4xcpu", world_size=dp * len(ep), device_types=["cpu"] * dp * len(ep)),
                global_batch_size=dp * 2, micro_batch_size=1, num_microbatches=2, schedule="1f1b", data_parallel=dp,
                dtype="fp32", stages=stages, predicted=dict(step_time_s=1.0, throughput_samples_per_s=1.0, peak_memory_bytes=[0]),
                solver=dict(status="pinned", search_time_s=0.0), kind=PLAN_KIND, schema_version=SCHEMA_VERSION)


def test_a_plan_file_with_expert_parallelism_loads_and_round_trips(tmp_path):
    path = tmp_path / "plan.json"
    plan = ParallelPlan.from_dict(_plan_dict(ep=(2, 2)))
    plan.save(path)
    assert [s.expert_parallel for s in ParallelPlan.load(path).stages] == [2, 2]


@pytest.mark.parametrize("kw,message", [
    (dict(ep=(2, 1)), "one degree on every stage"),
    (dict(ep=(2,), zero=2), "zero_stage 0"),
    (dict(ep=(3,), dp=2), "dividing its 2 data-parallel replicas"),
])
def test_plan_files_refuse_expert_parallelism_the_program_cannot_run(kw, message):
    with pytest.raises(PlanFileError, match=message):
        ParallelPlan.from_dict(_plan_dict(**kw))


# --- the search ----------------------------------------------------------------------------


def test_search_pins_are_checked_against_the_models_experts():
    dense = trace_model(load_model_file(ROOT / "examples/gpt.py"))
    cluster = parse_cluster("1x4xcpu")
    with pytest.raises(PlanningError, match="no module of experts"):
        plan_graph(dense, cluster, SearchOptions(global_batch_size=8, dtype="fp32", ep=2))
    moe = replace(dense, layers=[replace(l, num_experts=6, expert_params=l.params // 2) for l in dense.layers])
    with pytest.raises(PlanningError, match="use one of 1, 2, 3, 6"):
        plan_graph(moe, cluster, SearchOptions(global_batch_size=8, dtype="fp32", ep=4))
    with pytest.raises(PlanningError, match="ZeRO 0"):
        plan_graph(moe, cluster, SearchOptions(global_batch_size=8, dtype="fp32", ep=2, zero=2))


def test_mixtral_8x7b_plans_with_expert_parallelism_below_sixty_percent_mfu():
    """Issue 31's target: Mixtral 8x7B's default config at 4096 tokens on 4x8 A100-80GB."""
    graph = trace_model(load_model_file(ROOT / "tests/models/hf_default_zoo.py",
                                        {"family": "mixtral", "size": "default", "seq": 4096}))
    cluster = parse_cluster("4x8xA100-80GB")
    plan = plan_graph(graph, cluster, SearchOptions(global_batch_size=256, dtype="bf16", work_limit_s=2.0))
    assert plan.stages[0].expert_parallel > 1
    flops = sum(l.fwd_flops + l.bwd_flops for l in graph.layers) * 256
    peak = sum(cluster.profile(t).peak_flops("bf16") for t in cluster.device_types())
    assert 0.2 < flops / plan.predicted.step_time_s / peak < 0.6
    assert plan.predicted.ep_comm_time_s > 0


def test_an_expert_imbalance_slows_only_expert_parallel_plans_by_their_experts_share():
    model, cluster = moe_graph(), parse_cluster("1x4xA100-80GB")
    for ep in (1, 2):
        even, skewed = (estimate(model, cluster, config(ep=ep, expert_imbalance=f)) for f in (1.0, 1.5))
        if ep == 1:  # every rank runs all its own rows whatever the routing
            assert skewed.predicted.step_time_s == even.predicted.step_time_s
            continue
        # the busiest rank's experts run 1.5x their rows: 0.8 of the layer's FLOPs grow by half
        layer = model.layers[0]
        assert layer.with_expert_load(1.5).fwd_flops == pytest.approx(layer.fwd_flops * (1 + 0.8 * 0.5))
        assert skewed.time.compute_s > even.time.compute_s * 1.2
        assert skewed.time.ep_comm_s > even.time.ep_comm_s
        assert skewed.model_flops_per_step == even.model_flops_per_step  # the model's work is what it is
    with pytest.raises(EstimateError, match="expert imbalance"):
        config(expert_imbalance=0.5)
