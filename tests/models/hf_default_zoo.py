"""Hugging Face families as users write them: each model class with its DEFAULT config.

    hetpar plan tests/models/hf_default_zoo.py --model-arg family=llama --model-arg size=default ...

``size=default`` is the config class's own default (Llama 7B, Mixtral 8x7B, GPT-NeoX
20B, ...): it plans on the meta device, never runs here. ``size=tiny`` (the default
of this file, what the zoo's programs train on a 2-core CPU) changes only size fields:
widths, depths, head counts (keeping each default's ratio of query to key-value heads
where it has one), vocabulary, positions, image size; activation, norm, rotary embedding,
position scheme, tying, dropout and everything else stay the defaults. ``use_cache``
stays on as in the default config: hetpar turns it off ([Note: no KV cache in training]).
"""

import torch
import torch.nn.functional as F
import transformers as tf

TINY_VOCAB, TINY_SEQ, TINY_IMAGE = 96, 8, 32
TINY_RESNET_IMAGE = 64  # five halvings leave 2 x 2: batch norm in training needs more than one value per channel
DEFAULT_SEQ, DEFAULT_IMAGE = 512, 224  # BERT and RoBERTa have 512 positions

# family -> (model class, config class, the config's size fields at size=tiny)
_TINY_LM = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
# Mistral and Mixtral default to 4 query heads per key-value head: 8 and 2 here, so that
# tensor parallelism of 2 splits the key-value heads too.
_GQA_LM = dict(_TINY_LM, hidden_size=64, num_attention_heads=8)
FAMILIES = {
    # decoder-only
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_TINY_LM, num_key_value_heads=4, head_dim=8)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_GQA_LM, num_key_value_heads=2, head_dim=8)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_TINY_LM, num_key_value_heads=4)),
    # GPT-2's vocabulary stays: its default bos and eos ids are its last token
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(
        vocab_size=TINY_VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_TINY_LM)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_TINY_LM, num_key_value_heads=4)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_TINY_LM, num_key_value_heads=4, head_dim=8)),
    # mixture of experts
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(_GQA_LM, num_key_value_heads=2)),
    # encoder-only
    "bert": ("BertForMaskedLM", "BertConfig", dict(_TINY_LM)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_TINY_LM)),
    # encoder-decoder
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=TINY_VOCAB, d_model=32, d_kv=8, d_ff=64,
                                                           num_layers=2, num_decoder_layers=2, num_heads=4)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(
        vocab_size=TINY_VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=64)),
    # vision
    "vit": ("ViTForImageClassification", "ViTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=64, image_size=TINY_IMAGE, patch_size=8)),
    "resnet": ("ResNetForImageClassification", "ResNetConfig", dict(embedding_size=8, hidden_sizes=[16, 16, 32, 32],
                                                                    depths=[1, 1, 1, 1])),
}
ENCODER_DECODERS = ("t5", "bart")
VISION = ("vit", "resnet")


def build_model(family="llama", size="tiny", seq=None):
    model_class, config_class, tiny = FAMILIES[family]
    config = getattr(tf, config_class)(**(tiny if size == "tiny" else {}))
    return getattr(tf, model_class)(config)


def _shape(family, size, seq=None):
    """(sequence length, vocabulary) of a token model (``seq`` where given); (image side, labels) of a vision model."""
    if family in VISION:
        tiny = TINY_RESNET_IMAGE if family == "resnet" else TINY_IMAGE
        return (tiny if size == "tiny" else DEFAULT_IMAGE), 2  # the configs' default num_labels
    config = getattr(tf, FAMILIES[family][1])(**(FAMILIES[family][2] if size == "tiny" else {}))
    return int(seq) if seq else (TINY_SEQ if size == "tiny" else DEFAULT_SEQ), config.vocab_size


def example_inputs(batch_size, family="llama", size="tiny", seq=None):
    seq, vocab = _shape(family, size, seq)
    if family in VISION:
        return (torch.randn(batch_size, 3, seq, seq),)
    # token 3 upwards: no model's padding id (OPT's and RoBERTa's is 1, Gemma's 0)
    tokens = torch.randint(3, vocab, (batch_size, seq))
    if family in ENCODER_DECODERS:  # forward(input_ids, attention_mask, decoder_input_ids)
        return (tokens, torch.ones_like(tokens), torch.randint(3, vocab, (batch_size, seq)))
    return (tokens,)


def loss_fn(outputs, targets):
    """What a user writes: cross-entropy of ``outputs.logits`` (of every token or of the image)."""
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(batch_size, seed, family="llama", size="tiny", seq=None):
    seq, vocab = _shape(family, size, seq)
    gen = torch.Generator().manual_seed(seed)
    while True:
        if family in VISION:
            images = torch.randn(batch_size, 3, seq, seq, generator=gen)
            yield (images,), torch.randint(0, vocab, (batch_size,), generator=gen)
            continue
        tokens = torch.randint(3, vocab, (batch_size, seq + 1), generator=gen)
        if family in ENCODER_DECODERS:
            source = torch.randint(3, vocab, (batch_size, seq), generator=gen)
            yield (source, torch.ones_like(source), tokens[:, :-1]), tokens[:, 1:]
        else:
            yield (tokens[:, :-1],), tokens[:, 1:]
