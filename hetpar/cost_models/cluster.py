"""Clusters: which devices, how many per node, and the links between them.

A cluster is written as a shorthand (``2x8xA100-80GB+1x8xV100-32GB``) or as a TOML file;
both are documented in docs/cluster-format.md. Global ranks are numbered in the order
the cluster is written: group by group, node by node, device by device.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from hetpar.cost_models.devices import DeviceProfile, UnknownDeviceError, get_device

EXPECTED_FORM = "[NODES x] DEVICES x TYPE[@RATEgxNICS] joined by '+', e.g. 2x8xA100-80GB+1x8xV100-32GB"

_GBPS = 1e9 / 8  # bytes per second in one Gb/s

# "2x8xA100-80GB" -> nodes "2", devices "8", type "A100-80GB"; "2xcpu" -> devices "2".
_COUNTS_AND_TYPE = re.compile(r"^(?:(?P<nodes>\d+)x)?(?P<devices>\d+)x(?P<type>[a-z][a-z0-9_.\-]*)$", re.IGNORECASE)
# "200gx8", "200Gx8", "12.5gbpsx1"
_NIC = re.compile(r"^(?P<rate>\d+(?:\.\d+)?)(?:g|gbps|gb/s)x(?P<nics>\d+)$", re.IGNORECASE)

_GROUP_KEYS = ("nodes", "devices_per_node", "device", "nic_gbps", "nics_per_node", "intra_node_gbps", "usd_per_device_hour", "zone")
_ZONE_KEYS = ("name", "carbon_g_per_kwh")
_LINK_KEYS = ("zones", "gbps", "latency_ms")


class ClusterSpecError(ValueError):
    """A cluster shorthand or cluster file is malformed or names an unknown device."""


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """``num_nodes`` identical nodes, each with ``devices_per_node`` devices of one type.

    Bandwidths are bytes per second, one direction: ``nic_bw_bytes_per_s`` per NIC,
    ``intra_node_bw_bytes_per_s`` per device.
    """

    num_nodes: int
    devices_per_node: int
    device: DeviceProfile
    nic_bw_bytes_per_s: float
    nics_per_node: int
    # From the device (its staged rate where it has no peer-to-peer) unless overridden in TOML.
    intra_node_bw_bytes_per_s: float
    usd_per_device_hour: float | None = None  # what one device costs per hour, for --objective cost; None: not given
    zone: str = ""  # the site (data centre) of its nodes; "" in a cluster of one unnamed zone

    def __post_init__(self) -> None:
        counts = {"num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node, "nics_per_node": self.nics_per_node}
        for key, value in counts.items():
            if not isinstance(value, int) or value < 1:
                raise ClusterSpecError(f"{self.device.name} group: {key} must be an integer >= 1, got {value!r}")
        for key in ("nic_bw_bytes_per_s", "intra_node_bw_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise ClusterSpecError(f"{self.device.name} group: {key} must be positive, got {getattr(self, key)!r}")

    @property
    def num_devices(self) -> int:
        """Devices in the whole group."""
        return self.num_nodes * self.devices_per_node

    @property
    def node_nic_bw_bytes_per_s(self) -> float:
        """All NICs of one node together, one direction."""
        return self.nic_bw_bytes_per_s * self.nics_per_node


@dataclass(frozen=True, kw_only=True)
class Zone:
    """A site whose nodes share a data centre network; ``carbon_g_per_kwh`` is its grid's intensity, where given."""

    name: str
    carbon_g_per_kwh: float | None = None


