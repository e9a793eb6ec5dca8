"""Meta-device construction ([Note: building only this rank's tensors] in
runtime/materialize.py): any subset of a model's tensors, computed from the log of its
construction, equals one build_model() bit for bit, and computing it touches nothing
else; a rank's stages get their tensors (shards) from the seed or from --init-from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import ROOT, build_plan, run_torchrun
from hetpar.rewriters import compile_plan
from hetpar.runtime import shard
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.materialize import MaterializeError, build_on_meta, materialize, materialize_stages, named_tensors
from hetpar.runtime.model_file import load_model_file

HF_ZOO = ROOT / "tests" / "models" / "hf_zoo.py"
GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}

# Initialisers that draw a value-dependent count of numbers (trunc_normal_'s rejection
# loop), decompose (orthogonal_'s QR), write views of a tensor, use a generator of their
# own, Python's random module, or a tensor made outside any op.
TRICKY = """
import random
import torch
import torch.nn as nn

GLOBAL = torch.arange(6.0)


class Tricky(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=3)
        self.a = nn.Linear(8, 8)
        nn.init.orthogonal_(self.a.weight)
        self.b = nn.Linear(8, 24)
        nn.init.trunc_normal_(self.b.weight, std=0.5, a=-0.6, b=0.6)
        nn.init.xavier_normal_(self.b.weight[:8])
        self.c = nn.Conv1d(8, 8, 3)
        self.d = nn.Parameter(torch.randn(5, 7, generator=torch.Generator().manual_seed(99)))
        flat = torch.zeros(30)
        flat.uniform_()
        self.e = nn.Parameter(flat[:12].view(3, 4))
        self.register_buffer("perm", torch.randperm(16))
        self.register_buffer("g", GLOBAL)
        self.f = nn.Parameter(torch.full((4,), random.random()))
        self.h = nn.Parameter(torch.bernoulli(torch.full((6, 6), 0.3)))
        self.k = nn.Parameter(torch.empty(40, 30))
        nn.init.sparse_(self.k, 0.5)
        with torch.no_grad():
            self.a.bias.copy_(self.b.bias[:8] * 2)
            self.register_buffer("w", torch.multinomial(torch.softmax(self.a.weight[0], 0), 4))

    def forward(self, x):
        return self.a(self.emb(x))


def build_model():
    return Tricky()


def example_inputs(batch_size):
    return (torch.zeros(batch_size, 4, dtype=torch.long),)
