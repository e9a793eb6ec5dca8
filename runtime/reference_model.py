"""The reference model ``hetpar profile`` trains to calibrate kernel efficiency.

A model file (docs/model-file.md) of fixed size, unlike any example: two pre-norm
transformer blocks (hidden 192, 6 heads, sequence 48, GELU MLP) and two residual ReLU
MLP blocks (width 320), on float inputs. The profile times its forward and backward in
every worker at once (runtime/profiler.py ``reference_times``); the planner traces it
like any model; cost_models/calibrate.py sets ``kernel_efficiency`` to what the layer
cost model needs to match the time ([Note: calibrated fits]).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, HEADS, SEQ, WIDTH = 192, 6, 48, 320
BATCH = 4  # samples per timed forward and backward


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, HIDDEN))


class _TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = _Attention()
        self.fc, self.proj = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class _MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ReferenceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_TransformerBlock(), _TransformerBlock()])
        self.bridge = nn.Linear(SEQ * HIDDEN, WIDTH)
        self.mlp = nn.ModuleList([_MLPBlock(), _MLPBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = self.bridge(x.flatten(1))
        for block in self.mlp:
            x = block(x)
        return x


def build_model() -> nn.Module:
    return ReferenceModel()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, HIDDEN),)
