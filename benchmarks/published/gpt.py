"""The GPT of the published training runs that benchmarks/cost_model_published.py compares against.

One decoder, two flavours chosen by model args:

- Megatron-LM's GPT (Narayanan et al. 2021, section 5; Megatron-LM ``GPTModel``):
  biases on every Linear, dropout 0.1, learned positions, output layer tied to the
  word embedding. ``--model-arg bias=true --model-arg dropout=0.1``.
- MosaicML's MPT (llm-foundry ``mpt_causal_lm`` with its defaults: ``no_bias``,
  learned positions, no dropout, tied output layer; flash attention).
  ``--model-arg bias=false --model-arg dropout=0``.

q, k and v are separate Linears by default (Megatron and MPT fuse them into one; same
FLOPs and parameters). ``--model-arg fused_qkv=1`` fuses them as Megatron-LM does: one
``query_key_value`` Linear whose output is viewed per head as ``[q | k | v]``
(``view(B, T, heads, 3 * head_dim)`` then ``split(head_dim)``), the head count fixed in
the code; hetpar splits it by heads (issue 30). Attention is
``scaled_dot_product_attention``: hetpar's tracer measures it as a fused kernel keeps
it ([Note: fused attention on meta] in planner/capture/measure.py).
``--model-arg attention=unfused`` writes attention out as Megatron-LM did in 2022
(``CoreAttention``: Q K^T scaled, the causal mask filled, softmax, dropout, times V;
batched matmuls over heads), which keeps the s x s scores and probabilities for backward:
the model of Korthikanti et al.'s selective recompute. ``attention_dropout`` sets the
attention probabilities' dropout apart from the others' (default: ``dropout``).
``--model-arg head=0`` leaves out the output layer (the model returns the final norm's
output): how Sailor's GPT-Neo ran (its ``GPTNeoModelPipe`` ends in the norm), for costing
those runs, not for training.

    hetpar trace benchmarks/published/gpt.py --model-arg n_layers=96 --model-arg hidden=12288 \\
        --model-arg heads=96 --model-arg vocab=51200 --model-arg seq_len=2048
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layers=2, hidden=128, heads=4, vocab=512, seq_len=64, bias=True, dropout=0.1, fused_qkv=False,
                attention="sdpa", attention_dropout=None, head=True)


def core_attention(q, k, v, *, causal: torch.Tensor | None, dropout: float, training: bool):
    """Attention of q, k, v ([B, H, T, D]): one fused call, or (``causal`` given: a [T, T]
    bool mask, True above the diagonal) written out as Megatron-LM's ``CoreAttention``:
    its batched products run as ``bmm`` over B x H, as Megatron's ``baddbmm`` does."""
    if causal is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if training else 0.0)
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    probs = F.dropout(torch.softmax(scores.masked_fill(causal[:T, :T], float("-inf")), dim=-1), dropout, training)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, dropout: float, causal: torch.Tensor | None = None):
        super().__init__()
        self.head_dim, self.dropout = hidden // heads, dropout
        self.register_buffer("causal", causal, persistent=False)
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, hidden, bias=bias)
        self.v = nn.Linear(hidden, hidden, bias=bias)
        self.o = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = core_attention(q, k, v, causal=self.causal, dropout=self.dropout, training=self.training)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class FusedAttention(nn.Module):
    """Megatron-LM's ``ParallelAttention``: q, k and v of each head side by side in one Linear's output."""

    def __init__(self, hidden: int, heads: int, bias: bool, dropout: float, causal: torch.Tensor | None = None):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, hidden // heads, dropout
        self.register_buffer("causal", causal, persistent=False)
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.o = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.query_key_value(x).view(B, T, self.heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = core_attention(q, k, v, causal=self.causal, dropout=self.dropout, training=self.training)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, dropout: float, fused_qkv: bool, causal: torch.Tensor | None,
                 attention_dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, bias=bias)
        self.attn = (FusedAttention if fused_qkv else Attention)(hidden, heads, bias, attention_dropout, causal)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden, bias=bias)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.proj = nn.Linear(4 * hidden, hidden, bias=bias)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, n_layers, hidden, heads, vocab, seq_len, bias, dropout, fused_qkv, attention, attention_dropout, head):
        super().__init__()
        if attention not in ("sdpa", "unfused"):
            raise ValueError(f"attention={attention!r}: choose sdpa or unfused")
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1) if attention == "unfused" else None
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, bias, dropout, fused_qkv, causal, attention_dropout)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden, bias=bias)
        if head:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # output layer tied to the word embedding
        else:
            self.lm_head = nn.Identity()

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(n_layers=DEFAULTS["n_layers"], hidden=DEFAULTS["hidden"], heads=DEFAULTS["heads"], vocab=DEFAULTS["vocab"],
                seq_len=DEFAULTS["seq_len"], bias=DEFAULTS["bias"], dropout=DEFAULTS["dropout"],
                fused_qkv=DEFAULTS["fused_qkv"], attention=DEFAULTS["attention"],
                attention_dropout=DEFAULTS["attention_dropout"], head=DEFAULTS["head"]):
    return GPT(n_layers, hidden, heads, vocab, seq_len, bias, dropout, bool(fused_qkv), attention,
               dropout if attention_dropout is None else attention_dropout, bool(head))


def example_inputs(batch_size, vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"], **_):
    return (torch.randint(0, vocab, (batch_size, seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
