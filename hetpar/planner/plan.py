"""ParallelPlan: the one object that says everything about a plan.

The search returns it, ``hetpar compile`` consumes it, and it round-trips to JSON with
real lists and numbers. The format is documented in docs/plan-format.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hetpar.planner.errors import PlanFileError
from hetpar.runtime.sync_spec import check_sync
from hetpar.vocabulary import AggregationKind, CompressionKind, Recompute, Schedule, Sharding, SyncScope, ZeroStage

SCHEMA_VERSION = 1
PLAN_KIND = "hetpar.plan"


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """Which model a plan is for."""

    file: str  # absolute path of the model file when planned
    args: dict[str, Any] = field(default_factory=dict)
    fingerprint: str  # sha256 of the model file's bytes
    layer_names: list[str]
    leaf_modules: list[str] = field(default_factory=list)  # --leaf-module paths the layers were traced with


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: a contiguous run of layers on ``data_parallel * tensor_parallel`` ranks.

    ``ranks[d][t]`` is the global rank of data-parallel replica d, tensor-parallel index t.
    Replicas may differ in tensor-parallel degree (``len(ranks[d])``; [Note: replicas of
    different degrees] in runtime/mixed_sync.py): ``tensor_parallel`` is then replica 0's,
    and the stage runs ZeRO 0 without expert, context or sequence parallelism or offload.
    """

    index: int
    layers: list[int]  # layer indices, contiguous, ascending
    device_type: str
    tensor_parallel: int
    ranks: list[list[int]]
    tp_sharding: dict[str, Sharding] = field(default_factory=dict)  # module path -> sharding
    # module path -> the sizes of the parts a colwise fused projection's output is cut into
    # (q, k, v; gate, up), each split over the tp ranks ([Note: part-laid Linears] in
    # runtime/parts.py); written only where a stage has some
    tp_parts: dict[str, list[int]] = field(default_factory=dict)
    zero_stage: int = 0  # ZeRO stage of the data-parallel replicas of this stage (0 = plain all-reduce)
    recompute: str = Recompute.NONE  # "none" | "selective" | "full": activation recomputation of this stage's layers
    # the stage's modules of experts split over this many of its replicas: replica d holds
    # experts [(d % ep) E / ep, (d % ep + 1) E / ep) of each, tokens exchanged by all-to-all
    # inside each run of ep consecutive replicas ([Note: expert parallelism] in runtime/experts.py)
    expert_parallel: int = 1
    # Megatron's sequence parallelism inside the tp group: the residual stream between a
    # rowwise and the next colwise Linear (norms, dropout, residual adds) held as 1/tp of
    # the sequence per rank ([Note: sequence parallelism] in runtime/sequence.py); tp > 1 only
    sequence_parallel: bool = False
    # every sequence split over runs of this many consecutive replicas: ranks has
    # data_parallel * context_parallel rows, row d trains data replica d // cp on context
    # chunks d % cp ([Note: context parallelism] in runtime/context.py)
    context_parallel: int = 1
    # the stage's ZeRO-3 shard (weights, gradients, optimizer state) kept in host memory,
    # its optimizer step run on the host CPUs ([Note: offload through FSDP2] in
    # runtime/data_parallel.py); zero_stage 3 only
    offload: bool = False

    def __post_init__(self) -> None:
        if self.zero_stage not in tuple(ZeroStage):
            raise PlanFileError(f"stage {self.index}: zero_stage({self.zero_stage!r}) must be one of 0, 1, 2, 3")
        if self.recompute not in tuple(Recompute):
            raise PlanFileError(f"stage {self.index}: recompute {self.recompute!r} must be one of {', '.join(map(repr, Recompute))}")
        if not self.layers:
            raise PlanFileError(f"stage {self.index} has no layers")
        if self.layers != list(range(self.layers[0], self.layers[-1] + 1)):
            raise PlanFileError(f"stage {self.index} layers {self.layers} are not contiguous")
        if self.tensor_parallel < 1:
            raise PlanFileError(f"stage {self.index}: tensor_parallel({self.tensor_parallel}) must be >= 1")
        if type(self.expert_parallel) is not int or self.expert_parallel < 1 or len(self.ranks) % self.expert_parallel:
            raise PlanFileError(f"stage {self.index}: expert_parallel({self.expert_parallel!r}) must be a positive "
                                f"integer dividing its {len(self.ranks)} data-parallel replicas")
        if type(self.context_parallel) is not int or self.context_parallel < 1 or len(self.ranks) % self.context_parallel:
            raise PlanFileError(f"stage {self.index}: context_parallel({self.context_parallel!r}) must be a positive "
                                f"integer dividing its {len(self.ranks)} rows of ranks")
        if type(self.sequence_parallel) is not bool:
            raise PlanFileError(f"stage {self.index}: sequence_parallel({self.sequence_parallel!r}) must be true or false")
        if type(self.offload) is not bool:
            raise PlanFileError(f"stage {self.index}: offload({self.offload!r}) must be true or false")
        if self.offload and self.zero_stage != 3:
            raise PlanFileError(f"stage {self.index}: offload keeps a ZeRO-3 shard in host memory; it needs zero_stage 3, "
                                f"the stage has zero_stage {self.zero_stage}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise PlanFileError(f"stage {self.index}: sequence_parallel needs tensor_parallel > 1 (it shards the "
                                f"sequence over the tp ranks)")
        if not self.ranks or not all(self.ranks):
            raise PlanFileError(f"stage {self.index}: every replica needs at least one rank")
        if len(self.ranks[0]) != self.tensor_parallel:
            raise PlanFileError(f"stage {self.index}: replica 0 needs tensor_parallel({self.tensor_parallel}) ranks, "
                                f"got {len(self.ranks[0])}")
        if self.mixed_degrees:
            kept = [name for name, used in (("zero_stage > 0", self.zero_stage), ("expert_parallel",
                    self.expert_parallel > 1), ("context_parallel", self.context_parallel > 1),
                    ("sequence_parallel", self.sequence_parallel), ("offload", self.offload)) if used]
            if kept:
                raise PlanFileError(f"stage {self.index}: replicas of tensor-parallel degrees {self.replica_degrees} "
                                    f"run without {', '.join(kept)}; give every replica one degree or drop them")
        self._check_parts()

    @property
    def replica_degrees(self) -> list[int]:
        """The tensor-parallel degree of each replica: ``len(ranks[d])``."""
        return [len(r) for r in self.ranks]

    @property
    def mixed_degrees(self) -> bool:
        """Whether the stage's replicas differ in tensor-parallel degree."""
        return len(set(self.replica_degrees)) > 1

    @property
    def degree_label(self) -> str:
        """The tensor-parallel degree as tables show it: ``2``, or each replica's distinct degree, ``1/2``."""
        return "/".join(str(t) for t in dict.fromkeys(self.replica_degrees))

    def _check_parts(self) -> None:
        for path, parts in self.tp_parts.items():
            where = f"stage {self.index}: tp_parts[{path!r}]"
            if self.tp_sharding.get(path) != Sharding.COLWISE:
                raise PlanFileError(f"{where} names a module tp_sharding does not split colwise")
            if not isinstance(parts, list) or len(parts) < 2 or \
                    not all(type(p) is int and p > 0 for p in parts):
                raise PlanFileError(f"{where} must be a list of two or more positive part sizes, got {parts!r}")
            for tp in sorted(set(self.replica_degrees)):
                bad = [p for p in parts if p % tp]
                if bad:
                    raise PlanFileError(f"{where}: a part of {bad[0]} features does not divide by "
                                        f"tensor_parallel({tp})")


@dataclass(frozen=True, kw_only=True)
class Predicted:
    """What the cost model predicts for one training step."""

    step_time_s: float
    throughput_samples_per_s: float
    peak_memory_bytes: list[int]  # per stage, per device
    compute_time_s: float = 0.0
    bubble_time_s: float = 0.0
    dp_comm_time_s: float = 0.0
    pp_comm_time_s: float = 0.0
    tp_comm_time_s: float = 0.0
    ep_comm_time_s: float = 0.0  # expert-parallel all-to-alls on the busiest rank ([Note: expert parallelism costs])
    cp_comm_time_s: float = 0.0  # context-parallel key and value exchanges on the busiest rank ([Note: context parallelism costs])
    host_comm_time_s: float = 0.0  # offloaded shards over the host link on the busiest rank ([Note: offload costs])
    # One micro-batch on each pipeline rank (all its virtual stages), forward and backward,
    # tensor-parallel and ZeRO-3 communication included: what ``hetpar validate`` compares
    # with the run's stage times. Empty where the prediction has none (hetero-DP plans).
    stage_fwd_s: list[float] = field(default_factory=list)
    stage_bwd_s: list[float] = field(default_factory=list)
    # Joules one step draws on the plan's devices, and grams of CO2 where every zone gives its
    # grid intensity ([Note: energy model] in cost_models/energy.py); None unless --objective energy.
    energy_j_per_step: float | None = None
    co2_g_per_step: float | None = None
    # The model's FLOPs of one step (forward and backward of the whole global batch, no
    # recompute) and the sum of the plan's devices' peak FLOP/s in its dtype: a program's
    # step lines report MFU from them (the estimate's own MFU: planner.estimate). 0: unknown.
    model_flops_per_step: float = 0.0
    peak_flops_per_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SolverInfo:
    """How the search ended."""

    status: str  # "optimal", "feasible", "pinned", "heuristic"
    search_time_s: float  # wall-clock seconds of the search (machine-dependent; the plan itself is not)
    reason: str = ""  # why the status is not "optimal", e.g. which limits stopped candidates and the gap left
    trace_time_s: float = 0.0  # wall-clock seconds of tracing the model, when the plan came from a model file
    trace_cached: bool = False  # the traced model came from the trace cache ([Note: the trace cache] in planner.trace_cache)
    objective_gap: float = 0.0
    candidates: int = 0  # outer (dp, tp, pp, micro-batch) combinations solved
    objective_s: float = 0.0  # this plan's linear step time, what the search minimised ([Note: plan prediction])
    # the search's proven least linear step time, and how many of its best candidates it
    # then simulated to choose this plan ([Note: finalists re-ranked]); 0 where no search ran
    best_objective_s: float = 0.0
    finalists: int = 0


@dataclass(frozen=True, kw_only=True)
class ClusterRef:
    """The cluster a plan is for, as the user gave it and as hetpar laid it out."""

    spec: str
    world_size: int
    device_types: list[str]  # device type of each global rank


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """A complete parallel execution plan. Degrees check themselves on construction."""

    model: ModelRef
    cluster: ClusterRef
    global_batch_size: int
    micro_batch_size: int
    num_microbatches: int
    schedule: Schedule
    data_parallel: int
    dtype: str
    stages: list[StagePlan]
    predicted: Predicted
    solver: SolverInfo
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    grad_compression: str = CompressionKind.NONE  # none|bf16|fp16|powersgd:R|topk:F|sign: how data-parallel gradients travel
    aggregation: str = AggregationKind.MEAN  # mean|trimmed-mean:B|median|krum:F: how replicas' gradients combine
    sync_every: int = 1  # local SGD: replicas average parameters and optimizer state every K steps (1: every step's gradients)
    sync_scope: str = SyncScope.ALL  # "all", or "node": gradients all-reduced inside a node every step, across nodes every K
    rebalance_every: int = 0  # replica shares of the batch moved by measured speed every N steps (0: never)
    # micro-batch size of each replica; None: micro_batch_size each. With shares, global_batch_size is
    # num_microbatches * sum(shares) and micro_batch_size their mean, rounded down
    replica_batch_shares: list[int] | None = None
    virtual_stages: int = 1  # model chunks per pipeline rank; stages[s] runs on the ranks of stages[s % pp]
    compiled: bool = False  # stages run under torch.compile; the costs count fused kernels ([Note: compiled stages])
    expert_imbalance: float = 1.0  # the busiest expert-parallel rank's rows over the uniform share the costs assumed ([Note: expert load])
    schema_version: int = SCHEMA_VERSION
    kind: str = PLAN_KIND

    def __post_init__(self) -> None:
        self._check_virtual_stages()
        pp = self.pipeline_parallel
        physical = self.stages[:pp]  # the stages that own their ranks; the others reuse them
        world = self.cluster.world_size
        tps = {s.tensor_parallel for s in physical}
        cp = self.context_parallel
        used = sum(self.data_parallel * cp * s.tensor_parallel for s in physical)
        if any(s.mixed_degrees for s in physical):
            used = sum(len(r) for s in physical for r in s.ranks)
            tps = set()
        if used != world:
            tp_text = f"tp({tps.pop()})" if len(tps) == 1 else "sum of stage tp"
            cp_text = f" * cp({cp})" if cp > 1 else ""
            raise PlanFileError(f"dp({self.data_parallel}){cp_text} * {tp_text} * pp({pp}) = {used} != world_size({world})")
        shares = self.replica_batch_shares
        if isinstance(shares, list) and len(shares) == self.data_parallel and all(type(n) is int and n >= 1 for n in shares):
            # (a share list of another shape: _check_data_parallel_options)
            expected = sum(shares) * self.num_microbatches
            if expected != self.global_batch_size:
                raise PlanFileError(f"sum(replica_batch_shares {shares}) * num_microbatches({self.num_microbatches}) = "
                                    f"{expected} != global_batch_size({self.global_batch_size})")
        expected = self.data_parallel * self.micro_batch_size * self.num_microbatches
        if shares is None and expected != self.global_batch_size:
            raise PlanFileError(
                f"dp({self.data_parallel}) * micro_batch_size({self.micro_batch_size}) * "
                f"num_microbatches({self.num_microbatches}) = {expected} != global_batch_size({self.global_batch_size})"
            )
        for s in self.stages:
            if len(s.ranks) != self.data_parallel * cp:
                rows = f"data_parallel({self.data_parallel}) * context_parallel({cp})" if cp > 1 else \
                    f"data_parallel is {self.data_parallel}"
                raise PlanFileError(f"stage {s.index} has {len(s.ranks)} replicas, {rows}")
        all_ranks = sorted(r for s in physical for rep in s.ranks for r in rep)
        if all_ranks != list(range(world)):
            raise PlanFileError(f"stage ranks must cover 0..{world - 1} exactly once")
        layers = [l for s in self.stages for l in s.layers]
        if layers != list(range(len(self.model.layer_names))):
            raise PlanFileError(f"stages cover layers {layers}, the model has {len(self.model.layer_names)} layers")
        self._check_data_parallel_options()
        self._check_mixed_degrees()
        self._check_expert_parallel()
        self._check_context_parallel()

    @property
    def context_parallel(self) -> int:
        """The context-parallel degree: every sequence is split over this many ranks
        (one degree on every stage; ``_check_context_parallel``)."""
        return self.stages[0].context_parallel if self.stages else 1

    def _check_context_parallel(self) -> None:
        """Context parallelism is one degree for the whole plan, on plain data parallelism."""
        degrees = {s.context_parallel for s in self.stages}
        if degrees == {1}:
            return
        if len(degrees) > 1:
            raise PlanFileError(f"stages have context_parallel {sorted(degrees)}; a plan uses one degree on every stage")
        cp = degrees.pop()
        if any(s.expert_parallel > 1 for s in self.stages):
            raise PlanFileError(f"context_parallel {cp} runs without expert_parallel")
        if self.virtual_stages > 1:
            raise PlanFileError(f"context_parallel {cp} runs without virtual stages (virtual_stages is {self.virtual_stages})")
        if (self.grad_compression != CompressionKind.NONE or self.aggregation != AggregationKind.MEAN or self.sync_every != 1
                or self.replica_batch_shares is not None or self.rebalance_every):
            raise PlanFileError(f"context_parallel {cp} runs with plain data parallelism: no gradient compression, "
                                f"robust aggregation, local SGD, uneven replica shares or rebalancing")

    def _check_mixed_degrees(self) -> None:
        """Replicas of different tensor-parallel degrees sync their gradients by a plain weighted all-reduce."""
        mixed = [s.index for s in self.stages if s.mixed_degrees]
        if mixed and (self.grad_compression != CompressionKind.NONE or self.aggregation != AggregationKind.MEAN
                      or self.sync_every != 1):
            raise PlanFileError(f"stage {mixed[0]} has replicas of tensor-parallel degrees "
                                f"{self.stages[mixed[0]].replica_degrees}: they run with plain data parallelism (no "
                                f"gradient compression, robust aggregation or local SGD)")

    def _check_expert_parallel(self) -> None:
        """Expert parallelism is one degree for the whole plan, on the program's plain data parallelism."""
        if type(self.expert_imbalance) not in (int, float) or not self.expert_imbalance >= 1.0:
            raise PlanFileError(f"expert_imbalance({self.expert_imbalance!r}) must be a number >= 1 (1: uniform routing)")
        degrees = {s.expert_parallel for s in self.stages}
        if degrees == {1}:
            return
        if len(degrees) > 1:
            raise PlanFileError(f"stages have expert_parallel {sorted(degrees)}; a plan uses one degree on every stage")
        ep = degrees.pop()
        if any(s.zero_stage for s in self.stages):
            raise PlanFileError(f"expert_parallel {ep} runs with zero_stage 0 on every stage")
        if self.virtual_stages > 1:
            raise PlanFileError(f"expert_parallel {ep} runs without virtual stages (virtual_stages is {self.virtual_stages})")
        if (self.grad_compression != CompressionKind.NONE or self.aggregation != AggregationKind.MEAN or self.sync_every != 1
                or self.replica_batch_shares is not None or self.rebalance_every):
            raise PlanFileError(f"expert_parallel {ep} runs with plain data parallelism: no gradient compression, robust "
                                f"aggregation, local SGD, uneven replica shares or rebalancing")

    def _check_virtual_stages(self) -> None:
        """[Note: virtual stages] A plan with ``virtual_stages`` v > 1 lists pp * v stages in
        layer order; stage s runs on the ranks of stage ``s % pp`` (Megatron's interleaving:
        rank r holds chunks r, r + pp, ...), under the interleaved schedule."""
        v, count = self.virtual_stages, len(self.stages)
        if not isinstance(v, int) or v < 1:
            raise PlanFileError(f"virtual_stages({v!r}) must be an integer >= 1")
        if count % v:
            raise PlanFileError(f"{count} stages do not split into pp * virtual_stages({v}) chunks")
        if v > 1 and Schedule(self.schedule) is not Schedule.INTERLEAVED:
            raise PlanFileError(f"virtual_stages({v}) needs schedule 'interleaved', not {self.schedule.value!r}")
        if v == 1:
            return
        pp = count // v
        if self.num_microbatches % pp:
            raise PlanFileError(
                f"the interleaved schedule needs num_microbatches({self.num_microbatches}) to be a multiple of pp({pp})"
            )
        for s in self.stages[pp:]:
            owner = self.stages[s.index % pp]
            if (s.ranks, s.tensor_parallel, s.device_type) != (owner.ranks, owner.tensor_parallel, owner.device_type):
                raise PlanFileError(
                    f"stage {s.index} is chunk {s.index // pp} of pipeline rank {s.index % pp}: it needs the ranks, "
                    f"tensor_parallel and device_type of stage {owner.index}"
                )
        if any(s.zero_stage or max(s.replica_degrees) > 1 for s in self.stages):
            raise PlanFileError("virtual_stages > 1 runs with zero_stage 0 and tensor_parallel 1 on every stage")

    def _check_data_parallel_options(self) -> None:
        zero = [s.index for s in self.stages if s.zero_stage > 0]
        if zero and Schedule(self.schedule) is Schedule.ZERO_BUBBLE:
            raise PlanFileError(
                f"schedule 'zb' needs zero_stage 0 on every stage (FSDP reduces gradients inside the backward, which "
                f"'zb' splits), stage {zero[0]} has zero_stage {self.stages[zero[0]].zero_stage}"
            )
        try:
            check_sync(self.grad_compression, self.aggregation, self.sync_every, self.sync_scope,
                       data_parallel=self.data_parallel, zero_stages=[s.zero_stage for s in self.stages],
                       equal_shares=self.replica_batch_shares is None)
        except ValueError as exc:
            raise PlanFileError(str(exc)) from None
        self._check_rebalance()
        shares = self.replica_batch_shares
        if shares is None:
            return
        if len(shares) != self.data_parallel or any(not isinstance(n, int) or n < 1 for n in shares):
            raise PlanFileError(
                f"replica_batch_shares {shares} must hold one micro-batch size >= 1 per replica, data_parallel is "
                f"{self.data_parallel}"
            )
        if sum(shares) // self.data_parallel != self.micro_batch_size:
            raise PlanFileError(
                f"replica_batch_shares {shares}: micro_batch_size({self.micro_batch_size}) must be their mean, rounded "
                f"down: sum {sum(shares)} // dp({self.data_parallel}) = {sum(shares) // self.data_parallel}"
            )

    def _check_rebalance(self) -> None:
        every = self.rebalance_every
        if not isinstance(every, int) or every < 0:
            raise PlanFileError(f"rebalance_every {every!r} must be an integer >= 0 (0: never)")
        if not every:
            return
        if self.data_parallel < 2:
            raise PlanFileError("rebalance_every needs data_parallel >= 2: it moves samples between replicas")
        if len(self.stages) > 1:
            raise PlanFileError(f"rebalance_every needs one pipeline stage (the plan has {len(self.stages)}): a stage's "
                            f"pipeline buffers are sized for its micro-batch at start-up")
        if self.aggregation != AggregationKind.MEAN or self.sync_every > 1:
            raise PlanFileError("rebalance_every needs aggregation 'mean' and sync_every 1 (those need equal shares)")

    def stage_device_label(self, stage: StagePlan) -> str:
        """The device types of ``stage``'s replicas as tables show them: ``A100-80GB``, or ``A100-80GB+V100-32GB``
        where replicas differ in type (heterogeneous data parallelism)."""
        types = self.cluster.device_types
        found = dict.fromkeys(types[row[0]] for row in stage.ranks if 0 <= row[0] < len(types))
        return "+".join(found) or stage.device_type

    @property
    def replica_micro_batch_sizes(self) -> list[int]:
        """The micro-batch size of each data-parallel replica (``replica_batch_shares`` or equal sizes)."""
        if self.replica_batch_shares is not None:
            return list(self.replica_batch_shares)
        return [self.micro_batch_size] * self.data_parallel

    @property
    def pipeline_parallel(self) -> int:
        """Pipeline ranks per replica: ``len(stages) // virtual_stages``."""
        return len(self.stages) // self.virtual_stages

    def to_json(self) -> str:
        """The plan as indented JSON text."""
        data = _to_jsonable(asdict(self))
        for stage in data["stages"]:
            if not stage["tp_parts"]:
                del stage["tp_parts"]  # a plan without fused projections reads as before
        return json.dumps(data, indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan atomically: a crash never leaves a half-written file."""
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def from_dict(cls, data: Any) -> "ParallelPlan":
        """Build a plan from parsed JSON.

        Raises:
            PlanFileError: not a hetpar plan, another schema version, or inconsistent.
        """
        if not isinstance(data, dict) or data.get("kind") != PLAN_KIND:
            raise PlanFileError("not a hetpar plan (no \"kind\": \"hetpar.plan\"); make one with `hetpar plan`")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise PlanFileError(
                f"plan schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}; re-run `hetpar plan`"
            )
        try:
            _check_name("schedule", data["schedule"], Schedule)
            for s in data["stages"]:
                for path, style in s.get("tp_sharding", {}).items():
                    _check_name(f"stage {s.get('index')} tp_sharding of {path!r}", style, Sharding)
            stages = [
                StagePlan(**{**s, "tp_sharding": {k: Sharding(v) for k, v in s.get("tp_sharding", {}).items()}})
                for s in data["stages"]
            ]
            return cls(
                **{
                    **data,
                    "model": ModelRef(**data["model"]),
                    "cluster": ClusterRef(**data["cluster"]),
                    "schedule": Schedule(data["schedule"]),
                    "stages": stages,
                    "predicted": Predicted(**data["predicted"]),
                    "solver": SolverInfo(**_renamed(data["solver"], wall_time_s="search_time_s")),
                }
            )
        except PlanFileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFileError(f"plan is malformed: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> "ParallelPlan":
        """Read a plan file.

        Raises:
            PlanFileError: missing, unreadable, not JSON, or not a valid plan.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanFileError(f"cannot read plan {str(path)!r}: {exc.strerror}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"plan {str(path)!r} is not valid JSON (line {exc.lineno}): {exc.msg}") from exc
        return cls.from_dict(data)


def _check_name(field: str, value: Any, name: type[Enum]) -> None:
    """Refuse a plan field that is not one of a vocabulary name's values, in one line."""
    if value not in tuple(name):
        raise PlanFileError(f"plan {field} {value!r} must be one of {', '.join(map(repr, name))}; re-run `hetpar plan`")


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    return value


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise



def _renamed(fields: dict, **old_to_new: str) -> dict:
    """``fields`` with keys of older plan files under their current names."""
    return {old_to_new.get(k, k): v for k, v in fields.items()}


# [Note: what the proof bounds]
# The search proves its best candidate optimal (or within its gap) for the linear step
# time of [Note: split objective], which CP-SAT optimises exactly; the plan's prediction is
# planner.estimate's simulation of the schedule ([Note: plan prediction]). The search then
# simulates its finalists and keeps the fastest by the simulation ([Note: finalists
# re-ranked] in planner/search/solve.py). Where the plan is not the linear optimum, or its
# two numbers differ by more than PROOF_AGREEMENT, the proof does not bound the printed
# number: ``proof_scope`` says in one line which number it bounds and how the printed
# plan was chosen.
PROOF_AGREEMENT = 0.02


def proof_scope(plan: ParallelPlan) -> str | None:
    """One line on what the search's proof is about, where the plan's printed step time
    and the objective the search minimised differ by more than PROOF_AGREEMENT; None
    where they agree, or no search proved anything ([Note: what the proof bounds])."""
    info, step = plan.solver, plan.predicted.step_time_s
    if info.status not in ("optimal", "feasible") or info.objective_s <= 0 or step <= 0:
        return None
    claim = "optimal" if info.status == "optimal" else f"within {info.objective_gap:.1%}"
    best = info.best_objective_s or info.objective_s
    others = info.finalists - 1
    if info.objective_s > best * (1 + 1e-9):
        return (f"proof: {claim} for the search's linear step time, {_seconds(best)} for another candidate; this plan's "
                f"is {_seconds(info.objective_s)}, and its simulated step above is the fastest of the search's "
                f"{info.finalists} finalists")
    apart = (step - info.objective_s) / info.objective_s
    if abs(apart) <= PROOF_AGREEMENT:
        return None
    ranked = f"no other of the search's {info.finalists} finalists simulates faster" if others > 0 else \
        "it ranks no other candidate"
    return (f"proof: {claim} for the search's linear step time, {_seconds(info.objective_s)} for this plan; the "
            f"predicted step above simulates the schedule and is {abs(apart):.0%} {'lower' if apart < 0 else 'higher'}; "
            f"{ranked}")


def _seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"

__all__ = [
    "PROOF_AGREEMENT",
    "ParallelPlan",
    "StagePlan",
    "ModelRef",
    "ClusterRef",
    "Predicted",
    "SolverInfo",
    "Schedule",
    "Sharding",
    "proof_scope",
    "write_text_atomic",
]
