"""Tensor parallelism of GPTs as people write them (issue 30): fused q/k/v and gate/up
Linears split part by part, head counts fixed in the code, position embeddings left whole.

The held-out models are tests/models/mingpt_fused.py (nanoGPT's attention, ``split(n_embd)``),
megatron_fused.py (per-head interleaved ``query_key_value``) and gqa_fused.py (grouped-query
``qkv_proj`` split by sizes, ``repeat_interleave``, a fused SwiGLU ``gate_up_proj``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanningError
from hetpar.planner.options import SearchOptions
from hetpar.planner.errors import PlanFileError
from hetpar.planner.plan import ParallelPlan, StagePlan
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.parts import PartError, PartLayout
from hetpar.vocabulary import Sharding

from conftest import checkpoint_model_tensors, run_torchrun
from test_distributed import assert_trains_like_one_process, assert_within_rounding, exact_references

MODELS = Path(__file__).parent / "models"
MINGPT, MEGATRON, GQA = MODELS / "mingpt_fused.py", MODELS / "megatron_fused.py", MODELS / "gqa_fused.py"
# (model, its attention's fused Linear and output Linear in block 0, the parts of the fused Linear)
ATTENTION = {
    "mingpt": (MINGPT, "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", [64, 64, 64]),
    "megatron": (MEGATRON, "layers.0.self_attention.query_key_value", "layers.0.self_attention.dense", None),
    "gqa": (GQA, "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", [64, 32, 32]),
}


def _plan(model: Path, tp: int, *, world: int | None = None, model_args: dict | None = None, **pins) -> ParallelPlan:
    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=4 // pins.get("pp", 1),
                            tp=tp, **{"dp": 1, "pp": 1, **pins})
    return plan_model(model, parse_cluster(f"1x{world or tp * pins.get('pp', 1)}xcpu"), options, model_args=model_args or {})


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_attention_of_fused_models_splits(name, tp):
    model, fused, out, parts = ATTENTION[name]
    args = {"n_kv_head": 4} if name == "gqa" and tp == 4 else {}  # kv heads must divide by tp (see the refusal test)
    if args:
        parts = [64, 64, 64]
    plan = _plan(model, tp, model_args=args)
    (stage,) = plan.stages
    assert stage.tensor_parallel == tp
    assert stage.tp_sharding[fused] is Sharding.COLWISE and stage.tp_sharding[out] is Sharding.ROWWISE
    assert stage.tp_parts.get(fused) == parts
    if name == "gqa":
        assert stage.tp_sharding["layers.0.mlp.gate_up_proj"] is Sharding.COLWISE
        assert stage.tp_parts["layers.0.mlp.gate_up_proj"] == [128, 128]
        assert stage.tp_sharding["layers.0.mlp.down_proj"] is Sharding.ROWWISE
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan


@pytest.mark.parametrize("name", list(ATTENTION))
def test_attention_flops_per_rank_fall_with_tp(name):
    """The measured block: at tp 2 nearly all its FLOPs (the attention's included) are split."""
    model, *_ = ATTENTION[name]
    graph = trace_model(load_model_file(model, {}))
    block = next(l for l in graph.layers if l.name.endswith(("h", "layers.0", "h.0")))
    assert block.tp_split_flops_fraction > 0.97, block.name
    flops = block.fwd_flops + block.bwd_flops
    per_rank = {tp: flops * (1 - block.tp_split_flops_fraction + block.tp_split_flops_fraction / tp) for tp in (1, 2, 4)}
    assert per_rank[2] < 0.52 * per_rank[1] and per_rank[4] < 0.27 * per_rank[1]


def test_grouped_query_attention_refuses_tp_beyond_its_kv_heads():
    with pytest.raises(PlanningError, match=r"layers\.0 splits only 2 ways"):
        _plan(GQA, 4)
    graph = trace_model(load_model_file(GQA, {"n_kv_head": 1}))
    assert any(l.name == "layers.0" for l in graph.layers)
    assert "layers.0.self_attn.qkv_proj" not in graph.tp_sharding[1]  # one kv head: attention kept whole


def test_position_embedding_is_not_split_as_a_vocabulary():
    graph = trace_model(load_model_file(MINGPT, {}))
    split = {path: how for sharding in graph.tp_sharding for path, how in sharding.items()}
    assert "transformer.wpe" not in split
    assert split["lm_head"] is Sharding.VOCAB_HEAD  # tied to wte, which splits with it


def test_part_layout_rows_round_trip():
    layout = PartLayout((4, 2, 2), 2)
    assert layout.rank_rows(0).tolist() == [0, 1, 4, 6] and layout.rank_rows(1).tolist() == [2, 3, 5, 7]
    user = torch.arange(8.0).unsqueeze(1)
    assert torch.equal(layout.to_user(layout.from_user(user)), user)
    with pytest.raises(PartError, match=r"part of 2 features .* does not divide by tp\(4\)"):
        PartLayout((4, 2, 2), 4)


def test_part_layout_of_a_conv1d_weight_is_along_its_columns():
    """transformers' Conv1D (GPT-2's c_attn) stores its weight [in, out]: its parts lie
    along dimension 1, its bias's along dimension 0."""
    tf = pytest.importorskip("transformers")
    from hetpar.runtime.parts import part_layouts

    holder = torch.nn.Module()
    holder.c_attn = tf.pytorch_utils.Conv1D(12, 4)
    layouts = part_layouts({"c_attn": [4, 4, 4]}, holder, 2)
    assert layouts == {"c_attn.weight": PartLayout((4, 4, 4), 2, 1), "c_attn.bias": PartLayout((4, 4, 4), 2, 0)}
    weight = holder.c_attn.weight.detach()
    assert torch.equal(layouts["c_attn.weight"].of_rank(weight, 1), weight[:, [2, 3, 6, 7, 10, 11]])
    assert torch.equal(layouts["c_attn.weight"].to_user(layouts["c_attn.weight"].from_user(weight)), weight)
    assert torch.equal(layouts["c_attn.weight"].from_user(weight)[:, :6], weight[:, [0, 1, 4, 5, 8, 9]])


def test_plan_checks_its_parts():
    base = dict(index=0, layers=[0], device_type="cpu", tensor_parallel=2, ranks=[[0, 1]],
                tp_sharding={"a.qkv": Sharding.COLWISE, "a.o": Sharding.ROWWISE})
    StagePlan(**base, tp_parts={"a.qkv": [64, 32, 32]})
    with pytest.raises(PlanFileError, match="does not divide by tensor_parallel"):
        StagePlan(**base, tp_parts={"a.qkv": [64, 33, 33]})
    with pytest.raises(PlanFileError, match="does not split colwise"):
        StagePlan(**base, tp_parts={"a.o": [16, 16]})


def test_published_gpt_with_a_fused_qkv_splits_by_heads_and_costs_as_separate_qkv():
    """benchmarks/published/gpt.py's ``fused_qkv=1`` (Megatron's per-head interleaved
    ``query_key_value``, which benchmarks/published_as_typed.py --fused-qkv types) splits
    by heads at tp 2, and its plan is predicted as fast as the separate q/k/v one."""
    published = Path(__file__).parent.parent / "benchmarks" / "published" / "gpt.py"
    fused, separate = (_plan(published, 2, model_args={"fused_qkv": f, "dropout": 0.0}) for f in (1, 0))
    (stage,) = fused.stages
    assert stage.tp_sharding["blocks.0.attn.query_key_value"] is Sharding.COLWISE
    assert stage.tp_sharding["blocks.0.attn.o"] is Sharding.ROWWISE
    assert stage.tp_parts == {}  # one part per Linear: each rank's rows are whole heads of q, k and v
    assert fused.predicted.step_time_s == pytest.approx(separate.predicted.step_time_s, rel=0.02)


def _hetpar(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "hetpar", *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_trace_shows_the_parts_of_fused_projections():
    data = json.loads(_hetpar("trace", str(MINGPT), "--json").stdout)
    block = next(row for row in data["layers"] if row["name"] == "transformer.h.0")
    assert block["tp_parts"] == {"transformer.h.0.attn.c_attn": [64, 64, 64]}
    assert block["tp_sharding"]["transformer.h.0.attn.c_attn"] == Sharding.COLWISE
    assert all(not row["tp_parts"] for row in data["layers"] if not row["name"].startswith("transformer.h."))
    text = _hetpar("trace", str(MINGPT)).stderr
    assert re.search(r"transformer\.h\.1\.attn\.c_attn\s*│\s*colwise\s*│\s*\[64, 64, 64\]", text), text


def test_explain_shows_the_parts_of_fused_projections(tmp_path):
    path = tmp_path / "plan.json"
    _plan(GQA, 2).save(path)
    (stage,) = json.loads(_hetpar("explain", str(path), "--json").stdout)["stages"]
    assert stage["tp_parts"]["layers.0.self_attn.qkv_proj"] == [64, 32, 32]
    assert stage["tp_parts"]["layers.0.mlp.gate_up_proj"] == [128, 128]
    text = _hetpar("explain", str(path)).stderr
    assert re.search(r"stage 0\s*│\s*layers\.1\.self_attn\.qkv_proj\s*│\s*colwise\s*│\s*\[64, 32, 32\]", text), text


# ----------------------------------------------------------------------------- trained under torchrun, against one process

@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("mingpt", "sgd"), ("megatron", "adamw"), ("gqa", "adamw")])  # one optimizer each
def test_fused_models_train_like_one_process_at_tp_2(tmp_path, name, optimizer):
    plan = _plan(ATTENTION[name][0], 2)
    assert plan.stages[0].tp_sharding[ATTENTION[name][1]] is Sharding.COLWISE
    assert_trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTENTION))
