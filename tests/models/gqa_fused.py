"""A Llama-like decoder written with fused projections (Phi-3's ``qkv_proj`` and
``gate_up_proj``, InternLM's ``wqkv``): one qkv Linear of ``(n_head + 2 n_kv_head)
head_dim`` outputs split by sizes, grouped-query attention that repeats each key/value
head ``n_head // n_kv_head`` times, RMSNorm, rotary positions and a fused SwiGLU
(issue 30's held-out model).

    hetpar trace tests/models/gqa_fused.py
    hetpar plan tests/models/gqa_fused.py --cluster 1x4xcpu --global-batch 8 --tp 2

Rotary tables are computed from the positions in ``forward``, as transformers'
``LlamaRotaryEmbedding`` does: slicing a precomputed buffer by the traced length
(``self.cos[:T]``, Meta's reference Llama) fails torch.fx (hetpar's tracer does not
proxy buffers), and a model torch.fx cannot trace gets no tensor parallelism today.

``--model-arg n_kv_head=1`` gives multi-query attention (fewer key/value heads than
any tp > 1), ``n_kv_head=n_head`` plain multi-head attention.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layers=2, hidden=64, n_head=4, n_kv_head=2, intermediate=128, vocab=256, seq_len=32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, n_head: int, n_kv_head: int, theta: float = 10000.0):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = hidden // n_head
        self.qkv_proj = nn.Linear(hidden, (n_head + 2 * n_kv_head) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, hidden, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        freqs = torch.outer(torch.arange(T, device=x.device, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.n_head // self.n_kv_head
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hidden, n_head, n_kv_head, intermediate):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, n_head, n_kv_head)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, n_layers, hidden, n_head, n_kv_head, intermediate, vocab):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, n_head, n_kv_head, intermediate)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(n_layers=DEFAULTS["n_layers"], hidden=DEFAULTS["hidden"], n_head=DEFAULTS["n_head"],
                n_kv_head=DEFAULTS["n_kv_head"], intermediate=DEFAULTS["intermediate"], vocab=DEFAULTS["vocab"],
                seq_len=DEFAULTS["seq_len"]):
    return Decoder(n_layers, hidden, n_head, n_kv_head, intermediate, vocab)


def example_inputs(batch_size, vocab=DEFAULTS["vocab"], seq_len=DEFAULTS["seq_len"], **_):
    return (torch.randint(0, vocab, (batch_size, seq_len)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
