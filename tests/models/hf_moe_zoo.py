"""Hugging Face mixture-of-experts families, small but shaped like the real ones.

    hetpar trace tests/models/hf_moe_zoo.py --model-arg family=deepseek_v3

Each config keeps what makes its family a mixture of experts (8 experts or more, top-k
above 1, Qwen2-MoE's shared expert and its gate, DeepSeek-V3's dense first layers,
shared experts and grouped routing, OLMoE's and Qwen3-MoE's many small experts) and
shrinks only widths, depths and the vocabulary. ``experts`` picks the experts' kernels
as transformers' ``experts_implementation`` does (``grouped_mm``, the default, or
``batched_mm``).
"""

import torch
import torch.nn.functional as F
import transformers as tf

VOCAB, SEQ = 96, 16

# family -> (model class, config class, config)
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        num_experts=12, num_experts_per_tok=4, max_position_embeddings=64)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=16, num_experts_per_tok=8,
        max_position_embeddings=64)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, num_experts=16, num_experts_per_tok=8, max_position_embeddings=64)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=2,
        num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=64)),
}


def config(family="mixtral"):
    """The family's config (what the tests compute closed forms from)."""
    _, config_class, fields = FAMILIES[family]
    return getattr(tf, config_class)(**fields)


def build_model(family="mixtral", experts="grouped_mm"):
    model_class = FAMILIES[family][0]
    cfg = config(family)
    cfg._experts_implementation = experts
    return getattr(tf, model_class)(cfg)


def example_inputs(batch_size, **_):
    return (torch.randint(3, VOCAB, (batch_size, SEQ)),)


def loss_fn(outputs, targets):
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(batch_size, seed, **_):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(3, VOCAB, (batch_size, SEQ + 1), generator=gen)
        yield (tokens[:, :-1],), tokens[:, 1:]
