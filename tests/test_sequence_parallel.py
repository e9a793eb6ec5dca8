"""Sequence parallelism ([Note: sequence parallelism] in hetpar/runtime/sequence.py): the
autograd functions and stage rewrites in one process, compiled programs at tp 2 (with
pp 2, dp 2, ZeRO, recompute) trained like one process under torchrun, and the saved
activations it removes."""

from __future__ import annotations

import dataclasses
import json
import operator
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, run_torchrun
from hetpar.rewriters.program import program_source
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.sequence import (GATHERED_ATTRIBUTE, SequenceError, SequenceGroup, gather_sequence,
                                     gathered_for_colwise, reduce_grad, scatter_sequence, shard_graph,
                                     shard_module_stage)
from hetpar.runtime.shard import ShardError, cut_stage
from test_distributed import GPT_ARGS, HF_GPT2, HF_LLAMA, assert_trains_like_one_process

GPT = ROOT / "examples" / "gpt.py"
BLOCK_TP = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise", "mlp.fc": "colwise",
            "mlp.proj": "rowwise"}


def _gpt_tp(n_layers: int = GPT_ARGS["n_layers"]) -> dict[str, str]:
    return {f"blocks.{i}.{path}": kind for i in range(n_layers) for path, kind in BLOCK_TP.items()}


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one: the collectives run, over one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        seq = SequenceGroup(1)
        seq.bind(dist.group.WORLD)
        yield seq
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one process


def test_functions_move_values_and_gradients_like_their_transposes_on_one_rank(one_rank):
    x = torch.randn(2, 6, 4, requires_grad=True)
    y = scatter_sequence(x, one_rank)
    z = gather_sequence(y * 2, one_rank, partial_grad=True)
    assert gathered_for_colwise(z) and not gathered_for_colwise(y)
    w = reduce_grad(gather_sequence(z, one_rank), one_rank)
    torch.testing.assert_close(w, 2 * x)
    (g,) = torch.autograd.grad(w.pow(2).sum(), x)
    torch.testing.assert_close(g, 8 * x)


def test_a_whole_alias_of_a_gathered_value_is_gathered_too(one_rank):
    """FSDP2 hands a unit its inputs through an autograd function, as new tensor objects on
    the same storage ([Note: ZeRO through FSDP2]); a colwise Linear must still see them as
    gathered, or it all-reduces their gradient a second time."""
    z = gather_sequence(torch.randn(2, 6, 4, requires_grad=True), one_rank, partial_grad=True)
    alias = z.view_as(z)
    assert not hasattr(alias, GATHERED_ATTRIBUTE) and gathered_for_colwise(alias)
    assert not gathered_for_colwise(z[:, :3]) and not gathered_for_colwise(z.clone())
    assert not gathered_for_colwise(gather_sequence(z, one_rank).view_as(z))  # gathered for a replicated read


def test_scatter_of_a_broadcast_partner_cuts_its_own_sequence_dimension(one_rank):
    pos = torch.randn(6, 4, requires_grad=True)  # a position embedding [S, H] added to [B, S, H]
    out = scatter_sequence(pos, one_rank, dim=0)
    assert out.shape == pos.shape
    out.sum().backward()
    assert torch.equal(pos.grad, torch.ones(6, 4))


def test_an_unbound_group_of_two_refuses_to_run():
    with pytest.raises(SequenceError, match=r"tp\(2\) but no tp group was bound"):
        gather_sequence(torch.ones(1, 2, 1), SequenceGroup(2))


def _gpt_stage(recompute: str = "none", *, tp: int = 2, sequence_parallel: bool = True, args=GPT_ARGS, path=GPT,
               tp_sharding=None):
    model_file = load_model_file(path, args)
    torch.manual_seed(0)
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    stage = cut_stage(model, model_file, 2, (0, len(names) - 1), names, recompute=recompute, tensor_parallel=tp,
                      tp_sharding=_gpt_tp() if tp_sharding is None else tp_sharding,
                      sequence_parallel=sequence_parallel)
    return model, model_file, stage


