"""``hetpar plan --hf PATH``: a Hugging Face model planned from its config, no model file
([Note: planning from a config] in hetpar/commands/common.py), compiled into a program
that reads the config copied next to it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, hetpar
from conftest import ROOT

from hetpar.commands.common import DEFAULT_SEQ_LEN, model_source
from hetpar.models import HF_CAUSAL_LM, HF_CONFIG_COPY
from hetpar.runtime.model_file import ModelFileError

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama saved as transformers saves it: config.json and model.safetensors."""
    import torch

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_directory_a_file_and_a_cached_name_find_the_same_config(checkpoint, tmp_path, monkeypatch):
    config = (checkpoint / "config.json").resolve()
    for hf in (str(checkpoint), str(checkpoint / "config.json")):
        path, args = model_source(None, hf, 16, ["foo=1"])
        assert path == HF_CAUSAL_LM and args == {"foo": 1, "config": str(config), "seq": 16}
    # a model name in the local cache, laid out as huggingface_hub lays it out
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copyfile(config, snapshot / "config.json")
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    path, args = model_source(None, "acme/tiny", None, None)
    assert Path(args["config"]) == (snapshot / "config.json").resolve() and args["seq"] == DEFAULT_SEQ_LEN
    with pytest.raises(ModelFileError, match="no config.json of acme/other in the local Hugging Face cache"):
        model_source(None, "acme/other", None, None)


@pytest.mark.parametrize("model_file, hf, seq_len, model_arg, fragment", [
    (None, None, None, None, "no model: pass a MODEL_FILE, or --hf PATH"),
    (Path("m.py"), "x", None, None, "not both"),
    (Path("m.py"), None, 16, None, "--seq-len goes with --hf"),
    (None, "CHECKPOINT", 0, None, "--seq-len 0 must be >= 1"),
    (None, "CHECKPOINT", None, ["seq=8"], "--model-arg seq is set by --hf"),
    (None, "nowhere/at/all", None, None, "no such file or directory"),
])
def test_bad_model_sources_are_one_line(checkpoint, model_file, hf, seq_len, model_arg, fragment):
    hf = str(checkpoint) if hf == "CHECKPOINT" else hf
    with pytest.raises(ModelFileError, match=fragment.replace("-", r"\-").replace("(", r"\(")):
        model_source(model_file, hf, seq_len, model_arg)


def test_a_directory_without_a_config_is_one_line(tmp_path):
    result = hetpar("plan", "--hf", str(tmp_path), "--cluster", "1x2xcpu", "-b", "4", cwd=tmp_path)
    assert_one_line_error(result, "has no config.json")
    assert not (tmp_path / "plan.json").exists()


def test_plan_compile_and_train_from_the_copied_config(checkpoint, tmp_path):
    """Through the CLI as a user runs it: plan from the checkpoint's config, compile, move
    the checkpoint's config away, and the program still builds the model (from the copy)
    and trains one step from the checkpoint's weights."""
    plan_path = tmp_path / "plan.json"
    result = hetpar("plan", "--hf", str(checkpoint), "--seq-len", "16", "--cluster", "1x1xcpu", "-b", "2",
                    "-o", str(plan_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(plan_path.read_text())
    assert Path(plan["model"]["file"]) == HF_CAUSAL_LM
    assert plan["model"]["args"] == {"config": str((checkpoint / "config.json").resolve()), "seq": 16}
    result = hetpar("compile", str(plan_path), "-o", str(tmp_path / "build"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    copied = tmp_path / "build" / HF_CONFIG_COPY
    assert json.loads(copied.read_text()) == json.loads((checkpoint / "config.json").read_text())
    weights = tmp_path / "weights"
    shutil.copytree(checkpoint, weights)
    (weights / "config.json").unlink()  # the program must read the copy next to it, not the planned path
    moved = checkpoint.with_name("moved-away")
    checkpoint.rename(moved)
    try:
        done = subprocess.run([sys.executable, "train.py", "--steps", "1", "--init-from", str(weights)],
                              cwd=tmp_path / "build", capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        moved.rename(checkpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1/1" in done.stdout + done.stderr
