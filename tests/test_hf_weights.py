"""Hugging Face checkpoint directories in and out of a program (runtime.hf_checkpoint,
[Note: Hugging Face checkpoints]): ``--init-from DIR`` reads ``save_pretrained``'s
safetensors (one file or shards with an index, tied weights written once), each rank
only its tensors and of a tensor-parallel weight only its slice; a directory that does
not fit is one line naming what is missing, extra or of another shape. ``--save-hf DIR``
writes a directory that ``from_pretrained`` loads, atomically, and is refused for a
model without a Hugging Face config.

The fast tests run in one process (a rank of two under the ``fake`` process group for
the slices). The slow ones run compiled programs: a tiny tied Llama trained at tp 2 from
a checkpoint directory on a token file, saved with ``--save-hf``, loads with
``from_pretrained`` and gives the logits of the trained state; a directory of another
model stops the program in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_torchrun
from safetensors.torch import load_file, save_file
from test_token_data import HF_MODEL, LR, SEQ, VOCAB, assert_program_refuses, llama_plan, save_tiny_llama, write_tokens
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hetpar.runtime.graph import trace_layers
from hetpar.runtime.hf_checkpoint import HFCheckpoint, HFCheckpointError, check_savable, save_pretrained, tied_names
from hetpar.runtime.materialize import InitFromError, build_on_meta, materialize_stages
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.shard import cut_stage


def meta_stage(checkpoint: Path, layers: tuple[int, int] | None = None):
    """The model of ``checkpoint``'s config on meta, and a stage of it (all layers by default)."""
    model_file = load_model_file(HF_MODEL, {"config": str(checkpoint), "seq": SEQ})
    names = list(trace_layers(model_file.build_model(), example_inputs=model_file.example_inputs(2)).layer_names)
    model, log = build_on_meta(model_file.build_model)
    stage = cut_stage(model, model_file, 2, layers or (0, len(names) - 1), names)
    return model, log, stage


def assert_stage_holds(stage, expected: dict[str, torch.Tensor]) -> None:
    state = stage.module.state_dict()
    assert state
    for key, value in state.items():
        assert not value.is_meta and torch.equal(value, expected[key]), key


@pytest.mark.parametrize("tie,shard_size", [(False, None), (True, None), (False, "60KB")],
                         ids=["one file", "tied", "sharded"])
def test_a_stage_reads_its_tensors_from_a_checkpoint_directory(tmp_path, tie, shard_size):
    model = save_tiny_llama(tmp_path / "hf", tie=tie)
    if shard_size:
        model.save_pretrained(tmp_path / "hf", max_shard_size=shard_size)
        (tmp_path / "hf" / "model.safetensors").unlink(missing_ok=True)
        assert len(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]) > 0
        assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    expected = model.state_dict()
    for layers in ((0, 1), (2, 3)):  # the embedding's stage, then the head's (tied: lm_head.weight not in the file)
        whole, log, stage = meta_stage(tmp_path / "hf", layers)
        materialize_stages(whole, stage.module, log, init_from=tmp_path / "hf")
        assert_stage_holds(stage, expected)
    if tie:
        assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
        assert tied_names(meta_stage(tmp_path / "hf")[0]) == {"lm_head.weight": "model.embed_tokens.weight"}


def test_a_bfloat16_checkpoint_is_cast_to_the_models_dtype(tmp_path):
    model = save_tiny_llama(tmp_path / "hf")
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / "hf" / "model.safetensors",
              metadata={"format": "pt"})
    whole, log, stage = meta_stage(tmp_path / "hf")
    materialize_stages(whole, stage.module, log, init_from=tmp_path / "hf")
    assert_stage_holds(stage, {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})