def test_fx_gpt_stage_scatters_after_the_embeddings_and_gathers_at_the_edges():
    _, _, stage = _gpt_stage()
    nodes = list(stage.module.graph.nodes)
    names = [getattr(n.target, "__name__", n.target) for n in nodes if n.op in ("call_function", "call_module")]
    # the token and position embeddings are cut to this rank's positions before their sum
    first_add = next(n for n in nodes if n.target is operator.add)
    assert [a.target.__name__ for a in first_add.args] == ["scatter_sequence", "scatter_sequence"]
    assert [a.args[1] for a in first_add.args] == [1, 0]  # [B, S, H] along 1, [S, H] along 0
    # q, k and v read one gather; so does the MLP's fc; the unsplit head reads a plain one
    assert names.count("gather_sequence_for_colwise") == 2 * GPT_ARGS["n_layers"]
    head = next(n for n in nodes if n.target == "lm_head")
    assert head.args[0].target.__name__ == "gather_sequence"
    for block in range(GPT_ARGS["n_layers"]):
        (q,) = [n for n in nodes if n.target == f"blocks.{block}.attn.q"]
        (k,) = [n for n in nodes if n.target == f"blocks.{block}.attn.k"]
        assert q.args[0] is k.args[0] and q.args[0].target.__name__ == "gather_sequence_for_colwise"
        assert q.args[0].args[0].target == f"blocks.{block}.ln1"  # the norm ran on the shard
    # shape reads of the sharded norm output are the whole micro-batch's
    assert not any(n.target is getattr and n.args[1] == "shape" and n.args[0].op == "call_module" for n in nodes)


GQA_TP = {"self_attn.qkv_proj": "colwise", "self_attn.o_proj": "rowwise", "mlp.gate_up_proj": "colwise",
          "mlp.down_proj": "rowwise"}


def test_inlined_norms_read_their_weights_through_reduce_grad_and_device_reads_gather_nothing():
    """tests/models/gqa_fused.py: its RMSNorm is traced through (``x * rsqrt(...) *
    self.weight``, the weight a get_attr), its rotary tables read ``x.device``."""
    tp_sharding = {f"layers.{i}.{path}": kind for i in range(2) for path, kind in GQA_TP.items()}
    _, _, stage = _gpt_stage(path=ROOT / "tests" / "models" / "gqa_fused.py", args={}, tp_sharding=tp_sharding)
    calls = [n.target.__name__ for n in stage.module.graph.nodes if n.op == "call_function"
             and n.target.__module__ == "hetpar.runtime.sequence"]
    # one scatter after the embedding, one gather per colwise input, a plain one before the unsplit head
    assert calls.count("scatter_sequence") == 1 and calls.count("gather_sequence") == 1
    assert calls.count("gather_sequence_for_colwise") == 4
    assert calls.count("reduce_grad") == 5  # two norms per layer and the final one


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_fx_gpt_stage_under_recompute_keeps_the_collectives_in_its_layers(recompute):
    _, _, stage = _gpt_stage(recompute)
    code = stage.module.code
    assert "recompute_layer_1" in code and "checkpoint" not in code.split("def forward")[0]


def test_fx_gpt_stage_on_one_rank_computes_the_model(one_rank):
    """shard_graph's rewrite of a whole (unsplit) stage, over a group of one: the model's
    outputs and gradients, norms' parameters read through reduce_grad."""
    model, model_file, stage = _gpt_stage(tp=1, sequence_parallel=False)
    layered = trace_layers(model)
    from hetpar.runtime.graph import record_values

    example = model_file.example_inputs(2)
    shard_graph(stage.module, record_values(layered, example), layered.node_layer, _gpt_tp(), one_rank)
    tokens = example[0]
    expected = model(tokens)
    expected.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = stage.module(tokens)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_sequence_that_tp_does_not_divide_is_refused_in_one_line():
    with pytest.raises(ShardError, match=r"^sequence parallelism splits the sequence of 15 over tp\(2\), which does "
                                         r"not divide it; [^\n]*$"):
        _gpt_stage(args={**GPT_ARGS, "seq_len": 15})


