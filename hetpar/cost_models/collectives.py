"""Time of collectives over a group of global ranks of a Cluster: alpha-beta models.

[Note: collective model]

Symbols: P = nbytes, n = ranks in the group, k = nodes it spans, c = its ranks on a
node. alpha is the latency of one algorithm step, B a bandwidth in bytes/s, one
direction. ``nbytes`` is always the full tensor: the all-reduce buffer, the gathered
output of an all-gather, the scattered input of a reduce-scatter (as nccl-tests
counts it).

Links of a group:
- inside a node: B_intra(c) = intra_node_bw, or min(intra_node_bw, (c - 1) * peer_bw)
  on point-to-point meshes (xGMI, HCCS), which give each peer pair one link.
  alpha_intra is the device's intra-node step latency.
- across nodes: a node's egress for the group is
  E = min(nic_bw * nics_per_node / concurrent, c * per_device_nic_bw), where
  per_device_nic_bw = nic_bw * max(1, nics_per_node / devices_per_node) is the NIC
  share a device can drive (one rail per GPU on DGX-style nodes; a lone NIC when there
  are fewer NICs than devices). ``concurrent`` counts identical groups running the same
  collective on the same nodes at once (the t data-parallel groups of a TP-t stage):
  they share the NICs. alpha_inter is the device's inter-node step latency.
- a group that spans nodes or device types takes the slowest link: the smallest B and
  the largest alpha over its nodes.

A ring across nodes runs as NCCL runs it, with one channel per NIC: each node boundary
carries the same bytes as one device's link, so the ring's bottleneck is
B_ring = min(B_intra, E) (NVIDIA/nccl src/graph/tuning.cc: busBw = nChannels *
per-channel bandwidth). This reproduces the measured ~85-96 GB/s busbw of 3 nodes of
8 A100s with 4 x HDR (100 GB/s per node; hardware.md §3.2). Inside one node a ring
step costs alpha_intra; once the ring leaves the node every step costs alpha_inter.

All-reduce takes the cheapest of:
- ring: 2(n-1) alpha + 2(n-1)/n * P / B_ring
- tree, as NCCL builds it (a chain inside each node, a double binary tree across
  nodes; tuning.cc's latency 2((n/k - 1) alpha_intra + log2(k) alpha_inter), its
  algorithm bandwidth half the bus bandwidth, derated by 0.9 for trees):
  2((c_max - 1) alpha_intra + ceil(log2 k) alpha_inter) + 2P / (0.9 B_ring)
- hierarchical (hardware.md §3.3), when the group has the same c >= 2 ranks on each of
  k >= 2 nodes: intra-node reduce-scatter, then c concurrent inter-node all-reduces of
  the P/c shard (ring or tree as above, each device getting E/c of its node's egress), then an
  intra-node all-gather:
  2[(c-1) alpha_intra + (c-1)/c * P / B_intra] + allreduce_k(P/c, per-device bw E/c)

On balanced InfiniBand nodes (8 x HDR for 8 A100s) the ring wins on bandwidth, as NCCL
picks Ring there; with a thin network (one 25 Gb/s NIC for 8 V100s) hierarchical wins,
because the ring's every step then waits on the NIC.

All-gather and reduce-scatter are rings: (n-1) alpha + (n-1)/n * P / B_ring.
Broadcast is the cheaper of a pipelined chain, (n-1) alpha + P / B_ring, and a binomial
tree, ceil(log2 n) (alpha + P / B_ring).

Measured fits. A device profile may carry a measured fit ``time = latency + P / bw``
per collective at ``ranks`` = n0 (the cpu profile: torch's gloo, which is not a
textbook ring). For a group inside one node that fit is used as measured, scaled to n
ranks by the ring's step and volume factors: latency * steps(n) / steps(n0) +
P / bw * volume(n) / volume(n0), with steps and volume 2(n-1) and 2(n-1)/n for
all-reduce, n-1 and (n-1)/n for all-gather and reduce-scatter, n-1 and 1 for
broadcast, 1 and 1 for p2p. At n = n0 this is exactly the measurement.

A group of one rank, or zero bytes, costs 0.

[Note: staged copies]

GeForce cards under NVIDIA's driver have no PCIe peer-to-peer: one card cannot read or
write another's memory, so every byte NCCL moves between two cards of a node goes
through a buffer in host memory (its shared-memory transport), crossing PCIe twice and
the host's memory. A profile states what that path gives a ring, one direction, as
``intra_node_staged_bw_bytes_per_s``: NCCL's measured ring bus bandwidth where one was
found (RTX 2080 Ti), else half of what p2pBandwidthLatencyTest measured with peer access
off and both directions copying at once, a ring's load on each card (TITAN RTX, RTX
3090, RTX 4090; the sources are in the profiles). A node group of such cards takes it
as its intra-node bandwidth B_intra (``DeviceProfile.node_link_bw_bytes_per_s``): rings,
trees, all-to-alls and sends inside the node all run at it. A cluster file's
``intra_node_gbps`` replaces it (cards joined by an NVLink bridge, or a host measured
apart). The step latency stays the PCIe one, as NCCL's own model charges links without
peer-to-peer (tuning.cc's PCI row).

NCCL's model also charges each call a fixed base (tuning.cc's baseLat, 8.4 us for Simple
rings and trees). The NVLink profiles' step latencies are whole small calls measured and
divided by their ring steps, so that base is inside them; the PCIe profiles take NCCL's
step value (5.7 us) alone and leave the base out, a fifth of a small all-reduce on four
cards (6 steps, 34 us), nothing next to the megabytes a training step moves per call.

[Note: collectives across zones]

A group whose ranks sit in z >= 2 zones (sites joined by WAN links; docs/cluster-format.md)
is priced hierarchically: the collective runs inside each zone as above, and the zones
exchange over the WAN as z endpoints of a ring. The WAN has bandwidth
B_wan = min(min over the group's zone pairs of link_bw / concurrent, min over zones of
the zone's egress, the sum of E over its nodes in the group), since every shard of the
group crosses the same link, and a step latency a_wan = the largest one-way link
latency + alpha_inter. With m_z the group's ranks in zone z:

- all-reduce: max_z reduce_scatter(P, m_z) + [2(z-1) a_wan + 2(z-1)/z * P / B_wan]
  + max_z all_gather(P, m_z) (each zone reduce-scatters, the zones all-reduce their
  shards concurrently, so the WAN carries one all-reduce of P among z endpoints, then each
  zone all-gathers);
- all-gather, reduce-scatter: max_z (the same collective over m_z) + (z-1) a_wan +
  (z-1)/z * P / B_wan;
- broadcast: the root's zone chains P to the others, (z-1) a_wan + P / B_wan, then each
  zone broadcasts inside it;
- p2p between zones: a_wan + P / min(B_link, the two devices' NIC shares).

The one-site algorithms (ring, tree, node-hierarchical) with every node-to-node step
at a_wan and the egress capped at B_wan, are the other candidates; the cheapest is
taken (the zone-hierarchical one on any real WAN; with an unbounded, zero-latency link no
price exceeds the one-site one, and the two-level ring's fewer steps may undercut it). The
prices are a two-level implementation's: torch.distributed's NCCL and gloo collectives
build one ring or tree over all ranks and do not know the zones.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetpar.cost_models.cluster import Cluster, NodeGroup
from hetpar.cost_models.devices import MeasuredCollective

# NCCL derates tree bandwidth to 0.9 of the ring's (NVIDIA/nccl src/graph/tuning.cc,
# "if (a == NCCL_ALGO_TREE) busBw = std::min(busBw*.9, ...)").
TREE_BW_FACTOR = 0.9


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """The predicted time of one collective and the algorithm that achieves it."""

    algorithm: str  # "ring", "tree", "hierarchical", "chain", "binomial", "measured" or "none"
    time_s: float
    candidates_s: dict[str, float]  # every algorithm considered -> its time


@dataclass(frozen=True, kw_only=True)
class _GroupLinks:
    """The links a group of ranks runs over (see [Note: collective model])."""

    n: int
    k: int  # nodes spanned
    ranks_per_node: tuple[int, ...]  # c of each spanned node
    intra_bw_bytes_per_s: float  # min over nodes with c >= 2; inf when none has two ranks
    intra_latency_s: float
    egress_bw_bytes_per_s: float  # min over nodes of E; inf when k == 1
    inter_latency_s: float
    measured: dict[str, MeasuredCollective]  # fits usable for this group (k == 1 only)

    @property
    def ring_bw_bytes_per_s(self) -> float:
        return min(self.intra_bw_bytes_per_s, self.egress_bw_bytes_per_s)

    @property
    def ring_latency_s(self) -> float:
        return self.intra_latency_s if self.k == 1 else self.inter_latency_s


def _links(ranks: Sequence[int], cluster: Cluster, concurrent: int) -> _GroupLinks:
    """Summarise the slowest links of ``ranks`` (see [Note: collective model])."""
    return _group_links(tuple(ranks), cluster, concurrent)


@functools.lru_cache(maxsize=4096)
def _group_links(ranks: tuple[int, ...], cluster: Cluster, concurrent: int) -> _GroupLinks:
    """``_links``, kept per group: a planner prices the same groups' collectives at many sizes."""
    if concurrent < 1:
        raise ValueError(f"concurrent must be >= 1, got {concurrent}")
    if len(set(ranks)) != len(ranks):
        repeated = sorted({r for r in ranks if list(ranks).count(r) > 1})
        raise ValueError(f"ranks {list(ranks)} repeat {repeated}; a group lists each rank once")
    by_node: dict[int, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(cluster.node_of(rank), []).append(rank)
    node_groups = {node: cluster.group_of(members[0]) for node, members in by_node.items()}
    counts = {node: len(members) for node, members in by_node.items()}
    intra_bw = min(
        (_intra_bw(node_groups[node], c) for node, c in counts.items() if c >= 2),
        default=math.inf,
    )
    egress = math.inf
    if len(by_node) > 1:
        egress = min(_egress_bw(node_groups[node], c, concurrent) for node, c in counts.items())
    devices = [g.device for g in node_groups.values()]
    measured: dict[str, MeasuredCollective] = {}
    if len(by_node) == 1:
        measured = dict(devices[0].collectives)
    return _GroupLinks(
        n=len(ranks),
        k=len(by_node),
        ranks_per_node=tuple(counts.values()),
        intra_bw_bytes_per_s=intra_bw,
        intra_latency_s=max((d.intra_node_latency_s for d in devices), default=0.0),
        egress_bw_bytes_per_s=egress,
        inter_latency_s=max((d.inter_node_latency_s for d in devices), default=0.0),
        measured=measured,
    )


def _intra_bw(group: NodeGroup, c: int) -> float:
    """B_intra(c): one device's intra-node bandwidth when c devices of its node take part."""
    peer = group.device.intra_node_peer_bw_bytes_per_s
    if peer is None:
        return group.intra_node_bw_bytes_per_s
    return min(group.intra_node_bw_bytes_per_s, (c - 1) * peer)


def _per_device_nic_bw(group: NodeGroup) -> float:
    """The NIC bandwidth one device of ``group`` can drive on its own."""
    return group.nic_bw_bytes_per_s * max(1.0, group.nics_per_node / group.devices_per_node)


def _egress_bw(group: NodeGroup, c: int, concurrent: int) -> float:
    """E: what c devices of one node of ``group`` can send off the node, sharing it with ``concurrent`` groups."""
    return min(group.node_nic_bw_bytes_per_s / concurrent, c * _per_device_nic_bw(group))


def _check_nbytes(nbytes: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


# Steps and volume of each collective by ranks n, which scale a measured fit ([Note: collective model]).
_RING_FACTORS = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: n - 1, lambda n: 1),
    "p2p": (lambda n: 1, lambda n: 1),
}


