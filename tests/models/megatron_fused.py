"""A GPT written the Megatron-LM / GPT-NeoX way: one fused ``query_key_value`` Linear
whose output is stored per head, ``[q_h, k_h, v_h]`` for each head h in turn, viewed as
``(B, T, n_head, 3 * head_dim)`` and split into q, k and v along the last dimension
(issue 30's held-out model).

    hetpar trace tests/models/megatron_fused.py
    hetpar plan tests/models/megatron_fused.py --cluster 1x4xcpu --global-batch 8 --tp 2

Megatron's ``ParallelAttention`` (``mixed_x_layer.view(*new_shape)`` then
``split_tensor_along_last_dim(mixed_x_layer, 3)``) and GPT-NeoX's ``GPTNeoXAttention``
(``qkv.view(..., num_heads, 3 * head_size)`` then slices) store the weight this way,
which is why a rank's heads are one contiguous block of rows in it. The MLP is
Megatron's ``dense_h_to_4h`` / ``dense_4h_to_h``, the head an untied ``output_layer``
(``--untie-embeddings-and-output-weights``), positions a learned embedding.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)


class ParallelAttention(nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        B, T, H = hidden_states.shape
        mixed_x_layer = self.query_key_value(hidden_states)
        # [B, T, 3 H] -> [B, T, n_head, 3 head_dim]
        new_shape = (B, T, self.num_attention_heads, 3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_shape)
        query, key, value = torch.split(mixed_x_layer, self.hidden_size_per_attention_head, dim=-1)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [B, n_head, T, head_dim]
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        context = context.permute(0, 2, 1, 3).contiguous()
        context = context.view(B, T, self.num_attention_heads * self.hidden_size_per_attention_head)
        return self.dense(context)


class ParallelMLP(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.self_attention = ParallelAttention(hidden_size, num_attention_heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = ParallelMLP(hidden_size)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GPTModel(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int, seq_length: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(seq_length, hidden_size)
        self.layers = nn.ModuleList(ParallelTransformerLayer(hidden_size, num_attention_heads)
                                    for _ in range(num_layers))
        self.final_layernorm = nn.LayerNorm(hidden_size)
        self.output_layer = nn.Linear(hidden_size, vocab_size, bias=False)
        # Megatron's init_method_normal(0.02) and scaled_init_method_normal for output projections.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("dense.weight", "dense_4h_to_h.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.output_layer(self.final_layernorm(hidden_states))


def build_model(num_layers=DEFAULTS["num_layers"], hidden_size=DEFAULTS["hidden_size"],
                num_attention_heads=DEFAULTS["num_attention_heads"], vocab_size=DEFAULTS["vocab_size"],
                seq_length=DEFAULTS["seq_length"]):
    return GPTModel(num_layers, hidden_size, num_attention_heads, vocab_size, seq_length)


def example_inputs(batch_size, vocab_size=DEFAULTS["vocab_size"], seq_length=DEFAULTS["seq_length"], **_):
    return (torch.randint(0, vocab_size, (batch_size, seq_length)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