def test_llama_sequence_that_tp_does_not_divide_is_refused_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    model_file = load_model_file(_llama(tmp_path), {})
    names = ["embeddings", "model.layers.0", "model.layers.1", "head"]
    with pytest.raises(ShardError, match=r"^sequence parallelism splits the sequence of 16 over tp\(3\)"):
        cut_stage(model_file.build_model(), model_file, 2, (0, 3), names, tensor_parallel=3, sequence_parallel=True)


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(ShardError, match=r"needs tensor_parallel > 1"):
        _gpt_stage(tp=1)


def _llama(tmp_path: Path) -> Path:
    path = tmp_path / "hfllama.py"
    path.write_text(HF_LLAMA)
    return path


def test_llama_module_stage_on_one_rank_computes_the_model(tmp_path, one_rank):
    pytest.importorskip("transformers")
    from hetpar.runtime.module_stage import cut_module_stage

    model_file = load_model_file(_llama(tmp_path), {})
    torch.manual_seed(0)
    model = model_file.build_model()
    names = ["embeddings", "model.layers.0", "model.layers.1", "head"]
    tokens = model_file.example_inputs(2)[0].random_(0, 128)
    stage = cut_module_stage(model, (tokens,), (0, 3), names)
    tp_sharding = {f"model.layers.{i}.{p}": "colwise" for i in range(2) for p in ("self_attn.q_proj", "mlp.up_proj")}
    shard_module_stage(stage.module, one_rank, tp_sharding, tokens.shape[1])
    norms = [m for n, m in stage.module.named_modules() if n.endswith("layernorm") or n == "model.norm"]
    assert len(norms) == 5 and all(m._forward_pre_hooks for m in norms)
    attention = stage.module.get_submodule("model.layers.0.self_attn")
    assert attention._forward_pre_hooks and attention._forward_hooks  # gathered in, scattered out
    expected = model(tokens).logits
    expected.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = stage.module(tokens).logits
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_opt_module_stage_is_refused_in_one_line():
    tf = pytest.importorskip("transformers")
    from hetpar.runtime.module_stage import cut_module_stage

    model = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                           vocab_size=64, max_position_embeddings=32, word_embed_proj_dim=32))
    names = ["embeddings", "model.decoder.layers.0", "model.decoder.layers.1", "head"]
    stage = cut_module_stage(model, (torch.zeros(2, 8, dtype=torch.long),), (0, 3), names)
    with pytest.raises(SequenceError, match=r"^OPT's decoder layers flatten the sequence [^\n]*plan OPT without it$"):
        shard_module_stage(stage.module, SequenceGroup(2), {}, 8)


def test_program_passes_sequence_parallel_to_the_cut_only_where_planned():
    from conftest import build_plan

    plan = build_plan(GPT, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True, num_microbatches=2)
    assert "sequence_parallel" not in program_source(plan)
    source = program_source(_with_sequence_parallel(plan))
    assert source.count("sequence_parallel=True,  # norms and residuals on 1/tp of the sequence") == 2
    assert "sequence_parallel=stage_plan.sequence_parallel)" in source


# ----------------------------------------------------------------------------- torchrun


def _with_sequence_parallel(plan, **stage_fields):
    """``plan`` with every stage of tp > 1 sequence-parallel (and ``stage_fields`` set)."""
    stages = [dataclasses.replace(s, sequence_parallel=s.tensor_parallel > 1, **stage_fields) for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)


