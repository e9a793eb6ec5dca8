"""Tensor parallelism for Hugging Face decoder-only LMs: stages cut at module boundaries
(runtime.module_stage), their blocks split by the finder on the exported graph or by
the config's base_model_tp_plan (planner.module_tp), planned and trained like one process."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import checkpoint_model_tensors
from test_distributed import HF_GPT2, HF_LLAMA, assert_trains_like_one_process

tf = pytest.importorskip("transformers")

from hetpar.vocabulary import Sharding  # noqa: E402
from hetpar.runtime.model_file import turn_off_kv_cache  # noqa: E402
from hetpar.runtime.module_stage import cut_module_stage, decoder_layout  # noqa: E402

SEQ = 16
SMALL = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


def _decoder(kind: str) -> torch.nn.Module:
    """Small decoders with default configs otherwise (Mistral and Qwen2 with sliding windows shorter than SEQ)."""
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=4))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attn_pdrop=0.0))
    turn_off_kv_cache(model)
    return model


def _layer_names(model: torch.nn.Module) -> list[str]:
    """The planner's layering: a leading layer, the blocks, a trailing layer."""
    layout = decoder_layout(model)
    return ["embeddings", *(layout.block_path(i) for i in range(layout.num_blocks)), "head"]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_module_stages_chain_to_the_models_own_output(kind):
    torch.manual_seed(0)
    model = _decoder(kind)
    tokens = torch.randint(0, 128, (2, SEQ))
    expected = model(tokens)
    names = _layer_names(model)
    for cuts in ([(0, 4)], [(0, 1), (2, 4)], [(0, 0), (1, 2), (3, 3), (4, 4)]):
        x = tokens
        for first, last in cuts:
            stage = cut_module_stage(model, (tokens,), (first, last), names)
            assert stage.model_inputs == ((0,) if first == 0 else ())
            out = stage.module(x)
            x = out if stage.is_last else out[0]
            if not stage.is_last:
                assert [s.shape for s in stage.send] == [(2, SEQ, 64)] and x.shape == (2, SEQ, 64)
        assert type(x) is type(expected)  # loss_fn reads outputs.logits on every layout
        torch.testing.assert_close(x.logits, expected.logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_module_stages_pin_no_device(kind):
    """Every stage, moved to the meta device, runs forward and backward there: no op
    names the CPU (a CPU constant would meet meta tensors and raise)."""
    model = _decoder(kind)
    names = _layer_names(model)
    tokens = torch.randint(0, 128, (2, SEQ))
    for first, last in [(0, 1), (2, 3), (4, 4)]:
        stage = cut_module_stage(model, (tokens,), (first, last), names, recompute="selective")
        stage.module.to("meta")
        assert all(t.is_meta for t in (*stage.module.parameters(), *stage.module.buffers()))
        x = tokens.to("meta") if first == 0 else torch.empty(2, SEQ, 64, device="meta", requires_grad=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = stage.module(x)
            out = out.logits if stage.is_last else out[0]
            assert out.device.type == "meta"
            out.sum().backward()
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="meta and cpu"):
        torch.ones(2, SEQ, device="meta") + torch.arange(SEQ)  # what a pinned constant does


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_module_stage_recomputes_its_final_norm_and_head_as_a_traced_stage_does(kind):
    """Under recompute the last layer (final norm and head) is checkpointed with the
    blocks: the same logits and gradients, and under full recompute the norm's saved
    tensors are gone (what the costs assume: a traced stage recomputes every layer)."""
    model = _decoder(kind)
    names = _layer_names(model)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    runs = {}
    for mode in ("none", "full"):
        stage = cut_module_stage(model, (tokens,), (len(names) - 1, len(names) - 1), names, recompute=mode)
        x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logits = stage.module(x).logits
        logits.pow(2).mean().backward()
        runs[mode] = (logits.detach(), x.grad, sum(saved))
    torch.testing.assert_close(runs["full"][0], runs["none"][0], rtol=0, atol=0)
    torch.testing.assert_close(runs["full"][1], runs["none"][1], rtol=0, atol=0)
    assert runs["full"][2] < runs["none"][2] - 2 * SEQ * 64  # the final norm's [2, T, 64] tensors at least


def _block_sharding(source: str, tmp_path, block: int = 0):
    """planner.module_tp.block_sharding of a model file's block, as the planner's trace calls it."""
    from hetpar.planner.capture import block_sharding
    from hetpar.planner.capture.trace import differentiable_values
    from hetpar.runtime.graph import boundary_values, build_stage, record_values, trace_layers
    from hetpar.runtime.model_file import load_model_file
    from hetpar.runtime.module_stage import layout_for

    path = tmp_path / "hfmodel.py"
    path.write_text(source)
    model_file = load_model_file(path, {})
    with torch.device("meta"):
        model = model_file.build_model()
    example = model_file.example_inputs(1)
    meta = tuple(t.to("meta") for t in example)
    layered = trace_layers(model, example_inputs=meta)
    values = record_values(layered, example)
    needs_grad = differentiable_values(layered, values)
    stage = build_stage(layered, values, block + 1, block + 1)
    inputs = [meta[i] for i in stage.model_inputs] + [
        torch.empty(spec.shape, dtype=spec.dtype, device="meta", requires_grad=needs_grad[name])
        for spec, name in zip(stage.recv, boundary_values(layered, values, block), strict=True)]
    layout = layout_for(model, layered.layer_names, example)
    return block_sharding(model, layout, block, example[0].shape[1], stage.module, inputs)


def test_finder_on_the_exported_llama_agrees_with_its_base_model_tp_plan(tmp_path):
    split = _block_sharding(HF_LLAMA, tmp_path)
    megatron = {f"model.layers.0.{path}": how for path, how in {
        "self_attn.q_proj": Sharding.COLWISE, "self_attn.k_proj": Sharding.COLWISE, "self_attn.v_proj": Sharding.COLWISE,
        "self_attn.o_proj": Sharding.ROWWISE, "mlp.gate_proj": Sharding.COLWISE, "mlp.up_proj": Sharding.COLWISE,
        "mlp.down_proj": Sharding.ROWWISE}.items()}
    assert split.config == megatron and split.found == megatron
    assert split.source == "base_model_tp_plan" and split.chosen == megatron


def test_gpt2_splits_its_fused_qkv_by_heads_and_its_conv1d_mlp(tmp_path):
    """GPT-2's fused Conv1D ``c_attn`` (q, k, v cut by ``split(split_size, dim=2)``) splits
    colwise part by part, its heads with it ([Note: local attention attributes] in
    runtime/module_stage.py): the block's dry run passes at tp 2 and 4, on a copy."""
    from hetpar.planner.capture.module_tp import BlockDryRun

    split = _block_sharding(HF_GPT2, tmp_path)
    assert split.config is None and split.source == "finder"  # GPT2Config has no base_model_tp_plan
    block = "transformer.h.0"
    assert split.found == {f"{block}.attn.c_attn": Sharding.COLWISE, f"{block}.attn.c_proj": Sharding.ROWWISE,
                           f"{block}.mlp.c_fc": Sharding.COLWISE, f"{block}.mlp.c_proj": Sharding.ROWWISE}
    model = _gpt2_meta()
    check = BlockDryRun(model, decoder_layout(model), 0, SEQ, {s.path: s.name for s in split.problem.linears})
    assert check(split.found, 2) is None and check(split.found, 4) is None
    attention = model.get_submodule(f"{block}.attn")
    assert (attention.split_size, attention.num_heads, attention.embed_dim) == (64, 4, 64)  # the model is not changed
    # 4 heads do not split 8 ways: the attention names itself, and its fused projection
    failure = check({f"{block}.attn.c_attn": Sharding.COLWISE}, 8)
    assert failure.node == f"{block}.attn" and "num_heads is 4" in failure.reason
    assert failure.split_inputs == {next(s.name for s in split.problem.linears if s.path == f"{block}.attn.c_attn")}


def test_gpt2_attention_attributes_follow_the_split():
    from hetpar.runtime.module_stage import localise_attention
    from hetpar.runtime.parts import PartError

    model = _gpt2_meta()
    path = "transformer.h.0.attn"
    attention = model.get_submodule(path)
    sharding = {f"{path}.c_attn": Sharding.COLWISE, f"{path}.c_proj": Sharding.ROWWISE}
    parts = {f"{path}.c_attn": [64, 64, 64]}
    assert localise_attention(model, sharding, 2, parts) == [path]
    assert (attention.split_size, attention.num_heads, attention.embed_dim, attention.head_dim) == (32, 2, 32, 16)
    localise_attention(model, sharding, 2, parts)  # again: unchanged, the unsplit values are kept
    assert attention.split_size == 32 and model.get_submodule("transformer.h.1.attn").split_size == 64
    assert localise_attention(_gpt2_meta(), {f"{path}.c_attn": Sharding.COLWISE_GATHER}, 2) == []  # gathered: whole
    with pytest.raises(PartError, match=r"c_attn is split colwise in parts \[192\]"):
        localise_attention(_gpt2_meta(), sharding, 2, {})
    with pytest.raises(PartError, match=r"num_heads is 4, which tp\(8\) does not divide"):
        localise_attention(_gpt2_meta(), sharding, 8, {f"{path}.c_attn": [64, 64, 64]})


def _gpt2_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128))


