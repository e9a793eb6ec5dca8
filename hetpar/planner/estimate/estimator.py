"""Estimate a plan the user gives: step time, memory per stage, throughput and MFU.

``estimate(model, cluster, config)`` scores one configuration (what-if: "what would my
hand-tuned Megatron setting do?") without searching. It lays ranks out, costs every
layer on its stage's device ([Note: layer time] in cost_models/compute.py), plays the
pipeline schedule action by action (``runtime.schedule.simulate_timed``) with
point-to-point transfers between stages, adds the data-parallel gradient
synchronisation that the schedule does not hide and the optimizer step, and counts
memory per stage with ZeRO, recompute and the schedule's in-flight micro-batches
(cost_models/memory.py). ``hetpar estimate`` wraps it.

[Note: estimate time breakdown]
The step is the pipeline's makespan (the last rank's last action), plus what the
data-parallel synchronisation after each rank's last backward adds to it, plus the
optimizer step. It is split on the busiest pipeline rank, the bottleneck, exactly:
compute (its actions' kernels), tensor-parallel communication (the all-reduces inside
its actions, run between kernels as Megatron does), pipeline communication (how much
later it finishes with transfers than without), bubble (the rest of the makespan: its
warm-up, cool-down and waits), data-parallel communication (the gradient all-reduce,
or ZeRO's reduce-scatter and all-gather; with ``overlap_grad_reduce`` the last backward
hides up to its own length of it; ZeRO-3's per-micro-batch gathers and reduce-scatters
count in full, as the generated program runs them around a stage's compute, not under
it) and the optimizer step.

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

import functools
from dataclasses import asdict, dataclass

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.collectives import (
    all_gather_time_s, all_reduce_time_s, grad_sync_scale, reduce_scatter_time_s, tensor_parallel_pass_s,
)
from hetpar.cost_models.compute import dtype_bytes, layer_timing, optimizer_rates
from hetpar.cost_models.devices import DeviceProfile
from hetpar.cost_models.grad_sync import PLAIN, SyncMethod, collective_over, sync_seconds
from hetpar.cost_models.layers import LayerProfile, tp_misfit
from hetpar.cost_models.memory import (
    OPTIMIZER_BYTES_PER_PARAM,
    OPTIMIZERS,
    RECOMPUTE_CHOICES,
    WEIGHT_GRAD_ACTIVATION_SHARE,
    MemoryBreakdown,
    activation_bytes_per_microbatch,
    recompute_workspace_bytes,
    training_state_bytes,
)
from hetpar.cost_models.pipeline import SCHEDULES
from hetpar.planner.plan import Predicted
from hetpar.planner.costs import boundary_seconds, pack_stage_ranks
from hetpar.planner.options import PlanningError
from hetpar.planner.default_split import StageSplit, default_split
from hetpar.planner.split_model import bounds_from_sizes
from hetpar.planner.trace import ModelGraph
from hetpar.runtime.schedule import Action, Kind, ScheduleError, TimedRun, build_schedule, simulate_timed



class EstimateError(PlanningError):
    """A configuration that cannot be estimated; the message names the inconsistent inputs."""


@dataclass(frozen=True, kw_only=True)
class EstimateConfig:
    """One parallel configuration, as ``hetpar estimate`` takes it; checks itself on construction."""

    global_batch_size: int
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    dtype: str
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    zero_stage: int = 0
    optimizer: str = "adamw"
    stage_layers: tuple[int, ...] | None = None  # layers per virtual stage, p * v entries
    stage_devices: tuple[str, ...] | None = None  # device type per pipeline rank, p entries
    stage_recompute: tuple[str, ...] | None = None  # recompute per virtual stage, p * v entries; ``recompute`` for all when None
    stage_zero: tuple[int, ...] | None = None  # ZeRO stage per pipeline rank, p entries; ``zero_stage`` for all when None
    stage_tp: tuple[int, ...] | None = None  # tensor-parallel degree per pipeline rank, p entries; ``tp`` for all when None
    replica_batch_shares: tuple[int, ...] | None = None  # micro-batch size per replica (dp entries); ``micro_batch_size`` each when None
    scatter_gather: bool = True  # Megatron's p2p optimisation (Narayanan et al. 2021, section 4.1)
    overlap_grad_reduce: bool = False
    kernel_efficiency: float | None = None  # None: each device's own (cost_models.compute.training_efficiency)
    sync: SyncMethod = PLAIN  # how the replicas agree under zero_stage 0 ([Note: sync method costs])

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "dp", "tp", "pp", "micro_batch_size", "virtual_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise EstimateError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        self._check_choices()
        per_step = self.dp * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise EstimateError(
                f"global batch {self.global_batch_size} is not a multiple of dp({self.dp}) * "
                f"micro_batch_size({self.micro_batch_size}) = {per_step}"
            )
        if self.schedule == "interleaved" and self.num_microbatches % self.pp:
            raise EstimateError(
                f"the interleaved schedule needs micro-batches ({self.num_microbatches}) to be a multiple of pp({self.pp})"
            )
        self._check_stage_lists()

    def _check_choices(self) -> None:
        choices = (
            ("schedule", self.schedule, SCHEDULES),
            ("recompute", self.recompute, RECOMPUTE_CHOICES),
            ("zero", self.zero_stage, (0, 1, 2, 3)),
            ("optimizer", self.optimizer, OPTIMIZERS),
        )
        for name, value, allowed in choices:
            if value not in allowed:
                raise EstimateError(f"unknown {name} {value!r}; use one of {', '.join(str(a) for a in allowed)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise EstimateError(f"virtual stages ({self.virtual_stages}) need --schedule interleaved, not {self.schedule}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise EstimateError(f"unknown dtype {self.dtype!r}; use one of fp32, bf16, fp16")
        if self.kernel_efficiency is not None and not self.kernel_efficiency > 0:
            raise EstimateError(f"kernel efficiency must be positive, got {self.kernel_efficiency}")

    def _check_stage_lists(self) -> None:
        chunks = self.pp * self.virtual_stages
        if self.stage_layers is not None:
            if len(self.stage_layers) != chunks:
                what = f"pp({self.pp})" if self.virtual_stages == 1 else f"pp({self.pp}) * virtual_stages({self.virtual_stages})"
                raise EstimateError(f"--stage-layers has {len(self.stage_layers)} entries, {what} = {chunks} needed")
            if any(n < 1 for n in self.stage_layers):
                raise EstimateError(f"--stage-layers {','.join(map(str, self.stage_layers))}: every stage needs a layer")
        if self.stage_devices is not None and len(self.stage_devices) != self.pp:
            raise EstimateError(f"--stage-devices has {len(self.stage_devices)} entries, pp({self.pp}) needed")
        if self.stage_recompute is not None:
            if len(self.stage_recompute) != chunks:
                raise EstimateError(f"stage_recompute has {len(self.stage_recompute)} entries, {chunks} stages")
            for value in self.stage_recompute:
                if value not in RECOMPUTE_CHOICES:
                    raise EstimateError(f"unknown recompute {value!r}; use one of {', '.join(RECOMPUTE_CHOICES)}")
        shares = self.replica_batch_shares
        if shares is not None:
            if len(shares) != self.dp or any(not isinstance(b, int) or b < 1 for b in shares):
                raise EstimateError(f"replica_batch_shares {list(shares)}: one positive micro-batch size per replica, dp({self.dp}) needed")
            if sum(shares) != self.dp * self.micro_batch_size:
                raise EstimateError(f"replica_batch_shares {list(shares)} sum to {sum(shares)}, not dp({self.dp}) * "
                                    f"micro_batch_size({self.micro_batch_size}) = {self.dp * self.micro_batch_size}")
        if self.stage_tp is not None:
            if len(self.stage_tp) != self.pp:
                raise EstimateError(f"stage_tp has {len(self.stage_tp)} entries, pp({self.pp}) needed")
            if any(not isinstance(t, int) or t < 1 for t in self.stage_tp):
                raise EstimateError(f"stage_tp {list(self.stage_tp)}: every degree must be a positive integer")
            if self.virtual_stages > 1 and set(self.stage_tp) != {1}:
                raise EstimateError(f"virtual stages ({self.virtual_stages}) run with tp 1 on every stage, not {list(self.stage_tp)}")
        if self.stage_zero is not None:
            if len(self.stage_zero) != self.pp:
                raise EstimateError(f"stage_zero has {len(self.stage_zero)} entries, pp({self.pp}) needed")
            for value in self.stage_zero:
                if value not in (0, 1, 2, 3):
                    raise EstimateError(f"unknown zero {value!r}; use one of 0, 1, 2, 3")

    def recompute_of(self, chunk: int) -> str:
        """The recompute mode of virtual stage ``chunk``."""
        return self.stage_recompute[chunk] if self.stage_recompute is not None else self.recompute

    def tp_of(self, rank: int) -> int:
        """The tensor-parallel degree of pipeline rank ``rank``."""
        return self.stage_tp[rank] if self.stage_tp is not None else self.tp

    @property
    def devices_per_replica(self) -> int:
        """The devices one data-parallel replica spans: the sum of the stages' degrees."""
        return sum(self.tp_of(r) for r in range(self.pp))

    def zero_of(self, rank: int) -> int:
        """The ZeRO stage of pipeline rank ``rank``."""
        return self.stage_zero[rank] if self.stage_zero is not None else self.zero_stage

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica per step."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """Where one pipeline rank runs; see [Note: estimate rank layout]."""

    ranks: list[list[int]]  # [data-parallel replica][tensor-parallel index]
    device_types: list[str]  # distinct, in rank order
    device_type: str  # the slowest, which sets the pace
    memory_bytes: int  # the smallest


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One pipeline rank: its layers, device, per-micro-batch times and memory per device."""

    index: int
    chunks: list[tuple[int, int]]  # (first, last) layer of each virtual stage it holds
    device_type: str
    ranks: list[list[int]]
    fwd_s: float  # one micro-batch, all chunks, tensor-parallel communication included
    bwd_s: float
    peak_in_flight: int
    memory: MemoryBreakdown
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.capacity_bytes


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """The step split on its busiest rank; see [Note: estimate time breakdown]. Sums to the step."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    optimizer_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.optimizer_s


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What ``estimate`` predicts for one configuration."""

    config: EstimateConfig
    cluster_spec: str
    world_size: int
    predicted: Predicted
    time: TimeBreakdown
    stages: list[StageEstimate]
    model_flops_per_step: float  # forward + backward of the model, recompute not counted
    tflops_per_device: float
    mfu: float  # model FLOP/s over the sum of the devices' peak FLOP/s in the training dtype
    busiest_rank: int  # the pipeline rank with the most work, whose time ``time`` splits
    layout: str  # the rule that split the layers over the stages ([Note: default stage split])
    timeline: TimedRun | None = None  # the simulated schedule, action by action (hetpar explain draws it)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def misfit(self) -> str | None:
        """The worst stage that does not fit, in the user's terms; None when all fit."""
        over = [s for s in self.stages if not s.fits]
        if not over:
            return None
        s = max(over, key=lambda st: st.memory.total_bytes / st.capacity_bytes)
        gib, term = 2**30, s.memory.dominant_term()
        return (
            f"stage {s.index} needs {s.memory.total_bytes / gib:.1f} GiB per device, {s.device_type} has "
            f"{s.capacity_bytes / gib:.1f} GiB; {term} dominate ({s.memory.terms()[term] / gib:.1f} GiB)"
        )

    def to_dict(self) -> dict:
        """JSON-ready: the plan's ``predicted`` block plus fits, breakdowns and throughput."""
        return {
            "kind": "hetpar.estimate",
            "cluster": {"spec": self.cluster_spec, "world_size": self.world_size},
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.config).items()},
            "num_microbatches": self.config.num_microbatches,
            "predicted": asdict(self.predicted),
            "fits": self.fits,
            "misfit": self.misfit(),
            "layout": self.layout,
            "time_breakdown": {**asdict(self.time), "step_s": self.time.step_s},
            "stages": [_stage_dict(s) for s in self.stages],
            "model_flops_per_step": self.model_flops_per_step,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "busiest_rank": self.busiest_rank,
        }