@dataclass(frozen=True, kw_only=True)
class WanLink:
    """The wide-area link between two zones: what all traffic between them shares, one direction.

    ``latency_s`` is one way (half the round trip a ping reports).
    """

    zones: tuple[str, str]
    bw_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The devices of a training job, as node groups in the order the spec lists them.

    A cluster spans one or more zones (sites); every two zones its groups use are joined
    by a ``WanLink`` (docs/cluster-format.md, "Zones and WAN links").
    """

    spec: str  # the shorthand or file path it was parsed from
    groups: tuple[NodeGroup, ...]
    zones: tuple[Zone, ...] = ()  # named in a cluster file; empty: one unnamed zone
    links: tuple[WanLink, ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            raise ClusterSpecError(f"cluster '{self.spec}' has no node groups")
        _check_zones(self)

    @cached_property
    def zone_names(self) -> tuple[str, ...]:
        """The zones the groups use, in the order they first appear."""
        return tuple(dict.fromkeys(g.zone for g in self.groups))

    def zone_of(self, rank: int) -> str:
        """The zone of the node that holds ``rank``.

        Raises:
            ValueError: ``rank`` is outside 0 .. world_size - 1.
        """
        return self._locate(rank)[0].zone

    def wan_link(self, a: str, b: str) -> WanLink:
        """The link between zones ``a`` and ``b`` (two different zones of the cluster).

        Raises:
            KeyError: no link joins them.
        """
        for link in self.links:
            if set(link.zones) == {a, b}:
                return link
        raise KeyError(f"no link between zones {a!r} and {b!r}")

    def carbon_g_per_kwh(self, zone: str) -> float | None:
        """The grid intensity of ``zone`` in grams of CO2 per kWh, or None when the file gives none."""
        return next((z.carbon_g_per_kwh for z in self.zones if z.name == zone), None)

    @cached_property
    def world_size(self) -> int:
        """Number of devices (global ranks)."""
        return sum(g.num_devices for g in self.groups)

    @property
    def num_nodes(self) -> int:
        """Number of nodes over all groups."""
        return sum(g.num_nodes for g in self.groups)

    def device_types(self) -> list[str]:
        """Canonical device name of each global rank, in rank order."""
        return [g.device.name for g in self.groups for _ in range(g.num_devices)]

    def count_by_type(self) -> dict[str, int]:
        """Devices per canonical device name, in the order the types first appear."""
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.device.name] = counts.get(g.device.name, 0) + g.num_devices
        return counts

    def profile(self, device_type: str) -> DeviceProfile:
        """The profile this cluster's devices of ``device_type`` use (a measured one where given).

        Args:
            device_type: a device name, case-insensitively.

        Returns:
            The group's profile, or the built-in one when no group has that type.

        Raises:
            UnknownDeviceError: neither the cluster nor the built-ins know the name.
        """
        for g in self.groups:
            if g.device.name.lower() == device_type.strip().lower():
                return g.device
        return get_device(device_type)

    def node_of(self, rank: int) -> int:
        """Global index of the node that holds ``rank`` (nodes numbered in rank order).

        Raises:
            ValueError: ``rank`` is outside 0 .. world_size - 1.
        """
        return self._locate(rank)[1]

    def group_of(self, rank: int) -> NodeGroup:
        """The node group that holds ``rank``.

        Raises:
            ValueError: ``rank`` is outside 0 .. world_size - 1.
        """
        return self._locate(rank)[0]

    def nodes_of(self, ranks) -> tuple[np.ndarray, np.ndarray]:
        """(index in ``groups``, global node index) of each of ``ranks``, as arrays: ``group_of`` and
        ``node_of`` over many ranks at once.

        Raises:
            ValueError: a rank is outside 0 .. world_size - 1.
        """
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and not (0 <= ranks.min() and ranks.max() < self.world_size):
            raise ValueError(f"ranks {ranks.min()}..{ranks.max()} are out of range for world_size {self.world_size}")
        firsts = np.array([first for first, _, _ in self._group_starts])
        group = np.searchsorted(firsts, ranks, side="right") - 1
        first_node = np.array([node for _, node, _ in self._group_starts])[group]
        width = np.array([g.devices_per_node for g in self.groups])[group]
        return group, first_node + (ranks - firsts[group]) // width

    def devices_per_node_of(self, rank: int) -> int:
        """Devices on the node that holds ``rank``.

        Raises:
            ValueError: ``rank`` is outside 0 .. world_size - 1.
        """
        return self._locate(rank)[0].devices_per_node

    def ranks_of_node(self, node: int) -> range:
        """Global ranks on global node ``node``.

        Raises:
            ValueError: ``node`` is outside 0 .. num_nodes - 1.
        """
        first_rank, first_node = 0, 0
        for g in self.groups:
            if node < first_node + g.num_nodes:
                start = first_rank + (node - first_node) * g.devices_per_node
                return range(start, start + g.devices_per_node)
            first_rank += g.num_devices
            first_node += g.num_nodes
        raise ValueError(f"node {node} is out of range for a cluster of {self.num_nodes} nodes")

    @cached_property
    def _group_starts(self) -> tuple[tuple[int, int, NodeGroup], ...]:
        """(first rank, first node, group) of each group: the planner asks for ranks' places millions of times."""
        out, first_rank, first_node = [], 0, 0
        for g in self.groups:
            out.append((first_rank, first_node, g))
            first_rank += g.num_devices
            first_node += g.num_nodes
        return tuple(out)

    def _locate(self, rank: int) -> tuple[NodeGroup, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {self.world_size}")
        for first_rank, first_node, g in self._group_starts:
            if rank < first_rank + g.num_devices:
                return g, first_node + (rank - first_rank) // g.devices_per_node
        raise AssertionError("unreachable: rank checked against world_size")


def _check_zones(cluster: Cluster) -> None:
    """Raise ClusterSpecError unless the groups' zones are declared and every two of them are linked."""
    names = [z.name for z in cluster.zones]
    if len(set(names)) != len(names):
        raise ClusterSpecError(f"cluster '{cluster.spec}': zone names repeat: {', '.join(names)}")
    for z in cluster.zones:
        if z.carbon_g_per_kwh is not None and not z.carbon_g_per_kwh >= 0:
            raise ClusterSpecError(f"cluster '{cluster.spec}' zone {z.name!r}: carbon_g_per_kwh must be >= 0, got {z.carbon_g_per_kwh!r}")
    used = cluster.zone_names
    if names and not set(used) <= set(names):
        unknown = sorted(set(used) - set(names))
        raise ClusterSpecError(f"cluster '{cluster.spec}': groups name zones {', '.join(map(repr, unknown))} that no [[zone]] declares "
                               f"(declared: {', '.join(names)})")
    known = set(names or used)
    pairs = set()
    for link in cluster.links:
        a, b = link.zones
        if a == b or not {a, b} <= known:
            raise ClusterSpecError(f"cluster '{cluster.spec}': a link joins two different zones of the cluster ({', '.join(sorted(known))}), "
                                   f"got {a!r} and {b!r}")
        if frozenset((a, b)) in pairs:
            raise ClusterSpecError(f"cluster '{cluster.spec}': two links join zones {a!r} and {b!r}")
        if not (link.bw_bytes_per_s > 0 and link.latency_s >= 0):
            raise ClusterSpecError(f"cluster '{cluster.spec}': the link {a!r}-{b!r} needs gbps > 0 and latency_ms >= 0")
        pairs.add(frozenset((a, b)))
    for a, b in ((a, b) for i, a in enumerate(used) for b in used[i + 1:]):
        if frozenset((a, b)) not in pairs:
            raise ClusterSpecError(f"cluster '{cluster.spec}': zones {a!r} and {b!r} both hold nodes but no [[link]] joins them; "
                                   "add one with zones, gbps and latency_ms")


def parse_cluster(spec: str, profiles: Mapping[str, DeviceProfile] | None = None) -> Cluster:
    """Parse a cluster shorthand, or read a cluster TOML file.

    Args:
        spec: a shorthand such as ``2x8xA100-80GB+1x8xV100-32GB`` or ``4x8xA100-80GB@200gx8``,
            or the path of a ``.toml`` file (docs/cluster-format.md).
        profiles: device profiles that replace the built-in ones of the same name
            (case-insensitively), e.g. a profile ``hetpar profile`` measured.

    Returns:
        The cluster.

    Raises:
        ClusterSpecError: the shorthand or file is malformed, a count is zero, or a
            device type is unknown (the message lists the known ones).
    """
    text = spec.strip()
    if text.lower().endswith(".toml") or Path(text).is_file():
        cluster = _read_cluster_file(text)
    else:
        pieces = text.split("+")
        cluster = Cluster(spec=spec, groups=tuple(_parse_piece(piece.strip(), spec) for piece in pieces))
    return with_profiles(cluster, profiles or {})


def with_profiles(cluster: Cluster, profiles: Mapping[str, DeviceProfile]) -> Cluster:
    """``cluster`` with each group whose device is named in ``profiles`` on that profile.

    Link bandwidths a group took from its old profile's defaults follow the new one;
    values a cluster file set explicitly stay.

    Args:
        cluster: the cluster.
        profiles: device name -> profile (names compared case-insensitively).

    Returns:
        The new cluster (or ``cluster`` itself when nothing changes).
    """
    by_name = {name.strip().lower(): p for name, p in profiles.items()}
    if not any(g.device.name.lower() in by_name for g in cluster.groups):
        return cluster
    groups = []
    for g in cluster.groups:
        new = by_name.get(g.device.name.lower())
        if new is None:
            groups.append(g)
            continue
        old = g.device
        groups.append(replace(
            g, device=new,
            nic_bw_bytes_per_s=new.default_nic_bw_bytes_per_s if g.nic_bw_bytes_per_s == old.default_nic_bw_bytes_per_s else g.nic_bw_bytes_per_s,
            intra_node_bw_bytes_per_s=(new.node_link_bw_bytes_per_s if g.intra_node_bw_bytes_per_s == old.node_link_bw_bytes_per_s
                                       else g.intra_node_bw_bytes_per_s),
        ))
    return replace(cluster, groups=tuple(groups))


def _parse_piece(piece: str, spec: str) -> NodeGroup:
    """One ``[NODES x] DEVICES x TYPE[@RATEgxNICS]`` piece of a shorthand."""
    malformed = ClusterSpecError(f"malformed --cluster '{spec}'; expected {EXPECTED_FORM}")
    counts_and_type, at, nic = piece.partition("@")
    match = _COUNTS_AND_TYPE.match(counts_and_type.strip())
    if match is None:
        raise malformed
    device = _device(match["type"], piece, spec, malformed)
    nodes = _count(match["nodes"] or "1", "nodes", piece)
    devices = _count(match["devices"], "devices per node", piece)
    nic_bw, nics = device.default_nic_bw_bytes_per_s, device.default_nics_per_node
    if at:
        nic_match = _NIC.match(nic.strip())
        if nic_match is None:
            raise ClusterSpecError(
                f"malformed NIC part '@{nic}' in --cluster piece '{piece}'; expected @RATEgxNICS, e.g. @200gx8 "
                "(8 NICs of 200 Gb/s each)"
            )
        rate_gbps = float(nic_match["rate"])
        if rate_gbps <= 0:
            raise ClusterSpecError(f"NIC rate must be positive in --cluster piece '{piece}', got {nic_match['rate']} Gb/s")
        nic_bw, nics = rate_gbps * _GBPS, _count(nic_match["nics"], "NICs per node", piece)
    return NodeGroup(
        num_nodes=nodes,
        devices_per_node=devices,
        device=device,
        nic_bw_bytes_per_s=nic_bw,
        nics_per_node=nics,
        intra_node_bw_bytes_per_s=device.node_link_bw_bytes_per_s,
    )


def _device(name: str, piece: str, spec: str, malformed: ClusterSpecError) -> DeviceProfile:
    try:
        return get_device(name)
    except UnknownDeviceError as exc:
        # A type ending in a bare 'x' ("2xA100x") is a dangling separator, not a device name.
        if name.lower().endswith("x"):
            raise malformed from None
        raise ClusterSpecError(f"{exc} (in --cluster piece '{piece}')") from None


def _count(text: str, what: str, piece: str) -> int:
    value = int(text)
    if value < 1:
        raise ClusterSpecError(f"zero {what} in --cluster piece '{piece}'; every count must be at least 1")
    return value


# --- TOML files ------------------------------------------------------------------------


def _read_cluster_file(path_text: str) -> Cluster:
    path = Path(path_text)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterSpecError(f"cluster file '{path}' not found; pass a shorthand like 2x8xA100-80GB or a .toml path") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"cluster file '{path}' is not valid TOML: {exc}") from None
    return cluster_from_dict(data, spec=path_text)


