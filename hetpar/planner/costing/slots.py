"""Where a stage runs: the rank blocks of each pipeline rank (Megatron's layout, or a device
type's own blocks), and how stages of several tensor-parallel degrees pack a type's devices."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hetpar.planner.costing.candidate import Candidate
from hetpar.vocabulary import DType


@dataclass(frozen=True, kw_only=True)
class StageSlot:
    """Where a stage runs: its ranks and the device it is costed on."""

    ranks: list[list[int]]  # [data-parallel replica][tensor-parallel index]
    device_type: str
    memory_bytes: int


def _slot(ranks: list[list[int]], device_types: list[str], cluster) -> StageSlot:
    types = sorted({device_types[r] for rep in ranks for r in rep})
    profiles = [cluster.profile(t) for t in types]
    slowest = min(profiles, key=_peak)
    return StageSlot(ranks=ranks, device_type=slowest.name, memory_bytes=min(p.memory_bytes for p in profiles))


# Per pipeline rank: tensor-parallel degree -> where a stage of that degree is costed.
RankSlots = dict[int, StageSlot]


def _block(first: int, dp: int, tp: int) -> list[list[int]]:
    """Ranks of a stage block starting at ``first``: replica d, tensor-parallel index t at first + d tp + t."""
    return [[first + d * tp + t for t in range(tp)] for d in range(dp)]


def stage_slots(cluster, cand: Candidate) -> list[RankSlots]:
    """Megatron's rank layout, rank = s * dp * tp + d * tp + t, per offered degree; see [Note: split objective].

    With several degrees, rank s of degree tp is costed on the s-th block of dp * tp
    devices (cyclically): exact when every stage has that degree, representative
    otherwise ([Note: per-stage tensor parallelism]).
    """
    types = cluster.device_types()
    out: list[RankSlots] = [{} for _ in range(cand.pp)]
    for tp in cand.tp_degrees:
        size = cand.dp * tp
        blocks = cluster.world_size // size
        for s in range(cand.pp):
            if blocks:
                out[s][tp] = _slot(_block((s % blocks) * size, cand.dp, tp), types, cluster)
    return out


def type_slots(cluster, dp: int, tp: int) -> dict[str, list[StageSlot]]:
    """The stage-sized blocks of ``dp * tp`` devices each device type offers; see [Note: stage device types].

    Returns:
        Device type -> its blocks in listed order: as many whole blocks as fit, none
        where ``tp`` does not divide the type's node width.
    """
    return _type_slots(cluster, dp, tp)


@functools.lru_cache(maxsize=256)
def _type_slots(cluster, dp: int, tp: int) -> dict[str, list[StageSlot]]:
    size = dp * tp
    out = {}
    for device_type, ranks in ranks_by_type(cluster).items():
        if type_width(cluster, ranks) % tp:
            out[device_type] = []
            continue
        memory = cluster.profile(device_type).memory_bytes
        out[device_type] = [
            StageSlot(ranks=[ranks[i + d * tp : i + (d + 1) * tp] for d in range(dp)], device_type=device_type, memory_bytes=memory)
            for i in range(0, len(ranks) - size + 1, size)
        ]
    return out


def type_width(cluster, ranks: list[int]) -> int:
    """The largest tensor-parallel degree that tiles every node of these ranks: the gcd of their nodes' widths."""
    return math.gcd(*{cluster.devices_per_node_of(r) for r in ranks})


def ranks_by_type(cluster) -> dict[str, list[int]]:
    """Device type -> its global ranks, in the order the cluster lists them."""
    out: dict[str, list[int]] = {}
    for rank, device_type in enumerate(cluster.device_types()):
        out.setdefault(device_type, []).append(rank)
    return out


def pack_stage_ranks(ranks: list[int], dp: int, tps: list[int]) -> list[list[list[int]]]:
    """The ranks of stages of tensor-parallel degrees ``tps`` on the devices ``ranks`` of one type.

    Blocks of dp * tp devices are laid out largest degree first (ties in stage order),
    each starting where the last ended: with degrees that form a divisor chain every
    block starts at a multiple of its size, so a tensor-parallel group never crosses a
    node; see [Note: per-stage tensor parallelism]. One degree gives Megatron's layout.

    Returns:
        Per stage, in the order of ``tps``: ranks[d][t].
    """
    out: list[list[list[int]] | None] = [None] * len(tps)
    first = 0
    for s in sorted(range(len(tps)), key=lambda s: -tps[s]):
        out[s] = [ranks[first + d * tps[s] : first + (d + 1) * tps[s]] for d in range(dp)]
        first += dp * tps[s]
    return out


def _peak(profile) -> float:
    for dtype in (DType.BF16, DType.FP16, DType.FP32):
        try:
            return profile.peak_flops(dtype)
        except (KeyError, ValueError):
            continue
    return 0.0
