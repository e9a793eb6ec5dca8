"""Device profiles: every built-in profile loads, is sourced, and looks up case-insensitively."""

import dataclasses
import math

import pytest

from cost_models.devices import (
    DeviceProfile,
    ProfileError,
    UnknownDeviceError,
    dump_profile,
    get_device,
    known_devices,
    load_profile,
)

CANONICAL = [
    "V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "GH200-96GB",
    "T4-16GB", "MI250X", "MI300X", "Ascend910", "Ascend910B", "cpu",
]
GiB = 2**30


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
    assert message.startswith("unknown device type 'A10'; known: ")
    for name in CANONICAL:
        assert name in message
    assert "\n" not in message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", ["V100-32GB", "V100-16GB", "T4-16GB"])
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
