"""Sub-clusters: a cluster made of some of another cluster's devices.

The cost objective (planner.strategies.objective) plans on fewer nodes than the user has, and
heterogeneous data parallelism (planner.strategies.hetero_dp) costs one replica on its own
devices; both describe those devices as a ``Cluster`` whose ``spec`` is a shorthand
that ``parse_cluster`` reads back, so a plan made on a sub-cluster names exactly the
devices it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetpar.cost_models.cluster import Cluster, NodeGroup

_GBPS = 1e9 / 8  # bytes per second in one Gb/s, as cost_models.cluster counts NIC rates


@dataclass(frozen=True, kw_only=True)
class GroupUse:
    """How much of one node group a sub-cluster takes: ``nodes`` nodes of ``devices_per_node`` devices.

    ``devices_per_node`` below the group's means one node used in part (a divisor of
    its devices, so tensor-parallel groups still fit in it).
    """

    nodes: int
    devices_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


def group_uses(group: NodeGroup) -> list[GroupUse]:
    """Every way to use part of ``group``: none, 1..all whole nodes, or one node in part.

    A part of a node is a proper divisor of its device count.
    """
    uses = [GroupUse(nodes=0, devices_per_node=group.devices_per_node)]
    uses += [GroupUse(nodes=1, devices_per_node=d) for d in range(1, group.devices_per_node) if group.devices_per_node % d == 0]
    uses += [GroupUse(nodes=n, devices_per_node=group.devices_per_node) for n in range(1, group.num_nodes + 1)]
    return uses


def subcluster(cluster: Cluster, uses: list[GroupUse]) -> Cluster:
    """The cluster of the devices ``uses`` takes of each of ``cluster``'s groups, in the same order.

    Its spec is ``cluster.spec`` when every device is used, else a shorthand of the
    groups taken (see ``shorthand``).

    Raises:
        ValueError: ``uses`` has not one entry per group, asks for more than a group has,
            or takes no device at all.
    """
    if len(uses) != len(cluster.groups):
        raise ValueError(f"{len(uses)} group uses for a cluster of {len(cluster.groups)} groups")
    groups = []
    for g, use in zip(cluster.groups, uses):
        if use.nodes > g.num_nodes or use.devices_per_node > g.devices_per_node:
            raise ValueError(f"{use} asks for more than the {g.device.name} group has")
        if use.nodes:
            groups.append(replace(g, num_nodes=use.nodes, devices_per_node=use.devices_per_node))
    if not groups:
        raise ValueError("a sub-cluster needs at least one device")
    whole = all(u.nodes == g.num_nodes and u.devices_per_node == g.devices_per_node for g, u in zip(cluster.groups, uses))
    # zones and links carry over (a shorthand has none: [Note: zones in a sub-cluster's spec])
    return replace(cluster, spec=cluster.spec if whole else shorthand(groups), groups=tuple(groups))


# [Note: zones in a sub-cluster's spec]
# A sub-cluster keeps its groups' zones, the WAN links and the zones' grid intensities,
# so the plan made on it is priced across zones as the whole cluster is. Its spec is a
# shorthand, which has no zones: ``hetpar compile`` needs only the ranks and device
# types, but re-estimating such a plan from its spec (``hetpar explain``) prices it as
# one site.
def shorthand(groups: list[NodeGroup] | tuple[NodeGroup, ...]) -> str:
    """``groups`` as a --cluster shorthand, with ``@RATEgxNICS`` where a group's NICs are not its device's default.

    An ``intra_node_gbps`` a cluster file set has no shorthand; such a group reads back
    with its device's default intra-node bandwidth.
    """
    pieces = []
    for g in groups:
        piece = f"{g.num_nodes}x{g.devices_per_node}x{g.device.name}"
        d = g.device
        if (g.nic_bw_bytes_per_s, g.nics_per_node) != (d.default_nic_bw_bytes_per_s, d.default_nics_per_node):
            piece += f"@{g.nic_bw_bytes_per_s / _GBPS:g}gx{g.nics_per_node}"
        pieces.append(piece)
    return "+".join(pieces)


__all__ = ["GroupUse", "group_uses", "subcluster", "shorthand"]
