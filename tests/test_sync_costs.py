"""The data-parallel sync methods as the planner prices and searches them ([Note: sync
method costs], [Note: lossy sync choice]): each method's terms, the search tables against
the estimator, the pruned search against solving every candidate, and the CLI."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, hetpar
from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.collectives import all_gather_time_s, all_reduce_time_s
from hetpar.cost_models.grad_sync import CAST_BYTES, PLAIN, SyncMethod, collective_over, sync_seconds
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanningError
from hetpar.planner.options import SearchOptions
from hetpar.planner.strategies import DataParallelSync, cost_method, matrix_width
from hetpar.runtime.model_file import load_model_file

SLOW_LINK = "2x2xA100-80GB@10gx1"  # two nodes joined by one 10 Gb/s NIC each
GPT = {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 64, "vocab": 1024}


@pytest.fixture(scope="module")
def graph():
    return trace_model(load_model_file("examples/gpt.py", GPT))


def test_each_method_charges_what_it_sends():
    cluster = parse_cluster(SLOW_LINK)
    group, device = [0, 2], cluster.profile("A100-80GB")
    exact = collective_over(group, cluster)
    params, dp, mem = 1e6, 2, device.mem_bw_bytes_per_s
    assert sync_seconds(PLAIN, params, 2, dp, device, exact) == all_reduce_time_s(2e6, group, cluster)
    assert sync_seconds(SyncMethod(kind="cast"), params, 4, dp, device, exact) == pytest.approx(
        all_reduce_time_s(2e6, group, cluster) + CAST_BYTES * params / mem)
    topk = sync_seconds(SyncMethod(kind="topk", fraction=0.01), params, 2, dp, device, exact)
    assert topk > all_gather_time_s(dp * params * 8 * 0.01, group, cluster)  # the values and indices, and decoding
    assert topk < sync_seconds(PLAIN, params, 2, dp, device, exact) / 10  # 50x fewer bytes over the slow link
    every_4 = sync_seconds(SyncMethod(kind="local_sgd", every=4, state_bytes=8), params, 2, dp, device, exact)
    assert every_4 == pytest.approx(all_reduce_time_s(params * 12, group, cluster) / 4)
    assert sync_seconds(SyncMethod(kind="sign"), params, 2, 1, device, exact) == 0.0  # one replica: nothing to agree on


def test_powersgd_sends_rank_times_two_over_width(graph):
    width = matrix_width(graph.layers)
    assert 256 <= width <= 1024  # the blocks' matrices are 256 x 256 to 256 x 1024
    method = cost_method("powersgd:4", "mean", 1, "all", optimizer="adamw", width=width)
    cluster = parse_cluster(SLOW_LINK)
    sent = []
    sync_seconds(method, 1e6, 2, 2, cluster.profile("A100-80GB"), lambda kind, nbytes, scope: sent.append(nbytes) or 0.0)
    assert sent == [pytest.approx(1e6 * 4 * 8 / width)]


def test_search_tables_price_sync_as_the_estimator(graph):
    """The search's linear tables and the estimator's collectives agree on every method's sync
    (ring collectives are affine in bytes), so the plan the search picks is predicted as priced."""
    from hetpar.planner.costing import Candidate, StageMode, data_parallel_linear as _data_parallel_linear, stage_slots, sync_linear as _sync_linear

    cluster = parse_cluster(SLOW_LINK)
    device = cluster.profile("A100-80GB")
    for text in ("none", "bf16", "powersgd:2", "topk:0.05", "sign"):
        method = cost_method(text, "mean", 1, "all", optimizer="adamw", width=matrix_width(graph.layers))
        cand = Candidate(dp=2, pp=1, micro_batch_size=4, num_microbatches=1, schedule="1f1b", modes=(StageMode(tp=2),), sync=method)
        slot = stage_slots(cluster, cand)[0][2]
        latency, per_byte = _sync_linear(_data_parallel_linear(cluster, 2, 2, slot, {}), 2, 0, device, 1, method, 2.0)
        group = [rep[0] for rep in slot.ranks]
        exact = sync_seconds(method, 3e6, 2.0, 2, device, collective_over(group, cluster, concurrent=2))
        # collective_linear's latency is a 1-byte collective's time: a byte's time (< 1 ns at 10 Gb/s) per collective apart
        assert latency + per_byte * 3e6 * 2.0 == pytest.approx(exact, rel=1e-6, abs=1e-8), text


@pytest.mark.parametrize("text,aggregation,every", [("topk:0.01", "mean", 1), ("sign", "mean", 1), ("powersgd:4", "mean", 1),
                                                     ("none", "krum:1", 1), ("none", "mean", 4)])
def test_pruned_search_with_a_sync_method_finds_the_best_candidate(graph, text, aggregation, every):
    """The bounds that prune candidates price the method as the tables do: the search returns the
    best plan over every candidate solved, and no bound exceeds its candidate's optimum."""
    from hetpar.planner.search import enumerate_candidates, lower_bound_s, search, solve_candidate

    cluster = parse_cluster("2x2xA100-80GB@10gx1")
    method = cost_method(text, aggregation, every, "all", optimizer="adamw", width=matrix_width(graph.layers))
    options = SearchOptions(global_batch_size=16, dtype="bf16", zero=0, sync=method, min_dp=2)
    plan = search(graph, cluster, options)
    solved = []
    for cand in enumerate_candidates(graph, cluster, options):
        assert cand.sync == method and cand.dp >= 2
        _, split = solve_candidate(graph, cluster, cand, options)
        if split is not None:
            solved.append(split.cost.objective_s)
            assert lower_bound_s(graph, cluster, cand, "bf16") <= split.cost.objective_s * (1 + 1e-9)
    assert plan.solver.objective_s == pytest.approx(min(solved), rel=1e-6)


