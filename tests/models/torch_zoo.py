"""Plain torch models for the tracing tests: one model file, ``kind`` picks the model.

    hetpar trace tests/models/torch_zoo.py --model-arg kind=mha

Kinds: ``sequential`` (blocks in an nn.Sequential), ``moduledict`` (blocks in an
nn.ModuleDict), ``mha`` (nn.MultiheadAttention blocks in an nn.ModuleList),
``encdec`` (two ModuleLists: encoder and decoder blocks), ``shape_branch`` (a block
that branches on a shape: torch.fx fails, torch.export works), ``data_branch`` (a
block that branches on tensor values: nothing traces on the meta device).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN = 32
SEQ = 8


class ResidualMLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.proj(F.relu(self.fc(self.norm(x))))


class MHABlock(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = ResidualMLP(hidden)

    def forward(self, x):
        h = self.norm(x)
        y, _ = self.attn(h, h, h, need_weights=False)
        return self.mlp(x + y)


class CrossBlock(nn.Module):
    """A decoder block: causal self-attention, then attention over the encoder's output."""

    def __init__(self, hidden: int = HIDDEN, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.mlp = ResidualMLP(hidden)

    def split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.heads, -1).transpose(1, 2)

    def forward(self, x, memory):
        B, T, C = x.shape
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        k, v = (self.split(t) for t in self.kv(memory).chunk(2, dim=-1))
        x = x + F.scaled_dot_product_attention(self.split(self.q(x)), k, v).transpose(1, 2).reshape(B, T, C)
        return self.mlp(x)


class ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot follow it, torch.export can."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.mlp = ResidualMLP(hidden)

    def forward(self, x):
        if x.shape[1] > 1:
            x = x * 0.5
        return self.mlp(x)


class DataBranch(nn.Module):
    """Python control flow on tensor values: no tracer can follow it on the meta device."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.mlp = ResidualMLP(hidden)

    def forward(self, x):
        if x.mean() > 0:
            return self.mlp(x)
        return x


class Tokens(nn.Module):
    """Token model around a container of blocks: embedding, blocks, norm and head."""

    def __init__(self, blocks: nn.Module, vocab: int = 64, hidden: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = blocks
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in (self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks):
            x = block(x)
        return self.head(self.norm(x))


class EncoderDecoder(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = HIDDEN, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.ModuleList(MHABlock(hidden) for _ in range(n_layers))
        self.decoder = nn.ModuleList(CrossBlock(hidden) for _ in range(n_layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        memory = self.embed(src)
        for block in self.encoder:
            memory = block(memory)
        x = self.embed(tgt)
        for block in self.decoder:
            x = block(x, memory)
        return self.head(x)


def build_model(kind="sequential", n_layers=3):
    if kind == "sequential":
        return nn.Sequential(nn.Linear(HIDDEN // 2, HIDDEN), *(ResidualMLP() for _ in range(n_layers)), nn.Linear(HIDDEN, 10))
    if kind == "moduledict":
        return Tokens(nn.ModuleDict({f"b{i}": ResidualMLP() for i in range(n_layers)}))
    if kind == "mha":
        return Tokens(nn.ModuleList(MHABlock() for _ in range(n_layers)))
    if kind == "encdec":
        return EncoderDecoder(n_layers=n_layers)
    if kind == "shape_branch":
        return Tokens(nn.ModuleList(ShapeBranch() for _ in range(n_layers)))
    if kind == "data_branch":
        return Tokens(nn.ModuleList(DataBranch() for _ in range(n_layers)))
    raise ValueError(f"unknown kind {kind!r}")


def example_inputs(batch_size, kind="sequential"):
    if kind == "sequential":
        return (torch.randn(batch_size, HIDDEN // 2),)
    tokens = torch.randint(0, 64, (batch_size, SEQ))
    if kind == "encdec":
        return (tokens, torch.randint(0, 64, (batch_size, SEQ)))
    return (tokens,)