def cluster_from_dict(data: dict[str, Any], *, spec: str) -> Cluster:
    """Build a cluster from parsed TOML: a list of ``[[group]]`` tables (docs/cluster-format.md).

    Args:
        data: the parsed file.
        spec: what to record as ``Cluster.spec`` (the file path).

    Returns:
        The cluster.

    Raises:
        ClusterSpecError: unknown or missing keys, bad values, or an unknown device type.
    """
    extra = sorted(set(data) - {"group", "zone", "link"})
    if extra:
        raise ClusterSpecError(f"cluster file '{spec}': unknown top-level keys {', '.join(extra)}; "
                               "only [[group]], [[zone]] and [[link]] tables are allowed")
    tables = data.get("group")
    if not isinstance(tables, list) or not tables:
        raise ClusterSpecError(f"cluster file '{spec}' has no [[group]] tables; see docs/cluster-format.md")
    groups = tuple(_group_from_table(table, index, spec) for index, table in enumerate(tables))
    for key in ("zone", "link"):
        if not isinstance(data.get(key, []), list):
            raise ClusterSpecError(f"cluster file '{spec}': {key} must be a list of [[{key}]] tables")
    zones = tuple(_zone_from_table(table, index, spec) for index, table in enumerate(data.get("zone", [])))
    links = tuple(_link_from_table(table, index, spec) for index, table in enumerate(data.get("link", [])))
    if (zones or any(g.zone for g in groups)) and any(not g.zone for g in groups):
        raise ClusterSpecError(f"cluster file '{spec}' has zones, so every [[group]] needs zone = the name of its site")
    return Cluster(spec=spec, groups=groups, zones=zones, links=links)


