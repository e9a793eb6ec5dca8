"""What the user asks of the search, and the checks of it: a leaf the planner's modules share.

``SearchOptions`` (pins, limits), ``check_pins`` (impossible pins, caught before any
search, as a ``PlanningError`` in the user's terms), ``pinned_pp`` and ``misfit_fix``.
Imports only the planner's leaves (errors, model_graph), so that the search and the
strategies over it build on it without importing each other.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from hetpar.cost_models.devices import ProfileError
from hetpar.cost_models.grad_sync import PLAIN, SyncMethod
from hetpar.cost_models.layers import tp_misfit
from hetpar.cost_models.offload import offload_refusal
from hetpar.planner.errors import PlanningError
from hetpar.planner.model_graph import ModelGraph
from hetpar.vocabulary import DType, Optimizer, Recompute, Schedule, SplitSolver, Switch, ZeroStage


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the user asked for; ``None`` pins leave the choice to the search."""

    global_batch_size: int
    dtype: str
    optimizer: str = Optimizer.ADAMW
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None  # model chunks per pipeline rank, pinned (interleaved when > 1)
    recompute: str | None = None  # "none" | "selective" | "full" on every stage; none and full are searched per stage when None
    zero: int | None = None  # ZeRO stage of every stage, pinned; searched per stage when None
    stage_layers: tuple[int, ...] | None = None  # layers per stage (pp * virtual stages entries), pinned
    stage_devices: tuple[str, ...] | None = None  # device type per pipeline rank, pinned
    max_tp: int = 8
    max_virtual_stages: int = 4  # the interleaved schedules searched: 2..this many chunks per rank
    work_limit_s: float = 10.0  # CP-SAT deterministic seconds per solve ([Note: deterministic search])
    time_limit_s: float | None = None  # wall-clock seconds per solve: an opt-in safety net whose cuts depend on the machine
    gap_limit: float = 0.0  # stop a candidate's solve once proven within this relative gap
    uniform_split: bool = False  # equal layers per stage in Megatron's layout (a baseline, not a search)
    megatron_split: bool = False  # layers per stage as Megatron splits them ([Note: default stage split]), degrees searched
    workers: int = 1  # CP-SAT workers per solve; > 1 runs them in deterministic batches ([Note: deterministic search])
    # "auto": candidates of one chunk per rank by dynamic programming, the rest by CP-SAT; "cp-sat": every
    # candidate by CP-SAT ([Note: split by dynamic programming] in planner.search.split_dp)
    split_solver: str = SplitSolver.AUTO
    seed: int = 0
    top_k: int = 3
    compiled: bool = False  # stages run under torch.compile ([Note: compiled stages] in cost_models.compute)
    sync: SyncMethod = PLAIN  # how replicas agree, priced (planner.strategies.sync_methods); not PLAIN: ZeRO 0 only
    min_dp: int = 1  # fewest data-parallel replicas (robust aggregation and local SGD need several)
    ep: int | None = None  # expert parallelism, pinned; searched among the degrees the experts allow when None
    expert_imbalance: float = 1.0  # the busiest expert-parallel rank's rows over the uniform share ([Note: expert load])
    cp: int | None = None  # context parallelism, pinned; searched among powers of two up to max_cp when None
    max_cp: int = 16
    sequence_parallel: str = Switch.AUTO  # auto: searched ([Note: sequence parallelism costs]); on: every stage with tp > 1; off: none
    # the ZeRO-3 shard in host memory ([Note: offload costs] in cost_models.offload): on, every
    # stage; off, none; auto, searched per stage where no plan fits without it ([Note: offload search])
    offload: str = Switch.AUTO
    offload_offered: bool = False  # set by the search's second pass under auto: offload modes offered beside the others