def _stage_dict(s: StageEstimate) -> dict:
    memory = {f"{name.replace(' ', '_')}_bytes": value for name, value in s.memory.terms().items()}
    return {
        "index": s.index,
        "layers": [list(c) for c in s.chunks],
        "device_type": s.device_type,
        "ranks": s.ranks,
        "fwd_s": s.fwd_s,
        "bwd_s": s.bwd_s,
        "peak_in_flight": s.peak_in_flight,
        "memory": {**memory, "fragmentation_bytes": s.memory.fragmentation_bytes, "total_bytes": s.memory.total_bytes,
                   "capacity_bytes": s.capacity_bytes, "dominant": s.memory.dominant_term()},
        "fits": s.fits,
    }


# --- Checks and layout ---------------------------------------------------------------------


def check_against(model: ModelGraph, cluster: Cluster, config: EstimateConfig) -> None:
    """Refuse a configuration that does not match the model or the cluster, naming every factor.

    Raises:
        EstimateError: degrees that do not multiply to the world size, a layer split that
            does not cover the model, more stages than layers, or tp > 1 on a model with
            no layer that tensor parallelism splits.
    """
    world, c = cluster.world_size, config
    if c.stage_tp is not None and c.dp * c.devices_per_replica != world:
        raise EstimateError(f"dp({c.dp}) * sum of stage tp({c.devices_per_replica}) = {c.dp * c.devices_per_replica} != world_size({world})")
    if c.stage_tp is None and c.dp * c.tp * c.pp != world:
        raise EstimateError(f"dp({c.dp}) * tp({c.tp}) * pp({c.pp}) = {c.dp * c.tp * c.pp} != world_size({world})")
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
        groups = pack_stage_ranks(list(range(cluster.world_size)), c.dp, [c.tp_of(s) for s in range(c.pp)])
    else:
        groups = _ranks_by_device(cluster, config)
    types = cluster.device_types()
    return [_describe(ranks, types, c.dtype, cluster) for ranks in groups]


