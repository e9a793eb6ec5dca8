"""Collective costs, each checked against the formula worked by hand with the datasheet numbers.

Numbers used below (sources in cost_models/profiles/*.toml):
A100-80GB: NVLink 3 300e9 B/s per direction, 3.2e-6 s per intra-node step,
           HDR NIC 25e9 B/s x 8, 10e-6 s per inter-node step.
V100-16GB: NVLink 2 150e9 B/s, 3.2e-6 s; one 25 Gb/s NIC = 3.125e9 B/s, 30e-6 s.
V100-32GB: one EDR NIC 12.5e9 B/s, 10e-6 s.
MI300X:    xGMI 448e9 B/s all-to-all, 64e9 B/s per peer.
cpu:       gloo fits at 2 ranks: all_reduce 189e-6 s + P / 1.33e9, all_gather 199e-6 + P / 1.7e9,
           reduce_scatter 257e-6 + P / 1.1e9, p2p 57e-6 + P / 3.0e9.
"""

from dataclasses import replace

import pytest

from hetpar.cost_models.cluster import cluster_from_dict, parse_cluster
from hetpar.cost_models.collectives import (
    all_gather_time_s,
    all_reduce_time_s,
    best_all_reduce,
    broadcast_time_s,
    p2p_time_s,
    reduce_scatter_time_s,
)
from hetpar.cost_models.devices import ProfileError, get_device
from hetpar.planner.capture import trace_model
from hetpar.planner.estimate import EstimateConfig, estimate
from hetpar.runtime.model_file import load_model_file

GiB = 2**30


def test_ring_all_reduce_n8_in_one_node():
    cluster = parse_cluster("1x8xA100-80GB")
    nbytes = GiB
    ring = 2 * 7 * 3.2e-6 + 2 * 7 / 8 * nbytes / 300e9
    cost = best_all_reduce(nbytes, range(8), cluster)
    assert cost.algorithm == "ring"
    assert cost.time_s == pytest.approx(ring, rel=1e-12)
    assert all_reduce_time_s(nbytes, list(range(8)), cluster) == pytest.approx(ring, rel=1e-12)


def test_one_node_tree_is_a_chain_and_never_beats_the_ring():
    # NCCL's tree inside one node is a chain: the ring's 2(n-1) steps, and 0.9 of its bandwidth.
    cluster = parse_cluster("1x8xA100-80GB")
    cost = best_all_reduce(1024, range(8), cluster)
    assert cost.candidates_s["tree"] == pytest.approx(2 * 7 * 3.2e-6 + 2 * 1024 / (0.9 * 300e9))
    assert cost.algorithm == "ring"
    assert "hierarchical" not in cost.candidates_s


@pytest.mark.parametrize(
    "fn", [all_reduce_time_s, all_gather_time_s, reduce_scatter_time_s, broadcast_time_s]
)
def test_one_rank_or_no_bytes_costs_nothing(fn):
    cluster = parse_cluster("2x8xA100-80GB")
    assert fn(GiB, [3], cluster) == 0.0
    assert fn(0, list(range(16)), cluster) == 0.0
    assert fn(GiB, [], cluster) == 0.0


def test_hierarchical_beats_flat_ring_on_a_thin_network():
    # 4 nodes of 8 V100-16GB with one 25 Gb/s NIC each (AWS p3.16xlarge, Alpa's cluster).
    cluster = parse_cluster("4x8xV100-16GB")
    nbytes = GiB
    node_egress = 3.125e9  # min(one NIC, 8 devices x one NIC each)
    ring = 2 * 31 * 30e-6 + 2 * 31 / 32 * nbytes / min(150e9, node_egress)
    intra_phase = 7 * 3.2e-6 + 7 / 8 * nbytes / 150e9  # reduce-scatter, and again all-gather
    shard, per_device = nbytes / 8, node_egress / 8
    inter_ring = 2 * 3 * 30e-6 + 2 * 3 / 4 * shard / per_device
    inter_tree = 2 * 2 * 30e-6 + 2 * shard / (0.9 * per_device)
    hierarchical = 2 * intra_phase + min(inter_ring, inter_tree)

    cost = best_all_reduce(nbytes, range(32), cluster)
    assert cost.candidates_s["ring"] == pytest.approx(ring, rel=1e-12)
    assert cost.candidates_s["hierarchical"] == pytest.approx(hierarchical, rel=1e-12)
    assert hierarchical < ring
    assert cost.algorithm == "hierarchical"


