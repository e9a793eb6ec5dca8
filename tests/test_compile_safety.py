"""A plan file never becomes code ([Note: plan text] in rewriters/plan_text.py), and a
program holds only what its plan uses ([Note: what a program holds] in rewriters/program.py)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, hetpar
from conftest import ROOT, build_plan
from hetpar.rewriters import compile_plan
from hetpar.rewriters.torchrun import replan_options
from hetpar.runtime.faults import parse_faults
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.tied import TiedWeight, tied_across_stages

GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
MLP_ARGS = {"depth": 2, "width": 32, "in_features": 16, "out_features": 8}
BREAKOUT = '"""; print("INJECTED CODE RAN"); """'


@pytest.fixture
def plan_file(tmp_path, model_copy) -> Path:
    """A valid plan of examples/gpt.py (a private copy) over two stages, as JSON."""
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=2, tensor_parallel=2,
                      tp_blocks=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def set_layer_name(plan, tmp_path):
    plan["model"]["layer_names"][0] = "tok_emb" + BREAKOUT


def set_layer_name_newline(plan, tmp_path):
    plan["model"]["layer_names"][1] = "blocks.0\nimport os"


def set_model_arg_key(plan, tmp_path):
    plan["model"]["args"]['x=1); print("INJECTED"); (y'] = 1


def set_model_arg_value(plan, tmp_path):
    plan["model"]["args"]["hidden"] = "32" + BREAKOUT


def set_model_arg_nan(plan, tmp_path):
    plan["model"]["args"]["hidden"] = float("nan")  # repr is nan, a NameError in the program


def set_cluster_device_type(plan, tmp_path):
    plan["cluster"]["device_types"][0] = "cpu\necho INJECTED"


def set_stage_device_type(plan, tmp_path):
    plan["stages"][0]["device_type"] = "cpu" + BREAKOUT


def set_model_file(plan, tmp_path):
    crafted = tmp_path / "src" / ('gpt' + BREAKOUT + '.py')
    crafted.write_bytes(Path(plan["model"]["file"]).read_bytes())  # the planned bytes: only the name is wrong
    plan["model"]["file"] = str(crafted)


def set_cluster_spec(plan, tmp_path):
    plan["cluster"]["spec"] = "1x4xcpu" + BREAKOUT


def set_leaf_module(plan, tmp_path):
    plan["model"]["leaf_modules"] = ["blocks.0" + BREAKOUT]


def set_tp_sharding_key(plan, tmp_path):
    plan["stages"][0]["tp_sharding"] = {"blocks.0.attn.q" + BREAKOUT: "colwise"}


def set_compiled(plan, tmp_path):
    plan["compiled"] = "__import__('os').system('echo INJECTED')"


def set_step_time(plan, tmp_path):
    plan["predicted"]["step_time_s"] = "1; import os"


def set_dtype(plan, tmp_path):
    plan["dtype"] = "fp32" + BREAKOUT


CRAFTED = {  # how a plan is crafted -> the field the refusal must name
    set_layer_name: "model.layer_names[0]",
    set_layer_name_newline: "model.layer_names[1]",
    set_model_arg_key: "model.args has a key",
    set_model_arg_value: "model.args['hidden']",
    set_model_arg_nan: "model.args['hidden']",
    set_cluster_device_type: "cluster.device_types[0]",
    set_stage_device_type: "stages[0].device_type",
    set_model_file: "model.file",
    set_cluster_spec: "cluster.spec",
    set_leaf_module: "model.leaf_modules[0]",
    set_tp_sharding_key: "stages[0].tp_sharding",
    set_compiled: "compiled",
    set_step_time: "predicted.step_time_s",
    set_dtype: "plan dtype",
}


@pytest.mark.parametrize("craft", list(CRAFTED), ids=[c.__name__.removeprefix("set_") for c in CRAFTED])
def test_a_crafted_plan_is_refused_in_one_line_and_writes_nothing(tmp_path, plan_file, craft):
    plan = json.loads(plan_file.read_text())
    craft(plan, tmp_path)
    plan_file.write_text(json.dumps(plan))
    out = tmp_path / "build"
    result = hetpar("compile", str(plan_file), "-o", str(out))
    assert_one_line_error(result, CRAFTED[craft])
    assert "INJECTED" not in result.stdout + result.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "src"]  # no temporary directory either


def test_the_same_plan_uncrafted_compiles(tmp_path, plan_file):
    result = hetpar("compile", str(plan_file), "-o", str(tmp_path / "build"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "build" / "train.py").is_file()


def test_a_model_file_named_with_hyphens_and_dots_compiles(tmp_path, plan_file):
    plan = json.loads(plan_file.read_text())
    renamed = tmp_path / "src" / "nano-gpt.v2.py"
    renamed.write_bytes(Path(plan["model"]["file"]).read_bytes())
    plan["model"]["file"] = str(renamed)
    plan_file.write_text(json.dumps(plan))
    result = hetpar("compile", str(plan_file), "-o", str(tmp_path / "build"))
    assert result.returncode == 0, result.stderr
    assert "MODEL_FILE = 'nano-gpt.v2.py'" in (tmp_path / "build" / "train.py").read_text()


def test_model_arguments_reach_the_replan_line_quoted_for_the_shell(tmp_path, model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1, 2, 3]])
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, args={**GPT_ARGS, "name": "a b; c"}))
    assert replan_options(plan).endswith("--model-arg vocab=64 --model-arg 'name=a b; c'")


# ----------------------------------------------------------------------------- what a program holds


def program_text(plan, tmp_path, **kwargs) -> str:
    out = tmp_path / "out"
    compile_plan(plan, out, **kwargs)
    return (out / "train.py").read_text()


def runtime_modules(text: str) -> set[str]:
    """The hetpar.runtime modules a program imports."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module == "hetpar.runtime":
            found |= {a.name for a in node.names}
    return found