def _planned(path: Path, args: dict, *, tp: int = 2, pp: int = 1, dp: int = 1, **pins):
    """The planner's plan pinned to dp x tp x pp (``hetpar plan --dp --tp --pp``), made sequence-parallel."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    options = SearchOptions(global_batch_size=8, dtype="fp32", micro_batch_size=2, **{"schedule": "1f1b", **pins},
                            dp=dp, tp=tp, pp=pp)
    plan = plan_model(path, parse_cluster(f"1x{dp * tp * pp}xcpu"), options, model_args=args)
    assert plan.pipeline_parallel == pp and all(s.tensor_parallel == tp and s.tp_sharding for s in plan.stages)
    return _with_sequence_parallel(plan)


def _announced(stderr: str, plan) -> None:
    assert stderr.count("(sequence-parallel)") == len(plan.stages), stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_gpt_tp2_trains_like_one_process(tmp_path, optimizer):
    plan = _planned(GPT, GPT_ARGS)
    _announced(assert_trains_like_one_process(plan, tmp_path, optimizer), plan)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full"])  # selective: the Llama's test below
def test_gpt_tp2_with_recompute_trains_like_one_process(tmp_path, recompute):
    plan = _with_sequence_parallel(_planned(GPT, GPT_ARGS), recompute=recompute)
    assert_trains_like_one_process(plan, tmp_path, "adamw")


@pytest.mark.slow
def test_gpt_tp2_by_pp2_trains_like_one_process(tmp_path):
    plan = _planned(GPT, GPT_ARGS, pp=2)
    _announced(assert_trains_like_one_process(plan, tmp_path, "adamw"), plan)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_gpt_tp2_by_dp2_trains_like_one_process(tmp_path, zero):
    plan = _planned(GPT, GPT_ARGS, dp=2, zero=zero)
    assert all(s.zero_stage == zero for s in plan.stages)
    stderr = assert_trains_like_one_process(plan, tmp_path, "sgd")
    # each Linear, norm and embedding its own FSDP unit ([Note: ZeRO through FSDP2])
    assert zero == 0 or re.search(r"ZeRO-3 through FSDP2 over 2 replicas, \d\d modules gathered one at a time", stderr)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gqa_fused", "mingpt_fused"])  # megatron_fused's per-head layout: test_fused_projections.py
def test_fused_qkv_gpt_tp2_trains_like_one_process(tmp_path, model):
    """GPTs whose one Linear makes q, k and v: split part by part ([Note: part-laid
    Linears] in runtime/parts.py) or per head (Megatron's layout), reading one gathered input."""
    plan = _planned(ROOT / "tests" / "models" / f"{model}.py", {})
    assert_trains_like_one_process(plan, tmp_path, "adamw")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_llama_tp2_trains_like_one_process(tmp_path, optimizer):
    pytest.importorskip("transformers")
    plan = _planned(_llama(tmp_path), {})
    _announced(assert_trains_like_one_process(plan, tmp_path, optimizer), plan)


@pytest.mark.slow
def test_gpt2_tp2_trains_like_one_process(tmp_path):
    """GPT-2's module stages: its tied embedding and head split over the vocabulary, its
    fused c_attn (a Conv1D) part by part, the position embedding added before the cut."""
    pytest.importorskip("transformers")
    path = tmp_path / "hfgpt2.py"
    path.write_text(HF_GPT2)
    plan = _planned(path, {})
    assert any(s.tp_parts for s in plan.stages)
    assert_trains_like_one_process(plan, tmp_path, "sgd")


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective"])  # full: the GPT's test above
def test_llama_tp2_with_recompute_trains_like_one_process(tmp_path, recompute):
    pytest.importorskip("transformers")
    plan = _with_sequence_parallel(_planned(_llama(tmp_path), {}), recompute=recompute)
    assert_trains_like_one_process(plan, tmp_path, "adamw")


@pytest.mark.slow
def test_llama_tp2_by_pp2_trains_like_one_process(tmp_path):
    pytest.importorskip("transformers")
    plan = _planned(_llama(tmp_path), {}, pp=2)
    assert_trains_like_one_process(plan, tmp_path, "sgd")


@pytest.mark.slow
def test_llama_tp2_by_dp2_zero_3_trains_like_one_process(tmp_path):
    pytest.importorskip("transformers")
    plan = _planned(_llama(tmp_path), {}, dp=2, zero=3)
    assert "ZeRO-3 through FSDP2" in assert_trains_like_one_process(plan, tmp_path, "adamw")


# What a rank's forward saves for backward, in bytes (saved_tensors_hooks, parameters left
# out, each storage once): the fx GPT's whole stage in one process, and at tp 2 with and
# without sequence parallelism. The colwise Linears' own hooks (which keep a gathered input
# as its shard) are innermost and hide what they save from an outer hook, so the worker
# counts through them too.
SAVED_BYTES_WORKER = '''
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from hetpar.runtime import shard
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.model_file import load_model_file

COUNTERS = []
REAL = shard.save_gathered_as_shard


def counted(seq):
    inner = REAL(seq)

    def pack(t):
        packed = inner.pack_hook(t)
        for count in COUNTERS:
            count(packed[1] if isinstance(packed, tuple) else packed)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, inner.unpack_hook)


shard.save_gathered_as_shard = counted


def saved_bytes(module, run):
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in module.parameters()}
    seen, total = set(), [0]

    def count(t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if key[0] not in params and key not in seen:
            seen.add(key)
            total[0] += local.numel() * local.element_size()

    def pack(t):
        count(t)
        return t

    COUNTERS.append(count)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    COUNTERS.remove(count)
    return out, total[0]


args = json.loads(sys.argv[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model_file = load_model_file(args["model"], args["model_args"])
names = list(trace_layers(model_file.build_model()).layer_names)
result = {}
for tp, sp in ((1, False), (mesh.size(), False), (mesh.size(), True)):
    torch.manual_seed(0)
    model = model_file.build_model()
    tp_sharding = args["tp_sharding"] if tp > 1 else None
    stage = shard.cut_stage(model, model_file, args["batch"], (0, len(names) - 1), names, tensor_parallel=tp,
                            tp_sharding=tp_sharding, sequence_parallel=sp)
    if tp > 1:
        shard.apply_tensor_parallel(stage.module, mesh, tp_sharding)
    (tokens,) = model_file.example_inputs(args["batch"])
    dist.broadcast(tokens, 0)
    logits, nbytes = saved_bytes(stage.module, lambda: stage.module(tokens))
    logits.pow(2).mean().backward()
    result["tp1" if tp == 1 else "tp" if not sp else "sp"] = nbytes
if dist.get_rank() == 0:
    print("SAVED " + json.dumps(result))
dist.barrier()  # ranks leave together: see torch-cpu.md's teardown row
dist.destroy_process_group()
'''


def saved_activation_bytes(tmp_path: Path, model_args: dict, batch: int = 2) -> dict[str, int]:
    """Bytes one rank's forward of the fx GPT saves: ``tp1`` (one process), ``tp`` (tp 2)
    and ``sp`` (tp 2, sequence-parallel)."""
    worker = tmp_path / "saved_bytes.py"
    worker.write_text(SAVED_BYTES_WORKER)
    spec = {"model": str(GPT), "model_args": model_args, "batch": batch, "tp_sharding": _gpt_tp(model_args["n_layers"])}
    result = run_torchrun(worker, 2, [json.dumps(spec)])
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("SAVED ")]
    return json.loads(line.removeprefix("SAVED "))


