"""A GPT whose feed-forward layers are mixtures of experts (Mixtral's shape, small).

    hetpar plan examples/moe_gpt.py --cluster 1x4xcpu --global-batch 8 --ep 2

Each block's MLP is a router (a Linear to one logit per expert), the top-k experts per
token with softmax weights renormalised over the k, and a module of experts. The
experts follow hetpar's experts contract (docs/model-file.md, "Mixtures of experts"):
one module with ``num_experts``, the experts' weights stacked along a first dimension
of ``num_experts``, called as ``experts(hidden, top_k_index, top_k_weights)``. That is
the layout of Hugging Face's MoE families; it lets hetpar count each expert's work from
the routing and split the experts over ranks (``--ep``). The experts' forward has no
data-dependent shapes: the routed rows are sorted by expert and multiplied by each
expert's weights with ``torch.nn.functional.grouped_mm``.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layers=4, hidden=64, heads=4, experts=8, top_k=2, ffn=128, vocab=256, seq_len=32)


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


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs, weights stacked: expert e is slice [e] of each."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.randn(num_experts, hidden, 2 * ffn) / math.sqrt(hidden))
        self.down = nn.Parameter(torch.randn(num_experts, ffn, hidden) / math.sqrt(ffn))

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)  # one row per (token, choice)
        order = torch.argsort(expert_ids, stable=True)  # rows grouped by expert
        rows = hidden[order // k]
        counts = F.one_hot(expert_ids, self.num_experts).sum(0)
        ends = torch.cumsum(counts, 0).to(torch.int32)  # expert e's rows end at ends[e]
        gate, up = F.grouped_mm(rows, self.gate_up, offs=ends).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, self.down, offs=ends)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(out).index_copy(0, order, out)  # back to (token, choice) order
        return out.view(-1, k, out.shape[-1]).sum(1)


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, ffn)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, num_experts: int, top_k: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, num_experts, top_k, ffn)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, n_layers, hidden, heads, experts, top_k, ffn, vocab, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, experts, top_k, ffn) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(n_layers=DEFAULTS["n_layers"], hidden=DEFAULTS["hidden"], heads=DEFAULTS["heads"],
                experts=DEFAULTS["experts"], top_k=DEFAULTS["top_k"], ffn=DEFAULTS["ffn"], vocab=DEFAULTS["vocab"],
                seq_len=DEFAULTS["seq_len"]):
    return MoEGPT(n_layers, hidden, heads, experts, top_k, ffn, vocab, seq_len)


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