def _plan(tmp_path, source: str, *, tp: int, pp: int):
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    path = tmp_path / "hfmodel.py"
    path.write_text(source)
    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, tp=tp, pp=pp, dp=1)
    return plan_model(path, parse_cluster(f"1x{tp * pp}xcpu"), options, model_args={})


@pytest.mark.parametrize("source,splits", [
    (HF_LLAMA, {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                "mlp.down_proj": "rowwise"}),
    (HF_GPT2, {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}),
], ids=["llama", "gpt2"])
def test_the_planner_plans_hugging_face_decoders_at_tp_2(tmp_path, source, splits):
    plan = _plan(tmp_path, source, tp=2, pp=1)
    (stage,) = plan.stages
    blocks = plan.model.layer_names[1:-1]
    assert stage.tensor_parallel == 2 and stage.ranks == [[0, 1]]
    # the embedding and head split over the vocabulary too: Llama's untied, GPT-2's tied together
    embedding = "model.embed_tokens" if source is HF_LLAMA else "transformer.wte"
    vocab = {embedding: "vocab_embedding", "lm_head": "vocab_head"}
    assert {path: how.value for path, how in stage.tp_sharding.items()} == {
        **{f"{block}.{path}": how for block in blocks for path, how in splits.items()}, **vocab}
    assert plan.predicted.tp_comm_time_s > 0  # the all-reduces of the split blocks are costed


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_plans_its_attention_split_by_heads(tmp_path, tp):
    """Issue 30: Hugging Face GPT-2's fused c_attn is colwise in parts of n_embd, c_proj rowwise."""
    plan = _plan(tmp_path, HF_GPT2, tp=tp, pp=1)
    (stage,) = plan.stages
    assert stage.tensor_parallel == tp
    for block in plan.model.layer_names[1:-1]:
        assert stage.tp_sharding[f"{block}.attn.c_attn"] is Sharding.COLWISE
        assert stage.tp_sharding[f"{block}.attn.c_proj"] is Sharding.ROWWISE
        assert stage.tp_parts[f"{block}.attn.c_attn"] == [64, 64, 64]
    assert set(stage.tp_parts) == {f"{block}.attn.c_attn" for block in plan.model.layer_names[1:-1]}


