"""Hugging Face mixture-of-experts families, small but shaped like the real ones.

    hetpar trace tests/models/hf_moe_zoo.py --model-arg family=deepseek_v3

Each config keeps what makes its family a mixture of experts (8 experts or more, top-k
above 1, Qwen2-MoE's shared expert and its gate, DeepSeek-V3's dense first layers,
shared experts and grouped routing, OLMoE's and Qwen3-MoE's many small experts) and
shrinks only widths, depths and the vocabulary. ``size=default`` is the config class's
own default instead (Mixtral 8x7B, ...) on 4096 tokens: it plans on the meta device,
never runs here. ``experts`` picks the experts' kernels as transformers'
``experts_implementation`` does (``grouped_mm``, the default, ``batched_mm``, or
``eager``, a loop over the experts that no tracer can follow).
"""

import torch
import torch.nn.functional as F
import transformers as tf

VOCAB, SEQ = 96, 16
DEFAULT_SEQ = 4096

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
        num_key_value_heads=8, num_experts=16, num_experts_per_tok=8, max_position_embeddings=64,
        eos_token_id=VOCAB - 1)),  # its default eos id lies beyond this vocabulary
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=2,
        num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=64)),
}


def config(family="mixtral", size="small"):
    """The family's config (what the tests compute closed forms from)."""
    _, config_class, fields = FAMILIES[family]
    return getattr(tf, config_class)(**(fields if size == "small" else {}))


def tokens(size="small"):
    """Tokens per sample."""
    return SEQ if size == "small" else DEFAULT_SEQ


def build_model(family="mixtral", size="small", experts="grouped_mm"):
    cfg = config(family, size)
    cfg._experts_implementation = experts
    return getattr(tf, FAMILIES[family][0])(cfg)


def example_inputs(batch_size, family="mixtral", size="small", **_):
    vocab = VOCAB if size == "small" else config(family, size).vocab_size
    return (torch.randint(3, vocab, (batch_size, tokens(size))),)


def loss_fn(outputs, targets):
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(batch_size, seed, family="mixtral", size="small", **_):
    vocab = VOCAB if size == "small" else config(family, size).vocab_size
    gen = torch.Generator().manual_seed(seed)
    while True:
        sample = torch.randint(3, vocab, (batch_size, tokens(size) + 1), generator=gen)
        yield (sample[:, :-1],), sample[:, 1:]
