"""The data-parallel sync options of a request, as the planner searches and prices them.

``DataParallelSync`` is what the user asked for (``--grad-compression``,
``--aggregation``, ``--sync-every``, ``--sync-scope``, ``--rebalance-every``,
``--allow-lossy-sync``), checked with the runtime's own rules (runtime.sync_spec);
``cost_method`` turns one choice into the cost model's ``SyncMethod``
([Note: sync method costs] in cost_models.grad_sync). Under ``--allow-lossy-sync`` with
compression left open, the search plans once per entry of ``LOSSY_CHOICES`` and keeps the
fastest prediction, the exact all-reduce unless a lossy method is at least
``LOSSY_MIN_GAIN`` faster ([Note: lossy sync choice]).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cost_models.grad_sync import OPTIMIZER_STATE_BYTES, PLAIN, SyncMethod
from hetpar.planner.errors import PlanningError
from hetpar.runtime.sync_spec import check_sync, parse_aggregation, parse_compression
from hetpar.vocabulary import AggregationKind, CompressionKind, SyncScope

# [Note: lossy sync choice]
# The compressions the search weighs when the user allows lossy sync: bf16 (half the
# bytes, near-exact), PowerSGD at rank 4 (Vogels et al., NeurIPS 2019, train at ranks
# 1-4), top-k at 1% with error feedback (Lin et al., ICLR 2018, send 0.1-1%), and scaled
# sign (1 bit). fp16 costs what bf16 does with a narrower range, so it is never picked
# over it. A lossy method changes what is trained, so it must earn its place: it is
# chosen only when predicted at least LOSSY_MIN_GAIN faster than the exact all-reduce,
# that is when the gradient all-reduce is on the step's critical path.
LOSSY_CHOICES = (CompressionKind.BF16, "powersgd:4", "topk:0.01", CompressionKind.SIGN)
LOSSY_MIN_GAIN = 0.02


@dataclass(frozen=True, kw_only=True)
class DataParallelSync:
    """The data-parallel sync a request pins or leaves open."""

    grad_compression: str | None = None  # None: "none", or the search's choice under allow_lossy
    aggregation: str = AggregationKind.MEAN
    sync_every: int = 1
    sync_scope: str = SyncScope.ALL
    rebalance_every: int = 0
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        try:
            check_sync(self.grad_compression or CompressionKind.NONE, self.aggregation, self.sync_every, self.sync_scope,
                       data_parallel=2**30, zero_stages=[], equal_shares=True)
        except ValueError as exc:
            raise PlanningError(_as_option(str(exc))) from None
        if not isinstance(self.rebalance_every, int) or self.rebalance_every < 0:
            raise PlanningError(f"--rebalance-every {self.rebalance_every!r} must be an integer >= 0 (0: never)")
        if self.allow_lossy and (self.aggregation != AggregationKind.MEAN or self.sync_every > 1):
            raise PlanningError("--allow-lossy-sync chooses a gradient compression; it does not combine with "
                                "--aggregation or --sync-every")

    @property
    def compressions(self) -> tuple[str, ...]:
        """The compressions to plan with: the pinned one, or exact first then the lossy ones allowed."""
        if self.grad_compression is not None:
            return (self.grad_compression,)
        return (CompressionKind.NONE, *LOSSY_CHOICES) if self.allow_lossy else (CompressionKind.NONE,)

    @property
    def exact(self) -> bool:
        """Whether the sync leaves the algorithm as one process runs it (rebalancing does)."""
        return self.grad_compression in (None, CompressionKind.NONE) and not self.allow_lossy and self.aggregation == AggregationKind.MEAN \
            and self.sync_every == 1


def cost_method(compression: str, aggregation: str, sync_every: int, sync_scope: str, *, optimizer: str,
                width: float) -> SyncMethod:
    """The cost model's view of one combination of the options (already checked).

    Args:
        width: the model's typical weight-matrix width (``matrix_width``), for PowerSGD.
    """
    comp, agg = parse_compression(compression), parse_aggregation(aggregation)
    if sync_every > 1:
        return SyncMethod(name=f"local SGD every {sync_every}" + (" across nodes" if sync_scope == SyncScope.NODE else ""),
                          kind="local_sgd", every=sync_every, inside_node=sync_scope == SyncScope.NODE,
                          state_bytes=OPTIMIZER_STATE_BYTES[optimizer])
    if agg.robust:
        return SyncMethod(name=str(agg), kind=AggregationKind.KRUM if agg.kind == AggregationKind.KRUM else "coordinate")
    if comp.kind in (CompressionKind.BF16, CompressionKind.FP16):
        return SyncMethod(name=str(comp), kind="cast")
    if comp.kind == CompressionKind.POWERSGD:
        return SyncMethod(name=str(comp), kind=CompressionKind.POWERSGD, rank=comp.rank or 1, width=width)
    if comp.kind in (CompressionKind.TOPK, CompressionKind.SIGN):
        return SyncMethod(name=str(comp), kind=comp.kind, fraction=comp.fraction or 1.0)
    return PLAIN


def matrix_width(layers) -> float:
    """The model's typical weight-matrix width: its matmuls' sqrt(K N), weighted by FLOPs
    (``LayerProfile.matmul_rows``); 1 for a model without matmuls."""
    total = weighted = 0.0
    for layer in layers:
        for _, _, share, width in layer.matmul_rows:
            flops = share * layer.fwd_flops
            total += flops
            weighted += flops * width
    return weighted / total if total > 0 else 1.0


def _as_option(message: str) -> str:
    """A plan-field message in the CLI's option names."""
    for field, option in (("grad_compression", "--grad-compression"), ("aggregation", "--aggregation"),
                          ("sync_every", "--sync-every"), ("sync_scope", "--sync-scope")):
        message = message.replace(field, option)
    return message


__all__ = ["DataParallelSync", "LOSSY_CHOICES", "LOSSY_MIN_GAIN", "cost_method", "matrix_width"]