@pytest.mark.slow
@pytest.mark.parametrize("source,pp,optimizer", [(HF_LLAMA, 1, "adamw"), (HF_LLAMA, 2, "sgd")],
                         ids=["llama-tp2", "llama-tp2xpp2"])
def test_planned_tensor_parallel_trains_like_one_process(tmp_path, source, pp, optimizer):
    plan = _plan(tmp_path, source, tp=2, pp=pp)
    assert plan.pipeline_parallel == pp and all(s.tensor_parallel == 2 and s.tp_sharding for s in plan.stages)
    assert_trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("pp,optimizer", [(1, "sgd"), (2, "adamw")], ids=["tp2-sgd", "tp2xpp2-adamw"])
def test_gpt2_split_by_heads_trains_like_one_process(tmp_path, pp, optimizer):
    """GPT-2's c_attn part-laid along its Conv1D weight's dim 1, its attention's
    split_size made local, trained through the compiled program against one process."""
    plan = _plan(tmp_path, HF_GPT2, tp=2, pp=pp)
    assert plan.pipeline_parallel == pp and all(s.tensor_parallel == 2 for s in plan.stages)
    assert all(s.tp_parts and all(p.endswith(".attn.c_attn") for p in s.tp_parts) for s in plan.stages)
    assert_trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
def test_zero_3_on_module_stages_of_a_tied_model_trains_like_one_process(tmp_path):
    """GPT-2's module stages under FSDP2 (dp 2 x pp 2, ZeRO-3): wte on stage 0 and the
    tied lm_head on stage 1 are each sharded over the replicas and kept equal across the
    stages (runtime/tied.py), as AdamW in one process trains them."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    path = tmp_path / "hfmodel.py"
    path.write_text(HF_GPT2)
    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, tp=1, pp=2, dp=2, zero=3)
    plan = plan_model(path, parse_cluster("1x4xcpu"), options, model_args={})
    assert all(s.zero_stage == 3 for s in plan.stages)
    stderr = assert_trains_like_one_process(plan, tmp_path, "adamw")
    assert "ZeRO-3 through FSDP2 over 2 replicas" in stderr


@pytest.mark.slow
def test_gpt2_checkpoint_of_tp_2_holds_the_users_conv1d_and_resumes_at_tp_1(tmp_path):
    """A checkpoint saved at tp 2 holds GPT-2's own c_attn (its Conv1D weight [in, out]
    with q, k, v side by side): read by one process it equals --save-final, and a tp 1
    program resumes from it like one process's 4 steps ([Note: part-laid checkpoints])."""

    from hetpar.runtime.model_file import load_model_file
    from test_distributed import assert_within_rounding, exact_references
    from test_fused_projections import _run

    plan = _plan(tmp_path, HF_GPT2, tp=2, pp=1)
    assert plan.stages[0].tp_parts
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    torch.manual_seed(1234)
    init_state = load_model_file(plan.model.file, {}).build_model().state_dict()
    final, _ = _run(plan, tmp_path / "tp2", init_state, ckpt + ["--steps", "3"])
    (step,) = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")]
    saved = checkpoint_model_tensors(step)
    for key in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias", "lm_head.weight"):
        assert torch.equal(saved[key], final[key]), key
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, tp=1, pp=1, dp=1)
    one = plan_model(plan.model.file, parse_cluster("1x1xcpu"), options, model_args={})
    again, stderr = _run(one, tmp_path / "tp1", init_state, ckpt + ["--steps", "4"])
    assert "step 3" in stderr, stderr[-2000:]  # resumed after the checkpoint of step 3
    reference, exact_losses, exact, sensitivity = exact_references(plan, init_state, "adamw", 4)
    assert_within_rounding("adamw", 4, exact_losses, again, reference, exact_losses, exact, sensitivity)
