"""Zones and WAN links: the cluster file, collectives priced across zones, and the search on two-zone clusters
against brute force."""

from __future__ import annotations

import pytest

from hetpar.cost_models.cluster import ClusterSpecError, cluster_from_dict, cluster_to_toml, parse_cluster
from hetpar.cost_models.collectives import (
    all_gather_time_s, all_reduce_time_s, best_all_reduce, broadcast_time_s, p2p_time_s, reduce_scatter_time_s,
)
from hetpar.planner.capture import trace_model
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import enumerate_candidates, search, solve_candidate
from hetpar.runtime.model_file import load_model_file

GBPS = 1e9 / 8


def zoned(*groups: tuple[str, str], gbps: float = 10.0, latency_ms: float = 20.0, carbon: dict | None = None):
    """A cluster of ``(zone, "NODESxDEVICESxTYPE")`` groups, every two zones joined by one link."""
    tables = []
    for zone, piece in groups:
        nodes, devices, device = piece.split("x", 2)
        tables.append({"nodes": int(nodes), "devices_per_node": int(devices), "device": device, "zone": zone})
    names = list(dict.fromkeys(z for z, _ in groups))
    links = [{"zones": [a, b], "gbps": gbps, "latency_ms": latency_ms} for i, a in enumerate(names) for b in names[i + 1:]]
    zones = [{"name": z, **({"carbon_g_per_kwh": carbon[z]} if carbon and z in carbon else {})} for z in names]
    return cluster_from_dict({"group": tables, "zone": zones, "link": links}, spec="zoned.toml")


# --- The cluster file ----------------------------------------------------------------------


def test_zones_and_links_read_and_write_back(tmp_path):
    cluster = zoned(("eu", "1x4xA100-80GB"), ("us", "2x4xV100-32GB"), gbps=40, latency_ms=35, carbon={"eu": 250.0})
    assert [cluster.zone_of(r) for r in (0, 3, 4, 11)] == ["eu", "eu", "us", "us"]
    link = cluster.wan_link("us", "eu")
    assert link.bw_bytes_per_s == 40 * GBPS and link.latency_s == pytest.approx(0.035)
    assert cluster.carbon_g_per_kwh("eu") == 250.0 and cluster.carbon_g_per_kwh("us") is None
    path = tmp_path / "c.toml"
    path.write_text(cluster_to_toml(cluster))
    again = parse_cluster(str(path))
    assert (again.groups, again.zones, again.links) == (cluster.groups, cluster.zones, cluster.links)


