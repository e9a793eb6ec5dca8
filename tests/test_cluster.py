"""Cluster specs: the shorthand, TOML files, and rank-to-node bookkeeping."""

from pathlib import Path

import pytest

from hetpar.cost_models.cluster import Cluster, ClusterSpecError, cluster_to_toml, parse_cluster
from hetpar.cost_models.devices import get_device

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "mixed.toml"
GBPS = 1e9 / 8  # bytes per second in one Gb/s


def test_one_node_of_two_cpus():
    c = parse_cluster("1x2xcpu")
    assert c.world_size == 2 and c.num_nodes == 1
    assert c.device_types() == ["cpu", "cpu"]
    assert c.node_of(0) == c.node_of(1) == 0
    assert c.spec == "1x2xcpu"


def test_nodes_default_to_one():
    assert parse_cluster("2xcpu").groups == parse_cluster("1x2xcpu").groups


def test_mixed_shorthand_orders_ranks_group_node_device():
    c = parse_cluster("2x8xA100-80GB+1x8xV100-32GB")
    assert c.world_size == 24 and c.num_nodes == 3
    assert c.device_types() == ["A100-80GB"] * 16 + ["V100-32GB"] * 8
    assert [c.node_of(r) for r in (0, 7, 8, 15, 16, 23)] == [0, 0, 1, 1, 2, 2]
    assert c.group_of(16).device.name == "V100-32GB"
    assert c.group_of(15).device.name == "A100-80GB"
    assert c.devices_per_node_of(23) == 8
    assert c.count_by_type() == {"A100-80GB": 16, "V100-32GB": 8}
    assert list(c.ranks_of_node(1)) == list(range(8, 16))
    assert list(c.ranks_of_node(2)) == list(range(16, 24))


def test_default_nics_come_from_the_device():
    a100 = parse_cluster("2x8xA100-80GB").groups[0]
    assert a100.nic_bw_bytes_per_s == 200 * GBPS  # HDR
    assert a100.nics_per_node == 8
    assert a100.intra_node_bw_bytes_per_s == 300e9
    assert a100.device is get_device("A100-80GB")


def test_nic_override():
    g = parse_cluster("4x8xA100-80GB@200gx8").groups[0]
    assert (g.num_nodes, g.devices_per_node) == (4, 8)
    assert g.nic_bw_bytes_per_s == 25e9
    assert g.nics_per_node == 8
    assert g.node_nic_bw_bytes_per_s == 200e9


def test_two_groups_with_nics():
    c = parse_cluster("3x4xV100-16GB@10gx1+1x4xT4-16GB@50gx1")
    v100, t4 = c.groups
    assert (v100.num_nodes, v100.devices_per_node, v100.nic_bw_bytes_per_s, v100.nics_per_node) == (3, 4, 1.25e9, 1)
    assert (t4.num_nodes, t4.devices_per_node, t4.nic_bw_bytes_per_s, t4.nics_per_node) == (1, 4, 6.25e9, 1)
    assert c.world_size == 16
    assert c.node_of(11) == 2 and c.node_of(12) == 3
    assert c.group_of(12).device.name == "T4-16GB"


@pytest.mark.parametrize("rate", ["200g", "200G", "200gbps", "200Gbps", "200gb/s"])
def test_rate_spellings(rate):
    assert parse_cluster(f"1x8xA100-80GB@{rate}x4").groups[0].nic_bw_bytes_per_s == 25e9


def test_fractional_rate():
    assert parse_cluster("2x8xA100-80GB@12.5gx1").groups[0].nic_bw_bytes_per_s == 12.5 * GBPS


def test_case_and_spaces():
    c = parse_cluster(" 2X8Xa100-80gb + 1x8xv100-32gb ")
    assert c.device_types() == ["A100-80GB"] * 16 + ["V100-32GB"] * 8


@pytest.mark.parametrize("spec, name", [("1x8xMI300X", "MI300X"), ("8xMI250X", "MI250X"), ("4xmi300x", "MI300X")])
def test_device_names_that_contain_x(spec, name):
    assert set(parse_cluster(spec).device_types()) == {name}


MALFORMED = ["2xA100x", "", "+", "2x8xA100-80GB+", "2x8x", "x8xA100-80GB", "A100-80GB", "2x8x8xA100-80GB", "2 x 8 x A100"]


@pytest.mark.parametrize("spec", MALFORMED)
def test_malformed_shorthand(spec):
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster(spec)
    message = str(err.value)
    assert message == (
        f"malformed --cluster '{spec}'; expected [NODES x] DEVICES x TYPE[@RATEgxNICS] joined by '+', "
        "e.g. 2x8xA100-80GB+1x8xV100-32GB"
    )


