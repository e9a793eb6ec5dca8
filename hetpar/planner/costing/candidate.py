"""What the search fixes outside the CP-SAT model (a ``Candidate``), and the stage modes it offers inside."""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.grad_sync import PLAIN, SyncMethod
from hetpar.vocabulary import Recompute


@dataclass(frozen=True, order=True)
class StageMode:
    """What one stage (chunk) chooses inside the CP-SAT model."""

    recompute: str = Recompute.NONE  # "none" | "selective" | "full"
    zero_stage: int = 0
    tp: int = 1  # tensor-parallel degree of the stage
    sp: bool = False  # sequence parallelism inside the stage's tp group (tp > 1 only)
    offload: bool = False  # the ZeRO-3 shard in host memory ([Note: offload costs] in cost_models.offload); zero 3 only

    def describe(self) -> str:
        parts = ([f"recompute {self.recompute}"] if self.recompute != Recompute.NONE else []) + ([f"zero {self.zero_stage}"] if self.zero_stage else []) \
            + (["sp"] if self.sp else []) + (["offload"] if self.offload else [])
        return ", ".join(parts) or "plain"


# [Note: per-stage tensor parallelism]
# Each stage chooses its tensor-parallel degree inside the CP-SAT model, as part of its
# mode. A candidate fixes dp, pp, the micro-batch, the schedule and, on a cluster whose
# device types host whole stages, how many stages each type hosts; the stages on type t
# then have tensor-parallel degrees that sum to n_t / dp (n_t: the type's devices), so
# every device runs exactly one stage replica. The degrees offered are the divisors of
# the node width up to --max-tp that form a chain (each divides the next: powers of
# two), so the stages' blocks pack every node exactly (largest first, each block
# aligned to its size; ``pack_stage_ranks``) and a tensor-parallel group never leaves
# its node; a candidate offers two neighbours of that chain, or the few degrees that
# can sum right ([Note: stage counts] in planner.search.candidates). A layer that does not split a
# stage's degree forbids that degree to any
# chunk that holds it (its time is infinite; the CP-SAT model excludes the pair). A
# stage's degree changes its layers' time, memory and all-reduces, its data-parallel
# collectives and the hand-off to the next stage: between equal degrees Megatron's
# scatter/gather (p2p of 1/a of the tensor, then an all-gather), between different
# degrees what the runtime runs (receiver t reads the whole tensor from sender t mod a,
# so a sender sends ceil(b / a) whole tensors, one after another). The tables are
# costed on representative ranks per (type, degree); the plan's exact ranks are costed
# again after the solve ([Note: stage device types]).
@dataclass(frozen=True, kw_only=True)
class Candidate:
    """The choices the search enumerates outside the CP-SAT model, and the stage modes it offers inside."""

    dp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int = 1
    modes: tuple[StageMode, ...] = (StageMode(),)
    # Device type -> the sum of its stages' tensor-parallel degrees (n_t / dp), on
    # clusters whose types host whole stages; empty when the layout is Megatron's over
    # mixed devices (one degree for all). See [Note: per-stage tensor parallelism].
    tp_sum: tuple[tuple[str, int], ...] = ()
    stages_per_type: tuple[tuple[str, int], ...] = ()  # device type -> pipeline ranks it hosts (when typed)
    sync: SyncMethod = PLAIN  # how the replicas agree ([Note: sync method costs] in cost_models.grad_sync)
    ep: int = 1  # expert parallelism: each stage's experts split over runs of ep replicas ([Note: expert parallelism costs])
    expert_load: float = 1.0  # the busiest expert-parallel rank's rows over the uniform share ([Note: expert load])
    # context parallelism: every sequence split over runs of cp of the ``dp`` replica rows,
    # which are then dp / cp data replicas x cp ([Note: context parallelism costs]); the
    # tables cost ``dp`` rows of the model at 1/cp of its tokens
    cp: int = 1

    @property
    def data_replicas(self) -> int:
        """The data-parallel degree of the plan: ``dp`` rows over ``cp``."""
        return self.dp // self.cp

    @property
    def num_chunks(self) -> int:
        """Stages of the plan: pp * virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees the modes offer, ascending."""
        return tuple(sorted({m.tp for m in self.modes}))

    @property
    def tp(self) -> int | None:
        """The one tensor-parallel degree of every stage, or None when stages choose among several."""
        degrees = self.tp_degrees
        return degrees[0] if len(degrees) == 1 else None

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        tp = f"tp={self.tp}" if self.tp is not None else "tp=" + "|".join(map(str, self.tp_degrees))
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        if self.cp > 1:
            return f"dp={self.data_replicas} cp={self.cp} {tp} pp={self.pp} micro-batch {self.micro_batch_size}x{self.num_microbatches} {self.schedule}"
        return f"dp={self.dp}{ep} {tp} pp={self.pp} micro-batch {self.micro_batch_size}x{self.num_microbatches} {self.schedule}{v}"
