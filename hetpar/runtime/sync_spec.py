"""How data-parallel replicas agree, as the plan writes it: gradient compression,
aggregation rule and local-SGD period, parsed and checked. No torch here, so the planner
validates plans with the same rules the program runs by.

- compression: ``none``, ``bf16``, ``fp16``, ``powersgd`` or ``powersgd:R`` (rank R),
  ``topk:F`` (the largest fraction F of each bucket, 0 < F <= 1), ``sign`` (1 bit per
  element and one scale per bucket). ``topk`` and ``sign`` keep an error-feedback
  residual per replica.
- aggregation: ``mean``, ``trimmed-mean:B`` (drop the B largest and B smallest of each
  coordinate), ``median`` (coordinate-wise), ``krum:F`` (the replica whose gradient is
  nearest its dp - F - 2 nearest others, tolerating F bad replicas).
- sync_every K with sync_scope ``all`` (average parameters and optimizer state every K
  steps, none in between) or ``node`` (all-reduce gradients inside a node every step,
  average across nodes every K steps).

docs/running.md says which of these are exact and which change the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.vocabulary import AggregationKind, CompressionKind, SyncScope

COMPRESSION_SYNTAX = "none|bf16|fp16|powersgd:R|topk:F|sign"
AGGREGATION_SYNTAX = "mean|trimmed-mean:B|median|krum:F"


@dataclass(frozen=True)
class Compression:
    """A parsed ``grad_compression``."""

    kind: str  # one of tuple(CompressionKind)
    rank: int | None = None  # powersgd: approximation rank; None: the program's --powersgd-rank
    fraction: float | None = None  # topk: fraction of each bucket's elements sent

    def __str__(self) -> str:
        if self.kind == CompressionKind.POWERSGD and self.rank is not None:
            return f"powersgd:{self.rank}"
        if self.kind == CompressionKind.TOPK:
            return f"topk:{self.fraction:g}"
        return str(self.kind)

    @property
    def lossy(self) -> bool:
        """Whether the averaged gradient differs from plain all-reduce's."""
        return self.kind != CompressionKind.NONE

    @property
    def gathers(self) -> bool:
        """Whether replicas exchange their compressed gradients by all-gather (sparse or
        bit-packed payloads do not add up in an all-reduce)."""
        return self.kind in (CompressionKind.TOPK, CompressionKind.SIGN)


@dataclass(frozen=True)
class Aggregation:
    """A parsed ``aggregation``."""

    kind: str  # one of tuple(AggregationKind)
    param: int = 0  # trimmed-mean: B per side; krum: F bad replicas tolerated

    def __str__(self) -> str:
        return f"{self.kind}:{self.param}" if self.kind in (AggregationKind.TRIMMED_MEAN, AggregationKind.KRUM) else str(self.kind)

    @property
    def robust(self) -> bool:
        return self.kind != AggregationKind.MEAN

    def min_replicas(self) -> int:
        """The fewest data-parallel replicas the rule is defined for."""
        if self.kind == AggregationKind.TRIMMED_MEAN:
            return 2 * self.param + 1
        if self.kind == AggregationKind.KRUM:
            return self.param + 3  # a score needs n - f - 2 >= 1 neighbours; Krum's guarantee needs n > 2f + 2
        return 1


def parse_compression(text: str) -> Compression:
    """``text`` as a Compression.

    Raises:
        ValueError: one line naming the accepted forms.
    """
    kind, _, arg = str(text).partition(":")
    bad = ValueError(f"grad_compression {text!r} must be one of {COMPRESSION_SYNTAX} (R >= 1, 0 < F <= 1)")
    if kind not in tuple(CompressionKind):
        raise bad
    if kind == CompressionKind.POWERSGD:
        if not arg:
            return Compression(CompressionKind.POWERSGD)
        if not arg.isdigit() or int(arg) < 1:
            raise bad
        return Compression(CompressionKind.POWERSGD, rank=int(arg))
    if kind == CompressionKind.TOPK:
        try:
            fraction = float(arg)
        except ValueError:
            raise bad from None
        if not 0 < fraction <= 1:
            raise bad
        return Compression(CompressionKind.TOPK, fraction=fraction)
    if arg:
        raise bad
    return Compression(kind)


def parse_aggregation(text: str) -> Aggregation:
    """``text`` as an Aggregation.

    Raises:
        ValueError: one line naming the accepted forms.
    """
    kind, _, arg = str(text).partition(":")
    bad = ValueError(f"aggregation {text!r} must be one of {AGGREGATION_SYNTAX} (B, F >= 0 integers)")
    if kind not in tuple(AggregationKind):
        raise bad
    if kind in (AggregationKind.TRIMMED_MEAN, AggregationKind.KRUM):
        if not arg.isdigit():
            raise bad
        return Aggregation(kind, int(arg))
    if arg:
        raise bad
    return Aggregation(kind)


def check_sync(compression: str, aggregation: str, sync_every: int, sync_scope: str, *, data_parallel: int,
               zero_stages: list[int], equal_shares: bool) -> None:
    """Check that a combination of the options runs.

    Raises:
        ValueError: one line saying which options clash and what to change.
    """
    comp, agg = parse_compression(compression), parse_aggregation(aggregation)
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every {sync_every!r} must be an integer >= 1")
    if sync_scope not in tuple(SyncScope):
        raise ValueError(f"sync_scope {sync_scope!r} must be one of {', '.join(SyncScope)}")
    local_sgd = sync_every > 1
    chosen = [name for name, on in ((f"grad_compression {compression!r}", comp.lossy), (f"aggregation {aggregation!r}", agg.robust),
                                    (f"sync_every {sync_every}", local_sgd)) if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} do not combine; choose one way to sync the replicas")
    zero = [i for i, z in enumerate(zero_stages) if z > 0]
    if chosen and zero:
        raise ValueError(f"{chosen[0]} needs zero_stage 0 on every stage (FSDP reduces its own gradients), "
                         f"stage {zero[0]} has zero_stage {zero_stages[zero[0]]}")
    if agg.robust and data_parallel < agg.min_replicas():
        raise ValueError(f"aggregation {agg} needs at least {agg.min_replicas()} data-parallel replicas, "
                         f"the plan has {data_parallel}")
    if (agg.robust or local_sgd) and not equal_shares:
        raise ValueError(f"{chosen[0]} needs equal replica batch shares (replica_batch_shares unset)")
    if sync_scope == SyncScope.NODE and not local_sgd:
        raise ValueError("sync_scope 'node' applies to local SGD; give sync_every K > 1 with it")


__all__ = [
    "AGGREGATION_SYNTAX", "Aggregation", "COMPRESSION_SYNTAX", "Compression",
    "check_sync", "parse_aggregation", "parse_compression",
]