FEATURE_WORDS = re.compile(r"fault|inject|tied|rebalance|ReplicaShares|local sgd|sync_every|after_step|compression|"
                           r"aggregation|powersgd|scaler|autocast|executor|schedule|chunk|virtual", re.IGNORECASE)


def test_a_plain_data_parallel_program_holds_nothing_else(tmp_path):
    plan = build_plan(ROOT / "examples" / "mlp.py", MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2,
                      num_microbatches=2)
    text = program_text(plan, tmp_path)
    assert runtime_modules(text) == {"checkpoint", "cli", "data", "data_parallel", "devices", "distributed",
                                     "hf_checkpoint", "materialize", "shard", "timing", "training"}
    assert FEATURE_WORDS.findall(text) == []
    for call in ("optimizer.zero_grad(set_to_none=True)", "output = stage.module(", "loss = model_file.loss(",
                 "loss.backward()", "optimizer.step()", "grad_sync.reduce()"):
        assert call in text, call
    names = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
    assert {"PLAN_STAGES", "stage_plan", "stage", "model_shard"} <= names
    assert not names & {"STAGES", "stages", "my_stages", "my_stage", "module"}  # the look-alikes of before


def test_a_pipeline_of_an_untied_model_holds_no_tied_code(tmp_path, model_copy):
    plan = build_plan(model_copy, GPT_ARGS, splits=[[0, 1], [2, 3]], num_microbatches=2)
    text = program_text(plan, tmp_path, tied=False)
    assert "tied" not in text and {"executor", "schedule"} <= runtime_modules(text)
    assert "data_parallel" not in runtime_modules(text)  # one replica


def published_gpt_plan(tmp_path) -> Path:
    """benchmarks/published/gpt.py (output layer tied to the word embedding), small, over two stages."""
    plan = build_plan(ROOT / "benchmarks" / "published" / "gpt.py", GPT_ARGS, splits=[[0, 1], [2, 3]],
                      num_microbatches=2)
    path = tmp_path / "tied.json"
    plan.save(path)
    return path


def test_the_runtime_finds_a_weight_tied_across_stages():
    model_file = load_model_file(ROOT / "benchmarks" / "published" / "gpt.py", GPT_ARGS)
    names = ["tok_emb+pos_emb+drop", "blocks.0", "blocks.1", "ln_f+lm_head"]
    assert tied_across_stages(model_file, [(0, 1), (2, 3)], names) == [TiedWeight(name="tok_emb.weight", stages=(0, 1))]
    assert tied_across_stages(model_file, [(0, 3)], names) == []
    untied = load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS)
    assert tied_across_stages(untied, [(0, 1), (2, 3)], ["tok_emb+pos_emb", *names[1:]]) == []


def test_hetpar_compile_gives_a_tied_plan_the_tied_code_and_an_untied_one_none(tmp_path, plan_file):
    result = hetpar("compile", str(published_gpt_plan(tmp_path)), "-o", str(tmp_path / "tied"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "tied" / "train.py").read_text()
    assert "tied" in runtime_modules(text)
    assert "tied_grads = tied.TiedGradients(model, model_shard, [me.stage], PLAN_STAGES, me" in text
    assert "    tied_grads.reduce()" in text
    result = hetpar("compile", str(plan_file), "-o", str(tmp_path / "untied"))
    assert result.returncode == 0, result.stderr
    assert "tied" not in (tmp_path / "untied" / "train.py").read_text()


def test_features_appear_where_the_plan_asks_for_them(tmp_path):
    plain = build_plan(ROOT / "examples" / "mlp.py", MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2,
                       num_microbatches=2)
    local_sgd = program_text(dataclasses.replace(plain, sync_every=4), tmp_path / "local_sgd")
    assert "SYNC_EVERY = 4" in local_sgd and "sync_every=SYNC_EVERY" in local_sgd
    assert "grad_sync.after_step(step, optimizer, last=step == args.steps)" in local_sgd
    fp16 = program_text(dataclasses.replace(plain, dtype="fp16"), tmp_path / "fp16")
    assert "scaler = precision.LossScaler(enabled=True)" in fp16 and "(loss * scaler.scale).backward()" in fp16
    assert "torch.autocast(device.type, dtype=DTYPE)" in fp16
    rebalance = program_text(dataclasses.replace(plain, rebalance_every=2), tmp_path / "rebalance")
    assert "shares = rebalance.ReplicaShares(" in rebalance and "shares.observe(step, timer)" in rebalance
    assert "* shares.loss_weight" in rebalance
    topk = program_text(dataclasses.replace(plain, grad_compression="topk:0.1"), tmp_path / "topk")
    assert "GRAD_COMPRESSION = 'topk:0.1'" in topk and "compression=GRAD_COMPRESSION" in topk
    median = program_text(dataclasses.replace(plain, aggregation="median"), tmp_path / "median")
    assert "AGGREGATION = 'median'" in median and "aggregation=AGGREGATION" in median
    for text in (local_sgd, fp16, rebalance, topk, median):
        assert "fault" not in text and "tied" not in text


def test_test_faults_come_from_the_environment_not_the_program():
    assert parse_faults("bad-gradients=3") == {"bad_gradients": 3}
    assert parse_faults("bad-gradients=3, slowdown=1:0.005") == {"bad_gradients": 3, "slowdown": (1, 0.005)}
    with pytest.raises(ValueError, match="HETPAR_TEST_FAULTS='slowdown=1'"):
        parse_faults("slowdown=1")
    with pytest.raises(ValueError, match="HETPAR_TEST_FAULTS='fast=1'"):
        parse_faults("fast=1")
