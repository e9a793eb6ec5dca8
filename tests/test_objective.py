"""--objective cost: the cheapest sub-cluster that meets a throughput target, against brute force."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from cli_helpers import assert_one_line_error, hetpar
from conftest import ROOT
from hetpar.cost_models.cluster import ClusterSpecError, cluster_to_toml, parse_cluster
from hetpar.planner.api import fastest_plan, plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanningError
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import search
from hetpar.planner.strategies import Objective, cheapest_plan, resolve_prices, usd_per_step
from hetpar.planner.strategies.subcluster import group_uses, subcluster
from hetpar.runtime.model_file import load_model_file

GPT_ARGS = {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 512}
CLUSTER = "1x2xA100-80GB+1x4xV100-32GB"
# Prices are inputs of the test, not claims about any market: V100s cheaper per device, A100s per FLOP.
PRICES = {"A100-80GB": 3.0, "V100-32GB": 1.0}


@pytest.fixture(scope="module")
def gpt():
    return trace_model(load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS))


@pytest.fixture(scope="module")
def options():
    return SearchOptions(global_batch_size=32, dtype="fp16", workers=1, time_limit_s=5)


@pytest.fixture(scope="module")
def brute_force(gpt, options):
    """Every sub-cluster's plan (None if nothing fits), by searching each."""
    cluster = parse_cluster(CLUSTER)
    out = {}
    for uses in itertools.product(*(group_uses(g) for g in cluster.groups)):
        if any(u.nodes for u in uses):
            sub = subcluster(cluster, list(uses))
            try:
                out[sub.spec] = search(gpt, sub, options)
            except PlanningError:
                out[sub.spec] = None
    return out


def cheapest_by_brute_force(plans, target):
    meeting = [p for p in plans.values() if p is not None and p.predicted.throughput_samples_per_s >= target]
    return min((usd_per_step(p, PRICES) for p in meeting), default=None)


def test_sub_clusters_cover_whole_nodes_and_node_divisors():
    cluster = parse_cluster("2x4xA100-80GB+1x2xV100-32GB")
    per_group = [[(u.nodes, u.devices_per_node) for u in group_uses(g)] for g in cluster.groups]
    assert per_group == [[(0, 4), (1, 1), (1, 2), (1, 4), (2, 4)], [(0, 2), (1, 1), (1, 2)]]


def test_sub_cluster_spec_reads_back_to_the_same_devices():
    cluster = parse_cluster("3x8xA100-80GB@100gx2+2x4xV100-32GB")
    groups = cluster.groups
    sub = subcluster(cluster, [group_uses(groups[0])[-2], group_uses(groups[1])[1]])
    again = parse_cluster(sub.spec)
    assert sub.spec == "2x8xA100-80GB@100gx2+1x1xV100-32GB"
    assert again.groups == sub.groups
    assert subcluster(cluster, [group_uses(g)[-1] for g in groups]).spec == cluster.spec


@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.9, 1.0])
def test_cost_objective_picks_the_brute_force_cheapest(gpt, options, brute_force, quantile):
    """Targets at quantiles of the throughputs sub-clusters reach, so each target rules out a different share of them."""
    reached = sorted(p.predicted.throughput_samples_per_s for p in brute_force.values() if p is not None)
    target = reached[round(quantile * (len(reached) - 1))]
    plan = cheapest_plan(gpt, parse_cluster(CLUSTER), options, Objective(kind="cost", usd_per_device_hour=PRICES,
                                                                          min_throughput_samples_per_s=target))
    assert plan.predicted.throughput_samples_per_s >= target
    assert usd_per_step(plan, PRICES) == pytest.approx(cheapest_by_brute_force(brute_force, target), rel=1e-9)
    assert plan.cluster.world_size == len(plan.cluster.device_types) == sum(
        len(r) for s in plan.stages[: plan.pipeline_parallel] for r in s.ranks)


