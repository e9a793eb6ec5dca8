"""What an estimate reports: the step split on its busiest rank, each pipeline rank's times and
memory, throughput and MFU, and its JSON form.

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
it), the host link (an offloaded shard's copies around those gathers, in full too;
[Note: offload costs] in cost_models/offload.py) and the optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hetpar.cost_models.memory import MemoryBreakdown
from hetpar.planner.estimate.config import EstimateConfig
from hetpar.planner.plan import Predicted
from hetpar.runtime.schedule import TimedRun


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
    ep_comm_s: float = 0.0  # expert-parallel all-to-alls ([Note: expert parallelism costs])
    cp_comm_s: float = 0.0  # context-parallel key and value exchanges ([Note: context parallelism costs])
    host_comm_s: float = 0.0  # offloaded shards over the host link ([Note: offload costs])

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.optimizer_s
                + self.ep_comm_s + self.cp_comm_s + self.host_comm_s)


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