def _zone_from_table(table: Any, index: int, spec: str) -> Zone:
    where = f"cluster file '{spec}' zone {index}"
    if not isinstance(table, dict) or set(table) - set(_ZONE_KEYS) or not isinstance(table.get("name"), str) or not table["name"]:
        raise ClusterSpecError(f"{where}: a [[zone]] has a non-empty name and optionally carbon_g_per_kwh")
    carbon = table.get("carbon_g_per_kwh")
    if carbon is not None and (not isinstance(carbon, (int, float)) or isinstance(carbon, bool) or carbon < 0):
        raise ClusterSpecError(f"{where}: carbon_g_per_kwh must be a number >= 0 (grams of CO2 per kWh), got {carbon!r}")
    return Zone(name=table["name"], carbon_g_per_kwh=None if carbon is None else float(carbon))


def _link_from_table(table: Any, index: int, spec: str) -> WanLink:
    where = f"cluster file '{spec}' link {index}"
    if not isinstance(table, dict) or set(table) != set(_LINK_KEYS):
        raise ClusterSpecError(f"{where}: a [[link]] has exactly the keys {', '.join(_LINK_KEYS)}")
    zones, gbps, latency_ms = table["zones"], table["gbps"], table["latency_ms"]
    if not (isinstance(zones, list) and len(zones) == 2 and all(isinstance(z, str) for z in zones)):
        raise ClusterSpecError(f"{where}: zones must name two zones, e.g. zones = [\"eu\", \"us\"], got {zones!r}")
    for key, value, low in (("gbps", gbps, "> 0"), ("latency_ms", latency_ms, ">= 0")):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 if key == "gbps" else value >= 0):
            raise ClusterSpecError(f"{where}: {key} must be a number {low}, got {value!r}")
    return WanLink(zones=(zones[0], zones[1]), bw_bytes_per_s=gbps * _GBPS, latency_s=latency_ms / 1e3)


