"""Hugging Face transformers models from small configs with random weights (no download).

    hetpar trace tests/models/hf_zoo.py --model-arg kind=llama

Kinds: gpt2, llama, mistral, qwen2, bert, t5, vit, resnet. Causal LMs are built with
``use_cache=False``, which hetpar would set anyway (torch.export rejects a returned KV
cache; [Note: no KV cache in training] in runtime/model_file.py). Attention dropout is 0
so that a CPU run takes the fused attention kernel the planner assumes (with dropout,
CPU falls back to the math path, which saves the T x T probabilities).
"""

import torch
import transformers as tf

VOCAB = 128
SEQ = 16
IMAGE = 32

_LM = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=VOCAB, use_cache=False)


def build_model(kind="gpt2", n_layers=2):
    lm = {**_LM, "num_hidden_layers": n_layers}
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=n_layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                                use_cache=False, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**lm))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**lm))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**lm))
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, vocab_size=VOCAB, attention_probs_dropout_prob=0.0))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(num_layers=n_layers, num_decoder_layers=n_layers, d_model=64,
                                                         d_ff=128, num_heads=4, d_kv=16, vocab_size=VOCAB, use_cache=False))
    if kind == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=128,
                                                         num_attention_heads=4, image_size=IMAGE, patch_size=8,
                                                         attention_probs_dropout_prob=0.0))
    if kind == "resnet":
        return tf.ResNetForImageClassification(tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                                               depths=[1, 1, 2, 1]))
    raise ValueError(f"unknown kind {kind!r}")


def example_inputs(batch_size, kind="gpt2"):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ))
    if kind == "t5":  # forward(input_ids, attention_mask, decoder_input_ids)
        return (tokens, torch.ones_like(tokens), torch.randint(0, VOCAB, (batch_size, SEQ)))
    if kind == "vit":
        return (torch.randn(batch_size, 3, IMAGE, IMAGE),)
    if kind == "resnet":
        return (torch.randn(batch_size, 3, 64, 64),)
    return (tokens,)