def test_fused_models_train_like_one_process_at_tp_2_by_pp_2(tmp_path, name):
    plan = _plan(ATTENTION[name][0], 2, pp=2)
    assert plan.pipeline_parallel == 2 and any(s.tp_parts for s in plan.stages) == (name != "megatron")
    if name == "mingpt":  # nanoGPT's ModuleDict namespace: the blocks are layers, cut between them
        first, second = plan.stages
        assert [plan.model.layer_names[i] for i in (first.layers[-1], second.layers[0])] == [
            "transformer.h.0", "transformer.h.1"]
    assert_trains_like_one_process(plan, tmp_path, "adamw")


@pytest.mark.slow
def test_checkpoint_of_tp_2_holds_the_users_tensors_and_resumes_at_tp_1(tmp_path):
    """A checkpoint saved at tp 2 holds mingpt's own tensors under its own names: read by
    one process it equals --save-final, and a tp 1 program resumes from it."""

    final, saved = save_then_resume(_plan(MINGPT, 2), _plan(MINGPT, 1, world=1), MINGPT, tmp_path)
    for key in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias", "lm_head.weight"):
        assert torch.equal(saved[key], final[key]), key


@pytest.mark.slow
def test_a_checkpoint_resumes_into_part_laid_linears_at_tp_2(tmp_path):
    """The grouped-query GPT saved at tp 1 and resumed at tp 2, where its fused q/k/v and gate/up Linears are
    part-laid: each rank holds its rows of every part ([Note: part-laid checkpoints]), as one process's 4 steps.
    (Loading used to set the rank's tensors back to the user's row order after placing them.)"""
    plan = _plan(GQA, 2)
    assert plan.stages[0].tp_parts
    save_then_resume(_plan(GQA, 1, world=1), plan, GQA, tmp_path)