def test_flat_ring_wins_on_balanced_infiniband():
    # 4 DGX A100 nodes with 8 x HDR: every GPU has its own NIC; the ring's node boundary
    # carries one device's bytes over 200 GB/s, and NCCL picks Ring here (hardware.md §3.3).
    cluster = parse_cluster("4x8xA100-80GB@200gx8")
    nbytes = GiB
    ring = 2 * 31 * 10e-6 + 2 * 31 / 32 * nbytes / min(300e9, 200e9)
    hierarchical = 2 * (7 * 3.2e-6 + 7 / 8 * nbytes / 300e9) + (2 * 3 * 10e-6 + 2 * 3 / 4 * (nbytes / 8) / 25e9)
    cost = best_all_reduce(nbytes, range(32), cluster)
    assert cost.candidates_s["ring"] == pytest.approx(ring, rel=1e-12)
    assert cost.candidates_s["hierarchical"] == pytest.approx(hierarchical, rel=1e-12)
    assert cost.algorithm == "ring"


def test_tree_for_small_messages_at_large_n():
    cluster = parse_cluster("64x8xA100-80GB")
    nbytes = 1024
    ring = 2 * 511 * 10e-6 + 2 * 511 / 512 * nbytes / 200e9
    tree = 2 * (7 * 3.2e-6 + 6 * 10e-6) + 2 * nbytes / (0.9 * 200e9)
    cost = best_all_reduce(nbytes, range(512), cluster)
    assert cost.candidates_s["ring"] == pytest.approx(ring, rel=1e-12)
    assert cost.candidates_s["tree"] == pytest.approx(tree, rel=1e-12)
    assert cost.algorithm == "tree"
    assert tree < ring / 50


def test_group_spanning_device_types_takes_the_slowest_link():
    # One rank on an A100 node, one on a V100 node: NICs 25e9 vs 12.5e9 per device.
    cluster = parse_cluster("2x8xA100-80GB+2x8xV100-32GB")
    nbytes = 64 * 2**20
    ring = 2 * 1 * 10e-6 + 2 * 1 / 2 * nbytes / 12.5e9
    assert all_reduce_time_s(nbytes, [0, 16], cluster) == pytest.approx(ring, rel=1e-12)


def test_concurrent_groups_share_a_thin_nic():
    # 8 data-parallel groups, one rank per node each, share every node's single 25 Gb/s NIC.
    cluster = parse_cluster("2x8xV100-16GB")
    nbytes = 2**20
    alone = 2 * 30e-6 + nbytes / 3.125e9
    shared = 2 * 30e-6 + nbytes / (3.125e9 / 8)
    assert all_reduce_time_s(nbytes, [0, 8], cluster) == pytest.approx(alone, rel=1e-12)
    assert all_reduce_time_s(nbytes, [0, 8], cluster, concurrent=8) == pytest.approx(shared, rel=1e-12)


def test_concurrent_groups_on_rails_do_not_slow_down():
    # 8 x HDR per node: each of the 8 concurrent groups still gets one NIC.
    cluster = parse_cluster("2x8xA100-80GB")
    alone = all_reduce_time_s(GiB, [0, 8], cluster)
    assert all_reduce_time_s(GiB, [0, 8], cluster, concurrent=8) == alone


def test_point_to_point_mesh_scales_with_peers():
    cluster = parse_cluster("1x8xMI300X")
    nbytes = GiB
    two = 2 * 1 * 3.2e-6 + 2 * 1 / 2 * nbytes / 64e9  # one xGMI link
    eight = 2 * 7 * 3.2e-6 + 2 * 7 / 8 * nbytes / 448e9  # all seven links
    assert all_reduce_time_s(nbytes, [0, 1], cluster) == pytest.approx(two, rel=1e-12)
    assert all_reduce_time_s(nbytes, range(8), cluster) == pytest.approx(eight, rel=1e-12)