def _group_from_table(table: dict[str, Any], index: int, spec: str) -> NodeGroup:
    where = f"cluster file '{spec}' group {index}"
    extra = sorted(set(table) - set(_GROUP_KEYS))
    if extra:
        raise ClusterSpecError(f"{where}: unknown keys {', '.join(extra)}; allowed: {', '.join(_GROUP_KEYS)}")
    missing = [k for k in ("nodes", "devices_per_node", "device") if k not in table]
    if missing:
        raise ClusterSpecError(f"{where}: missing keys {', '.join(missing)}")
    try:
        device = get_device(str(table["device"]))
    except UnknownDeviceError as exc:
        raise ClusterSpecError(f"{where}: {exc}") from None
    for key in ("nodes", "devices_per_node", "nics_per_node"):
        if key in table and (not isinstance(table[key], int) or isinstance(table[key], bool) or table[key] < 1):
            raise ClusterSpecError(f"{where}: {key} must be an integer >= 1, got {table[key]!r}")
    for key in ("nic_gbps", "intra_node_gbps"):
        if key in table and (not isinstance(table[key], (int, float)) or table[key] <= 0):
            raise ClusterSpecError(f"{where}: {key} must be a positive number of Gb/s, got {table[key]!r}")
    price = table.get("usd_per_device_hour")
    if price is not None and (not isinstance(price, (int, float)) or isinstance(price, bool) or price < 0):
        raise ClusterSpecError(f"{where}: usd_per_device_hour must be a number >= 0 (US dollars per device-hour), got {price!r}")
    return NodeGroup(
        num_nodes=table["nodes"],
        devices_per_node=table["devices_per_node"],
        device=device,
        nic_bw_bytes_per_s=table["nic_gbps"] * _GBPS if "nic_gbps" in table else device.default_nic_bw_bytes_per_s,
        nics_per_node=table.get("nics_per_node", device.default_nics_per_node),
        intra_node_bw_bytes_per_s=(
            table["intra_node_gbps"] * _GBPS if "intra_node_gbps" in table else device.node_link_bw_bytes_per_s
        ),
        usd_per_device_hour=None if price is None else float(price),
        zone=_zone_name(table.get("zone", ""), where),
    )