def test_cost_objective_through_the_api_matches_brute_force_with_hetero_dp(gpt, options, brute_force):
    """plan_graph's solve also tries heterogeneous data parallelism; brute force does the same on every sub-cluster."""
    cluster = parse_cluster(CLUSTER)
    everything = {}
    for spec in brute_force:
        try:
            everything[spec] = fastest_plan(gpt, parse_cluster(spec), options)
        except PlanningError:
            everything[spec] = None
    reached = sorted(p.predicted.throughput_samples_per_s for p in everything.values() if p is not None)
    target = reached[len(reached) // 2]
    plan = plan_graph(gpt, cluster, options, objective=Objective(kind="cost", usd_per_device_hour=PRICES,
                                                                  min_throughput_samples_per_s=target))
    assert usd_per_step(plan, PRICES) == pytest.approx(cheapest_by_brute_force(everything, target), rel=1e-9)


def test_unreachable_target_is_one_error_bracketing_the_best_throughput(gpt, options, brute_force):
    """A plan's throughput no higher than the best any sub-cluster reaches, and a bound no lower ([Note: unreachable target])."""
    reached = [p.predicted.throughput_samples_per_s for p in brute_force.values() if p is not None]
    best = max(reached)
    with pytest.raises(PlanningError) as err:
        cheapest_plan(gpt, parse_cluster(CLUSTER), options,
                      Objective(kind="cost", usd_per_device_hour=PRICES, min_throughput_samples_per_s=2 * best))
    message = str(err.value)
    assert "\n" not in message
    found, ceiling = map(float, re.search(r"the fastest plan found reaches (\S+) samples/s .* none passes (\S+);", message).groups())
    assert any(found == pytest.approx(r, rel=1e-3) for r in reached)
    assert found <= best * (1 + 1e-3) and best <= ceiling * (1 + 1e-3)


def test_time_objective_refuses_a_target_its_plan_misses(gpt, options):
    cluster = parse_cluster(CLUSTER)
    fastest = plan_graph(gpt, cluster, options)
    with pytest.raises(PlanningError, match=re.escape(f"reaches {fastest.predicted.throughput_samples_per_s:.4g} samples/s, below")):
        plan_graph(gpt, cluster, options, objective=Objective(min_throughput_samples_per_s=2 * fastest.predicted.throughput_samples_per_s))


def test_prices_come_from_the_cluster_file_and_price_flags_override_them(tmp_path):
    text = cluster_to_toml(parse_cluster(CLUSTER)).replace('device = "V100-32GB"', 'device = "V100-32GB"\nusd_per_device_hour = 0.5')
    path = tmp_path / "priced.toml"
    path.write_text(text)
    cluster = parse_cluster(str(path))
    assert parse_cluster(str(path)).groups == cluster.groups and cluster_to_toml(cluster).count("usd_per_device_hour") == 1
    assert resolve_prices(cluster, {"a100-80gb": 2.0}) == {"A100-80GB": 2.0, "V100-32GB": 0.5}
    assert resolve_prices(cluster, {"A100-80GB": 2.0, "V100-32GB": 0.75})["V100-32GB"] == 0.75
    with pytest.raises(PlanningError, match=r"needs a price for A100-80GB: pass --price A100-80GB=USD_PER_DEVICE_HOUR"):
        resolve_prices(cluster, {})
    with pytest.raises(PlanningError, match=r"--price names 'H100-80GB', which is not in the cluster"):
        resolve_prices(cluster, {"H100-80GB": 1.0, "A100-80GB": 1.0})


def test_a_negative_price_in_a_cluster_file_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[group]]\nnodes = 1\ndevices_per_node = 2\ndevice = "A100-80GB"\nusd_per_device_hour = -1\n')
    with pytest.raises(ClusterSpecError, match="usd_per_device_hour must be a number >= 0"):
        parse_cluster(str(path))


def test_cli_cost_objective_without_a_price_is_one_line(tmp_path):
    result = hetpar("plan", str(ROOT / "examples" / "mlp.py"), "-c", CLUSTER, "-b", "16", "--objective", "cost",
                    "--price", "A100-80GB=2", "-o", str(tmp_path / "p.json"))
    assert_one_line_error(result, "--objective cost needs a price for V100-32GB")


def test_cli_cost_objective_writes_the_sub_cluster_plan_that_compiles(tmp_path):
    plan_path = tmp_path / "plan.json"
    result = hetpar("plan", str(ROOT / "examples" / "mlp.py"), "-c", CLUSTER, "-b", "16", "--objective", "cost",
                    "--price", "A100-80GB=3", "--price", "V100-32GB=1", "-o", str(plan_path))
    assert result.returncode == 0, result.stderr
    assert "per step on" in result.stderr
    compiled = hetpar("compile", str(plan_path), "-o", str(tmp_path / "build"))
    assert compiled.returncode == 0, compiled.stderr
    assert (tmp_path / "build" / "train.py").is_file()
    assert not math.isnan(float(result.stderr.split("cost: $")[1].split()[0]))