def test_all_gather_and_reduce_scatter_rings():
    cluster = parse_cluster("2x8xA100-80GB")
    nbytes = 256 * 2**20
    intra = 7 * 3.2e-6 + 7 / 8 * nbytes / 300e9
    across = 15 * 10e-6 + 15 / 16 * nbytes / 200e9
    assert all_gather_time_s(nbytes, range(8), cluster) == pytest.approx(intra, rel=1e-12)
    assert reduce_scatter_time_s(nbytes, range(8), cluster) == pytest.approx(intra, rel=1e-12)
    assert all_gather_time_s(nbytes, range(16), cluster) == pytest.approx(across, rel=1e-12)


def test_broadcast_chain_and_binomial():
    cluster = parse_cluster("1x8xA100-80GB")
    big, small = GiB, 1024
    assert broadcast_time_s(big, range(8), cluster) == pytest.approx(7 * 3.2e-6 + big / 300e9, rel=1e-12)
    assert broadcast_time_s(small, range(8), cluster) == pytest.approx(3 * (3.2e-6 + small / 300e9), rel=1e-12)


def test_p2p_intra_and_inter_node():
    cluster = parse_cluster("2x8xA100-80GB")
    nbytes = 64 * 2**20
    intra = 3.2e-6 + nbytes / 300e9
    inter = 10e-6 + nbytes / 25e9
    assert p2p_time_s(nbytes, 0, 1, cluster) == pytest.approx(intra, rel=1e-12)
    assert p2p_time_s(nbytes, 0, 8, cluster) == pytest.approx(inter, rel=1e-12)
    assert p2p_time_s(nbytes, 0, 8, cluster) > p2p_time_s(nbytes, 0, 1, cluster)
    assert p2p_time_s(nbytes, 5, 5, cluster) == 0.0
    assert p2p_time_s(0, 0, 8, cluster) == 0.0


def test_p2p_across_device_types_uses_the_slower_nic():
    cluster = parse_cluster("1x8xA100-80GB+1x8xV100-32GB")
    assert p2p_time_s(2**20, 7, 8, cluster) == pytest.approx(10e-6 + 2**20 / 12.5e9, rel=1e-12)


def test_cpu_uses_measured_gloo_fits():
    cluster = parse_cluster("2xcpu")
    nbytes = 4 * 2**20
    assert best_all_reduce(nbytes, [0, 1], cluster).algorithm == "measured"
    assert all_reduce_time_s(nbytes, [0, 1], cluster) == pytest.approx(189e-6 + nbytes / 1.33e9, rel=1e-12)
    assert all_gather_time_s(nbytes, [0, 1], cluster) == pytest.approx(199e-6 + nbytes / 1.7e9, rel=1e-12)
    assert reduce_scatter_time_s(nbytes, [0, 1], cluster) == pytest.approx(257e-6 + nbytes / 1.1e9, rel=1e-12)
    assert p2p_time_s(nbytes, 0, 1, cluster) == pytest.approx(57e-6 + nbytes / 3.0e9, rel=1e-12)


def test_cpu_fits_scale_to_more_ranks_by_ring_factors():
    # At 4 ranks a ring all-reduce takes 2*3 = 6 steps (3x the 2 measured at 2 ranks)
    # and moves 2*3/4 = 1.5 buffers (1.5x the 1 buffer at 2 ranks).
    cluster = parse_cluster("1x4xcpu")
    nbytes = 2**20
    assert all_reduce_time_s(nbytes, range(4), cluster) == pytest.approx(189e-6 * 3 + nbytes / 1.33e9 * 1.5, rel=1e-12)
    # all-gather: 3 steps vs 1, volume 3/4 vs 1/2.
    assert all_gather_time_s(nbytes, range(4), cluster) == pytest.approx(199e-6 * 3 + nbytes / 1.7e9 * 1.5, rel=1e-12)


def test_cpu_across_hosts_uses_the_link_model():
    cluster = parse_cluster("2x1xcpu")
    nbytes = 2**20
    # 10 Gb/s NIC, 100 us per step (assumed in cpu.toml); no measured fit across hosts.
    assert all_reduce_time_s(nbytes, [0, 1], cluster) == pytest.approx(2 * 100e-6 + nbytes / 1.25e9, rel=1e-12)


