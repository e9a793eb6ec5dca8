"""Device profiles: every built-in profile loads, is sourced, and looks up case-insensitively."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hetpar.cost_models.devices import (
    DeviceProfile,
    ProfileError,
    UnknownDeviceError,
    dump_profile,
    get_device,
    known_devices,
    load_profile,
)

# The GPUs people also train on: workstation, GeForce and PCIe data-center cards.
PCIE_GPUS = [
    "RTX2080Ti-11GB", "TitanRTX-24GB", "RTX3090-24GB", "RTX4090-24GB", "A10-24GB", "A40-48GB", "A6000-48GB",
    "L4-24GB", "L40S-48GB",
]
CANONICAL = [
    "V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "GH200-96GB",
    "T4-16GB", "MI250X", "MI300X", "Ascend910", "Ascend910B", "cpu", *PCIE_GPUS,
]
GiB = 2**30
MiB = 2**20
GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")


def _numeric_source_keys(profile: DeviceProfile) -> list[str]:
    """Every numeric field of ``profile``, spelled as its [sources] key."""
    keys = []
    for f in dataclasses.fields(profile):
        value = getattr(profile, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            keys.append(f.name)
        elif isinstance(value, dict) and f.name != "sources":
            keys += [f"{f.name}.{k}" for k in value]
    return keys


def test_every_canonical_device_is_built_in():
    assert sorted(p.name for p in known_devices()) == sorted(CANONICAL)


@pytest.mark.parametrize("name", CANONICAL)
def test_every_numeric_field_has_a_source(name):
    profile = get_device(name)
    for key in _numeric_source_keys(profile) + ["intra_node_link"]:
        assert profile.sources.get(key, "").strip(), f"{name}: no source for {key}"


@pytest.mark.parametrize("name", CANONICAL)
def test_profiles_are_plausible(name):
    p = get_device(name)
    assert p.memory_bytes > 0 and p.mem_bw_bytes_per_s > 0
    assert 0 < p.matmul_efficiency <= 1
    assert "fp32" in p.peak_flops_per_s
    assert "bf16" in p.peak_flops_per_s or "fp16" in p.peak_flops_per_s
    # Tensor-core rates are never below the plain FP32 rate.
    for dtype in ("bf16", "fp16"):
        if dtype in p.peak_flops_per_s:
            assert p.peak_flops_per_s[dtype] >= p.peak_flops_per_s["fp32"]


def test_datasheet_numbers():
    a100 = get_device("A100-80GB")
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("fp32") == 19.5e12
    assert a100.memory_bytes == 80 * GiB
    assert a100.mem_bw_bytes_per_s == 2.039e12
    assert a100.intra_node_bw_bytes_per_s == 300e9
    assert a100.achievable_matmul_flops("bf16") == pytest.approx(312e12 * 0.869)
    assert get_device("H100-80GB").peak_flops("bf16") == 989e12
    assert get_device("MI250X").peak_flops("bf16") == 383e12 / 2  # per GCD
    assert get_device("MI300X").matmul_efficiency == pytest.approx(668.4 / 1300, abs=1e-3)


def test_cpu_profile_is_this_machine_measured():
    cpu = get_device("cpu")
    assert cpu.peak_flops("fp32") == 187e9
    assert cpu.peak_flops("bf16") == cpu.peak_flops("fp16") == 187e9
    assert cpu.mem_bw_bytes_per_s == 6.9e9
    assert cpu.memory_bytes == 8 * GiB
    assert cpu.intra_node_link == "shm"
    fits = {name: (c.latency_s, c.bw_bytes_per_s, c.ranks) for name, c in cpu.collectives.items()}
    assert fits == {
        "all_reduce": (189e-6, 1.33e9, 2),
        "all_gather": (199e-6, 1.7e9, 2),
        "reduce_scatter": (257e-6, 1.1e9, 2),
        "p2p": (57e-6, 3.0e9, 2),
    }
    assert "measured on this machine" in cpu.sources["collectives.all_reduce"]


def test_numbers_without_a_public_source_say_so():
    b = get_device("Ascend910B")
    for key in ("mem_bw_bytes_per_s", "peak_flops_per_s.bf16", "peak_flops_per_s.fp32", "intra_node_bw_bytes_per_s"):
        assert "not found" in b.sources[key], key
    a = get_device("Ascend910")
    for key in ("mem_bw_bytes_per_s", "peak_flops_per_s.fp32"):
        assert "not found" in a.sources[key], key


@pytest.mark.parametrize("spelling", ["a100-80gb", "A100-80GB", "a100-80GB", "  A100-80gb "])
def test_lookup_is_case_insensitive(spelling):
    assert get_device(spelling) is get_device("A100-80GB")


def test_cpu_lookup_any_case():
    assert get_device("CPU").name == "cpu"


def test_unknown_device_lists_known_names():
    with pytest.raises(UnknownDeviceError) as err:
        get_device("A10")
    message = str(err.value)
    assert message.startswith("unknown device type 'A10'; did you mean A10-24GB? known: ")
    for name in CANONICAL:
        assert name in message
    assert "\n" not in message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", ["V100-32GB", "V100-16GB", "T4-16GB", "RTX2080Ti-11GB", "TitanRTX-24GB"])
def test_no_bf16_points_at_fp16(name):
    with pytest.raises(ProfileError, match=rf"^{name} has no bf16; use --dtype fp16$"):
        get_device(name).peak_flops("bf16")


def test_dtype_spellings():
    h100 = get_device("H100-80GB")
    assert h100.peak_flops("bfloat16") == h100.peak_flops("torch.bfloat16") == 989e12
    assert h100.peak_flops("float32") == 67.0e12
    with pytest.raises(ProfileError, match="unknown dtype 'int4'"):
        h100.peak_flops("int4")


@pytest.mark.parametrize("name", CANONICAL)
def test_dump_and_load_round_trip(name, tmp_path):
    profile = get_device(name)
    path = tmp_path / "profile.toml"
    path.write_text(dump_profile(profile))
    assert load_profile(path) == profile


def _valid_text() -> str:
    return dump_profile(get_device("A100-80GB"))


def test_load_rejects_a_value_without_source(tmp_path):
    lines = [line for line in _valid_text().splitlines() if not line.startswith('mem_bw_bytes_per_s = "')]
    path = tmp_path / "p.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=r"no source for mem_bw_bytes_per_s; add them under \[sources\]"):
        load_profile(path)


def test_load_rejects_unknown_and_missing_keys(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("tflops = 3\n" + _valid_text())
    with pytest.raises(ProfileError, match="unknown keys tflops"):
        load_profile(path)
    path.write_text("\n".join(l for l in _valid_text().splitlines() if l != "memory_bytes = 85899345920") + "\n")
    with pytest.raises(ProfileError, match="missing keys memory_bytes"):
        load_profile(path)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ProfileError, match="is not valid TOML"):
        load_profile(bad)


def test_profile_checks_ranges():
    fields = {f.name: getattr(get_device("A100-80GB"), f.name) for f in dataclasses.fields(DeviceProfile)}
    with pytest.raises(ProfileError, match="matmul_efficiency must be in \\(0, 1\\]"):
        DeviceProfile(**{**fields, "matmul_efficiency": 1.5})
    with pytest.raises(ProfileError, match="unknown intra_node_link 'infiniband'"):
        DeviceProfile(**{**fields, "intra_node_link": "infiniband"})
    with pytest.raises(ProfileError, match="mem_bw_bytes_per_s must be a positive number"):
        DeviceProfile(**{**fields, "mem_bw_bytes_per_s": math.nan})


# --- PCIe, workstation and GeForce GPUs ------------------------------------------------

# Dense tensor FLOP/s with FP32 accumulation (what PyTorch's matmuls use), as the
# profiles cite them: GeForce cards run it at half their FP16-accumulate headline.
PCIE_DATASHEET = {
    # name: (fp32, bf16 or None, fp16, memory GiB, memory bandwidth, intra-node link)
    "RTX2080Ti-11GB": (13.4e12, None, 53.8e12, 11, 616e9, "pcie3"),
    "TitanRTX-24GB": (16.3e12, None, 130.5e12, 24, 672e9, "pcie3"),
    "RTX3090-24GB": (35.6e12, 71e12, 71e12, 24, 936e9, "pcie4"),
    "RTX4090-24GB": (82.6e12, 165.2e12, 165.2e12, 24, 1008e9, "pcie4"),
    "A10-24GB": (31.2e12, 125e12, 125e12, 24, 600e9, "pcie4"),
    "A40-48GB": (37.4e12, 149.7e12, 149.7e12, 48, 696e9, "pcie4"),
    "A6000-48GB": (38.7e12, 154.8e12, 154.8e12, 48, 768e9, "pcie4"),
    "L4-24GB": (30.3e12, 121e12, 121e12, 24, 300e9, "pcie4"),
    "L40S-48GB": (91.6e12, 362.05e12, 362.05e12, 48, 864e9, "pcie4"),
}
SOURCE_TAGS = ("[P]", "[S]", "[D]", "[P/S]", "[assumed]")


@pytest.mark.parametrize("name", PCIE_GPUS)
def test_pcie_gpu_datasheet_numbers(name):
    fp32, bf16, fp16, memory_gib, mem_bw, link = PCIE_DATASHEET[name]
    p = get_device(name)
    assert p.peak_flops("fp32") == fp32
    assert p.peak_flops("fp16") == fp16
    assert p.peak_flops_per_s.get("bf16") == bf16
    assert p.memory_bytes == memory_gib * GiB
    assert p.mem_bw_bytes_per_s == mem_bw
    assert p.intra_node_link == link


@pytest.mark.parametrize("name", PCIE_GPUS)
def test_pcie_gpu_sources_are_tagged(name):
    """Every number says where it comes from, and an assumed one says so."""
    p = get_device(name)
    for key in p.source_keys():
        assert p.sources[key].startswith(SOURCE_TAGS), f"{name}: {key} has no source tag"
    assert "[assumed]" in p.sources["default_nic_bw_bytes_per_s"]


def test_geforce_rates_are_the_fp32_accumulate_ones():
    """The GeForce headline FP16 rates accumulate in FP16; PyTorch accumulates in FP32, at half."""
    for name in ("RTX2080Ti-11GB", "RTX3090-24GB", "RTX4090-24GB"):
        assert "fp32 accumulate" in get_device(name).sources["peak_flops_per_s.fp16"].lower(), name


# torch.cuda.get_device_properties(...).name and total_memory as these cards report them
# (nvidia-smi's totals where a public GPU catalogue lists one, else the nominal size).
TORCH_NAMES = {
    "RTX2080Ti-11GB": ("NVIDIA GeForce RTX 2080 Ti", 11264 * MiB),
    "TitanRTX-24GB": ("NVIDIA TITAN RTX", 25396576256),
    "RTX3090-24GB": ("NVIDIA GeForce RTX 3090", 24576 * MiB),
    "RTX4090-24GB": ("NVIDIA GeForce RTX 4090", 24564 * MiB),
    "A10-24GB": ("NVIDIA A10", 24576 * MiB),
    "A40-48GB": ("NVIDIA A40", 49152 * MiB),
    "A6000-48GB": ("NVIDIA RTX A6000", 49140 * MiB),
    "L4-24GB": ("NVIDIA L4", 23034 * MiB),
    "L40S-48GB": ("NVIDIA L40S", 46068 * MiB),
}


@pytest.mark.parametrize("name", PCIE_GPUS)
def test_torch_device_name_matches_exactly_its_profile(name):
    from hetpar.runtime.devices import FoundDevice, matches

    torch_name, memory_bytes = TORCH_NAMES[name]
    found = FoundDevice(name=torch_name, memory_bytes=memory_bytes)
    assert [p.name for p in known_devices() if matches(p.name, found)] == [name]
    # Older drivers leave out the "NVIDIA " prefix.
    assert matches(name, FoundDevice(name=torch_name.removeprefix("NVIDIA "), memory_bytes=memory_bytes))


@pytest.mark.parametrize("torch_name", [
    "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D", "NVIDIA A10G", "NVIDIA L40",
    "NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX A4000", "NVIDIA GeForce RTX 2080 SUPER",
])
def test_other_cards_of_a_family_match_no_profile(torch_name):
    """A variant with other numbers is not planned as its sibling."""
    from hetpar.runtime.devices import FoundDevice, matches

    found = FoundDevice(name=torch_name, memory_bytes=24 * GiB)
    assert [p.name for p in known_devices() if matches(p.name, found)] == []


def test_clusters_with_a_card_without_bf16_default_to_fp16():
    from hetpar.commands.common import default_dtype

    assert default_dtype(["RTX2080Ti-11GB"]) == "fp16"
    assert default_dtype(["RTX4090-24GB", "TitanRTX-24GB"]) == "fp16"
    assert default_dtype(["RTX4090-24GB", "L40S-48GB"]) == "bf16"


def test_plan_on_rtx_2080_ti_picks_fp16_by_default(tmp_path):
    from tests.cli_helpers import hetpar

    out = tmp_path / "plan.json"
    result = hetpar("plan", GPT, "-c", "1x4xRTX2080Ti-11GB", "-b", "8", "-a", "n_layers=2",
                    "-a", "hidden=32", "-a", "seq_len=8", "-a", "vocab=64", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["dtype"] == "fp16"


@pytest.fixture(scope="module")
def small_gpt():
    from hetpar.planner.capture import trace_model
    from hetpar.runtime.model_file import load_model_file

    return trace_model(load_model_file(GPT, {"n_layers": 4, "hidden": 64, "seq_len": 16, "vocab": 128}))


@pytest.mark.parametrize("name", PCIE_GPUS)
def test_plan_on_a_cluster_of_each_pcie_gpu(name, small_gpt):
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.commands.common import default_dtype
    from hetpar.planner.api import plan_graph
    from hetpar.planner.options import SearchOptions

    dtype = default_dtype([name])
    plan = plan_graph(small_gpt, parse_cluster(f"2x4x{name}"), SearchOptions(global_batch_size=16, dtype=dtype, workers=1))
    assert plan.dtype == dtype == ("bf16" if "bf16" in get_device(name).peak_flops_per_s else "fp16")
    assert {s.device_type for s in plan.stages} == {name}
    assert plan.predicted.step_time_s > 0
