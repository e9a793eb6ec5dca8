"""Device profiles: what one accelerator (or one CPU worker) can compute, hold and move.

Every profile is a TOML file in ``cost_models/profiles/`` so that each number sits next
to its public source; ``load_profile`` reads any such file (``hetpar profile`` writes
them for measured hosts). The file format and the sourcing rules are documented in
docs/devices.md.
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from hetpar.vocabulary import Precision
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).parent / "profiles"

INTRA_NODE_LINKS = ("nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "xgmi", "hccs", "shm")
COLLECTIVE_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")

# Spellings users and torch use for the same dtype; the profile keys are the values.
_DTYPE_ALIASES = {
    "float32": Precision.FP32,
    "float": Precision.FP32,
    "torch.float32": Precision.FP32,
    "bfloat16": Precision.BF16,
    "torch.bfloat16": Precision.BF16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "torch.float16": Precision.FP16,
    "tensorfloat32": Precision.TF32,
    "float8": Precision.FP8,
}
_REQUIRED_DTYPES = (Precision.FP32,)

_NUMERIC_FIELDS = (
    "memory_bytes",
    "mem_bw_bytes_per_s",
    "matmul_efficiency",
    "intra_node_bw_bytes_per_s",
    "intra_node_latency_s",
    "default_nic_bw_bytes_per_s",
    "default_nics_per_node",
    "inter_node_latency_s",
)
# Measured by ``hetpar profile`` (docs/profiling.md); absent from datasheet profiles but
# for ``op_overhead_s``, which the accelerator profiles state from public measurements.
_CALIBRATED_FIELDS = ("op_overhead_s", "step_overhead_s", "kernel_efficiency", "backward_kernel_efficiency",
                      "tp_module_overhead_s", "tp_collective_overhead_s", "grad_sync_scale", "optimizer_bytes_per_s",
                      "optimizer_tensor_overhead_s", "tp_optimizer_tensor_overhead_s", "weight_stream_bytes_per_s",
                      "matmul_narrow_width", "late_receive_s")
# Power draw: a datasheet's TDP, or measured (NVML); see [Note: energy model] in cost_models/energy.py.
_POWER_FIELDS = ("power_w", "idle_power_w")
# The host a device's training state may be offloaded to ([Note: offload costs] in
# cost_models/offload.py); None where the profile states no host.
_HOST_FIELDS = ("host_link_bw_bytes_per_s", "host_mem_bw_bytes_per_s")
_LINK_FIELDS = ("intra_node_peer_bw_bytes_per_s", "intra_node_staged_bw_bytes_per_s")
_OPTIONAL_NUMERIC_FIELDS = _LINK_FIELDS + _CALIBRATED_FIELDS + _POWER_FIELDS + _HOST_FIELDS
_STRING_FIELDS = ("name", "vendor", "intra_node_link")
_OPTIONAL_STRING_FIELDS = ("fingerprint",)
_TABLE_FIELDS = ("peak_flops_per_s", "collectives", "sources", "matmul_rows_efficiency", "matmul_narrow_efficiency",
                 "layer_corrections")
_ROWS_CURVES = ("forward", "backward")  # also the passes of a layer correction


class UnknownDeviceError(ValueError):
    """A device type name matches no built-in profile."""


class ProfileError(ValueError):
    """A device profile is inconsistent, or a profile file is malformed."""


@dataclass(frozen=True, kw_only=True)
class MeasuredCollective:
    """A measured alpha-beta fit of one collective: ``time_s = latency_s + nbytes / bw_bytes_per_s``.

    ``nbytes`` is the full tensor (the all-reduce buffer, the gathered output, the
    scattered input), as nccl-tests and torch's benchmarks count it. ``ranks`` is the
    group size the fit was measured at; other sizes are scaled by the algorithm's step
    and volume factors (see cost_models/collectives.py).
    """

    latency_s: float
    bw_bytes_per_s: float
    ranks: int

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bw_bytes_per_s <= 0 or self.ranks < 2:
            raise ProfileError(
                f"measured collective needs latency_s >= 0, bw_bytes_per_s > 0 and ranks >= 2; "
                f"got latency_s={self.latency_s}, bw_bytes_per_s={self.bw_bytes_per_s}, ranks={self.ranks}"
            )


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device type: peak compute per dtype, memory, and the links it usually sits on.

    Bandwidths are one direction, per device, in bytes per second (vendors often quote
    duplex, twice as much). ``sources`` maps each field name (``peak_flops_per_s.bf16``,
    ``collectives.all_reduce`` for table entries) to the public source of its value.
    """

    name: str  # canonical, e.g. "A100-80GB"
    vendor: str
    memory_bytes: int
    peak_flops_per_s: dict[str, float]  # dense; tensor-core rate where the device has one
    mem_bw_bytes_per_s: float
    matmul_efficiency: float  # achievable fraction of peak for large matmuls
    intra_node_link: str
    intra_node_bw_bytes_per_s: float  # per device, one direction, all peers together
    intra_node_latency_s: float  # per step of a ring or chain
    default_nic_bw_bytes_per_s: float  # one NIC, one direction
    default_nics_per_node: int
    inter_node_latency_s: float  # per step of a ring or tree across nodes
    sources: dict[str, str]
    # Point-to-point meshes (xGMI, HCCS) give each peer pair one link: a group of c
    # devices gets min(intra_node_bw, (c - 1) * peer_bw). None on switched fabrics.
    intra_node_peer_bw_bytes_per_s: float | None = None
    # Cards without PCIe peer-to-peer (GeForce under NVIDIA's driver): every GPU-to-GPU
    # copy is staged through host memory, at this measured rate per direction, and NCCL
    # rings and sends inside the node run at it ([Note: staged copies] in
    # cost_models/collectives.py). None where peers reach each other directly.
    intra_node_staged_bw_bytes_per_s: float | None = None
    collectives: dict[str, MeasuredCollective] = field(default_factory=dict)
    # Calibrated by `hetpar profile` on the host itself; None in datasheet profiles, where
    # cost_models/compute.py's defaults apply. See docs/profiling.md.
    # Dispatch, autograd and kernel-launch cost of one op, per pass; the accelerator
    # datasheet profiles state a public measurement (docs/devices.md).
    op_overhead_s: float | None = None
    step_overhead_s: float | None = None  # fixed per training step: data, loss all-reduce, optimizer calls
    # Fraction of the microbenchmark rates training kernels reach; None: the estimator's
    # global TRAINING_KERNEL_EFFICIENCY (fitted on published GPU runs). A measured
    # profile fits it on a reference training workload ([Note: calibrated fits] in
    # cost_models/calibrate.py), 1.0 without that timing.
    kernel_efficiency: float | None = None
    backward_kernel_efficiency: float | None = None  # the backward's, where measured apart; else kernel_efficiency
    tp_module_overhead_s: float | None = None  # per tensor-parallel module and micro-batch, fwd + bwd
    tp_collective_overhead_s: float | None = None  # per tensor-parallel collective, between kernels
    # Mean wait of a pipeline receive posted after its send while the sender computes
    # ([Note: late receives] in runtime/schedule.py); None: no such wait.
    late_receive_s: float | None = None
    # How many times its collectives' time the data-parallel synchronisation (the gradient
    # all-reduce, ZeRO's reduce-scatters and gathers) takes inside a training step; None: 1
    # ([Note: calibrated fits] in cost_models/calibrate.py).
    grad_sync_scale: float | None = None
    optimizer_bytes_per_s: float | None = None  # optimizer step, memory traffic per second
    optimizer_tensor_overhead_s: float | None = None  # optimizer step, per parameter tensor
    tp_optimizer_tensor_overhead_s: float | None = None  # ... and more per tensor-parallel (DTensor) one
    # Rate at which a layer's weights stream from memory each pass; None: they hide under
    # the FLOPs ([Note: weight traffic] in cost_models/compute.py).
    weight_stream_bytes_per_s: float | None = None
    fingerprint: str | None = None  # the host a measured profile was fitted on
    # Matmul throughput by row count, as fractions of peak_flops_per_s: {"forward": {rows:
    # efficiency}, "backward": {...}} ([Note: matmul rows] in planner.capture); measured
    # by `hetpar profile`, empty in datasheet profiles (every matmul at matmul_efficiency).
    matmul_rows_efficiency: dict[str, dict[int, float]] = field(default_factory=dict)
    # The same curves for matmuls of K = N = matmul_narrow_width (a narrow Linear's);
    # a matmul between the two widths interpolates (cost_models/compute.py
    # ``matmul_efficiency``). Both measured by `hetpar profile` since 2026-12-03.
    matmul_narrow_efficiency: dict[str, dict[int, float]] = field(default_factory=dict)
    matmul_narrow_width: int | None = None
    # Layers of a model timed on the host (`hetpar profile --model`): LayerProfile.cost_key
    # -> {"layer": its name, "forward": {micro-batch: measured / modelled seconds},
    # "backward": {...}} ([Note: measured layers] in cost_models/compute.py); empty otherwise.
    layer_corrections: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Watts one device draws while it computes (the datasheet's TDP, or measured), and while
    # it waits (None: cost_models.energy's stated fraction of power_w); None where no source.
    power_w: float | None = None
    idle_power_w: float | None = None
    # The link between one device and its host's memory, one direction (PCIe, NVLink-C2C),
    # and the host memory bandwidth one device's share of the host CPUs reaches (the
    # node's CPU memory bandwidth over its devices): what FSDP2's CPU offload moves over
    # and steps the optimizer at ([Note: offload costs] in cost_models/offload.py). None
    # where no source states the host; such a device is never offloaded.
    host_link_bw_bytes_per_s: float | None = None
    host_mem_bw_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _check_profile(self)

    def __hash__(self) -> int:
        # The dict fields are not hashable; equal profiles share a name, so clusters and
        # node groups holding a profile can still be set members and cache keys.
        return hash(self.name)

    @property
    def cpu_host(self) -> bool:
        """A CPU training worker: the ``cpu`` profile, or one `hetpar profile` measured from it."""
        return self.name.strip().lower().startswith("cpu")

    @property
    def node_link_bw_bytes_per_s(self) -> float:
        """What one device sends to the others of its node, one direction: the staged rate
        through host memory on a card without peer-to-peer, else ``intra_node_bw_bytes_per_s``."""
        return self.intra_node_staged_bw_bytes_per_s or self.intra_node_bw_bytes_per_s

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of this device in ``dtype``.

        Args:
            dtype: "fp32", "tf32", "bf16", "fp16" or "fp8"; torch spellings
                ("bfloat16", "torch.float16") are accepted too.

        Returns:
            Peak FLOP/s (not derated by ``matmul_efficiency``); for "tf32" on a device
            without TF32 tensor cores, its fp32 peak (torch's TF32 switch changes
            nothing there).

        Raises:
            ProfileError: the device has no such dtype, or the dtype is unknown.
        """
        key = normalize_dtype(dtype)
        if key in self.peak_flops_per_s:
            return self.peak_flops_per_s[key]
        if key == Precision.TF32 and Precision.FP32 in self.peak_flops_per_s:
            return self.peak_flops_per_s[Precision.FP32]  # no TF32 tensor cores (V100, T4, CPUs): fp32 matmuls run as fp32
        if key not in tuple(Precision):
            raise ProfileError(f"unknown dtype '{dtype}'; known: {', '.join(Precision)}")
        alternatives = [d for d in (Precision.BF16, Precision.FP16, Precision.FP32) if d in self.peak_flops_per_s]
        raise ProfileError(f"{self.name} has no {key}; use --dtype {alternatives[0]}")

    def achievable_matmul_flops(self, dtype: str) -> float:
        """Peak FLOP/s in ``dtype`` times ``matmul_efficiency``: what a large, well-shaped matmul reaches.

        Args:
            dtype: as for ``peak_flops``.

        Returns:
            Achievable FLOP/s.

        Raises:
            ProfileError: as for ``peak_flops``.
        """
        return self.peak_flops(dtype) * self.matmul_efficiency

    def source_keys(self) -> list[str]:
        """The keys ``sources`` must hold: every numeric field, each dtype and measured collective.

        Returns:
            Field names, table entries as ``table.key``.
        """
        keys = list(_NUMERIC_FIELDS) + ["intra_node_link"]
        keys += [k for k in _OPTIONAL_NUMERIC_FIELDS if getattr(self, k) is not None]
        keys += [f"peak_flops_per_s.{d}" for d in self.peak_flops_per_s]
        keys += [f"collectives.{c}" for c in self.collectives]
        keys += ["matmul_rows_efficiency"] if self.matmul_rows_efficiency else []
        keys += ["matmul_narrow_efficiency"] if self.matmul_narrow_efficiency else []
        keys += ["layer_corrections"] if self.layer_corrections else []
        return keys


def normalize_dtype(dtype: str) -> str:
    """Map a dtype spelling to a profile key.

    Args:
        dtype: e.g. "bf16", "bfloat16", "torch.bfloat16".

    Returns:
        The profile key, e.g. "bf16" (unknown spellings come back lower-cased).
    """
    key = str(dtype).strip().lower()
    return _DTYPE_ALIASES.get(key, key)


def _check_profile(p: DeviceProfile) -> None:
    """Raise ProfileError naming the first field of ``p`` that is out of range."""
    who = p.name or "<unnamed profile>"
    if not p.name or not p.vendor:
        raise ProfileError(f"{who}: name and vendor must be non-empty")
    positive = {
        "memory_bytes": p.memory_bytes,
        "mem_bw_bytes_per_s": p.mem_bw_bytes_per_s,
        "intra_node_bw_bytes_per_s": p.intra_node_bw_bytes_per_s,
        "default_nic_bw_bytes_per_s": p.default_nic_bw_bytes_per_s,
        "default_nics_per_node": p.default_nics_per_node,
    }
    for key, value in positive.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ProfileError(f"{who}: {key} must be a positive number, got {value!r}")
    if not isinstance(p.memory_bytes, int) or not isinstance(p.default_nics_per_node, int):
        raise ProfileError(f"{who}: memory_bytes and default_nics_per_node must be integers")
    for key in ("intra_node_latency_s", "inter_node_latency_s"):
        value = getattr(p, key)
        if not (isinstance(value, (int, float)) and value >= 0):
            raise ProfileError(f"{who}: {key} must be >= 0, got {value!r}")
    if not 0 < p.matmul_efficiency <= 1:
        raise ProfileError(f"{who}: matmul_efficiency must be in (0, 1], got {p.matmul_efficiency}")
    if p.intra_node_link not in INTRA_NODE_LINKS:
        raise ProfileError(
            f"{who}: unknown intra_node_link '{p.intra_node_link}'; known: {', '.join(INTRA_NODE_LINKS)}"
        )
    for key in _LINK_FIELDS:
        value = getattr(p, key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ProfileError(f"{who}: {key} must be a positive number of bytes per second when given, got {value!r}")
    for key in _CALIBRATED_FIELDS:
        value = getattr(p, key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ProfileError(f"{who}: {key} must be >= 0 when given, got {value!r}")
    for key in _POWER_FIELDS:
        value = getattr(p, key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ProfileError(f"{who}: {key} must be a positive number of watts when given, got {value!r}")
    for key in _HOST_FIELDS:
        value = getattr(p, key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ProfileError(f"{who}: {key} must be a positive number of bytes per second when given, got {value!r}")
    if p.idle_power_w is not None and (p.power_w is None or p.idle_power_w > p.power_w):
        raise ProfileError(f"{who}: idle_power_w ({p.idle_power_w} W) needs a power_w at least as large")
    for key in ("kernel_efficiency", "backward_kernel_efficiency"):
        value = getattr(p, key)
        if value is not None and not value > 0:
            raise ProfileError(f"{who}: {key} must be positive when given, got {value}")
    for table in ("matmul_rows_efficiency", "matmul_narrow_efficiency"):
        for curve, points in getattr(p, table).items():
            if curve not in _ROWS_CURVES:
                raise ProfileError(f"{who}: unknown {table} curve '{curve}'; known: {', '.join(_ROWS_CURVES)}")
            if not points or any(not (isinstance(r, int) and r >= 1 and 0 < e <= 1) for r, e in points.items()):
                raise ProfileError(f"{who}: {table}.{curve} needs rows >= 1 mapped to efficiencies in (0, 1]")
    if bool(p.matmul_narrow_efficiency) != (p.matmul_narrow_width is not None) or (
            p.matmul_narrow_efficiency and not p.matmul_rows_efficiency):
        raise ProfileError(f"{who}: matmul_narrow_efficiency needs matmul_narrow_width and matmul_rows_efficiency, "
                           "and matmul_narrow_width needs matmul_narrow_efficiency")
    if p.matmul_narrow_width is not None and not p.matmul_narrow_width >= 1:
        raise ProfileError(f"{who}: matmul_narrow_width must be at least 1, got {p.matmul_narrow_width}")
    for key, entry in p.layer_corrections.items():
        ratios = [r for curve in _ROWS_CURVES for r in entry.get(curve, {}).values()]
        if set(entry) - {"layer", *_ROWS_CURVES} or not all(entry.get(c) for c in _ROWS_CURVES) or not all(
                isinstance(r, float) and math.isfinite(r) and r > 0 for r in ratios):
            raise ProfileError(f"{who}: layer_corrections.{key} needs forward and backward tables of micro-batch = positive ratio")
    for dtype in _REQUIRED_DTYPES:
        if dtype not in p.peak_flops_per_s:
            raise ProfileError(f"{who}: peak_flops_per_s needs a '{dtype}' entry")
    for dtype, flops in p.peak_flops_per_s.items():
        if dtype not in tuple(Precision):
            raise ProfileError(f"{who}: unknown dtype '{dtype}' in peak_flops_per_s; known: {', '.join(Precision)}")
        if not flops > 0:
            raise ProfileError(f"{who}: peak_flops_per_s.{dtype} must be positive, got {flops!r}")
    for name in p.collectives:
        if name not in COLLECTIVE_NAMES:
            raise ProfileError(f"{who}: unknown collective '{name}'; known: {', '.join(COLLECTIVE_NAMES)}")
    missing = [k for k in p.source_keys() if not p.sources.get(k, "").strip()]
    if missing:
        raise ProfileError(f"{who}: no source for {', '.join(missing)}; add them under [sources]")


# --- Reading and writing profile files ---------------------------------------------


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a device profile file (a built-in one, or one ``hetpar profile`` wrote).

    Args:
        path: a .toml file, or a .json file with the same layout.

    Returns:
        The profile.

    Raises:
        ProfileError: the file is missing, not TOML, has unknown or missing keys, or a
            numeric field without a source.
    """
    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (FileNotFoundError, IsADirectoryError):
        raise ProfileError(f"device profile '{path}' not found") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"device profile '{path}' is not valid {path.suffix.lstrip('.').upper() or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"device profile '{path}' must hold a table of fields")
    try:
        return profile_from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"device profile '{path}': {exc}") from None