def _ranks_by_device(cluster: Cluster, config: EstimateConfig) -> list[list[list[int]]]:
    types = cluster.device_types()
    wanted = [_canonical(name, cluster) for name in config.stage_devices]
    for name in dict.fromkeys(wanted):
        mine = [s for s, n in enumerate(wanted) if n == name]
        need = sum(config.dp * config.tp_of(s) for s in mine)
        have = types.count(name)
        if need > have:
            each = f"dp({config.dp}) * tp({config.tp}) each" if config.stage_tp is None else f"dp({config.dp}) * their tp"
            raise EstimateError(f"--stage-devices puts {len(mine)} stages on {name}: {need} devices ({each}), the cluster has {have}")
    groups: list = [None] * len(wanted)
    for name in dict.fromkeys(wanted):
        mine = [s for s, n in enumerate(wanted) if n == name]
        free = [r for r, t in enumerate(types) if t == name]
        for s, ranks in zip(mine, pack_stage_ranks(free, config.dp, [config.tp_of(s) for s in mine])):
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


# --- Per virtual stage costs -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _ChunkCost:
    """One virtual stage, one micro-batch: compute and communication of each action kind."""

    fwd_compute_s: float
    fwd_tp_s: float
    b_compute_s: float  # input gradient, plus the recomputed forward under full recompute
    b_tp_s: float
    w_compute_s: float
    zero3_fwd_s: float  # ZeRO-3 gathers and reduce-scatters, before and after the compute
    zero3_bwd_s: float

    def seconds(self, kind: Kind, split_weights: bool) -> tuple[float, float, float]:
        """(compute, tensor-parallel, exposed ZeRO-3) seconds of one action.

        ZeRO-3's collectives are all exposed: the generated program makes each stage one
        FSDP unit ([Note: ZeRO through FSDP2] in runtime/data_parallel.py), so the stage's
        parameters are gathered before its compute starts and its gradients
        reduce-scattered after it ends; nothing is left to prefetch under.
        """
        if kind is Kind.FORWARD:
            compute, tp, gather = self.fwd_compute_s, self.fwd_tp_s, self.zero3_fwd_s
        elif kind is Kind.WEIGHT:
            return self.w_compute_s, 0.0, 0.0
        else:
            compute = self.b_compute_s + (0.0 if split_weights else self.w_compute_s)
            tp, gather = self.b_tp_s, self.zero3_bwd_s
        return compute, tp, gather


