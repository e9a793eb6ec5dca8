"""Where an estimate's stages run and which layers they hold, and the checks of a configuration
against the model and the cluster.

[Note: estimate rank layout]
Without stage devices, ranks follow Megatron's order: rank = s * dp * tp + d * tp + t
(tensor-parallel innermost, then data-parallel, then pipeline) over the devices in the
order the cluster lists them. With stage devices, pipeline rank s takes the next
dp * tp devices of its type in cluster order, tensor-parallel innermost. A stage whose
ranks span device types runs at the pace of the slowest (lowest achievable matmul
rate in the training dtype) and must fit the smallest memory. With v virtual stages
(interleaved schedule), virtual stage k runs on pipeline rank k mod p.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.layers import LayerProfile, tp_misfit
from hetpar.cost_models.offload import offload_refusal
from hetpar.planner.costing import pack_stage_ranks
from hetpar.planner.estimate.config import EstimateConfig, EstimateError
from hetpar.planner.estimate.layer_split import StageSplit, bounds_from_sizes, default_split
from hetpar.planner.model_graph import ModelGraph


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """Where one pipeline rank runs; see [Note: estimate rank layout]."""

    ranks: list[list[int]]  # [data-parallel replica][tensor-parallel index]
    device_types: list[str]  # distinct, in rank order
    device_type: str  # the slowest, which sets the pace
    memory_bytes: int  # the smallest


def check_against(model: ModelGraph, cluster: Cluster, config: EstimateConfig) -> None:
    """Refuse a configuration that does not match the model or the cluster, naming every factor.

    Raises:
        EstimateError: degrees that do not multiply to the world size, a layer split that
            does not cover the model, more stages than layers, or tp > 1 on a model with
            no layer that tensor parallelism splits.
    """
    world, c = cluster.world_size, config
    rows, dp_text = c.replica_rows, f"dp({c.dp})" + (f" * cp({c.cp})" if c.cp > 1 else "")
    if c.stage_tp is not None and rows * c.devices_per_replica != world:
        raise EstimateError(f"{dp_text} * sum of stage tp({c.devices_per_replica}) = {rows * c.devices_per_replica} != world_size({world})")
    if c.stage_tp is None and rows * c.tp * c.pp != world:
        raise EstimateError(f"{dp_text} * tp({c.tp}) * pp({c.pp}) = {rows * c.tp * c.pp} != world_size({world})")
    if c.cp > 1:
        _check_context(model, c)
    offloading = [r for r in range(c.pp) if c.offload_of(r)]
    if offloading and c.zero_of(offloading[0]) != 3:
        raise EstimateError(f"--offload keeps ZeRO-3 shards in host memory: it needs --zero 3 (pipeline rank "
                            f"{offloading[0]} has ZeRO {c.zero_of(offloading[0])})")
    for device_type in sorted({t for r in offloading for t in (c.stage_devices[r:r + 1] if c.stage_devices else cluster.count_by_type())}):
        reason = offload_refusal(cluster.profile(device_type))
        if reason:
            raise EstimateError(f"--offload: {reason}; drop --offload")
    num_layers, chunks = len(model.layers), c.pp * c.virtual_stages
    if c.stage_layers is not None and sum(c.stage_layers) != num_layers:
        raise EstimateError(
            f"--stage-layers {','.join(map(str, c.stage_layers))} sums to {sum(c.stage_layers)}, the model has {num_layers} layers"
        )
    if chunks > num_layers:
        raise EstimateError(f"{chunks} pipeline stages but the model has only {num_layers} layers")
    if max(c.tp_of(r) for r in range(c.pp)) > 1 and not any(l.tp_capable for l in model.layers):
        raise EstimateError(f"--tp {c.tp}: the model has no layer that tensor parallelism can split")
    for k, (first, last) in enumerate(stage_split(model, c).bounds):
        tp = c.tp_of(k % c.pp)
        misfit = tp_misfit(model.layers[first : last + 1], tp)
        if misfit is not None:
            where = f"--tp {c.tp}" if c.stage_tp is None else f"stage {k} (tp {tp})"
            raise EstimateError(f"{where}: layer {misfit.name} splits only {_degrees(misfit)} ways (heads or features "
                                f"do not divide by {tp}); pick one of those")


def _check_context(model: ModelGraph, c: EstimateConfig) -> None:
    """Refuse context parallelism where it does not apply: a model without token inputs or
    attention, or a sequence that does not cut into 2 cp chunks."""
    if not model.context_capable:
        raise EstimateError(f"--cp {c.cp}: context parallelism splits the tokens of a model whose first input is token "
                            f"ids and whose layers attend; this model has no such input or attention")
    if model.sequence_length % (2 * c.cp):
        raise EstimateError(f"--cp {c.cp}: the sequence of {model.sequence_length} tokens does not cut into 2 * cp = "
                            f"{2 * c.cp} equal chunks; pick a cp that divides {model.sequence_length // 2}")


def _degrees(layer: LayerProfile) -> str:
    return ", ".join(map(str, layer.tp_degrees or ())) or "no"


def stage_devices_of(ranks: list[list[list[int]]], device_types: list[str]) -> tuple[str, ...] | None:
    """``EstimateConfig.stage_devices`` of a plan whose pipeline rank s runs on ``ranks[s]`` ([replica][tp index]):
    each rank's device type where every one runs on a single type of a mixed cluster; None where the cluster has
    one type or a stage spans types (Megatron's rank order over mixed devices, which None gives)."""
    per_rank = [{device_types[r] for replica in stage for r in replica} for stage in ranks]
    if len(set(device_types)) == 1 or any(len(types) > 1 for types in per_rank):
        return None
    return tuple(types.pop() for types in per_rank)


def stage_layout(cluster: Cluster, config: EstimateConfig) -> list[StageLayout]:
    """The ranks of each pipeline rank; see [Note: estimate rank layout].

    Raises:
        EstimateError: a stage device type the cluster lacks, or too few devices of a type.
    """
    c = config
    if c.stage_devices is None:
        groups = pack_stage_ranks(list(range(cluster.world_size)), c.replica_rows, [c.tp_of(s) for s in range(c.pp)])
    else:
        groups = _ranks_by_device(cluster, config)
    types = cluster.device_types()
    return [_describe(ranks, types, c.dtype, cluster) for ranks in groups]


def _ranks_by_device(cluster: Cluster, config: EstimateConfig) -> list[list[list[int]]]:
    types = cluster.device_types()
    wanted = [_canonical(name, cluster) for name in config.stage_devices]
    for name in dict.fromkeys(wanted):
        mine = [s for s, n in enumerate(wanted) if n == name]
        need = sum(config.replica_rows * config.tp_of(s) for s in mine)
        have = types.count(name)
        if need > have:
            each = f"dp({config.dp}) * tp({config.tp}) each" if config.stage_tp is None else f"dp({config.dp}) * their tp"
            raise EstimateError(f"--stage-devices puts {len(mine)} stages on {name}: {need} devices ({each}), the cluster has {have}")
    groups: list = [None] * len(wanted)
    for name in dict.fromkeys(wanted):
        mine = [s for s, n in enumerate(wanted) if n == name]
        free = [r for r, t in enumerate(types) if t == name]
        for s, ranks in zip(mine, pack_stage_ranks(free, config.replica_rows, [config.tp_of(s) for s in mine])):
            groups[s] = ranks
    return groups


def _canonical(name: str, cluster: Cluster) -> str:
    present = list(cluster.count_by_type())
    for known in present:
        if known.lower() == name.strip().lower():
            return known
    raise EstimateError(f"--stage-devices names {name!r}, which is not in the cluster ({', '.join(present)})")


def _describe(ranks: list[list[int]], types: list[str], dtype: str, cluster: Cluster) -> StageLayout:
    present = list(dict.fromkeys(types[r] for replica in ranks for r in replica))
    profiles = [cluster.profile(t) for t in present]
    slowest = min(profiles, key=lambda p: p.achievable_matmul_flops(dtype))
    return StageLayout(
        ranks=ranks, device_types=present, device_type=slowest.name, memory_bytes=min(p.memory_bytes for p in profiles)
    )


def stage_split(model: ModelGraph, config: EstimateConfig) -> StageSplit:
    """(first, last) layer of each virtual stage: the user's split, or Megatron's ([Note: default stage split])."""
    if config.stage_layers is None:
        return default_split(model.layers, config.pp * config.virtual_stages)
    return StageSplit(bounds=bounds_from_sizes(config.stage_layers), layout="--stage-layers")
