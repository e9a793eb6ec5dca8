"""The stage split of a configuration the user gives without ``--stage-layers``, and the
shapes of a split: layers dealt out evenly, ranges from sizes.

[Note: default stage split]
Megatron-LM gives every pipeline stage (every virtual stage, interleaved) the same
number of transformer blocks and runs the layers before the first block (the
embedding) with the first stage and the layers after the last block (final norm and
head) with the last (Narayanan et al. 2021; megatron/core/transformer/transformer_block.py,
``get_num_layers_to_build``). Published configurations are laid out that way, so
``hetpar estimate`` does the same. The blocks are the longest run of consecutive layers
that repeat: equal ``cost_key`` (same kernels on the same shapes), or names
``prefix.N`` with N counting up (``blocks.7``, ``layers.7``), which also covers a block
that differs a little from its neighbours. Where the blocks do not divide by the
stages, or the model has no repeated layers, the layers are dealt out evenly by count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetpar.cost_models.layers import LayerProfile

_NUMBERED = re.compile(r"(.*)\.(\d+)")


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """(first, last) layer of each virtual stage, and the rule that chose them, in the user's words."""

    bounds: list[tuple[int, int]]
    layout: str


def default_split(layers: list[LayerProfile], num_chunks: int) -> StageSplit:
    """Megatron's split of ``layers`` over ``num_chunks`` virtual stages; see [Note: default stage split].

    Args:
        layers: the model's layers in order (ModelGraph.layers).
        num_chunks: pipeline stages times virtual stages.

    Returns:
        Megatron's split where the blocks divide by ``num_chunks``, else the even split by count.
    """
    first, last = block_run(layers)
    blocks = last - first + 1
    if blocks < 2 or blocks % num_chunks:
        return StageSplit(bounds=equal_split(len(layers), num_chunks), layout=f"even split of {len(layers)} layers")
    each = blocks // num_chunks
    sizes = [each] * num_chunks
    sizes[0] += first
    sizes[-1] += len(layers) - 1 - last
    return StageSplit(bounds=bounds_from_sizes(sizes), layout="Megatron (blocks evenly, embedding with the first stage, head with the last)")


def block_run(layers: list[LayerProfile]) -> tuple[int, int]:
    """(first, last) index of the longest run of repeated layers, the earliest of equal runs; a single layer
    where nothing repeats."""
    best, start = (0, 0), 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or not _repeats(layers[i - 1], layers[i]):
            if i - 1 - start > best[1] - best[0]:
                best = (start, i - 1)
            start = i
    return best


def _repeats(before: LayerProfile, after: LayerProfile) -> bool:
    if before.cost_key == after.cost_key:
        return True
    a, b = _NUMBERED.fullmatch(before.name), _NUMBERED.fullmatch(after.name)
    return a is not None and b is not None and a[1] == b[1] and int(b[2]) == int(a[2]) + 1


def equal_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layers dealt out as evenly as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return bounds_from_sizes([base + (1 if s < extra else 0) for s in range(num_stages)])


def bounds_from_sizes(sizes) -> list[tuple[int, int]]:
    """Inclusive (first, last) layer of each stage from the number of layers per stage."""
    bounds, first = [], 0
    for size in sizes:
        bounds.append((first, first + size - 1))
        first += size
    return bounds


__all__ = ["StageSplit", "block_run", "bounds_from_sizes", "default_split", "equal_split"]