def misfit_fix(dtype: str) -> str:
    """What a plan that does not fit memory can change: more devices, a smaller batch,
    and 2-byte training where it trains in fp32."""
    return "add devices, lower --global-batch or use --dtype bf16" if dtype in (DType.FP32, DType.TF32) else \
        "add devices or lower --global-batch"


def check_pins(model: ModelGraph, cluster, options: SearchOptions) -> None:
    world = cluster.world_size
    gbs = options.global_batch_size
    if gbs < 1:
        raise PlanningError(f"--global-batch must be positive, got {gbs}")
    if options.split_solver not in tuple(SplitSolver):
        raise PlanningError(f"split_solver {options.split_solver!r} must be one of {', '.join(SplitSolver)}")
    if not options.work_limit_s > 0:
        raise PlanningError(f"--work-limit must be a positive number of deterministic seconds, got {options.work_limit_s:g}")
    if options.time_limit_s is not None and not options.time_limit_s > 0:
        raise PlanningError(f"--time-limit must be a positive number of seconds, got {options.time_limit_s:g}")
    for name, value in (("dp", options.dp), ("tp", options.tp)):
        if value is not None and (value < 1 or world % value):
            raise PlanningError(f"--{name} {value} does not divide the cluster's world size ({world})")
    if options.pp is not None and not 1 <= options.pp <= world:
        raise PlanningError(f"--pp {options.pp} must be between 1 and the cluster's world size ({world})")
    dp, tp, pp = options.dp, options.tp, options.pp
    cp = options.cp or 1
    if dp and tp and pp and dp * cp * tp * pp != world:
        cp_text = f" * cp({cp})" if cp > 1 else ""
        raise PlanningError(f"dp({dp}){cp_text} * tp({tp}) * pp({pp}) = {dp * cp * tp * pp} != world_size({world})")
    if pp and pp > len(model.layers):
        raise PlanningError(f"--pp {pp} exceeds the model's {len(model.layers)} layers")
    if tp and tp > 1 and not any(l.tp_capable for l in model.layers):
        raise PlanningError(f"--tp {tp}: the model has no layer that tensor parallelism can split")
    misfit = tp_misfit(model.layers, tp) if tp else None
    if misfit is not None:
        degrees = ", ".join(map(str, misfit.tp_degrees or ())) or "no"
        raise PlanningError(f"--tp {tp}: layer {misfit.name} splits only {degrees} ways (heads or features do not divide by {tp}); pick one of those")
    if dp and gbs % dp:
        raise PlanningError(f"--global-batch {gbs} is not divisible by dp({dp})")
    mbs = options.micro_batch_size
    if mbs and dp and (gbs // dp) % mbs:
        raise PlanningError(f"--micro-batch-size {mbs} does not divide the per-replica batch {gbs // dp}")
    if mbs and mbs > gbs:
        raise PlanningError(f"--micro-batch-size {mbs} exceeds --global-batch {gbs}")
    if options.recompute and options.recompute not in tuple(Recompute):
        raise PlanningError(f"unknown --recompute {options.recompute!r}; use none, selective or full")
    if options.schedule and options.schedule not in tuple(Schedule):
        raise PlanningError(f"unknown --schedule {options.schedule!r}; use one of {', '.join(Schedule)}")
    for device_type in cluster.count_by_type():  # else every time is infinite and nothing seems to fit
        try:
            cluster.profile(device_type).peak_flops(options.dtype)
        except ProfileError as exc:
            raise PlanningError(str(exc)) from None
    check_schedule_pins(model, options)
    check_stage_pins(model, cluster, options)
    check_expert_pins(model, options)
    check_sequence_pins(model, options)
    check_offload_pins(cluster, options)


def check_offload_pins(cluster, options: SearchOptions) -> None:
    """Refuse an --offload the cluster or the other pins cannot take, in one line."""
    if options.offload not in tuple(Switch):
        raise PlanningError(f"unknown --offload {options.offload!r}; use auto, on or off")
    if options.offload != Switch.ON:
        return
    if options.zero not in (None, 3):
        raise PlanningError(f"--offload on keeps ZeRO-3 shards in host memory; drop --zero {options.zero} or pin --zero 3")
    for device_type in cluster.count_by_type():
        reason = offload_refusal(cluster.profile(device_type))
        if reason:
            raise PlanningError(f"--offload on: {reason}; drop --offload")


def check_sequence_pins(model: ModelGraph, options: SearchOptions) -> None:
    """Refuse --cp and --sp pins the model cannot take, in one line each."""
    if options.sequence_parallel not in tuple(Switch):
        raise PlanningError(f"unknown --sp {options.sequence_parallel!r}; use auto, on or off")
    if options.sequence_parallel == Switch.ON and not model.sequence_splits(2) and not any(
            model.sequence_splits(t) for t in range(2, options.max_tp + 1)):
        raise PlanningError("--sp on: sequence parallelism splits the tokens of a model whose first input is token ids "
                            "and whose layers tensor parallelism splits; this model has none")
    cp = options.cp
    if cp is None or cp == 1:
        return
    if cp < 1:
        raise PlanningError(f"--cp must be a positive integer, got {cp}")
    if not model.context_capable:
        raise PlanningError(f"--cp {cp}: context parallelism splits the tokens of a model whose first input is token ids "
                            f"and whose layers attend; this model has no such input or attention")
    if model.sequence_length % (2 * cp):
        raise PlanningError(f"--cp {cp}: the sequence of {model.sequence_length} tokens does not cut into 2 * cp = "
                            f"{2 * cp} equal chunks; pick a cp that divides {model.sequence_length // 2}")
    if options.ep not in (None, 1):
        raise PlanningError(f"--cp {cp} runs without expert parallelism (--ep {options.ep})")


def expert_degrees(model: ModelGraph) -> tuple[int, ...]:
    """The expert-parallel degrees the model's experts split into: the divisors of the
    gcd of its layers' expert counts; (1,) for a model without experts."""
    counts = [l.num_experts for l in model.layers if l.num_experts]
    if not counts:
        return (1,)
    common = math.gcd(*counts)
    return tuple(d for d in range(1, common + 1) if common % d == 0)


def check_expert_pins(model: ModelGraph, options: SearchOptions) -> None:
    imbalance = options.expert_imbalance
    if not (isinstance(imbalance, (int, float)) and imbalance >= 1.0):
        raise PlanningError(f"--expert-imbalance must be a number >= 1 (1: uniform routing), got {imbalance!r}")
    ep = options.ep
    if ep is None or ep == 1:
        return
    if ep < 1:
        raise PlanningError(f"--ep must be a positive integer, got {ep}")
    degrees = expert_degrees(model)
    if degrees == (1,):
        raise PlanningError(f"--ep {ep}: the model has no module of experts to split (docs/model-file.md, "
                            f"'Mixtures of experts')")
    if ep not in degrees:
        raise PlanningError(f"--ep {ep} does not divide the model's {degrees[-1]} experts per layer; use one of "
                            f"{', '.join(map(str, degrees))}")
    if options.dp is not None and options.dp % ep:
        raise PlanningError(f"--ep {ep} must divide --dp {options.dp}: the experts split over data-parallel replicas")
    if options.zero:
        raise PlanningError(f"--ep {ep} runs with ZeRO 0 (the experts' gradients are averaged over their own replicas); "
                            f"drop --zero {options.zero}")
    if options.schedule == Schedule.INTERLEAVED or (options.virtual_stages or 1) > 1:
        raise PlanningError(f"--ep {ep} runs without virtual stages; drop the interleaved schedule")


def check_schedule_pins(model: ModelGraph, options: SearchOptions) -> None:
    v, schedule, zero, dp = options.virtual_stages, options.schedule, options.zero, options.dp
    if zero is not None and zero not in tuple(ZeroStage):
        raise PlanningError(f"unknown --zero {zero}; use 0, 1, 2 or 3")
    if schedule == Schedule.INTERLEAVED and v is None and options.stage_layers is not None:
        raise PlanningError(f"--stage-layers with --schedule interleaved needs --virtual-stages: how many of the "
                            f"{len(options.stage_layers)} stages each pipeline rank runs")
    if v is not None:
        if v < 1:
            raise PlanningError(f"--virtual-stages must be at least 1, got {v}")
        if v > 1 and schedule not in (None, Schedule.INTERLEAVED):
            raise PlanningError(f"--virtual-stages {v} needs --schedule interleaved, not {schedule}")
        if v > 1 and options.tp not in (None, 1):
            raise PlanningError(f"--virtual-stages {v} runs with tp 1 (the program runs interleaved chunks without tensor parallelism), not --tp {options.tp}")
        if v > 1 and options.pp and options.pp * v > len(model.layers):
            raise PlanningError(f"--pp {options.pp} * --virtual-stages {v} = {options.pp * v} stages, the model has only {len(model.layers)} layers")
    if zero:
        if dp == 1 and not (zero == 3 and options.offload == Switch.ON):
            raise PlanningError(f"--zero {zero} shards over data-parallel replicas; --dp 1 has none (use --zero 0, or "
                                f"--zero 3 --offload on to keep the training state in host memory)")
        if schedule in (Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED) or (v or 1) > 1:
            what = Schedule.INTERLEAVED if (v or 1) > 1 else schedule
            raise PlanningError(f"--zero {zero} runs with schedule 1f1b or gpipe only (FSDP cannot run {what}'s stages); use --zero 0")


def check_stage_pins(model: ModelGraph, cluster, options: SearchOptions) -> None:
    layers, devices, pp, v = options.stage_layers, options.stage_devices, options.pp, options.virtual_stages or 1
    if layers is not None:
        if any(n < 1 for n in layers) or sum(layers) != len(model.layers):
            raise PlanningError(
                f"--stage-layers {','.join(map(str, layers))} sums to {sum(layers)}; the model has {len(model.layers)} layers "
                "(each stage needs at least one; see hetpar trace)"
            )
        if len(layers) % v:
            raise PlanningError(f"--stage-layers gives {len(layers)} stages, not a multiple of --virtual-stages {v}")
        if pp is not None and pp * v != len(layers):
            what = f"--pp is {pp}" if v == 1 else f"--pp {pp} * --virtual-stages {v} is {pp * v}"
            raise PlanningError(f"--stage-layers gives {len(layers)} stages but {what}")
    if devices is not None:
        stages = pp or (len(layers) // v if layers else None)
        if stages is not None and len(devices) != stages:
            raise PlanningError(f"--stage-devices names {len(devices)} device types for {stages} stages")
        present = set(cluster.device_types())
        missing = [d for d in devices if d not in present]
        if missing:
            raise PlanningError(f"--stage-devices: {', '.join(missing)} not in the cluster (it has {', '.join(sorted(present))})")
        types = cluster.device_types()
        per_stage, rest = divmod(len(types), len(devices))
        for k in sorted(present):
            if rest or devices.count(k) * per_stage != types.count(k):
                raise PlanningError(
                    f"--stage-devices puts {devices.count(k)} of {len(devices)} stages on {k}: "
                    f"{devices.count(k) * per_stage} devices at {len(types)}/{len(devices)} per stage, the cluster has {types.count(k)}"
                )


def pinned_pp(options: SearchOptions) -> int | None:
    """The pipeline depth the pins imply, if any."""
    if options.pp:
        return options.pp
    if options.stage_layers:
        return len(options.stage_layers) // (options.virtual_stages or 1)
    return len(options.stage_devices) if options.stage_devices else None


__all__ = ["SearchOptions", "check_pins", "check_schedule_pins", "check_stage_pins", "misfit_fix", "pinned_pp"]