def measured_collective_s(name: str, fit: MeasuredCollective, nbytes: float, n: int) -> float:
    """Seconds of collective ``name`` of ``nbytes`` over ``n`` ranks of one node from its
    measured fit at ``fit.ranks``, scaled by the step and volume factors."""
    steps, volume = _RING_FACTORS[name]
    n0 = fit.ranks
    return fit.latency_s * steps(n) / steps(n0) + nbytes / fit.bw_bytes_per_s * volume(n) / volume(n0)


def _log2_ceil(x: int) -> int:
    return math.ceil(math.log2(x)) if x > 1 else 0


# --- All-reduce --------------------------------------------------------------------------


def _ring_all_reduce_s(nbytes: float, n: int, latency_s: float, bw: float) -> float:
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bw


def _tree_all_reduce_s(nbytes: float, links: _GroupLinks) -> float:
    chain_steps = max(links.ranks_per_node) - 1
    latency = 2 * (chain_steps * links.intra_latency_s + _log2_ceil(links.k) * links.inter_latency_s)
    return latency + 2 * nbytes / (TREE_BW_FACTOR * links.ring_bw_bytes_per_s)


def _hierarchical_all_reduce_s(nbytes: float, links: _GroupLinks) -> float:
    c, k = links.ranks_per_node[0], links.k
    intra_phase = (c - 1) * links.intra_latency_s + (c - 1) / c * nbytes / links.intra_bw_bytes_per_s
    shard, per_device_bw = nbytes / c, links.egress_bw_bytes_per_s / c
    inter_ring = _ring_all_reduce_s(shard, k, links.inter_latency_s, per_device_bw)
    inter_tree = 2 * _log2_ceil(k) * links.inter_latency_s + 2 * shard / (TREE_BW_FACTOR * per_device_bw)
    return 2 * intra_phase + min(inter_ring, inter_tree)