def _chunk_cost(model: ModelGraph, cluster: Cluster, config: EstimateConfig, bounds, layout: StageLayout, chunk: int,
                memo: dict) -> _ChunkCost:
    """One chunk's action seconds; ``memo`` keeps each layer kind's tensor-parallel collectives over one group for the estimate."""
    first, last = bounds
    layers = model.layers[first : last + 1]
    device = cluster.profile(layout.device_type)
    tp = config.tp_of(chunk % config.pp)
    times = [layer_timing(l, device, tp=tp, micro_batch_size=config.micro_batch_size, dtype=config.dtype,
                          kernel_efficiency=config.kernel_efficiency) for l in layers]
    scale = config.micro_batch_size * dtype_bytes(config.dtype) / 4
    group = tuple(layout.ranks[0])

    def pass_s(l: LayerProfile, p: str) -> float:
        key = (l.tp_collectives, p, scale, group)
        if key not in memo:
            memo[key] = tensor_parallel_pass_s(l.tp_collectives, p, scale, layout.ranks[0], cluster)
        return memo[key]

    tp_fwd, tp_bwd = (sum(pass_s(l, p) for l in layers) for p in ("forward", "backward"))
    fwd = sum(t.fwd_s for t in times)
    full = config.recompute_of(chunk) == "full"
    gather_fwd, gather_bwd = _zero3_comm_s(layers, cluster, config, layout, config.zero_of(chunk % config.pp))
    return _ChunkCost(
        fwd_compute_s=fwd,
        fwd_tp_s=tp_fwd,
        b_compute_s=sum(t.bwd_input_s for t in times) + (fwd if full else 0.0),
        b_tp_s=tp_bwd + (tp_fwd if full else 0.0),
        w_compute_s=sum(t.bwd_weight_s for t in times),
        zero3_fwd_s=gather_fwd,
        zero3_bwd_s=gather_bwd,
    )