def _zone_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ClusterSpecError(f"{where}: zone must be the name of a [[zone]], got {value!r}")
    return value


def cluster_to_toml(cluster: Cluster) -> str:
    """Write a cluster as a TOML file that ``parse_cluster`` reads back to the same groups.

    Args:
        cluster: the cluster.

    Returns:
        TOML text, one ``[[group]]`` table per node group, every key written out.
    """
    lines = [f"# hetpar cluster, {cluster.world_size} devices; format: docs/cluster-format.md"]
    for g in cluster.groups:
        lines += [
            "",
            "[[group]]",
            f"nodes = {g.num_nodes}",
            f"devices_per_node = {g.devices_per_node}",
            f'device = "{g.device.name}"',
            f"nic_gbps = {g.nic_bw_bytes_per_s / _GBPS!r}",
            f"nics_per_node = {g.nics_per_node}",
            f"intra_node_gbps = {g.intra_node_bw_bytes_per_s / _GBPS!r}",
        ]
        if g.usd_per_device_hour is not None:
            lines.append(f"usd_per_device_hour = {g.usd_per_device_hour!r}")
        if g.zone:
            lines.append(f'zone = "{g.zone}"')
    for z in cluster.zones:
        lines += ["", "[[zone]]", f'name = "{z.name}"']
        if z.carbon_g_per_kwh is not None:
            lines.append(f"carbon_g_per_kwh = {z.carbon_g_per_kwh!r}")
    for link in cluster.links:
        lines += ["", "[[link]]", f'zones = ["{link.zones[0]}", "{link.zones[1]}"]',
                  f"gbps = {link.bw_bytes_per_s / _GBPS!r}", f"latency_ms = {link.latency_s * 1e3!r}"]
    return "\n".join(lines) + "\n"