@pytest.mark.parametrize("data,message", [
    ({"group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "eu"},
                {"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "us"}]},
     "zones 'eu' and 'us' both hold nodes but no [[link]] joins them"),
    ({"group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "eu"},
                {"nodes": 1, "devices_per_node": 2, "device": "A100-80GB"}]},
     "every [[group]] needs zone"),
    ({"zone": [{"name": "eu"}], "group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "mars"}]},
     "no [[zone]] declares"),
    ({"group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "eu"},
                {"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "us"}],
      "link": [{"zones": ["eu", "us"], "gbps": 0, "latency_ms": 5}]},
     "gbps must be a number > 0"),
    ({"zone": [{"name": "eu", "carbon_g_per_kwh": -1}], "group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "eu"}]},
     "carbon_g_per_kwh must be a number >= 0"),
])
def test_bad_zones_are_refused_in_one_line(data, message):
    with pytest.raises(ClusterSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cluster_from_dict(data, spec="bad.toml")


# --- Collectives across zones ----------------------------------------------------------------


def test_a_free_wan_costs_nothing_and_a_slow_one_costs_more():
    """With an unbounded, zero-latency link no collective costs more than on one site (the one-site algorithms
    stay candidates); over a real WAN every one that crosses costs more, and one inside a zone is unchanged."""
    free = zoned(("eu", "2x4xA100-80GB"), ("us", "2x4xA100-80GB"), gbps=1e12, latency_ms=0)
    slow = zoned(("eu", "2x4xA100-80GB"), ("us", "2x4xA100-80GB"), gbps=100, latency_ms=5)
    together = parse_cluster("4x4xA100-80GB")
    for ranks in (list(range(16)), [0, 4, 8, 12], [3, 7, 11, 15]):
        for fn in (all_reduce_time_s, all_gather_time_s, reduce_scatter_time_s, broadcast_time_s):
            one_site = fn(2**26, ranks, together)
            assert fn(2**26, ranks, free) <= one_site * (1 + 1e-12)
            assert fn(2**26, ranks, slow) > one_site
            assert fn(2**26, ranks[: len(ranks) // 2], slow) == fn(2**26, ranks[: len(ranks) // 2], together)
    assert p2p_time_s(2**26, 0, 8, free) == pytest.approx(p2p_time_s(2**26, 0, 8, together))


def test_a_collective_across_zones_is_hierarchical_over_the_wan():
    """Each zone reduce-scatters, the two zones all-reduce over the link, each zone all-gathers: by hand."""
    cluster = zoned(("eu", "1x4xA100-80GB"), ("us", "1x4xA100-80GB"), gbps=80, latency_ms=10)
    nbytes, eu, us = 2**30, [0, 1, 2, 3], [4, 5, 6, 7]
    a_wan = 10e-3 + cluster.groups[0].device.inter_node_latency_s
    wan = 2 * a_wan + nbytes / (80 * GBPS)  # 2 (z - 1) a + 2 (z - 1) / z * P / B with z = 2
    expected = reduce_scatter_time_s(nbytes, eu, cluster) + wan + all_gather_time_s(nbytes, us, cluster)
    cost = best_all_reduce(nbytes, eu + us, cluster)
    assert cost.algorithm == "zone-hierarchical"
    assert cost.time_s == pytest.approx(expected, rel=1e-12)
    # The identical groups of a tensor-parallel stage share the link.
    assert all_reduce_time_s(nbytes, eu + us, cluster, concurrent=2) > cost.time_s + nbytes / (80 * GBPS) * 0.99
    # A p2p across zones is priced at the link.
    assert p2p_time_s(nbytes, 1, 6, cluster) == pytest.approx(a_wan + nbytes / (80 * GBPS))


# --- The search on two-zone clusters ----------------------------------------------------------


@pytest.fixture(scope="module")
def small_gpt():
    return trace_model(load_model_file("examples/gpt.py", {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 64, "vocab": 512}))


TWO_ZONE_CLUSTERS = [
    (("eu", "1x2xA100-80GB"), ("us", "1x2xA100-80GB")),
    (("eu", "1x2xA100-80GB"), ("us", "1x2xV100-32GB")),
    (("eu", "2x1xA100-80GB"), ("us", "1x2xA100-80GB")),
]


@pytest.mark.parametrize("groups", TWO_ZONE_CLUSTERS)
@pytest.mark.parametrize("gbps,latency_ms", [(1.0, 30.0), (400.0, 0.01)])
def test_search_on_two_zones_matches_brute_force(small_gpt, groups, gbps, latency_ms):
    """Each candidate's split and modes against brute force over every type order, split and mode; the
    bound-pruned search against every candidate solved."""
    from tests.test_search import _solver_and_brute_force

    cluster = zoned(*groups, gbps=gbps, latency_ms=latency_ms)
    options = SearchOptions(global_batch_size=8, dtype="fp16", workers=1)
    rows = _solver_and_brute_force(small_gpt, cluster, options)
    for cand, solved, best, _ in rows:
        assert (solved is None) == (best is None), cand.describe()
        if best is not None:
            assert solved == pytest.approx(best, rel=1e-4), cand.describe()
    exhaustive = [split.cost.objective_s for cand in enumerate_candidates(small_gpt, cluster, options)
                  if (split := solve_candidate(small_gpt, cluster, cand, options)[1]) is not None]
    assert search(small_gpt, cluster, options).solver.objective_s == pytest.approx(min(exhaustive), rel=1e-6)


WIDE_GPT = {"n_layers": 4, "hidden": 4096, "heads": 32, "seq_len": 1024, "vocab": 1024}  # tensor parallelism pays
NARROW_GPT = {"n_layers": 8, "hidden": 1024, "heads": 16, "seq_len": 512, "vocab": 1024}


@pytest.mark.parametrize("groups,model,batch,tp", [
    ((("eu", "1x4xA100-40GB"), ("us", "1x4xA100-40GB")), WIDE_GPT, 8, 2),
    ((("eu", "1x4xA100-80GB"), ("us", "1x4xA100-80GB")), NARROW_GPT, 32, 1),
    ((("eu", "2x4xA100-80GB"), ("us", "1x4xV100-32GB")), NARROW_GPT, 32, 1),
    ((("eu", "1x4xH100-80GB"), ("us", "1x4xA100-80GB")), NARROW_GPT, 32, 1),
])
def test_two_zone_plans_keep_tensor_and_data_parallel_groups_inside_a_zone(groups, model, batch, tp):
    """On a slow WAN, tensor-parallel groups stay inside a node and data-parallel groups inside a zone; only
    pipeline hand-offs cross."""
    graph = trace_model(load_model_file("examples/gpt.py", model))
    cluster = zoned(*groups, gbps=10, latency_ms=20)
    plan = search(graph, cluster, SearchOptions(global_batch_size=batch, dtype="fp16", workers=1))
    assert plan.pipeline_parallel >= 2
    assert max(s.tensor_parallel for s in plan.stages) == tp
    for stage in plan.stages:
        for replica in stage.ranks:
            assert len({cluster.node_of(r) for r in replica}) == 1
        assert len({cluster.zone_of(r) for replica in stage.ranks for r in replica}) == 1, stage
