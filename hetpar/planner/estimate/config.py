"""One parallel configuration to estimate, as ``hetpar estimate`` takes it, checking itself on construction."""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.grad_sync import PLAIN, SyncMethod
from hetpar.planner.errors import PlanningError
from hetpar.vocabulary import DType, Optimizer, Recompute, Schedule, ZeroStage


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
    schedule: str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    recompute: str = Recompute.NONE
    zero_stage: int = 0
    optimizer: str = Optimizer.ADAMW
    stage_layers: tuple[int, ...] | None = None  # layers per virtual stage, p * v entries
    stage_devices: tuple[str, ...] | None = None  # device type per pipeline rank, p entries
    stage_recompute: tuple[str, ...] | None = None  # recompute per virtual stage, p * v entries; ``recompute`` for all when None
    stage_zero: tuple[int, ...] | None = None  # ZeRO stage per pipeline rank, p entries; ``zero_stage`` for all when None
    stage_tp: tuple[int, ...] | None = None  # tensor-parallel degree per pipeline rank, p entries; ``tp`` for all when None
    replica_batch_shares: tuple[int, ...] | None = None  # micro-batch size per replica (dp entries); ``micro_batch_size`` each when None
    # tensor-parallel degree per replica (dp entries), where replicas differ ([Note: replicas of different degrees] in
    # runtime/mixed_sync.py; planner.strategies.hetero_dp estimates such plans); ``tp`` each when None
    replica_tp: tuple[int, ...] | None = None
    scatter_gather: bool = True  # Megatron's p2p optimisation (Narayanan et al. 2021, section 4.1)
    overlap_grad_reduce: bool = False
    kernel_efficiency: float | None = None  # None: each device's own (cost_models.compute.training_efficiency)
    sync: SyncMethod = PLAIN  # how the replicas agree under zero_stage 0 ([Note: sync method costs])
    ep: int = 1  # expert parallelism: experts split over runs of ep replicas ([Note: expert parallelism costs])
    expert_imbalance: float = 1.0  # the busiest expert-parallel rank's rows over the uniform share ([Note: expert load])
    cp: int = 1  # context parallelism: every sequence split over cp ranks ([Note: context parallelism costs])
    sequence_parallel: bool = False  # sequence parallelism on every stage with tp > 1 ([Note: sequence parallelism costs])
    stage_sp: tuple[bool, ...] | None = None  # sequence parallelism per pipeline rank, p entries; ``sequence_parallel`` when None
    offload: bool = False  # ZeRO-3 shards in host memory on every rank ([Note: offload costs] in cost_models.offload)
    stage_offload: tuple[bool, ...] | None = None  # offload per pipeline rank, p entries; ``offload`` when None

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "dp", "tp", "pp", "micro_batch_size", "virtual_stages", "ep", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise EstimateError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        self._check_choices()
        per_step = self._per_step()
        if self.global_batch_size % per_step:
            which = f"sum(replica_batch_shares) = {per_step}" if self.replica_batch_shares else \
                f"dp({self.dp}) * micro_batch_size({self.micro_batch_size}) = {per_step}"
            raise EstimateError(f"global batch {self.global_batch_size} is not a multiple of {which}")
        if self.schedule == Schedule.INTERLEAVED and self.num_microbatches % self.pp:
            raise EstimateError(
                f"the interleaved schedule needs micro-batches ({self.num_microbatches}) to be a multiple of pp({self.pp})"
            )
        self._check_stage_lists()
        self._check_experts()
        self._check_context()

    def _check_context(self) -> None:
        if self.stage_sp is not None and len(self.stage_sp) != self.pp:
            raise EstimateError(f"stage_sp has {len(self.stage_sp)} entries, pp({self.pp}) needed")
        if self.stage_offload is not None and len(self.stage_offload) != self.pp:
            raise EstimateError(f"stage_offload has {len(self.stage_offload)} entries, pp({self.pp}) needed")
        if self.cp == 1:
            return
        if self.ep > 1:
            raise EstimateError(f"context parallelism {self.cp} runs without expert parallelism (got ep {self.ep})")
        if self.virtual_stages > 1:
            raise EstimateError(f"context parallelism {self.cp} runs without virtual stages (got {self.virtual_stages})")
        if self.replica_batch_shares is not None:
            raise EstimateError(f"context parallelism {self.cp} runs with equal replica shares")

    def _check_experts(self) -> None:
        if not (isinstance(self.expert_imbalance, (int, float)) and self.expert_imbalance >= 1.0):
            raise EstimateError(f"expert imbalance must be a number >= 1 (1: uniform routing), got {self.expert_imbalance!r}")
        if self.ep == 1:
            return
        if self.dp % self.ep:
            raise EstimateError(f"expert parallelism {self.ep} must divide dp({self.dp}): the experts split over replicas")
        zero = [r for r in range(self.pp) if self.zero_of(r)]
        if zero:
            raise EstimateError(f"expert parallelism {self.ep} runs with ZeRO 0; pipeline rank {zero[0]} has ZeRO "
                                f"{self.zero_of(zero[0])}")
        if self.virtual_stages > 1:
            raise EstimateError(f"expert parallelism {self.ep} runs without virtual stages (got {self.virtual_stages})")

    def _check_choices(self) -> None:
        choices = (
            ("schedule", self.schedule, tuple(Schedule)),
            ("recompute", self.recompute, tuple(Recompute)),
            ("zero", self.zero_stage, tuple(ZeroStage)),
            ("optimizer", self.optimizer, tuple(Optimizer)),
        )
        for name, value, allowed in choices:
            if value not in allowed:
                raise EstimateError(f"unknown {name} {value!r}; use one of {', '.join(str(a) for a in allowed)}")
        if self.virtual_stages > 1 and self.schedule != Schedule.INTERLEAVED:
            raise EstimateError(f"virtual stages ({self.virtual_stages}) need --schedule interleaved, not {self.schedule}")
        if self.dtype not in tuple(DType):
            raise EstimateError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DType)}")
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
                if value not in tuple(Recompute):
                    raise EstimateError(f"unknown recompute {value!r}; use one of {', '.join(Recompute)}")
        shares = self.replica_batch_shares
        if shares is not None:
            if len(shares) != self.dp or any(not isinstance(b, int) or b < 1 for b in shares):
                raise EstimateError(f"replica_batch_shares {list(shares)}: one positive micro-batch size per replica, dp({self.dp}) needed")
            if sum(shares) // self.dp != self.micro_batch_size:
                raise EstimateError(f"replica_batch_shares {list(shares)}: micro_batch_size({self.micro_batch_size}) "
                                    f"must be their mean, rounded down ({sum(shares) // self.dp})")
        if self.replica_tp is not None:
            if len(self.replica_tp) != self.dp or any(not isinstance(t, int) or t < 1 for t in self.replica_tp):
                raise EstimateError(f"replica_tp {list(self.replica_tp)}: one positive degree per replica, dp({self.dp}) "
                                    f"needed")
            if self.replica_tp[0] != self.tp:
                raise EstimateError(f"replica_tp {list(self.replica_tp)} starts with replica 0's degree, tp({self.tp})")
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
                if value not in tuple(ZeroStage):
                    raise EstimateError(f"unknown zero {value!r}; use one of 0, 1, 2, 3")

    def recompute_of(self, chunk: int) -> str:
        """The recompute mode of virtual stage ``chunk``."""
        return self.stage_recompute[chunk] if self.stage_recompute is not None else self.recompute

    @property
    def replica_rows(self) -> int:
        """Rows of ranks per stage: dp data replicas x cp ranks sharing each sequence. They
        hold the same parameters: gradients sync and ZeRO shards over all of them."""
        return self.dp * self.cp

    def sp_of(self, rank: int) -> bool:
        """Whether pipeline rank ``rank`` runs sequence parallelism (only where its tp > 1)."""
        on = self.stage_sp[rank] if self.stage_sp is not None else self.sequence_parallel
        return bool(on) and self.tp_of(rank) > 1

    def tp_of(self, rank: int) -> int:
        """The tensor-parallel degree of pipeline rank ``rank``."""
        return self.stage_tp[rank] if self.stage_tp is not None else self.tp

    @property
    def devices_per_replica(self) -> int:
        """The devices one data-parallel replica spans: the sum of the stages' degrees."""
        return sum(self.tp_of(r) for r in range(self.pp))

    def offload_of(self, rank: int) -> bool:
        """Whether pipeline rank ``rank`` keeps its ZeRO-3 shard in host memory."""
        return bool(self.stage_offload[rank] if self.stage_offload is not None else self.offload)

    def zero_of(self, rank: int) -> int:
        """The ZeRO stage of pipeline rank ``rank``."""
        return self.stage_zero[rank] if self.stage_zero is not None else self.zero_stage

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica per step."""
        return self.global_batch_size // self._per_step()

    def _per_step(self) -> int:
        """Samples of one micro-batch over every replica: the shares' sum, or dp * micro_batch_size."""
        shares = self.replica_batch_shares
        if shares and all(isinstance(b, int) and b >= 1 for b in shares):
            return sum(shares)
        return self.dp * self.micro_batch_size
