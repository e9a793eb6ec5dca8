"""A residual MLP regressor: a stack of identical blocks between an input and an output
projection. No batches() or loss_fn(): hetpar uses synthetic data and mean squared error.

    hetpar plan examples/mlp.py --cluster 1x2xcpu --global-batch 16 --model-arg depth=8
"""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build_model(depth=4, width=64, in_features=32, out_features=8):
    return nn.Sequential(
        nn.Linear(in_features, width),
        *[Block(width) for _ in range(depth)],
        nn.LayerNorm(width),
        nn.Linear(width, out_features),
    )


def example_inputs(batch_size, in_features=32, **_):
    return (torch.randn(batch_size, in_features),)