def save_then_resume(saver: ParallelPlan, resumer: ParallelPlan, model: Path, tmp_path: Path) -> tuple[dict, dict]:
    """``saver`` trains ``model`` 3 steps under AdamW with a checkpoint after the third, ``resumer`` resumes from it
    to step 4, and its parameters are checked against one process's 4 steps within float32 rounding ([Note: float
    tolerance]). Returns the saver's --save-final state and the checkpoint's model tensors read by one process."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    torch.manual_seed(1234)
    init_state = load_model_file(model, {}).build_model().state_dict()
    final, _ = _run(saver, tmp_path / "saver", init_state, ckpt + ["--steps", "3"])
    (step,) = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")]
    saved = checkpoint_model_tensors(step)
    again, stderr = _run(resumer, tmp_path / "resumer", init_state, ckpt + ["--steps", "4"])
    assert "step 3" in stderr, stderr[-2000:]  # resumed after the checkpoint of step 3
    reference, exact_losses, exact, sensitivity = exact_references(resumer, init_state, "adamw", 4)
    assert_within_rounding("adamw", 4, exact_losses, again, reference, exact_losses, exact, sensitivity)
    return final, saved


def _run(plan: ParallelPlan, out: Path, init_state: dict, args: list[str]) -> tuple[dict, str]:
    """Compile ``plan`` into ``out`` and run it with AdamW from ``init_state``: its --save-final state and stderr."""
    from hetpar.rewriters import compile_plan

    compile_plan(plan, out)
    torch.save(init_state, out / "init.pt")
    result = run_torchrun(out / "train.py", plan.cluster.world_size,
                          ["--optimizer", "adamw", "--lr", "0.01", "--init-from", "init.pt", "--save-final", "final.pt",
                           *args])
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out / "final.pt", weights_only=True), result.stderr


@pytest.mark.slow
def test_written_out_attention_splits_by_heads_and_trains_at_tp_2_with_selective_recompute(tmp_path):
    """benchmarks/published/gpt.py's ``attention=unfused`` (Megatron-LM's 2022 CoreAttention:
    heads folded into the batch, baddbmm, a causal mask buffer, bmm) splits by heads, and
    under selective recompute, which runs its products of two activations again in backward
    ([Note: selective recompute costs]), trains at tp 2 like one process."""
    published = Path(__file__).parent.parent / "benchmarks" / "published" / "gpt.py"
    plan = _plan(published, 2, model_args={"attention": "unfused", "dropout": 0.0}, recompute="selective")
    sharding = plan.stages[0].tp_sharding
    assert [sharding[f"blocks.0.attn.{p}"] for p in "qkvo"] == [Sharding.COLWISE] * 3 + [Sharding.ROWWISE]
    assert all(s.recompute == "selective" for s in plan.stages)
    assert_trains_like_one_process(plan, tmp_path, "adamw")