def test_a_checkpoint_that_does_not_fit_is_one_line_naming_what(tmp_path):
    model = save_tiny_llama(tmp_path / "hf")
    state = model.state_dict()
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj"):
            del state[f"model.layers.{layer}.self_attn.{proj}.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["model.norm.weight"] = torch.ones(32)
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    whole, log, stage = meta_stage(tmp_path / "hf")
    with pytest.raises(InitFromError) as raised:
        materialize_stages(whole, stage.module, log, init_from=tmp_path / "hf")
    assert str(raised.value) == (
        f"--init-from {tmp_path / 'hf'} does not fit LlamaForCausalLM: it lacks "
        "model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
        "model.layers.0.self_attn.v_proj.weight and 3 more; has model.layers.0.self_attn.rotary_emb.inv_freq, which the "
        "model lacks; has model.norm.weight of shape [32] (the model's: [64])")


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    model = save_tiny_llama(tmp_path / "hf")
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    next((tmp_path / "hf").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(HFCheckpointError, match=r"model.safetensors.index.json names model-00002-of-\d+.safetensors, "
                                                r"which is not there"):
        HFCheckpoint(tmp_path / "hf", model)


@pytest.fixture
def fake_rank_1_of_2():
    """A function that makes this process rank 1 of 2 under the ``fake`` process group (no
    peers, collectives are no-ops) and returns their mesh; torn down after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start() -> DeviceMesh:
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
        return DeviceMesh("cpu", [0, 1])

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_tensor_parallel_rank_reads_only_its_slice(tmp_path, fake_rank_1_of_2, monkeypatch):
    """Rank 1's halves of a colwise and a rowwise weight come from ``get_slice`` (the whole
    tensor never read: ``get_tensor`` fails here); a replicated one is read whole."""
    model = save_tiny_llama(tmp_path / "hf")  # before the process group: save_pretrained writes on rank 0 only
    checkpoint = HFCheckpoint(tmp_path / "hf", model)
    mesh, state = fake_rank_1_of_2(), model.state_dict()
    like = {}
    for name, dim in (("model.layers.0.mlp.up_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1)):
        full = state[name]
        local = torch.empty(full.shape[:dim] + (full.shape[dim] // 2,) + full.shape[dim + 1:], device="meta")
        like[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape,
                                        stride=full.stride())
    like["model.norm.weight"] = torch.empty(64, device="meta")

    import safetensors

    real_open = safetensors.safe_open

    class NoWholeReads:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            assert key == "model.norm.weight", f"{key} read whole"
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", NoWholeReads)
    got = checkpoint.read(set(like), {}, like)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"][64:])
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"])


@pytest.mark.slow
def test_the_program_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path):
    """One process (plain python): exit 2, one line naming the mismatch, no traceback, before step 1."""
    save_tiny_llama(tmp_path / "hf")
    from hetpar.rewriters import compile_plan

    compile_plan(llama_plan(tmp_path / "hf"), tmp_path / "build")
    other = dict(load_file(tmp_path / "hf" / "model.safetensors"))
    other["model.embed_tokens.weight"] = torch.zeros(100, 64)
    (tmp_path / "other").mkdir()
    save_file(other, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
    assert_program_refuses(tmp_path / "build", ["--init-from", str(tmp_path / "other")],
                           f"hetpar: --init-from {tmp_path / 'other'} does not fit LlamaForCausalLM: it has "
                           "model.embed_tokens.weight of shape [100, 64] (the model's: [128, 64])")


# ----------------------------------------------------------------------------- --save-hf


def test_save_hf_is_refused_for_a_model_without_a_hugging_face_config():
    with pytest.raises(HFCheckpointError, match=r"^--save-hf writes a Hugging Face checkpoint, but Linear has no Hugging "
                                                r"Face config \(model.config\) to write as config.json; use --save-final$"):
        check_savable(torch.nn.Linear(2, 2))


def test_save_hf_writes_a_directory_from_pretrained_loads_or_nothing(tmp_path):
    """Tied weights once, contiguous; use_cache back on; an existing directory replaced;
    a write that fails leaves neither a directory nor a temporary one."""
    import transformers as tf

    model = save_tiny_llama(tmp_path / "hf", tie=True)
    model.config.use_cache = False  # as training leaves it
    state = {k: (v.t().contiguous().t() if v.dim() == 2 else v) for k, v in model.state_dict().items()}  # not contiguous
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("from before")
    save_pretrained(tmp_path / "out", state, model)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["use_cache"] is True
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    class Broken(torch.nn.Module):  # a config whose save_pretrained fails halfway
        config = type("Config", (), {"save_pretrained": lambda self, directory: 1 / 0})()
    with pytest.raises(ZeroDivisionError):
        save_pretrained(tmp_path / "failed", {"w": torch.zeros(2)}, Broken())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


@pytest.mark.slow
def test_a_tensor_parallel_run_saves_what_from_pretrained_loads_with_the_trained_logits(tmp_path):
    """A tied Llama at tp 2 from its checkpoint directory (each rank its slices) on a
    token file; ``--save-hf`` loads with ``from_pretrained`` and gives the logits of the
    trained state (``--save-final``), which moved from the start."""
    import transformers as tf

    from hetpar.rewriters import compile_plan

    initial = save_tiny_llama(tmp_path / "hf", tie=True)
    write_tokens(tmp_path / "train.bin", 2000, vocab=VOCAB)
    compile_plan(llama_plan(tmp_path / "hf", tp=2), tmp_path / "build")
    result = run_torchrun(tmp_path / "build" / "train.py", 2, [
        "--steps", "2", "--optimizer", "sgd", "--lr", str(LR), "--init-from", str(tmp_path / "hf"),
        "--data", str(tmp_path / "train.bin"), "--save-final", "final.pt", "--save-hf", str(tmp_path / "trained")])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "tp 2" in result.stderr  # the stage's Linears split over the two ranks
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    final = torch.load(tmp_path / "build" / "final.pt", weights_only=True)
    trained = load_model_file(HF_MODEL, {"config": str(tmp_path / "hf"), "seq": SEQ}).build_model()
    trained.load_state_dict(final)
    assert not torch.equal(final["model.embed_tokens.weight"], initial.state_dict()["model.embed_tokens.weight"])
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, trained(tokens).logits, rtol=0, atol=0)
