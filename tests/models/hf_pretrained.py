"""A Hugging Face causal LM built from the config.json of a checkpoint directory, with
random weights; ``--init-from DIR`` gives it the checkpoint's.

    hetpar plan tests/models/hf_pretrained.py --model-arg config=DIR --model-arg seq=16 ...

``seq`` is the sequence length the plan and ``--data`` use.
"""

import torch
import transformers as tf


def build_model(config, seq=16):
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(config))


def example_inputs(batch_size, config, seq=16):
    vocab = tf.AutoConfig.from_pretrained(config).vocab_size
    return (torch.randint(0, vocab, (batch_size, seq)),)