def _zero3_comm_s(layers, cluster: Cluster, config: EstimateConfig, layout: StageLayout, zero_stage: int) -> tuple[float, float]:
    """ZeRO-3, per micro-batch: gather the weights for forward; gather again and reduce-scatter the gradients in
    backward; data-parallel synchronisation inside the step, so times the device's ``grad_sync_scale``."""
    if zero_stage < 3 or config.dp == 1:
        return 0.0, 0.0
    tp = len(layout.ranks[0])
    nbytes = sum(l.params_at(tp) for l in layers) * dtype_bytes(config.dtype)
    group = [replica[0] for replica in layout.ranks]
    scale = grad_sync_scale(cluster.profile(layout.device_type))
    gather = all_gather_time_s(nbytes, group, cluster, concurrent=tp) * scale
    return gather, gather + reduce_scatter_time_s(nbytes, group, cluster, concurrent=tp) * scale


def _boundary_s(model: ModelGraph, cluster: Cluster, config: EstimateConfig, last_layer: int,
                src: StageLayout, dst: StageLayout) -> float:
    """Seconds to hand one micro-batch's boundary tensor from ``src`` to ``dst`` (either direction)."""
    nbytes = model.layers[last_layer].boundary_bytes * config.micro_batch_size * dtype_bytes(config.dtype) / 4
    return boundary_seconds(nbytes, src.ranks[0], dst.ranks[0], cluster, config.scatter_gather)


# --- The schedule, played ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Played:
    schedule: list[list[Action]]
    run: TimedRun
    run_without_transfers: TimedRun | None  # None: not simulated (``estimate(breakdown=False)``)
    parts: dict[tuple[int, Kind], tuple[float, float, float]]  # (stage, kind) -> (compute, tensor-parallel, exposed ZeRO-3) seconds


@functools.lru_cache(maxsize=32)
def _schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """``build_schedule``, kept: the heterogeneous data-parallel plan estimates the same schedule thousands of
    times (the lists are only read here)."""
    return build_schedule(name, pp, num_microbatches, virtual_stages)


