"""Memory of one pipeline stage on one device.

[Note: training-state bytes per parameter]
fp32 training keeps weights, gradients and Adam's two moments in fp32: 4 + 4 + 8 = 16
bytes per parameter. Mixed precision (bf16/fp16) keeps half-precision weights and
gradients plus fp32 master weights and moments: 2 + 2 + 4 + 8 = 16 bytes (ZeRO paper,
Rajbhandari et al. 2020, section 3.1: "16Ψ bytes"). SGD without momentum drops the
moments: 8 bytes (fp32) or 2 + 2 + 4 = 8 (mixed).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import dtype_bytes
from cost_models.layers import LayerProfile

# Allocator fragmentation and workspace margin on top of the tensors we count: a
# documented conservative choice (PyTorch's caching allocator typically reserves
# 5-15% above allocated bytes), not a measured constant.
FRAGMENTATION_MARGIN = 1.10


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one device of a stage needs, by term."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        raw = self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes
        return raw * FRAGMENTATION_MARGIN

    def dominant_term(self) -> str:
        terms = {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": self.optimizer_bytes,
            "activations": self.activations_bytes,
        }
        return max(terms, key=terms.get)


def state_bytes_per_param(dtype: str, optimizer: str = "adamw") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter; see [Note: training-state bytes per parameter]."""
    w = dtype_bytes(dtype)
    master = 4 if w < 4 else 0
    moments = 8 if optimizer == "adamw" else 0
    return float(w), float(w), float(master + moments)


def stage_memory(
    layers: list[LayerProfile], *, tp: int, micro_batch_size: int, in_flight: int, dtype: str, optimizer: str = "adamw"
) -> MemoryBreakdown:
    """Memory of a stage holding ``layers`` on one tensor-parallel rank.

    Args:
        in_flight: micro-batches whose activations the schedule keeps at once on this stage.
    """
    params = sum(l.params_at(tp) for l in layers)
    w, g, o = state_bytes_per_param(dtype, optimizer)
    scale = dtype_bytes(dtype) / 4
    acts = sum(l.saved_bytes_at(tp) for l in layers) * micro_batch_size * in_flight * scale
    return MemoryBreakdown(weights_bytes=params * w, gradients_bytes=params * g, optimizer_bytes=params * o, activations_bytes=acts)