@pytest.mark.slow
def test_sequence_parallel_saves_one_tp_th_of_the_blocks_activations(tmp_path):
    """Korthikanti et al. 2022, Table 2: tp alone saves sbh(10 + 24/t + ...) per layer,
    with sp sbh(34/t + ...), 1/t of one process's. Here (no dropout, the unsplit head
    reading the whole gathered sequence) each block's share is 1/tp of one process's."""
    args = {"n_layers": 4, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 64}
    saved = saved_activation_bytes(tmp_path, args)
    head_input = 2 * args["seq_len"] * args["hidden"] * 4  # [B, S, H] float32, gathered for the unsplit lm_head
    assert saved["sp"] < saved["tp"] < saved["tp1"]
    blocks_sp = saved["sp"] - head_input  # what is left is 1/tp of the one-process blocks, embeddings and ln_f
    assert abs(blocks_sp - (saved["tp1"] - head_input) / 2) <= 0.05 * saved["tp1"] / 2, saved


@pytest.mark.slow
def test_gpt_tp2_by_pp2_zero_bubble_trains_like_one_process(tmp_path):
    """Zero-bubble's W actions compute weight gradients apart from the input gradients:
    the colwise inputs kept as shards are gathered again there, alike on both tp ranks."""
    plan = _planned(GPT, GPT_ARGS, pp=2, schedule="zb")
    assert plan.schedule == "zb"
    assert_trains_like_one_process(plan, tmp_path, "adamw")


