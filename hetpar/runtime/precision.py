"""Mixed precision: dynamic loss scaling for fp16, agreed by every rank; TF32 matmuls.

[Note: mixed precision]
Forward passes run under ``torch.autocast`` in the plan's dtype; parameters, gradients
and optimizer state stay float32 (the "master weights"), so the optimizer updates in
full precision. bf16 has float32's exponent range and needs nothing more. fp16 does:
small gradients underflow to zero, so the backward starts from the loss times a scale
S, and the gradients are divided by S before the optimizer step. If any gradient is
inf or NaN the step is skipped and S halves; after ``growth_interval`` good steps S
doubles. That is ``torch.amp.GradScaler``'s rule with its defaults, with one change:
the overflow check is all-reduced over every rank, because a pipeline stage or a
replica that skipped a step alone would leave the model inconsistent. (GradScaler
checks only the gradients of the optimizer it is given.)
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


class LossScaler:
    """Dynamic loss scaling; see [Note: mixed precision]. Disabled, ``scale`` is 1 and
    ``unscale_and_check`` does nothing."""

    def __init__(
        self,
        *,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps since the scale last changed
        self.skipped_steps = 0

    def unscale_and_check(self, params: Iterable[nn.Parameter]) -> bool:
        """Divide the gradients by the scale and update the scale (collective when enabled).

        Returns:
            True when the optimizer may step: every gradient on every rank is finite.
        """
        if not self.enabled:
            return True
        grads = [_local(p.grad) for p in params if p.grad is not None]
        found_inf = torch.zeros(1, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(1.0 / self.scale)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().float())  # no host sync per tensor
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        finite = found_inf.item() == 0
        self._update(finite)
        return finite

    def _update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allow_tf32(device: torch.device) -> None:
    """Run float32 matmuls and convolutions on TF32 tensor cores, as a plan of dtype "tf32"
    is costed (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``).

    [Note: TF32]
    TF32 keeps float32 tensors and float32 accumulation but rounds matmul inputs to a
    10-bit mantissa, at the tensor cores' TF32 rate (A100: 156 TFLOP/s against 19.5 for
    float32). torch runs float32 matmuls in IEEE float32 by default and cuDNN
    convolutions in TF32; a "tf32" plan turns both on, an "fp32" plan leaves torch's
    defaults (so a convolution of an fp32 plan may run faster than costed). On a device
    without TF32 tensor cores (before Ampere, CPUs) the switches change nothing and the
    costs use the fp32 rate (``DeviceProfile.peak_flops``), so this is a no-op off CUDA.
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


__all__ = ["LossScaler", "allow_tf32"]