def best_all_reduce(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> CollectiveCost:
    """The cheapest all-reduce of ``nbytes`` over ``ranks``, with every candidate's time.

    Candidates (formulas in [Note: collective model]): ring
    ``2(n-1) a + 2(n-1)/n * P / B``; NCCL's tree
    ``2((c-1) a_intra + ceil(log2 k) a_inter) + 2P / (0.9 B)``; hierarchical (intra-node
    reduce-scatter, inter-node all-reduce of the P/c shard, intra-node all-gather) when
    the group has the same c >= 2 ranks on each of k >= 2 nodes. A group inside one node
    of a device with a measured all-reduce fit (cpu) uses that fit instead.

    Args:
        nbytes: bytes of the buffer each rank holds.
        ranks: global ranks of the group, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups doing the same all-reduce at once on the same
            nodes; they share each node's NICs.

    Returns:
        The chosen algorithm, its time and all candidates' times.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    _check_nbytes(nbytes)
    links = _links(ranks, cluster, concurrent)
    if links.n <= 1 or nbytes == 0:
        return CollectiveCost(algorithm="none", time_s=0.0, candidates_s={"none": 0.0})
    zones = _by_zone(ranks, cluster)
    across = {}
    if len(zones) > 1:
        links, across = _across_zones("all_reduce", nbytes, zones, links, cluster, concurrent)
    fit = links.measured.get("all_reduce")
    if fit is not None:
        time_s = measured_collective_s("all_reduce", fit, nbytes, links.n)
        return CollectiveCost(algorithm="measured", time_s=time_s, candidates_s={"measured": time_s})
    candidates = {
        "ring": _ring_all_reduce_s(nbytes, links.n, links.ring_latency_s, links.ring_bw_bytes_per_s),
        "tree": _tree_all_reduce_s(nbytes, links),
    }
    if links.k >= 2 and len(set(links.ranks_per_node)) == 1 and links.ranks_per_node[0] >= 2:
        candidates["hierarchical"] = _hierarchical_all_reduce_s(nbytes, links)
    candidates.update(across)
    algorithm = min(candidates, key=candidates.__getitem__)  # ties keep the earlier: ring first
    return CollectiveCost(algorithm=algorithm, time_s=candidates[algorithm], candidates_s=candidates)


def all_reduce_time_s(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``ranks``: the cheapest of ring, tree, hierarchical.

    Ring: ``2(n-1) a + 2(n-1)/n * P / B``; tree and hierarchical as in ``best_all_reduce``
    and [Note: collective model].

    Args:
        nbytes: bytes of the buffer each rank holds.
        ranks: global ranks of the group, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups doing the same all-reduce at once on the same nodes.

    Returns:
        Seconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    return best_all_reduce(nbytes, ranks, cluster, concurrent=concurrent).time_s


# --- All-gather, reduce-scatter, broadcast, p2p ------------------------------------------


def _ring_collective_s(name: str, nbytes: float, ranks: Sequence[int], cluster: Cluster, concurrent: int) -> float:
    """(n-1) a + (n-1)/n * P / B_ring, or the measured fit of ``name`` inside one node."""
    _check_nbytes(nbytes)
    links = _links(ranks, cluster, concurrent)
    n = links.n
    if n <= 1 or nbytes == 0:
        return 0.0
    zones = _by_zone(ranks, cluster)
    across = {}
    if len(zones) > 1:
        links, across = _across_zones(name, nbytes, zones, links, cluster, concurrent)
    fit = links.measured.get(name)
    if fit is not None:
        return measured_collective_s(name, fit, nbytes, n)
    return min([(n - 1) * links.ring_latency_s + (n - 1) / n * nbytes / links.ring_bw_bytes_per_s, *across.values()])


def all_gather_time_s(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> float:
    """Seconds for a ring all-gather whose gathered output is ``nbytes``: ``(n-1) a + (n-1)/n * P / B``.

    Args:
        nbytes: bytes of the gathered output (each rank contributes nbytes / n).
        ranks: global ranks of the group, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups doing the same all-gather at once on the same nodes.

    Returns:
        Seconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    return _ring_collective_s("all_gather", nbytes, ranks, cluster, concurrent)


def reduce_scatter_time_s(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> float:
    """Seconds for a ring reduce-scatter of an ``nbytes`` input: ``(n-1) a + (n-1)/n * P / B``.

    Args:
        nbytes: bytes of each rank's full input (each rank keeps nbytes / n).
        ranks: global ranks of the group, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups doing the same reduce-scatter at once on the same nodes.

    Returns:
        Seconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    return _ring_collective_s("reduce_scatter", nbytes, ranks, cluster, concurrent)


def broadcast_time_s(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> float:
    """Seconds to broadcast ``nbytes`` from one rank of ``ranks`` to the others.

    The cheaper of a pipelined chain, ``(n-1) a + P / B``, and a binomial tree,
    ``ceil(log2 n) (a + P / B)``, with the ring's a and B ([Note: collective model]).

    Args:
        nbytes: bytes broadcast.
        ranks: global ranks of the group, root included, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups broadcasting at once on the same nodes.

    Returns:
        Seconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    _check_nbytes(nbytes)
    links = _links(ranks, cluster, concurrent)
    n = links.n
    if n <= 1 or nbytes == 0:
        return 0.0
    zones = _by_zone(ranks, cluster)
    across = {}
    if len(zones) > 1:
        links, across = _across_zones("broadcast", nbytes, zones, links, cluster, concurrent)
    fit = links.measured.get("broadcast")
    if fit is not None:
        return measured_collective_s("broadcast", fit, nbytes, n)
    latency, bw = links.ring_latency_s, links.ring_bw_bytes_per_s
    chain = (n - 1) * latency + nbytes / bw
    binomial = _log2_ceil(n) * (latency + nbytes / bw)
    return min(chain, binomial, *across.values())


# --- All-to-all ([Note: expert parallelism costs]) ----------------------------------------


# [Note: expert parallelism costs]
# Under expert parallelism of degree ep, a replica keeps E / ep of each module of
# experts and sends each routed row (token, choice) to the replica holding its expert:
# one all-to-all to dispatch and one to combine in the forward, the same two in the
# backward (runtime/experts.py). With uniform routing a rank keeps 1/ep of its rows and
# sends the rest, (ep - 1)/ep of its ``routed_bytes`` per sample, spread evenly over the
# other ranks; what each of those pairs moves crosses the link between them. The time of
# one all-to-all is the slowest of its parts, which run at once:
#
#   (n - 1) a + max(P_intra / B_intra, P_inter / E_dev, P_zone / B_wan)
#
# with P the bytes one rank sends to peers on its own node (P_intra), on other nodes of
# its zone (P_inter) and in other zones (P_zone); B_intra the node's link, E_dev one
# device's share of its node's egress with the whole group sending, B_wan the WAN link's
# bandwidth shared by the rank's zone; a the latency of the farthest peer (a message per
# peer). Inside one node whose profile has a measured all-gather (``hetpar profile``;
# the CPU profile), the all-to-all takes that fit's time for the bytes it sends: an
# all-gather sends the same (n - 1)/n of a rank's bytes over the same links, and
# all-to-all has no fit of its own. Each dispatch also exchanges the row counts (and the
# rows' expert numbers) first, all-to-alls of a few bytes that cost their latency
# (``EXCHANGES_PER_DISPATCH``). The experts' compute is unchanged by ep (each rank runs the rows its experts
# receive, 1/ep of E experts' rows from ep ranks); their parameters, gradients and
# optimizer state are 1/ep per rank, and their gradients are averaged over the dp / ep
# replicas holding the same experts rather than over all dp.
# All-to-alls of a forward dispatch besides the rows' two (there and back): the row
# counts and the rows' expert numbers (runtime/experts.py ``dispatch``).
EXCHANGES_PER_DISPATCH = 2


def all_to_all_time_s(nbytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1) -> float:
    """Seconds of an all-to-all in which each rank of ``ranks`` holds ``nbytes`` spread
    evenly over the group (1/n of it stays); see [Note: expert parallelism costs].

    Args:
        nbytes: bytes each rank holds before the exchange (it sends (n - 1)/n of them).
        ranks: global ranks of the group, each once.
        cluster: the cluster the ranks belong to.
        concurrent: identical groups exchanging at once on the same nodes.

    Returns:
        Seconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: negative nbytes, a repeated or out-of-range rank, concurrent < 1.
    """
    _check_nbytes(nbytes)
    links = _links(ranks, cluster, concurrent)
    n = links.n
    if n <= 1 or nbytes == 0:
        return 0.0
    fit = links.measured.get("all_gather")
    if fit is not None:
        return measured_collective_s("all_gather", fit, nbytes, n)
    per_peer = nbytes / n
    zones = _by_zone(ranks, cluster)
    worst = 0.0
    for rank in ranks:
        node, zone = cluster.node_of(rank), (cluster.zone_of(rank) if cluster.links else "")
        same_node = sum(1 for r in ranks if r != rank and cluster.node_of(r) == node)
        same_zone = len(zones[zone]) - 1 - same_node if len(zones) > 1 else n - 1 - same_node
        other_zones = n - 1 - same_node - same_zone
        c = same_node + 1
        group = cluster.group_of(rank)
        parts = [per_peer * same_node / _intra_bw(group, c) if same_node else 0.0]
        if same_zone or other_zones:
            parts.append(per_peer * (same_zone + other_zones) / (_egress_bw(group, c, concurrent) / c))
        if other_zones:
            _, wan_bw = _wan_step(cluster, list(zones), [group.device])
            parts.append(per_peer * other_zones * len(zones[zone]) / wan_bw)
        worst = max(worst, max(parts))
    latency = links.ring_latency_s
    if len(zones) > 1:
        latency = _wan_step(cluster, list(zones), [cluster.group_of(r).device for r in ranks])[0]
    return (n - 1) * latency + worst


# [Note: expert load]
# Routing is learned, so experts are not equally popular: a rank whose experts receive
# more rows than the uniform 1/ep share computes longer, and every rank of its group waits
# for it at the combine. ``--expert-imbalance F`` (F >= 1, recorded in the plan as
# ``expert_imbalance``; 1 is uniform routing) says the busiest rank receives F times the
# uniform share: under expert parallelism its experts' FLOPs and the rows it receives are
# costed at F times (``LayerProfile.with_expert_load``); without expert parallelism every
# rank runs all its own rows whatever the routing, so nothing changes. The program
# measures its routing (``expert_imbalance`` in its metrics: each step, the most rows a
# rank of the group was sent over the mean, as rank 0 routed them), which is the number
# to give.


# --- Across zones ([Note: collectives across zones]) -------------------------------------


def _by_zone(ranks: Sequence[int], cluster: Cluster) -> dict[str, list[int]]:
    """The group's ranks by zone, in the order the zones first appear; one entry on a one-zone cluster."""
    if not cluster.links:
        return {"": list(ranks)}
    out: dict[str, list[int]] = {}
    for rank in ranks:
        out.setdefault(cluster.zone_of(rank), []).append(rank)
    return out


def _wan_step(cluster: Cluster, zones: Sequence[str], devices) -> tuple[float, float]:
    """(a_wan, the slowest link's bandwidth) among ``zones``."""
    pairs = [cluster.wan_link(a, b) for i, a in enumerate(zones) for b in zones[i + 1:]]
    latency = max(link.latency_s for link in pairs) + max(d.inter_node_latency_s for d in devices)
    return latency, min(link.bw_bytes_per_s for link in pairs)


def _zone_egress_bw(members: Sequence[int], cluster: Cluster, concurrent: int) -> float:
    """What the group's ranks in one zone can send off their nodes together."""
    counts: dict[int, int] = {}
    for rank in members:
        counts[cluster.node_of(rank)] = counts.get(cluster.node_of(rank), 0) + 1
    return sum(_egress_bw(cluster.group_of(cluster.ranks_of_node(node)[0]), c, concurrent) for node, c in counts.items())


def _across_zones(name: str, nbytes: float, zones: dict[str, list[int]], links: _GroupLinks, cluster: Cluster,
                  concurrent: int) -> tuple[_GroupLinks, dict[str, float]]:
    """A group in several zones: its links with every node-to-node step over the WAN (for the one-site
    algorithms), and the zone-hierarchical candidate; see [Note: collectives across zones]."""
    z = len(zones)
    devices = [cluster.group_of(m[0]).device for m in zones.values()]
    a_wan, link_bw = _wan_step(cluster, list(zones), devices)
    wan_bw = min(link_bw / concurrent, min(_zone_egress_bw(m, cluster, concurrent) for m in zones.values()))
    flat = replace(links, egress_bw_bytes_per_s=min(links.egress_bw_bytes_per_s, wan_bw), inter_latency_s=a_wan, measured={})

    def inside(kind: str) -> float:
        if kind == "broadcast":
            return max(broadcast_time_s(nbytes, m, cluster, concurrent=concurrent) for m in zones.values())
        return max(_ring_collective_s(kind, nbytes, m, cluster, concurrent) for m in zones.values())

    if name == "all_reduce":
        time_s = inside("reduce_scatter") + 2 * (z - 1) * a_wan + 2 * (z - 1) / z * nbytes / wan_bw + inside("all_gather")
    elif name == "broadcast":
        time_s = (z - 1) * a_wan + nbytes / wan_bw + inside("broadcast")
    else:
        time_s = inside(name) + (z - 1) * a_wan + (z - 1) / z * nbytes / wan_bw
    return flat, {"zone-hierarchical": time_s}


def grad_sync_scale(device) -> float:
    """How many times its collectives' time the data-parallel synchronisation (the
    gradient all-reduce, ZeRO's reduce-scatters and gathers) takes inside a training
    step on ``device`` (a measured profile's ``grad_sync_scale``; 1 for datasheet
    profiles)."""
    return getattr(device, "grad_sync_scale", None) or 1.0


def tensor_parallel_pass_s(collectives, pass_: str, scale: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Seconds of a layer's tensor-parallel collectives in one pass over the group ``ranks``.

    Each costs its algorithm's time and the device profile's ``tp_collective_overhead_s``
    (measured by ``hetpar profile``: what a collective between kernels costs beyond a
    tight loop of them, where the ranks arrive apart; zero for datasheet profiles).

    Args:
        collectives: ``LayerProfile.tp_collectives``, (pass, collective, bytes per sample).
        pass_: "forward" or "backward".
        scale: bytes per sample in fp32 to bytes per micro-batch in the training dtype.
    """
    if len(ranks) < 2:
        return 0.0
    time = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s, "reduce_scatter": reduce_scatter_time_s}
    extra = getattr(cluster.group_of(ranks[0]).device, "tp_collective_overhead_s", None) or 0.0
    return sum(time[kind](nbytes * scale, ranks, cluster) + extra for p, kind, nbytes in collectives if p == pass_ and nbytes > 0)


# [Note: context parallelism costs]
# Under context parallelism of degree cp every sequence is cut into 2 cp chunks and rank
# j of a cp group holds chunks j and 2 cp - 1 - j, so with causal attention each rank
# has the same share of the work ([Note: context parallelism] in runtime/context.py).
# One rank then runs 1/cp of every layer: its FLOPs, elementwise work, activations,
# boundary and tensor-parallel collectives per sample are the layer's / cp
# (``LayerProfile.at_context``), its parameters are whole. Attention needs every
# earlier key and value: per layer and micro-batch the forward all-gathers the keys and
# values over the cp group (``attention_kv_bytes``, split over tp where the layer's heads
# are), and the backward reduce-scatters their gradients; the gathered ones are kept
# for backward (saved bytes grow by kv (1 - 1/cp)), and so is the concatenation of the
# rank's two chunks' attention outputs (``attention_out_bytes`` / cp more): the attention
# calls keep their chunks' outputs, and the next op (the output projection) keeps the
# joined copy, where without cp it reads the one output attention keeps through a view
# (torch's fused kernels lay their output out [b, s, heads, d], so the usual transpose and
# reshape copies nothing). Under recompute the copy is rebuilt, not kept. On CPU workers
# torch's kernel also keeps a float32 [T / 2cp, (c + 1) T / 2cp] mask for each later chunk
# c of the rank (the lower-right causal bias it builds); that is not counted (GPUs' kernels
# make none). The exchange is counted exposed:
# the program runs it before the attention that needs it, on the compute stream's
# turn. Gradients are synchronised over all dp x cp ranks of a stage, which hold the
# same parameters. The search and the estimator cost a plan of dp data replicas at
# degree cp as dp x cp replicas of the model at ``at_context(cp)`` with the same
# micro-batches, plus these exchanges.
def context_exchange_s(kv_bytes: float, ranks: Sequence[int], cluster: Cluster, *, concurrent: int = 1
                       ) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's key and value exchange over the
    context-parallel group ``ranks``: an all-gather of ``kv_bytes`` (the whole sequence's
    keys and values of a micro-batch, one tensor-parallel rank's share) and the
    reduce-scatter of their gradients; see [Note: context parallelism costs]."""
    if len(ranks) < 2 or kv_bytes <= 0:
        return 0.0, 0.0
    return (all_gather_time_s(kv_bytes, ranks, cluster, concurrent=concurrent),
            reduce_scatter_time_s(kv_bytes, ranks, cluster, concurrent=concurrent))


def p2p_time_s(nbytes: float, src: int, dst: int, cluster: Cluster) -> float:
    """Seconds to send ``nbytes`` from global rank ``src`` to ``dst``: ``a + P / B``.

    Same node: a = alpha_intra, B = the peer link (intra_node_peer_bw on meshes, else the
    node group's intra-node bandwidth), or the device's measured p2p fit (cpu).
    Different nodes: a = the larger alpha_inter of the two, B = the smaller per-device
    NIC bandwidth of the two ([Note: collective model]). Different zones: a = the WAN
    link's latency + alpha_inter, B = the link's bandwidth where it is the smaller
    ([Note: collectives across zones]).

    Args:
        nbytes: bytes sent.
        src: sending global rank.
        dst: receiving global rank.
        cluster: the cluster the ranks belong to.

    Returns:
        Seconds; 0 when src == dst or nbytes == 0.

    Raises:
        ValueError: negative nbytes, or a rank out of range.
    """
    _check_nbytes(nbytes)
    src_group, dst_group = cluster.group_of(src), cluster.group_of(dst)
    if src == dst or nbytes == 0:
        return 0.0
    if src_group.zone != dst_group.zone:
        latency, wan_bw = _wan_step(cluster, [src_group.zone, dst_group.zone], [src_group.device, dst_group.device])
        return latency + nbytes / min(wan_bw, _per_device_nic_bw(src_group), _per_device_nic_bw(dst_group))
    if cluster.node_of(src) == cluster.node_of(dst):
        fit = src_group.device.collectives.get("p2p")
        if fit is not None:
            return fit.latency_s + nbytes / fit.bw_bytes_per_s
        return src_group.device.intra_node_latency_s + nbytes / _intra_bw(src_group, 2)
    latency = max(src_group.device.inter_node_latency_s, dst_group.device.inter_node_latency_s)
    bw = min(_per_device_nic_bw(src_group), _per_device_nic_bw(dst_group))
    return latency + nbytes / bw