def profile_from_dict(data: dict[str, Any]) -> DeviceProfile:
    """Build a profile from parsed TOML (the layout of docs/devices.md).

    Args:
        data: the parsed file.

    Returns:
        The profile.

    Raises:
        ProfileError: unknown or missing keys, or values out of range.
    """
    allowed = set(_NUMERIC_FIELDS + _OPTIONAL_NUMERIC_FIELDS + _STRING_FIELDS + _OPTIONAL_STRING_FIELDS + _TABLE_FIELDS)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProfileError(f"unknown keys {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    required = _NUMERIC_FIELDS + _STRING_FIELDS + ("peak_flops_per_s", "sources")
    missing = [k for k in required if k not in data]
    if missing:
        raise ProfileError(f"missing keys {', '.join(missing)}")
    kwargs = {k: data[k] for k in _NUMERIC_FIELDS + _OPTIONAL_NUMERIC_FIELDS + _STRING_FIELDS + _OPTIONAL_STRING_FIELDS if k in data}
    kwargs["peak_flops_per_s"] = {k: float(v) for k, v in data["peak_flops_per_s"].items()}
    kwargs["collectives"] = {name: _measured_collective(name, fit) for name, fit in data.get("collectives", {}).items()}
    kwargs["matmul_rows_efficiency"] = _rows_curves(data.get("matmul_rows_efficiency", {}))
    kwargs["matmul_narrow_efficiency"] = _rows_curves(data.get("matmul_narrow_efficiency", {}), "matmul_narrow_efficiency")
    kwargs["layer_corrections"] = _layer_corrections(data.get("layer_corrections", {}))
    kwargs["sources"] = _flatten_sources(data["sources"])
    for key in ("mem_bw_bytes_per_s", "intra_node_bw_bytes_per_s", "default_nic_bw_bytes_per_s"):
        kwargs[key] = float(kwargs[key])
    return DeviceProfile(**kwargs)


def _measured_collective(name: str, fit: Any) -> MeasuredCollective:
    keys = {"latency_s", "bw_bytes_per_s", "ranks"}
    if not isinstance(fit, dict) or set(fit) != keys:
        raise ProfileError(f"[collectives.{name}] needs exactly the keys latency_s, bw_bytes_per_s, ranks")
    return MeasuredCollective(
        latency_s=float(fit["latency_s"]), bw_bytes_per_s=float(fit["bw_bytes_per_s"]), ranks=int(fit["ranks"])
    )


def _rows_curves(table: Any, name: str = "matmul_rows_efficiency") -> dict[str, dict[int, float]]:
    """``{"forward": {"4": 0.3, ...}}`` (TOML keys are strings) -> ``{"forward": {4: 0.3, ...}}``."""
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ProfileError(f"[{name}] needs sub-tables forward and backward of rows = efficiency")
    try:
        return {curve: {int(rows): float(e) for rows, e in points.items()} for curve, points in table.items()}
    except (TypeError, ValueError):
        raise ProfileError(f"[{name}] keys must be row counts and values efficiencies") from None


def _layer_corrections(table: Any) -> dict[str, dict[str, Any]]:
    """``{key: {"layer": name, "forward": {"4": 1.2}, ...}}`` with the micro-batch keys as ints."""
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ProfileError("[layer_corrections] needs one sub-table per measured layer")
    out: dict[str, dict[str, Any]] = {}
    try:
        for key, entry in table.items():
            out[key] = {name: (str(value) if name == "layer" else {int(b): float(r) for b, r in value.items()})
                        for name, value in entry.items()}
    except (TypeError, ValueError, AttributeError):
        raise ProfileError("[layer_corrections] tables map micro-batch sizes to ratios") from None
    return out


def _flatten_sources(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"peak_flops_per_s": {"bf16": "..."}}`` -> ``{"peak_flops_per_s.bf16": "..."}``."""
    flat: dict[str, str] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten_sources(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def dump_profile(profile: DeviceProfile) -> str:
    """Write a profile as TOML text that ``load_profile`` reads back to an equal profile.

    Args:
        profile: the profile.

    Returns:
        TOML text.
    """
    keys = _STRING_FIELDS + _OPTIONAL_STRING_FIELDS + _NUMERIC_FIELDS + _OPTIONAL_NUMERIC_FIELDS
    lines = [f"{k} = {_toml_value(getattr(profile, k))}" for k in keys if getattr(profile, k) is not None]
    lines += ["", "[peak_flops_per_s]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in profile.peak_flops_per_s.items()]
    for table in ("matmul_rows_efficiency", "matmul_narrow_efficiency"):
        for curve, points in getattr(profile, table).items():
            lines += ["", f"[{table}.{curve}]"]
            lines += [f'"{rows}" = {_toml_value(e)}' for rows, e in sorted(points.items())]
    for key, entry in profile.layer_corrections.items():
        if "layer" in entry:
            lines += ["", f"[layer_corrections.{key}]", f"layer = {_toml_value(entry['layer'])}"]
        for curve in _ROWS_CURVES:
            lines += ["", f"[layer_corrections.{key}.{curve}]"]
            lines += [f'"{b}" = {_toml_value(r)}' for b, r in sorted(entry[curve].items())]
    for name, fit in profile.collectives.items():
        lines += ["", f"[collectives.{name}]"]
        lines += [f"{k} = {_toml_value(getattr(fit, k))}" for k in ("latency_s", "bw_bytes_per_s", "ranks")]
    tables: dict[str, list[str]] = {"sources": []}
    for key, text in profile.sources.items():
        table, _, leaf = key.rpartition(".")
        tables.setdefault(f"sources.{table}" if table else "sources", []).append(f"{leaf} = {_toml_value(text)}")
    for table, entries in tables.items():
        lines += ["", f"[{table}]", *entries]
    return "\n".join(lines) + "\n"


def profile_to_dict(profile: DeviceProfile) -> dict[str, Any]:
    """The profile as plain data in the layout of the TOML files (for JSON profiles).

    Args:
        profile: the profile.

    Returns:
        What ``profile_from_dict`` reads back to an equal profile.
    """
    return tomllib.loads(dump_profile(profile))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


# --- Built-in profiles ---------------------------------------------------------------


@functools.cache
def _builtin_profiles() -> dict[str, DeviceProfile]:
    """Lower-cased canonical name -> profile, for every file in PROFILES_DIR."""
    profiles = {}
    for path in sorted(PROFILES_DIR.glob("*.toml")):
        profile = load_profile(path)
        profiles[profile.name.lower()] = profile
    return profiles


def known_devices() -> list[DeviceProfile]:
    """All built-in device profiles, sorted by name (case-insensitively).

    Returns:
        The profiles.
    """
    return sorted(_builtin_profiles().values(), key=lambda p: p.name.lower())


def get_device(name: str) -> DeviceProfile:
    """Look up a built-in profile by its canonical name, case-insensitively.

    Args:
        name: e.g. "A100-80GB", "a100-80gb", "cpu".

    Returns:
        The profile.

    Raises:
        UnknownDeviceError: no built-in profile has that name; the message lists them.
    """
    profile = _builtin_profiles().get(name.strip().lower())
    if profile is None:
        names = [p.name for p in known_devices()]
        close = [n for n in names if n.lower().startswith(name.strip().lower() + "-")]
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UnknownDeviceError(f"unknown device type '{name}'; {hint}known: {', '.join(names)}")
    return profile
