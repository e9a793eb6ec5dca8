"""Which device type each rank runs on, checked against the plan at start-up.

[Note: rank device types]
A plan costs every global rank on one device type (``plan.cluster.device_types``,
names of hetpar's device profiles such as ``A100-80GB`` or ``cpu``). torchrun numbers
ranks ``node_rank * nproc_per_node + local_rank``, so which host runs which ranks is
decided by the node ranks the hosts are started with; on a mixed cluster a host
started with the wrong node rank would run layers costed for another device type,
slower or out of memory, without a word. So every rank finds out what it runs on:

- ``HETPAR_DEVICE_TYPE`` in its environment, when the launch environment sets it
  (a profile name; compared case-insensitively), else
- detection: ``cpu`` on a rank that computes on the CPU; on a GPU, torch's device
  name and memory, which match a profile name when the name holds its model
  (``A100`` in ``NVIDIA A100-SXM4-80GB``, as a whole word; the parts of a run-together
  model may stand apart, ``RTX4090`` in ``NVIDIA GeForce RTX 4090``, ``TitanRTX`` in
  ``NVIDIA TITAN RTX``; a variant word after it, ``Ti``, ``SUPER`` or ``D``, names
  another card: ``RTX 3090 Ti`` is not an ``RTX3090``) and the memory its size
  (``-80GB``: 0.85 x 80e9 to 1.05 x 80 GiB, so a MIG slice is another device).

The ranks gather what they found (one collective) and, when any differs from the
plan, every rank stops with the same one-line error, so no host waits for peers that
already left. ``--allow-device-mismatch`` turns that into one warning on rank 0.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV_VAR = "HETPAR_DEVICE_TYPE"
# Detected memory within [LOW * size * 1e9, HIGH * size * 2**30] of a "-<size>GB" type:
# vendors print either unit, and torch reports a little less than the whole memory.
_MEMORY_LOW, _MEMORY_HIGH = 0.85, 1.05
# Words after a model that make it another card with other numbers (GeForce RTX 3090 Ti,
# RTX 4090 D, RTX 2080 SUPER).
_VARIANT_WORDS = ("ti", "super", "d")


@dataclass(frozen=True, kw_only=True)
class FoundDevice:
    """What one rank runs on, as the launch environment or detection says."""

    name: str  # HETPAR_DEVICE_TYPE's value, "cpu", or torch's device name ("NVIDIA H200")
    memory_bytes: int | None = None  # detected accelerator memory; None when not detected
    source: str = "detected"  # "detected" or ENV_VAR
    host: str = ""

    def describe(self, as_type: str | None = None) -> str:
        """``cpu``, ``NVIDIA H200 (139.8 GiB)``, ``H200-141GB (NVIDIA H200, 139.8 GiB)`` when
        ``as_type`` names the profile it matches, or ``V100-32GB (from HETPAR_DEVICE_TYPE)``."""
        if self.source == ENV_VAR:
            return f"{self.name} (from {ENV_VAR})"
        if self.memory_bytes is None:
            return self.name
        detail = f"{self.name}, {self.memory_bytes / 2**30:.1f} GiB"
        return f"{as_type} ({detail})" if as_type else f"{self.name} ({self.memory_bytes / 2**30:.1f} GiB)"


def is_cpu_type(device_type: str) -> bool:
    """Whether a plan's device type is a CPU (the ``cpu`` profile or one measured from it)."""
    return device_type.strip().lower().startswith("cpu")


def needs_accelerator(device_types: list[str]) -> bool:
    """False when the plan puts every rank on a CPU: then the program computes on the
    CPU with gloo even on a host with GPUs, as the plan was costed."""
    return not all(is_cpu_type(t) for t in device_types)


def this_device(device: torch.device) -> FoundDevice:
    """What this process runs on; see [Note: rank device types]."""
    host = socket.gethostname()
    declared = os.environ.get(ENV_VAR, "").strip()
    if declared:
        return FoundDevice(name=declared, source=ENV_VAR, host=host)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return FoundDevice(name=props.name, memory_bytes=int(props.total_memory), host=host)
    return FoundDevice(name=device.type, host=host)


