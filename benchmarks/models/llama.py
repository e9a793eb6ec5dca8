"""A Hugging Face Llama causal LM from a config (random weights, no download) for tracing benchmarks.

    hetpar trace benchmarks/models/llama.py                     # Llama-2 7B shape
    hetpar trace benchmarks/models/llama.py -a n_layers=80 -a hidden=8192 -a heads=64 -a kv_heads=8 -a ffn=28672

Needs ``pip install 'hetpar[hf]'``. torch.fx cannot trace transformers 5.x, so hetpar
captures it with torch.export on the meta device.
"""

import torch
import transformers as tf


def build_model(n_layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq_len=4096):
    config = tf.LlamaConfig(num_hidden_layers=n_layers, hidden_size=hidden, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                            max_position_embeddings=seq_len, use_cache=False)
    return tf.LlamaForCausalLM(config)


def example_inputs(batch_size, vocab=32000, seq_len=4096, **_):
    return (torch.randint(0, vocab, (batch_size, seq_len)),)