def test_bad_groups():
    cluster = parse_cluster("2x8xA100-80GB")
    with pytest.raises(ValueError, match=r"repeat \[3\]; a group lists each rank once"):
        all_reduce_time_s(1, [3, 3], cluster)
    with pytest.raises(ValueError, match="rank 16 is out of range"):
        all_reduce_time_s(1, [0, 16], cluster)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        all_gather_time_s(-1, [0, 1], cluster)
    with pytest.raises(ValueError, match="concurrent must be >= 1"):
        all_reduce_time_s(1, [0, 1], cluster, concurrent=0)


# --- Cards without peer-to-peer ([Note: staged copies]) -----------------------------------
# RTX2080Ti-11GB: no PCIe peer-to-peer; its profile's staged rate 4.0e9 B/s (NCCL's measured
# ring through host memory), PCIe 3.0 x16 15.75e9 B/s, 5.7e-6 s per PCIe ring step.


def test_cards_without_peer_to_peer_run_rings_and_sends_at_their_staged_rate():
    cluster = parse_cluster("1x4xRTX2080Ti-11GB")
    assert all_reduce_time_s(GiB, range(4), cluster) == pytest.approx(2 * 3 * 5.7e-6 + 2 * 3 / 4 * GiB / 4.0e9, rel=1e-12)
    assert all_gather_time_s(GiB, range(4), cluster) == pytest.approx(3 * 5.7e-6 + 3 / 4 * GiB / 4.0e9, rel=1e-12)
    assert p2p_time_s(GiB, 0, 1, cluster) == pytest.approx(5.7e-6 + GiB / 4.0e9, rel=1e-12)


def test_a_bridge_in_a_cluster_file_or_a_profile_with_peer_access_replaces_the_staged_rate():
    bridged = cluster_from_dict({"group": [{"nodes": 1, "devices_per_node": 2, "device": "RTX2080Ti-11GB",
                                            "intra_node_gbps": 400}]}, spec="bridged.toml")
    assert p2p_time_s(GiB, 0, 1, bridged) == pytest.approx(5.7e-6 + GiB / 50e9, rel=1e-12)
    # A profile of one's own (--profile) whose cards reach each other: PCIe's rate again.
    direct = replace(get_device("RTX2080Ti-11GB"), intra_node_staged_bw_bytes_per_s=None)
    cluster = parse_cluster("1x4xRTX2080Ti-11GB", profiles={"RTX2080Ti-11GB": direct})
    assert p2p_time_s(GiB, 0, 1, cluster) == pytest.approx(5.7e-6 + GiB / 15.75e9, rel=1e-12)


def test_tensor_parallel_time_of_a_plan_follows_the_links_the_cluster_file_gives(gpt_path):
    # The staged rate, and the same rate stated per group in a cluster file: the same prediction;
    # a bridge-fast link in the file: less tensor-parallel time.
    graph = trace_model(load_model_file(str(gpt_path), {"n_layers": 2}))
    config = EstimateConfig(global_batch_size=8, dp=1, tp=2, pp=1, micro_batch_size=2, dtype="fp16")

    def tp_seconds(cluster):
        return estimate(graph, cluster, config).predicted.tp_comm_time_s

    def in_file(gbps):
        return cluster_from_dict({"group": [{"nodes": 1, "devices_per_node": 2, "device": "RTX2080Ti-11GB",
                                             "intra_node_gbps": gbps}]}, spec="c.toml")

    staged = tp_seconds(parse_cluster("1x2xRTX2080Ti-11GB"))
    assert staged > 0
    assert tp_seconds(in_file(4.0e9 * 8 / 1e9)) == pytest.approx(staged, rel=1e-12)
    assert tp_seconds(in_file(400)) < staged


def test_a_staged_rate_needs_a_positive_number_and_a_source():
    base = get_device("RTX2080Ti-11GB")
    with pytest.raises(ProfileError, match="intra_node_staged_bw_bytes_per_s must be a positive number"):
        replace(base, intra_node_staged_bw_bytes_per_s=0.0)
    sources = {k: v for k, v in base.sources.items() if k != "intra_node_staged_bw_bytes_per_s"}
    with pytest.raises(ProfileError, match="no source for intra_node_staged_bw_bytes_per_s"):
        replace(base, sources=sources)
