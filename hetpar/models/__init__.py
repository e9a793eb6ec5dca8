"""Model files hetpar ships: ``hf_causal_lm.py``, a Hugging Face causal LM built from
its ``config.json`` (``hetpar plan --hf PATH``; [Note: planning from a config] in
hetpar/commands/common.py)."""

from pathlib import Path

HF_CAUSAL_LM = Path(__file__).resolve().with_name("hf_causal_lm.py")
HF_CONFIG_COPY = "hf_config.json"  # hf_causal_lm.py's COPIED_CONFIG: the config hetpar compile writes next to it

__all__ = ["HF_CAUSAL_LM", "HF_CONFIG_COPY"]
