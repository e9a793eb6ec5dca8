"""A GPT written the minGPT/nanoGPT way: one fused ``c_attn`` Linear split by a fixed
width, heads viewed with a fixed head count, a learned position embedding and an
``lm_head`` tied to the token embedding (issue 30's held-out model).

    hetpar trace tests/models/mingpt_fused.py
    hetpar plan tests/models/mingpt_fused.py --cluster 1x4xcpu --global-batch 8 --tp 2

The attention is nanoGPT's ``CausalSelfAttention`` (flash path) as published, and the
initialisation its ``_init_weights`` plus the scaled ``c_proj`` init. Two changes from
nanoGPT, both outside the blocks: ``forward`` takes the token ids only and returns the
logits (the loss is ``loss_fn``), and it has no ``assert t <= block_size``, which
torch.fx cannot trace (it branches on a traced size). ``flash=false`` takes nanoGPT's
other path, as published: attention written out with the causal mask a registered
``bias`` buffer sliced to the sequence (``self.bias[:, :, :T, :T]``).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32, bias=True, flash=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool, block_size: int = 0, flash: bool = True):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # key, query, value projections for all heads
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head
        self.n_embd = n_embd
        self.flash = flash
        if not self.flash:  # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool, block_size: int = 0, flash: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, block_size, flash)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab_size: int, block_size: int, bias: bool,
                 flash: bool = True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, bias, block_size, flash) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build_model(n_layer=DEFAULTS["n_layer"], n_embd=DEFAULTS["n_embd"], n_head=DEFAULTS["n_head"],
                vocab_size=DEFAULTS["vocab_size"], block_size=DEFAULTS["block_size"], bias=DEFAULTS["bias"],
                flash=DEFAULTS["flash"]):
    return GPT(n_layer, n_embd, n_head, vocab_size, block_size, bias, flash)


def example_inputs(batch_size, vocab_size=DEFAULTS["vocab_size"], block_size=DEFAULTS["block_size"], **_):
    return (torch.randint(0, vocab_size, (batch_size, block_size)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
