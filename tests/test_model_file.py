"""The model-file contract: loading, clear errors, default loss and synthetic data."""

import pytest
import torch

from hetpar.runtime.model_file import ModelFileError, default_loss, load_model_file, parse_model_args

EXAMPLES = "examples"


def test_parse_model_args_types():
    assert parse_model_args(["a=3", "b=0.5", "c=true", "d=gelu", "e=False"]) == {"a": 3, "b": 0.5, "c": True, "d": "gelu", "e": False}


def test_parse_model_args_rejects_missing_equals():
    with pytest.raises(ModelFileError, match="not key=value"):
        parse_model_args(["n_layers"])


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_import_failure_names_the_line(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("import torch\n\nraise RuntimeError('boom')\n")
    with pytest.raises(ModelFileError, match=r"failed to import at line 3: RuntimeError: boom"):
        load_model_file(f)


def test_syntax_error(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def build_model(:\n")
    with pytest.raises(ModelFileError, match="failed to import at line 1: SyntaxError"):
        load_model_file(f)


def test_missing_build_model(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def example_inputs(b):\n    return ()\n")
    with pytest.raises(ModelFileError, match="defines no build_model"):
        load_model_file(f)


def test_unknown_model_arg_is_an_error():
    mf = load_model_file(f"{EXAMPLES}/mlp.py", {"depht": 3})
    with pytest.raises(ModelFileError, match="takes no argument 'depht'"):
        mf.build_model()


def test_model_args_reach_build_model_and_example_inputs():
    mf = load_model_file(f"{EXAMPLES}/gpt.py", {"n_layers": 3, "seq_len": 8})
    assert len(mf.build_model().blocks) == 3
    assert mf.example_inputs(2)[0].shape == (2, 8)


def test_default_loss_cross_entropy_for_class_targets():
    logits = torch.randn(4, 5, 7)
    targets = torch.randint(0, 7, (4, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    torch.testing.assert_close(default_loss(logits, targets), expected)


def test_default_loss_mse_otherwise():
    out, target = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(default_loss(out, target), ((out - target) ** 2).mean())


def test_default_loss_reads_the_first_tensor_of_a_model_output():
    tf = pytest.importorskip("transformers")
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    for outputs in (tf.modeling_outputs.CausalLMOutputWithPast(logits=logits), {"logits": logits}, (logits, None)):
        torch.testing.assert_close(default_loss(outputs, targets), default_loss(logits, targets))
    with pytest.raises(ModelFileError, match="no tensor"):
        default_loss({"tag": "x"}, targets)


def test_synthetic_targets_follow_a_model_output(tmp_path):
    pytest.importorskip("transformers")
    f = tmp_path / "hf.py"
    f.write_text(
        "import torch, transformers as tf\n"
        "def build_model():\n"
        "    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,\n"
        "                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=11))\n"
        "def example_inputs(b):\n    return (torch.zeros(b, 4, dtype=torch.long),)\n"
    )
    inputs, targets = next(load_model_file(f).batches(3, seed=0))  # the model returns a CausalLMOutputWithPast
    assert targets.shape == (3, 4) and int(targets.max()) < 11


def test_synthetic_batches_are_deterministic_and_shaped():
    mf = load_model_file(f"{EXAMPLES}/mlp.py")
    a = next(mf.batches(6, seed=1))
    b = next(mf.batches(6, seed=1))
    c = next(mf.batches(6, seed=2))
    torch.testing.assert_close(a[0][0], b[0][0])
    assert not torch.equal(a[0][0], c[0][0])
    assert a[0][0].shape == (6, 32) and a[1].shape == (6, 8) and a[1].is_floating_point()


def test_synthetic_targets_for_token_models(tmp_path):
    f = tmp_path / "tok.py"
    f.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Embedding(10, 4)\n"
        "def example_inputs(b):\n    return (torch.full((b, 3), 9),)\n"
    )
    inputs, targets = next(load_model_file(f).batches(5, seed=0))
    assert inputs[0].shape == (5, 3) and int(inputs[0].max()) <= 9
    assert targets.shape == (5, 3) and not targets.is_floating_point() and int(targets.max()) < 4