def matches(planned: str, found: FoundDevice) -> bool:
    """Whether ``found`` is the device type ``planned``; see [Note: rank device types]."""
    planned = planned.strip()
    if found.name.lower() == planned.lower():
        return True
    if found.source == ENV_VAR:
        return False
    if is_cpu_type(planned) or found.name == "cpu":
        return is_cpu_type(planned) and found.name == "cpu"
    model, size_gb = _model_and_size(planned)
    # The model as a whole word: A100 is not in A1000, H200 is not in GH200. A model
    # ending in a letter may carry a variant digit (Ascend910B2 is an Ascend910B).
    after = r"(?![a-z])" if model[-1:].isalpha() else r"(?![a-z0-9])"
    variant = rf"(?![ _-]?(?:{'|'.join(_VARIANT_WORDS)})\b)"
    if not re.search(rf"(?<![a-z0-9]){_model_pattern(model)}{after}{variant}", found.name.lower()):
        return False
    if size_gb is None or found.memory_bytes is None:
        return True
    return _MEMORY_LOW * size_gb * 1e9 <= found.memory_bytes <= _MEMORY_HIGH * size_gb * 2**30


def _model_pattern(model: str) -> str:
    """A regex for ``model`` as torch may spell it: its parts (letters, digits, a
    lower-to-upper case change) joined by an optional separator, so ``RTX4090``
    matches ``rtx 4090`` and ``TitanRTX`` matches ``titan rtx``."""
    parts = re.split(r"[ _-]+|(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])|(?<=[a-z])(?=[A-Z])", model)
    return "[ _-]?".join(re.escape(part.lower()) for part in parts if part)


def _model_and_size(device_type: str) -> tuple[str, int | None]:
    """``A100-80GB`` -> ``("A100", 80)``; ``MI300X`` -> ``("MI300X", None)``."""
    m = re.fullmatch(r"(.+?)-(\d+)GB", device_type, flags=re.IGNORECASE)
    return (m[1], int(m[2])) if m else (device_type, None)


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """A rank that runs on another device type than the plan's."""

    rank: int
    planned: str
    found: FoundDevice


def mismatches(planned_by_rank: list[str], found_by_rank: list[FoundDevice]) -> list[Mismatch]:
    """The ranks whose device is not the plan's, in rank order."""
    return [
        Mismatch(rank=r, planned=planned, found=found)
        for r, (planned, found) in enumerate(zip(planned_by_rank, found_by_rank, strict=True))
        if not matches(planned, found)
    ]


def mismatch_message(wrong: list[Mismatch], world_size: int, planned_by_rank: list[str], *, allowed: bool) -> str:
    """One line about the first mismatching rank (and how many more), and what to do."""
    first = wrong[0]
    known = [t for t in dict.fromkeys(planned_by_rank) if matches(t, first.found)]
    found = first.found.describe(known[0] if known else None)
    where = f" on host {first.found.host}" if first.found.host else ""
    more = f" ({len(wrong)} of {world_size} ranks differ)" if len(wrong) > 1 else ""
    head = f"rank {first.rank}{where} is planned for {first.planned} but runs on {found}{more}"
    if allowed:
        return f"warning: {head}; running anyway (--allow-device-mismatch), so the plan's predicted times do not hold"
    return (
        f"{head}; start the host of the n-th node of the cluster spec with node rank n (NODE_RANK for launch.sh, "
        f"the node order for Slurm), set {ENV_VAR} on hosts whose device is misdetected, "
        "or pass --allow-device-mismatch to run anyway"
    )


def check_device_types(planned_by_rank: list[str], device: torch.device, *, allow_mismatch: bool) -> None:
    """Compare every rank's device with the plan's type for it (collective).

    Every rank gathers what every rank found. On a mismatch every rank leaves the
    process group and exits with code 2; the first local rank of each host prints one
    line naming the first mismatching rank, its planned and its found type. With
    ``allow_mismatch`` rank 0 prints that as one warning instead and training goes on.

    Args:
        planned_by_rank: the plan's device type of each global rank
            (``plan.cluster.device_types``).
        device: the device this rank computes on.
        allow_mismatch: warn instead of stopping.
    """
    found_by_rank: list[FoundDevice | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found_by_rank, this_device(device))
    wrong = mismatches(planned_by_rank, found_by_rank)
    if not wrong:
        return
    message = mismatch_message(wrong, len(found_by_rank), planned_by_rank, allowed=allow_mismatch)
    if allow_mismatch:
        if dist.get_rank() == 0:
            print(f"hetpar: {message}", file=sys.stderr, flush=True)
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"hetpar: {message}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    raise SystemExit(2)


__all__ = [
    "ENV_VAR", "FoundDevice", "Mismatch", "check_device_types", "is_cpu_type", "matches", "mismatch_message",
    "mismatches", "needs_accelerator", "this_device",
]