"""


def _model_file(tmp_path: Path, which: str):
    if which == "tricky":
        (tmp_path / "tricky.py").write_text(TRICKY)
        return load_model_file(tmp_path / "tricky.py")
    if which == "gpt":
        return load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS)
    pytest.importorskip("transformers")
    return load_model_file(HF_ZOO, {"kind": which})


def _one_build(model_file, seed: int):
    """The model's tensors by name after one build, and the generators' states after it."""
    random.seed(seed)
    torch.manual_seed(seed)
    model = model_file.build_model()
    return dict(named_tensors(model)), torch.get_rng_state(), random.getstate()


@pytest.mark.parametrize("which", ["gpt", "tricky", "gpt2", "llama", "vit", "t5"])
def test_any_subset_of_tensors_equals_one_build(tmp_path, which):
    # vit: transformers' trunc_normal_ loops until no value is out of range (its draws depend on values)
    model_file = _model_file(tmp_path, which)
    whole, rng_after, python_after = _one_build(model_file, 7)
    random.seed(7)
    torch.manual_seed(7)
    model, log = build_on_meta(model_file.build_model)
    assert torch.equal(torch.get_rng_state(), rng_after) and random.getstate() == python_after  # as one build leaves them
    assert all(t.is_meta for name, t in named_tensors(model) if name != "g")  # g: a tensor made outside any op
    names = [name for name, _ in named_tensors(model)]
    subsets = [{n for n in names if n.startswith(child + ".")} for child, _ in model.named_children()]
    for subset in [s for s in subsets if s] + [set(names[::3]), set(names)]:
        torch.manual_seed(123)  # materialize sets the generator itself
        values = materialize(log, subset)
        assert torch.equal(torch.get_rng_state(), rng_after)
        for name in subset:
            assert torch.equal(values[name], whole[name]), name
            assert values[name].stride() == whole[name].stride(), name


def test_a_tied_weight_is_one_tensor(tmp_path):
    model_file = _model_file(tmp_path, "gpt2")
    _, log = build_on_meta(model_file.build_model)
    values = materialize(log, {"transformer.wte.weight", "lm_head.weight"})
    assert values["transformer.wte.weight"] is values["lm_head.weight"]


def test_only_the_asked_tensors_are_computed(tmp_path):
    model_file = _model_file(tmp_path, "gpt")
    model, log = build_on_meta(model_file.build_model)
    mine = {name for name, _ in named_tensors(model) if name.startswith("blocks.1.")}
    kept = {log.tensors[name].storage for name in mine}
    others = {ref.storage for name, ref in log.tensors.items()} - kept
    runs, _ = log.plan(kept)
    touched = set().union(*(op.reads | op.writes for op, run in zip(log.ops, runs) if run))
    assert touched & kept == kept and not touched & others  # nothing of blocks.0, the embeddings or the head


def test_a_shard_is_taken_from_the_whole_tensor(tmp_path):
    model_file = _model_file(tmp_path, "gpt")
    whole, _, _ = _one_build(model_file, 3)
    torch.manual_seed(3)
    _, log = build_on_meta(model_file.build_model)
    seen = []

    def half(full: torch.Tensor) -> torch.Tensor:
        seen.append(full.shape)
        return full[: full.shape[0] // 2].clone()

    values = materialize(log, {"blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight"}, local={"blocks.0.mlp.fc.weight": half})
    assert seen == [torch.Size([128, 32])]
    assert torch.equal(values["blocks.0.mlp.fc.weight"], whole["blocks.0.mlp.fc.weight"][:64])
    assert torch.equal(values["blocks.0.mlp.proj.weight"], whole["blocks.0.mlp.proj.weight"])


def _meta_stage(model_file, layers: tuple[int, int], names: list[str]):
    torch.manual_seed(0)
    model, log = build_on_meta(model_file.build_model)
    stage = shard.cut_stage(model, model_file, 2, layers, names)
    return model, log, stage


def test_a_stage_from_the_seed_a_file_or_a_checkpoint_directory(tmp_path):
    model_file = _model_file(tmp_path, "gpt")
    names = list(trace_layers(model_file.build_model()).layer_names)
    whole, _, _ = _one_build(model_file, 0)
    torch.manual_seed(11)
    other = model_file.build_model().state_dict()
    torch.save(other, tmp_path / "init.pt")
    dcp.save(other, checkpoint_id=str(tmp_path / "init-dcp"))
    for init_from, expected in [(None, whole), (tmp_path / "init.pt", other), (tmp_path / "init-dcp", other)]:
        model, log, stage = _meta_stage(model_file, (1, 2), names)
        materialize_stages(model, stage.module, log, init_from=init_from)
        state = stage.module.state_dict()
        assert sorted(state) == sorted(k for k in whole if k.startswith(("blocks.0.", "blocks.1.")))
        for key, value in state.items():
            assert not value.is_meta and torch.equal(value, expected[key]), (init_from, key)
        assert model.tok_emb.weight.is_meta and model.lm_head.weight.is_meta  # other stages' tensors are never made


def test_an_init_file_of_another_model_is_one_line(tmp_path):
    model_file = _model_file(tmp_path, "gpt")
    names = list(trace_layers(model_file.build_model()).layer_names)
    state = model_file.build_model().state_dict()
    state["blocks.0.attn.q.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "init.pt")
    model, log, stage = _meta_stage(model_file, (1, 2), names)
    with pytest.raises(MaterializeError, match=r"init.pt is not a state_dict of this model: it has blocks.0.attn.q.weight "
                                               r"of shape \[3, 3\], the model's is \[32, 32\]"):
        materialize_stages(model, stage.module, log, init_from=tmp_path / "init.pt")


def test_a_stage_exported_on_meta_runs_on_the_cpu(tmp_path):
    model_file = _model_file(tmp_path, "bert")  # torch.fx cannot trace it: cut from a torch.export graph
    torch.manual_seed(0)
    real = model_file.build_model()
    layered = trace_layers(real, example_inputs=model_file.example_inputs(2))
    assert layered.capture == "export"
    names, last = list(layered.layer_names), len(layered.layer_names) - 1
    expected = shard.cut_stage(real, model_file, 2, (0, last), names).module
    model, log, stage = _meta_stage(model_file, (0, last), names)
    materialize_stages(model, stage.module, log)
    tokens = model_file.example_inputs(2)
    outputs = []
    for module in (stage.module, expected):
        torch.manual_seed(1)  # the same dropout masks
        outputs.append(module(*tokens))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.slow
def test_programs_start_from_the_seed_like_one_build(tmp_path, monkeypatch):
    """pp 2 x tp 2 (shards), and tied GPT-2 at pp 2 (module stages): --steps 0 saves the initial state."""
    pytest.importorskip("transformers")
    import conftest

    gpt, gpt2 = ROOT / "examples" / "gpt.py", {"kind": "gpt2"}
    cases = [(build_plan(gpt, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True), gpt, GPT_ARGS)]
    monkeypatch.setattr(conftest, "layer_names", lambda path, args: list(trace_layers(
        load_model_file(path, args).build_model(), example_inputs=load_model_file(path, args).example_inputs(2)).layer_names))
    cases.append((build_plan(HF_ZOO, gpt2, splits=[[0, 1], [2, 3]]), HF_ZOO, gpt2))
    for i, (plan, path, args) in enumerate(cases):
        out = tmp_path / f"build{i}"
        compile_plan(plan, out)
        result = run_torchrun(out / "train.py", plan.cluster.world_size, ["--steps", "0", "--seed", "5",
                                                                         "--save-final", "final.pt"])
        assert result.returncode == 0, result.stderr[-4000:]
        final = torch.load(out / "final.pt", weights_only=True)
        torch.manual_seed(5)
        expected = load_model_file(path, args).build_model().state_dict()
        assert list(final) == list(expected)
        assert all(torch.equal(final[k], expected[k]) for k in expected), [k for k in expected if not torch.equal(final[k], expected[k])]


@pytest.mark.slow
def test_a_program_reads_its_shards_from_a_checkpoint_directory(tmp_path):
    gpt = ROOT / "examples" / "gpt.py"
    plan = build_plan(gpt, GPT_ARGS, splits=[[0, 1, 2, 3]], tensor_parallel=2, tp_blocks=True)
    compile_plan(plan, tmp_path / "build")
    torch.manual_seed(11)
    state = load_model_file(gpt, GPT_ARGS).build_model().state_dict()
    dcp.save(state, checkpoint_id=str(tmp_path / "init-dcp"))
    result = run_torchrun(tmp_path / "build" / "train.py", 2, ["--steps", "0", "--init-from", str(tmp_path / "init-dcp"),
                                                               "--save-final", "final.pt"])
    assert result.returncode == 0, result.stderr[-4000:]
    final = torch.load(tmp_path / "build" / "final.pt", weights_only=True)
    assert list(final) == list(state) and all(torch.equal(final[k], state[k]) for k in state)