@pytest.mark.parametrize("nic", ["@200", "@200x8", "@gx8", "@200mx8", "@200g", "@"])
def test_malformed_nic_part(nic):
    with pytest.raises(ClusterSpecError, match=r"malformed NIC part .* expected @RATEgxNICS, e\.g\. @200gx8"):
        parse_cluster(f"2x8xA100-80GB{nic}")


def test_unknown_device_lists_known():
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster("2x8xA100-80GB+2x8xA10")
    message = str(err.value)
    assert message.startswith("unknown device type 'A10'; did you mean A10-24GB? known: A10-24GB, A100-40GB, A100-80GB,")
    assert "V100-32GB" in message and "cpu" in message
    assert "in --cluster piece '2x8xA10'" in message


@pytest.mark.parametrize(
    "spec, what",
    [("0x8xA100-80GB", "zero nodes"), ("2x0xA100-80GB", "zero devices per node"), ("0xcpu", "zero devices per node"),
     ("2x8xA100-80GB@200gx0", "zero NICs per node")],
)
def test_zero_counts(spec, what):
    with pytest.raises(ClusterSpecError, match=f"^{what} in --cluster piece"):
        parse_cluster(spec)


def test_zero_rate():
    with pytest.raises(ClusterSpecError, match="NIC rate must be positive"):
        parse_cluster("2x8xA100-80GB@0gx8")


def test_rank_out_of_range():
    c = parse_cluster("2xcpu")
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        c.node_of(2)
    with pytest.raises(ValueError, match="rank -1"):
        c.group_of(-1)


# --- TOML ------------------------------------------------------------------------------


def test_example_file():
    c = parse_cluster(str(EXAMPLE))
    assert c.count_by_type() == {"A100-80GB": 16, "V100-32GB": 24, "T4-16GB": 4}
    a100, v100, t4 = c.groups
    assert a100.nic_bw_bytes_per_s == 25e9 and a100.nics_per_node == 8
    assert v100.nic_bw_bytes_per_s == 12.5e9 and v100.nics_per_node == 1
    assert t4.intra_node_bw_bytes_per_s == 8e9  # intra_node_gbps = 64
    assert v100.intra_node_bw_bytes_per_s == 150e9  # the device default
    assert c.spec == str(EXAMPLE)


@pytest.mark.parametrize(
    "spec", ["2x8xA100-80GB+1x8xV100-32GB", "3x4xV100-16GB@10gx1+1x4xT4-16GB@50gx1", "1x2xcpu", "8xMI250X@12.5gx3"]
)
def test_toml_round_trip(spec, tmp_path):
    original = parse_cluster(spec)
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_to_toml(original))
    again = parse_cluster(str(path))
    assert again.groups == original.groups
    assert again.device_types() == original.device_types()


def test_example_round_trip(tmp_path):
    original = parse_cluster(str(EXAMPLE))
    path = tmp_path / "again.toml"
    path.write_text(cluster_to_toml(original))
    assert parse_cluster(str(path)).groups == original.groups


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[[group]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A100-80GB"\nnic_gb = 100\n', "unknown keys nic_gb; allowed:"),
        ('[[group]]\nnodes = 1\ndevice = "A100-80GB"\n', "missing keys devices_per_node"),
        ('[[group]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A10"\n', "unknown device type 'A10'; did you mean A10-24GB? known:"),
        ('[[group]]\nnodes = 0\ndevices_per_node = 8\ndevice = "A100-80GB"\n', "nodes must be an integer >= 1"),
        ('[[group]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A100-80GB"\nnic_gbps = -1\n', "nic_gbps must be a positive"),
        ('name = "x"\n[[group]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A100-80GB"\n', "unknown top-level keys name"),
        ("# nothing\n", "has no [[group]] tables"),
        ("[[group]\n", "is not valid TOML"),
    ],
)
def test_bad_toml(tmp_path, text, message):
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster(_write(tmp_path, text))
    assert message in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="cluster file .* not found"):
        parse_cluster(str(tmp_path / "nope.toml"))


def test_clusters_are_hashable():
    assert hash(parse_cluster("2x8xA100-80GB")) == hash(parse_cluster("2x8xA100-80GB"))
    assert len({parse_cluster("2xcpu").groups, parse_cluster("1x2xcpu").groups}) == 1


def test_empty_cluster_is_an_error():
    with pytest.raises(ClusterSpecError, match="has no node groups"):
        Cluster(spec="x", groups=())
