"""``hetpar estimate`` as a user meets it: JSON on stdout, one clear line for bad input."""

import json
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, hetpar

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
SMALL_GPT = ["-a", "n_layers=2", "-a", "hidden=32", "-a", "seq_len=8", "-a", "vocab=64"]  # 4 layers: emb, 2 blocks, head
BASE = ["estimate", GPT, *SMALL_GPT, "--cluster", "1x8xA100-80GB", "--global-batch", "16", "--micro-batch-size", "2"]


def test_estimate_prints_the_predicted_block_as_json():
    result = hetpar(*BASE, "--dp", "2", "--tp", "2", "--pp", "2", "--stage-layers", "1,3", "--schedule", "zb",
                    "--recompute", "full", "--zero", "1", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "hetpar.estimate" and data["fits"] is True
    assert data["predicted"]["step_time_s"] > 0 and data["tflops_per_device"] > 0 and 0 < data["mfu"] < 1
    assert [s["layers"] for s in data["stages"]] == [[[0, 0]], [[1, 3]]]
    assert set(data["time_breakdown"]) >= {"compute_s", "bubble_s", "tp_comm_s", "pp_comm_s", "dp_comm_s"}
    assert {"weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "total_bytes"} <= set(
        data["stages"][0]["memory"])
    assert "predicted step" in result.stderr


def test_estimate_on_a_mixed_cluster_with_stage_devices():
    result = hetpar("estimate", GPT, *SMALL_GPT, "--cluster", "1x4xV100-32GB+1x4xA100-80GB", "--global-batch", "16",
                    "--micro-batch-size", "2", "--dp", "4", "--tp", "1", "--pp", "2", "--stage-devices", "A100-80GB,V100-32GB",
                    "--dtype", "fp16", "--json")
    assert result.returncode == 0, result.stderr
    stages = json.loads(result.stdout)["stages"]
    assert [(s["device_type"], s["ranks"]) for s in stages] == [("A100-80GB", [[4], [5], [6], [7]]), ("V100-32GB", [[0], [1], [2], [3]])]


@pytest.mark.parametrize("args,fragments", [
    (["--dp", "2", "--tp", "2", "--pp", "3"], ["dp(2) * tp(2) * pp(3) = 12 != world_size(8)"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--stage-layers", "1,2"], ["--stage-layers 1,2 sums to 3", "4 layers"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--stage-layers", "1,x"], ["--stage-layers '1,x' is not a comma-separated list"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--stage-devices", "A100-80GB,V100-32GB"], ["'V100-32GB', which is not in the cluster"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--global-batch", "8"],
     ["micro-batches (1)", "multiple of pp(2)"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--virtual-stages", "2"], ["need --schedule interleaved"]),
    (["--dp", "4", "--tp", "1", "--pp", "2", "--zero", "5"], ["unknown zero 5"]),
    (["--dp", "8", "--tp", "1", "--pp", "1", "--global-batch", "12"], ["global batch 12 is not a multiple of dp(8)"]),
])
def test_bad_input_is_one_line(args, fragments):
    assert_one_line_error(hetpar(*BASE, *args), *fragments)


def test_a_device_without_the_dtype_is_one_line():
    result = hetpar("estimate", GPT, *SMALL_GPT, "--cluster", "1x8xV100-32GB", "--global-batch", "16", "--micro-batch-size", "2",
                    "--dp", "8", "--tp", "1", "--pp", "1", "--dtype", "bf16")
    assert_one_line_error(result, "V100-32GB has no bf16", "--dtype fp16")


def test_a_tp_degree_the_heads_do_not_divide_is_refused_in_one_line():
    six_heads = [GPT, "-a", "n_layers=1", "-a", "hidden=96", "-a", "heads=6", "-c", "1x4xcpu", "-b", "4"]
    refused = hetpar("estimate", *six_heads, "--dp", "1", "--tp", "4", "--pp", "1", "--micro-batch-size", "4")
    assert_one_line_error(refused, "--tp 4", "blocks.0", "2, 3, 6")
    plan_refused = hetpar("plan", *six_heads, "--tp", "4")
    assert_one_line_error(plan_refused, "--tp 4", "blocks.0")


def test_estimate_says_which_layout_it_used():
    megatron = hetpar(*BASE, "--dp", "4", "--tp", "1", "--pp", "2", "--json")
    assert megatron.returncode == 0, megatron.stderr
    assert [s["layers"] for s in json.loads(megatron.stdout)["stages"]] == [[[0, 1]], [[2, 3]]]
    assert "layout: Megatron (blocks evenly" in megatron.stderr
    assert json.loads(megatron.stdout)["layout"].startswith("Megatron")
    uneven = hetpar(*BASE, "--dp", "2", "--tp", "1", "--pp", "4", "--json")
    assert uneven.returncode == 0, uneven.stderr
    assert json.loads(uneven.stdout)["layout"] == "even split of 4 layers"
