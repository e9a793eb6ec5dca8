"""The GPT of the published training runs that benchmarks/cost_model_published.py compares against.

One decoder, two flavours chosen by model args:

- Megatron-LM's GPT (Narayanan et al. 2021, section 5; Megatron-LM ``GPTModel``):
  biases on every Linear, dropout 0.1, learned positions, output layer tied to the
  word embedding. ``--model-arg bias=true --model-arg dropout=0.1``.
- MosaicML's MPT (llm-foundry ``mpt_causal_lm`` with its defaults: ``no_bias``,
  learned positions, no dropout, tied output layer; flash attention).
  ``--model-arg bias=false --model-arg dropout=0``.

q, k and v are separate Linears (Megatron and MPT fuse them into one; same FLOPs and
parameters) so that hetpar's tensor-parallel finder sees whole heads. Attention is
``scaled_dot_product_attention``: hetpar's tracer measures it as a fused kernel keeps
it ([Note: fused attention on meta] in planner/capture/measure.py).

    hetpar trace benchmarks/published/gpt.py --model-arg n_layers=96 --model-arg hidden=12288 \\
        --model-arg heads=96 --model-arg vocab=51200 --model-arg seq_len=2048
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layers=2, hidden=128, heads=4, vocab=512, seq_len=64, bias=True, dropout=0.1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = hidden // heads, dropout
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, hidden, bias=bias)
        self.v = nn.Linear(hidden, hidden, bias=bias)
        self.o = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, bias=bias)
        self.attn = Attention(hidden, heads, bias, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden, bias=bias)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.proj = nn.Linear(4 * hidden, hidden, bias=bias)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, n_layers, hidden, heads, vocab, seq_len, bias, dropout):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, bias, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden, bias=bias)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # output layer tied to the word embedding

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(n_layers=DEFAULTS["n_layers"], hidden=DEFAULTS["hidden"], heads=DEFAULTS["heads"], vocab=DEFAULTS["vocab"],
                seq_len=DEFAULTS["seq_len"], bias=DEFAULTS["bias"], dropout=DEFAULTS["dropout"]):
    return GPT(n_layers, hidden, heads, vocab, seq_len, bias, dropout)


def example_inputs(batch_size, vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"], **_):
    return (torch.randint(0, vocab, (batch_size, seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
