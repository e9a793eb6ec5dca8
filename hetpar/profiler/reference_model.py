"""The reference model ``hetpar profile`` trains to calibrate kernel efficiency.

A model file (docs/model-file.md) of fixed size, unlike any example: two pre-norm
transformer blocks (GELU MLP) and two residual ReLU MLP blocks, on float inputs, in one
of two sizes (model arg ``size``):

- ``cpu``: hidden 192, 6 heads, sequence 48, MLP width 320; the transformer's output
  is flattened into the MLP blocks, so they run on ``BATCH`` rows, as a small model's
  classifier head does;
- ``cuda``: hidden 2048, 16 heads, sequence 1024, MLP width 2048, the MLP blocks on
  every token (flattening 1024 x 2048 features would be a 4-billion-weight Linear), so
  that a GPU's kernels are not launch-bound: about 1.5 TFLOPs per forward.

The profile times its forward and backward in every worker at once
(profiler/reference.py ``reference_times``); the planner traces it like any model;
cost_models/calibrate.py sets ``kernel_efficiency`` to what the layer cost model needs
to match the time ([Note: calibrated fits]).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "cpu": {"hidden": 192, "heads": 6, "seq": 48, "width": 320, "flatten": True},
    "cuda": {"hidden": 2048, "heads": 16, "seq": 1024, "width": 2048, "flatten": False},
}
BATCH = {"cpu": 4, "cuda": 4}  # samples per timed forward and backward, by size


def size_for(device_type: str) -> str:
    """The reference model's size for a worker on ``device_type`` ("cuda" or "cpu")."""
    return "cuda" if device_type == "cuda" else "cpu"


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.hidden))


class _TransformerBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads)
        self.fc, self.proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class _MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ReferenceModel(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int, width: int, flatten: bool) -> None:
        super().__init__()
        self.flatten = flatten
        self.blocks = nn.ModuleList([_TransformerBlock(hidden, heads), _TransformerBlock(hidden, heads)])
        self.bridge = nn.Linear(seq * hidden if flatten else hidden, width)
        self.mlp = nn.ModuleList([_MLPBlock(width), _MLPBlock(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = self.bridge(x.flatten(1) if self.flatten else x)
        for block in self.mlp:
            x = block(x)
        return x


def build_model(size: str = "cpu") -> nn.Module:
    s = SIZES[size]
    return ReferenceModel(s["hidden"], s["heads"], s["seq"], s["width"], s["flatten"])


def example_inputs(batch_size: int, size: str = "cpu") -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SIZES[size]["seq"], SIZES[size]["hidden"]),)
