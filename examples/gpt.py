"""A GPT-style decoder (nanoGPT shape) whose size comes from model args.

    hetpar plan examples/gpt.py --cluster 1x2xcpu --global-batch 8 \
        --model-arg n_layers=4 --model-arg hidden=128

Written to be tensor-parallel friendly: separate q/k/v projections, and attention
reshapes with ``view(B, T, -1, head_dim)`` so each tensor-parallel rank sees its own
heads (see ../shared/reference/torch-cpu.md).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layers=4, hidden=128, heads=4, vocab=256, seq_len=32)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layers: int, hidden: int, heads: int, vocab: int, seq_len: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("o.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(n_layers=DEFAULTS["n_layers"], hidden=DEFAULTS["hidden"], heads=DEFAULTS["heads"],
                vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"]):
    return GPT(n_layers, hidden, heads, vocab, seq_len)


def example_inputs(batch_size, vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"], **_):
    return (torch.randint(0, vocab, (batch_size, seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(batch_size, seed, vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"], **_):
    """Next-token prediction on a fixed random token stream: targets are inputs shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
        yield (tokens[:, :-1],), tokens[:, 1:]
