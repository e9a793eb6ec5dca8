"""A Hugging Face causal LM built from its ``config.json``, with random weights: the model
file behind ``hetpar plan --hf PATH`` ([Note: planning from a config] in
hetpar/commands/common.py). ``--init-from DIR`` gives the program a checkpoint's weights.

    hetpar plan --hf path/to/checkpoint --seq-len 2048 --cluster 1x8xA100-80GB -b 64
    hetpar plan hetpar/models/hf_causal_lm.py -a config=path/to/config.json -a seq=2048 ...

``config`` is a ``config.json`` or the directory holding it; ``seq`` is the sequence
length trained on. A compiled program finds the config copied next to this file
(``hf_config.json``) and reads that one, so it runs where the original path does not exist.
"""

from pathlib import Path

import torch
import transformers as tf

COPIED_CONFIG = "hf_config.json"  # what hetpar compile writes next to this file (hetpar.models.HF_CONFIG_COPY)


def _config(config: str) -> "tf.PretrainedConfig":
    copied = Path(__file__).with_name(COPIED_CONFIG)
    path = copied if copied.is_file() else Path(config)
    if path.is_dir():
        path = path / "config.json"
    return tf.AutoConfig.from_pretrained(str(path))


def build_model(config: str, seq: int = 2048):
    return tf.AutoModelForCausalLM.from_config(_config(config))


def example_inputs(batch_size: int, config: str, seq: int = 2048):
    return (torch.randint(0, _config(config).vocab_size, (batch_size, int(seq))),)