# Each function at tp 2 against its definition, forward and backward, from what every
# rank holds (all-gathered): the transposes of [Note: sequence parallelism]'s table.
FUNCTIONS_WORKER = '''
import gc

import torch
import torch.distributed as dist
from hetpar.runtime.sequence import SequenceGroup, gather_sequence, reduce_grad, scatter_sequence

dist.init_process_group("gloo")
rank = dist.get_rank()
seq = SequenceGroup(2)
seq.bind(dist.group.WORLD)


def every(t):
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t.contiguous())
    return out


def run(fn, x):
    x = x.clone().requires_grad_()
    y = fn(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + rank))  # a different gradient per rank
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), g, gx


common = torch.Generator().manual_seed(0)
whole = torch.randn(3, 4, 5, generator=common)  # replicated over the group
mine = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(1 + rank))  # this rank's shard

y, g, gx = run(lambda x: scatter_sequence(x, seq), whole)
assert torch.equal(y, whole[:, 2 * rank:2 * rank + 2])
assert torch.equal(gx, torch.cat(every(g), 1))  # backward: all-gather

y, g, gx = run(lambda x: scatter_sequence(x, seq, dim=0), whole[0])  # a [S, H] partner along its dim 0
assert torch.equal(y, whole[0, 2 * rank:2 * rank + 2]) and torch.equal(gx, torch.cat(every(g), 0))

y, g, gx = run(lambda x: gather_sequence(x, seq, partial_grad=True), mine)
assert torch.equal(y, torch.cat(every(mine), 1))
torch.testing.assert_close(gx, sum(every(g))[:, 2 * rank:2 * rank + 2])  # backward: reduce-scatter

y, g, gx = run(lambda x: gather_sequence(x, seq), mine)
assert torch.equal(y, torch.cat(every(mine), 1)) and torch.equal(gx, g[:, 2 * rank:2 * rank + 2])  # own chunk

y, g, gx = run(lambda x: reduce_grad(x, seq), whole)
assert torch.equal(y, whole)
torch.testing.assert_close(gx, sum(every(g)))  # backward: all-reduce
print("FUNCTIONS OK")
del seq, y, g, gx  # nothing holding the group or its work alive at exit: torch-cpu.md's teardown row
gc.collect()
dist.barrier()  # ranks leave together
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_functions_at_tp_2_move_values_and_gradients_as_defined(tmp_path):
    worker = tmp_path / "functions.py"
    worker.write_text(FUNCTIONS_WORKER)
    result = run_torchrun(worker, 2, [])
    assert result.returncode == 0 and "FUNCTIONS OK" in result.stdout, result.stderr[-4000:]