def _play(model, cluster, config, layouts, bounds, costs: list[_ChunkCost], breakdown: bool = True) -> _Played:
    try:
        plan = _schedule(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    except ScheduleError as exc:
        raise EstimateError(str(exc)) from None
    split = config.schedule == "zb"
    parts = {(k, kind): costs[k].seconds(kind, split) for k in range(len(costs)) for kind in Kind}
    totals = {key: sum(value) for key, value in parts.items()}
    hop = [_boundary_s(model, cluster, config, bounds[k][1], layouts[k % config.pp], layouts[(k + 1) % config.pp])
           for k in range(len(bounds) - 1)]

    def transfer(sender: Action, receiver: Action) -> float:
        return hop[min(sender.stage, receiver.stage)]

    def duration(action: Action) -> float:
        return totals[action.stage, action.kind]

    # [Note: late receives] in runtime/schedule.py: measured on the sender's host
    late = [getattr(cluster.profile(layouts[k % config.pp].device_type), "late_receive_s", None) or 0.0
            for k in range(len(bounds))]
    return _Played(schedule=plan, run=simulate_timed(plan, duration, transfer, (lambda a: late[a.stage]) if any(late) else None),
                   run_without_transfers=simulate_timed(plan, duration) if breakdown else None, parts=parts)


def _stage_params(model: ModelGraph, tp: int, chunks: list[tuple[int, int]]) -> float:
    """Parameters a rank of these chunks holds and updates, a tied copy included ([Note: ZeRO stages])."""
    layers = [l for first, last in chunks for l in range(first, last + 1)]
    params = sum(model.layers[l].params_at(tp) for l in layers)
    if 0 not in layers:
        params += sum(model.layers[l].tied_at(tp) for l in layers)
    return params


def _dp_sync_s(params: float, cluster: Cluster, config: EstimateConfig, layout: StageLayout, zero_stage: int) -> float:
    """The gradient synchronisation of one pipeline rank in a step: an all-reduce; ZeRO-1's reduce-scatter and
    all-gather; ZeRO-2's reduce-scatter after every micro-batch's backward ([Note: ZeRO through FSDP2] in
    runtime/data_parallel.py) and all-gather (ZeRO-3 synchronises per micro-batch, in ``_zero3_comm_s``)."""
    if config.dp == 1 or zero_stage == 3:
        return 0.0
    nbytes = params * dtype_bytes(config.dtype)
    group, kw = [replica[0] for replica in layout.ranks], {"concurrent": len(layout.ranks[0])}
    scale = grad_sync_scale(cluster.profile(layout.device_type))
    if zero_stage == 0:
        return sync_seconds(config.sync, params, dtype_bytes(config.dtype), config.dp, cluster.profile(layout.device_type),
                            collective_over(group, cluster, **kw)) * scale
    scatters = config.num_microbatches if zero_stage == 2 else 1
    return (scatters * reduce_scatter_time_s(nbytes, group, cluster, **kw) + all_gather_time_s(nbytes, group, cluster, **kw)) * scale


def _optimizer_s(params: float, tensors: int, sharded_tensors: int, device: DeviceProfile, config: EstimateConfig,
                 zero_stage: int) -> float:
    """One optimizer step over this rank's share of the parameters: bound by memory traffic.

    A measured profile has the traffic rate an optimizer step reaches and its cost per
    parameter tensor (more for a DTensor one), and adds its ``step_overhead_s``: what a training step costs
    besides the layers and the gradient sync (docs/profiling.md); datasheet profiles
    have none of these.
    """
    share = params / config.dp if zero_stage >= 1 else params
    rates = optimizer_rates(device, config.kernel_efficiency)
    return rates.seconds(share * OPTIMIZER_BYTES_PER_PARAM[config.optimizer], tensors, sharded_tensors) + rates.fixed_s


# --- Memory --------------------------------------------------------------------------------


def _peak_activations(actions: list[Action], per_mb: dict[int, float], split_weights: bool) -> float:
    """The most activation bytes a rank holds while it runs ``actions``; see [Note: zero-bubble split]."""
    kept_for_w = WEIGHT_GRAD_ACTIVATION_SHARE if split_weights else 0.0
    live = peak = 0.0
    for a in actions:
        if a.kind is Kind.FORWARD:
            live += per_mb[a.stage]
        elif a.kind is Kind.BACKWARD:
            live -= per_mb[a.stage] * (1 - kept_for_w)
        else:
            live -= per_mb[a.stage] * kept_for_w
        peak = max(peak, live)
    return peak


def _rank_memory(model: ModelGraph, config: EstimateConfig, bounds, chunks: list[int], actions: list[Action]) -> MemoryBreakdown:
    c = config
    tp = c.tp_of(chunks[0] % c.pp)
    layers = [model.layers[l] for k in chunks for l in range(bounds[k][0], bounds[k][1] + 1)]
    tied = _stage_params(model, tp, [bounds[k] for k in chunks]) - sum(l.params_at(tp) for l in layers)
    weights, grads, opt = training_state_bytes(layers, tp=tp, dtype=c.dtype, optimizer=c.optimizer, dp=c.dp,
                                               zero_stage=c.zero_of(chunks[0] % c.pp), extra_params=tied)
    per_mb, workspace = {}, 0.0
    for k in chunks:
        first, last = bounds[k]
        inputs = model.layers[first - 1].boundary_bytes if first > 0 else model.input_bytes
        mine = model.layers[first : last + 1]
        per_mb[k] = activation_bytes_per_microbatch(mine, tp=tp, micro_batch_size=c.micro_batch_size,
                                                    dtype=c.dtype, recompute=c.recompute_of(k), input_bytes=inputs)
        workspace = max(workspace, recompute_workspace_bytes(mine, tp=tp, micro_batch_size=c.micro_batch_size, dtype=c.dtype,
                                                             recompute=c.recompute_of(k)))
    activations = _peak_activations(actions, per_mb, c.schedule == "zb") + workspace
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=activations)