def test_request_checks_are_one_line():
    for kwargs, message in ((dict(grad_compression="int8"), "--grad-compression 'int8' must be one of"),
                            (dict(sync_scope="node"), "--sync-scope 'node' applies to local SGD"),
                            (dict(allow_lossy=True, sync_every=4), "--allow-lossy-sync chooses a gradient compression"),
                            (dict(rebalance_every=-2), "--rebalance-every -2 must be an integer >= 0")):
        with pytest.raises(PlanningError, match=message):
            DataParallelSync(**kwargs)
    assert DataParallelSync(allow_lossy=True).compressions[0] == "none"


def plan_json(tmp_path, *extra):
    result = hetpar("plan", "examples/gpt.py", "--cluster", SLOW_LINK, "-b", "32", "--json", "-o", str(tmp_path / "p.json"),
                    *(f"-a{k}={v}" for k, v in GPT.items()), *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


@pytest.mark.slow
def test_cli_picks_a_lossy_sync_only_when_allowed_and_says_what_it_saves(tmp_path):
    exact, stderr = plan_json(tmp_path)
    assert exact["grad_compression"] == "none" and "exact all-reduce of the gradients" in stderr
    lossy, stderr = plan_json(tmp_path, "--allow-lossy-sync")
    assert lossy["grad_compression"] != "none"
    assert lossy["predicted"]["step_time_s"] <= 0.98 * exact["predicted"]["step_time_s"]
    assert "(lossy)" in stderr and "per step against none" in stderr
    alternatives = {a["grad_compression"] for a in lossy["alternatives"] if "grad_compression" in a}
    assert {"none", "bf16", "powersgd:4", "topk:0.01", "sign"} - {lossy["grad_compression"]} <= alternatives


@pytest.mark.slow
def test_cli_pins_sync_options_into_the_plan(tmp_path):
    plan, stderr = plan_json(tmp_path, "--aggregation", "trimmed-mean:1")
    assert plan["aggregation"] == "trimmed-mean:1" and plan["data_parallel"] >= 3
    assert all(s["zero_stage"] == 0 for s in plan["stages"]) and "robust aggregation trimmed-mean:1" in stderr
    plan, stderr = plan_json(tmp_path, "--sync-every", "8", "--sync-scope", "node")
    assert (plan["sync_every"], plan["sync_scope"]) == (8, "node") and "local SGD" in stderr
    plan, _ = plan_json(tmp_path, "--rebalance-every", "10")
    assert plan["rebalance_every"] == 10 and len(plan["stages"]) == 1 and plan["data_parallel"] >= 2


@pytest.mark.parametrize("args,message", [
    (["--grad-compression", "int8"], "--grad-compression 'int8' must be one of none|bf16|fp16|powersgd:R|topk:F|sign"),
    (["--aggregation", "krum:1", "--dp", "2"], "--aggregation krum:1 needs at least 4 data-parallel replicas; raise --dp 2"),
    (["--rebalance-every", "2", "--pp", "2"], "--rebalance-every needs one pipeline stage; drop --pp 2"),
    (["--grad-compression", "sign", "--zero", "2"], "--grad-compression sign needs ZeRO 0"),
])
def test_cli_refuses_bad_sync_options_in_one_line(tmp_path, args, message):
    result = hetpar("plan", "examples/gpt.py", "--cluster", SLOW_LINK, "-b", "32", "-o", str(tmp_path / "p.json"),
                    *(f"-a{k}={v}" for k, v in GPT.items()), *args)
    assert_one_line_error(result, message)
    assert not (tmp_path / "p.json").exists()


def test_explain_prices_the_plans_sync_and_what_a_plain_all_reduce_would_take():
    from hetpar.planner.api import plan_model
    from hetpar.planner.explain import explain_plan

    plan = plan_model("examples/gpt.py", parse_cluster(SLOW_LINK), SearchOptions(global_batch_size=32, dtype="bf16", dp=4),
                      model_args=GPT, sync=DataParallelSync(grad_compression="topk:0.01"))
    assert plan.grad_compression == "topk:0.01" and plan.data_parallel == 4
    result = explain_plan(plan)
    assert result.estimate.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    # A ring all-reduce of bf16 moves 2 * 3/4 * 2 = 3 bytes per element and rank, the all-gather of
    # four 1% payloads 3/4 * 4 * 0.08 = 0.24: 12.5x fewer, plus latency and encoding on the GPU
    assert result.estimate.time.dp_comm_s < result.plain_dp_comm_s / 4