# --- The estimate --------------------------------------------------------------------------


def estimate(model: ModelGraph, cluster: Cluster, config: EstimateConfig, *, breakdown: bool = True,
             memo: dict | None = None) -> Estimate:
    """Predict step time, memory per stage and throughput of ``config`` for ``model`` on ``cluster``.

    Args:
        model: the traced model (planner.trace.trace_model).
        cluster: the cluster (cost_models.cluster.parse_cluster).
        config: the parallel configuration.
        breakdown: tell pipeline transfers apart from the bubble, which takes a second
            simulation of the schedule without them; False counts them in the bubble
            (``pp_comm_s`` 0) and leaves the step time as it is, for callers that
            compare step times by the thousand (planner.hetero_dp).
        memo: the tensor-parallel collectives' seconds by layer kind, group and size,
            kept across calls on one ``cluster`` (and ``model``) by a caller that makes
            many; a fresh one per call by default.

    Returns:
        The estimate; ``fits`` says whether every stage fits its devices' memory.

    Raises:
        EstimateError: the configuration does not match the model or the cluster.
        cost_models.devices.ProfileError: a device lacks the training dtype.
    """
    check_against(model, cluster, config)
    if config.replica_batch_shares is not None:  # hetero_dp builds on this module, so it estimates those plans
        raise EstimateError("replica_batch_shares: estimate the plan with planner.hetero_dp.estimate_shares")
    layouts = stage_layout(cluster, config)
    split = stage_split(model, config)
    bounds = split.bounds
    memo = {} if memo is None else memo
    costs = [_chunk_cost(model, cluster, config, b, layouts[k % config.pp], k, memo) for k, b in enumerate(bounds)]
    played = _play(model, cluster, config, layouts, bounds, costs, breakdown)
    stages = [_stage_estimate(model, config, layouts, bounds, played, r) for r in range(config.pp)]
    return _assemble(model, cluster, config, layouts, split, played, stages)


def _stage_estimate(model, config, layouts, bounds, played: _Played, r: int) -> StageEstimate:
    chunks = [k for k in range(len(bounds)) if k % config.pp == r]
    actions = played.schedule[r]
    m = config.num_microbatches
    fwd = sum(sum(played.parts[a.stage, a.kind]) for a in actions if a.kind is Kind.FORWARD) / m
    bwd = sum(sum(played.parts[a.stage, a.kind]) for a in actions if a.kind is not Kind.FORWARD) / m
    return StageEstimate(
        index=r,
        chunks=[bounds[k] for k in chunks],
        device_type=layouts[r].device_type,
        ranks=layouts[r].ranks,
        fwd_s=fwd,
        bwd_s=bwd,
        peak_in_flight=played.run.peak_in_flight(r),
        memory=_rank_memory(model, config, bounds, chunks, actions),
        capacity_bytes=layouts[r].memory_bytes,
    )


def _assemble(model, cluster, config, layouts, split: StageSplit, played: _Played, stages: list[StageEstimate]) -> Estimate:
    c, run = config, played.run
    params = [_stage_params(model, c.tp_of(s.index), s.chunks) for s in stages]
    dp_s = [_exposed_dp_s(_dp_sync_s(params[r], cluster, c, layouts[r], c.zero_of(r)), played, r, c) for r in range(c.pp)]
    pipeline_end = max(run.end_s(r) for r in range(c.pp))
    dp = max(run.end_s(r) + dp_s[r] for r in range(c.pp)) - pipeline_end
    busiest = max(range(c.pp), key=run.busy_s)
    compute, tp, zero3 = (sum(played.parts[t.action.stage, t.action.kind][i] for t in run.ranks[busiest]) for i in range(3))
    alone = played.run_without_transfers
    pp = max(0.0, run.end_s(busiest) - alone.end_s(busiest)) if alone is not None else 0.0
    def count(s: StageEstimate, attribute: str) -> int:
        return sum(getattr(model.layers[l], attribute) for first, last in s.chunks for l in range(first, last + 1))

    tensors = [count(s, "param_tensors") for s in stages]
    sharded = [count(s, "tp_sharded_tensors") if c.tp_of(s.index) > 1 else 0 for s in stages]
    optimizer = max(_optimizer_s(params[r], tensors[r], sharded[r], cluster.profile(layouts[r].device_type), c, c.zero_of(r))
                    for r in range(c.pp))
    # The busiest rank's busy time never exceeds the makespan; max() drops a rounding error's -1e-21.
    time = TimeBreakdown(compute_s=compute, bubble_s=max(0.0, pipeline_end - compute - tp - zero3 - pp), tp_comm_s=tp, pp_comm_s=pp,
                         dp_comm_s=dp + zero3, optimizer_s=optimizer)
    step = time.step_s
    flops = sum(l.fwd_flops + l.bwd_flops for l in model.layers) * c.global_batch_size
    peak = sum(cluster.profile(t).peak_flops(c.dtype) for t in cluster.device_types())
    predicted = Predicted(
        step_time_s=step,
        throughput_samples_per_s=c.global_batch_size / step,
        peak_memory_bytes=[int(s.memory.total_bytes) for s in stages],
        compute_time_s=time.compute_s + time.optimizer_s,
        bubble_time_s=time.bubble_s,
        dp_comm_time_s=time.dp_comm_s,
        pp_comm_time_s=time.pp_comm_s,
        tp_comm_time_s=time.tp_comm_s,
        stage_fwd_s=[s.fwd_s for s in stages],
        stage_bwd_s=[s.bwd_s for s in stages],
    )
    return Estimate(config=c, cluster_spec=cluster.spec, world_size=cluster.world_size, predicted=predicted, time=time,
                    stages=stages, model_flops_per_step=flops, tflops_per_device=flops / step / cluster.world_size / 1e12,
                    mfu=flops / step / peak, busiest_rank=busiest, layout=split.layout, timeline=played.run)


def _exposed_dp_s(sync_s: float, played: _Played, r: int, config: EstimateConfig) -> float:
    """What of a rank's gradient synchronisation the step waits for; the last backward hides some with overlap."""
    if not config.overlap_grad_reduce:
        return sync_s
    last = next(t for t in reversed(played.run.ranks[r]) if t.action.kind is not Kind.FORWARD)
    return max(0.0, sync_s - (last.end_s - last.start_s))


__all__ = ["Estimate", "EstimateConfig", "EstimateError", "StageEstimate", "TimeBreakdown", "estimate", "stage_devices_of", "stage_layout", "stage_split"]
