"""planner.estimate on synthetic layers (hand-derived values) and on a traced GPT."""

import json
from dataclasses import fields, replace

import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import layer_timing
from hetpar.cost_models.devices import get_device
from hetpar.cost_models.layers import LayerProfile
from hetpar.cost_models.memory import FRAGMENTATION_MARGIN
from hetpar.planner.estimate import EstimateConfig, EstimateError, estimate, stage_layout
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.plan import Predicted

A100 = get_device("A100-80GB")


def layer(name="l", flops=1e12, params=1_000_000, saved=1e6, boundary=0.0, tp_split=False):
    return LayerProfile(name=name, fwd_flops=flops, bwd_flops=2 * flops, params=params, saved_activation_bytes=saved,
                        boundary_bytes=boundary, num_ops=0, tp_split_flops_fraction=1.0 if tp_split else 0.0,
                        tp_split_params=params if tp_split else 0, tp_split_saved_bytes=saved if tp_split else 0.0)


def graph(n=8, **kw):
    return ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[layer(name=f"l{i}", **kw) for i in range(n)])


def config(**kw):
    base = dict(global_batch_size=8, dp=1, tp=1, pp=4, micro_batch_size=1, dtype="bf16")
    return EstimateConfig(**{**base, **kw})


def layer_s(model, **kw):
    t = layer_timing(model.layers[0], A100, tp=1, micro_batch_size=1, dtype="bf16", **kw)
    return t.fwd_s, t.bwd_s


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb", 1)])
def test_equal_stages_give_the_closed_form_bubble(schedule, v):
    model = graph(8)
    e = estimate(model, parse_cluster("1x4xA100-80GB"), config(schedule=schedule, virtual_stages=v))
    fwd, bwd = layer_s(model)
    per_rank = 2 * (fwd + bwd)  # two layers per pipeline rank
    ideal = 8 * per_rank
    bubble = {"1f1b": 3 * per_rank, "gpipe": 3 * per_rank, "interleaved": 3 * per_rank / 2}.get(schedule)
    if schedule == "zb":
        w = 2 * layer_timing(model.layers[0], A100, tp=1, micro_batch_size=1, dtype="bf16").bwd_weight_s
        bubble = 3 * (per_rank - 2 * w)
    assert e.time.compute_s == pytest.approx(ideal)
    assert e.time.bubble_s == pytest.approx(bubble)
    assert e.time.tp_comm_s == e.time.pp_comm_s == e.time.dp_comm_s == 0.0
    assert e.predicted.step_time_s == pytest.approx(ideal + bubble + e.time.optimizer_s)


def test_time_breakdown_sums_to_the_step_and_fills_the_predicted_block():
    model = graph(8, boundary=4e6, tp_split=True)
    model = replace(model, layers=[
        replace(l, tp_collectives=(("forward", "all_reduce", 8e6), ("backward", "all_reduce", 8e6))) for l in model.layers])
    e = estimate(model, parse_cluster("2x8xA100-80GB"), config(global_batch_size=16, dp=2, tp=2, pp=4))
    t, p = e.time, e.predicted
    assert t.step_s == pytest.approx(p.step_time_s)
    assert min(t.tp_comm_s, t.pp_comm_s, t.dp_comm_s, t.bubble_s) > 0
    assert p.compute_time_s + p.bubble_time_s + p.tp_comm_time_s + p.pp_comm_time_s + p.dp_comm_time_s == pytest.approx(p.step_time_s)
    assert p.throughput_samples_per_s == pytest.approx(16 / p.step_time_s)
    data = json.loads(json.dumps(e.to_dict()))
    assert set(data["predicted"]) == {f.name for f in fields(Predicted)}
    assert data["fits"] is True and len(data["stages"]) == 4
    assert data["stages"][0]["memory"]["dominant"] in ("weights", "gradients", "optimizer state", "activations")


def test_throughput_tflops_and_mfu():
    model = graph(4)
    e = estimate(model, parse_cluster("1x4xA100-80GB"), config(pp=4))
    flops = 4 * 3e12 * 8
    assert e.model_flops_per_step == flops
    assert e.tflops_per_device == pytest.approx(flops / e.predicted.step_time_s / 4 / 1e12)
    assert e.mfu == pytest.approx(flops / e.predicted.step_time_s / (4 * 312e12))


def test_one_f_one_b_memory_holds_p_minus_s_microbatches():
    model = graph(4, params=1000, saved=1e9)
    e = estimate(model, parse_cluster("1x4xA100-80GB"), config(pp=4))
    for s, stage in enumerate(e.stages):
        assert stage.peak_in_flight == 4 - s
        assert stage.memory.activations_bytes == pytest.approx(1e9 / 2 * (4 - s))  # fp32 bytes measured, bf16 kept
        assert stage.memory.total_bytes == pytest.approx(stage.memory.raw_bytes * FRAGMENTATION_MARGIN)
    gpipe = estimate(model, parse_cluster("1x4xA100-80GB"), config(pp=4, schedule="gpipe"))
    assert [s.peak_in_flight for s in gpipe.stages] == [8] * 4


def test_full_recompute_keeps_inputs_and_costs_a_forward():
    model = graph(8, saved=1e9, boundary=1e7)
    plain = estimate(model, parse_cluster("1x4xA100-80GB"), config(pp=4))
    full = estimate(model, parse_cluster("1x4xA100-80GB"), config(pp=4, recompute="full"))
    fwd, bwd = layer_s(model)
    assert full.time.compute_s == pytest.approx(8 * 2 * (2 * fwd + bwd))
    # stage 1 keeps, per micro-batch in flight, its two layers' inputs, plus one layer rebuilt.
    assert full.stages[1].memory.activations_bytes == pytest.approx((2 * 1e7 * 3 + 1e9) / 2)
    assert full.stages[1].memory.activations_bytes < plain.stages[1].memory.activations_bytes


def test_zero_shards_state_and_changes_the_sync():
    model = graph(4, params=100_000_000)
    cluster = parse_cluster("2x8xA100-80GB")
    kw = dict(global_batch_size=16, dp=16, pp=1)
    plain, z1, z3 = (estimate(model, cluster, config(zero_stage=z, **kw)) for z in (0, 1, 3))
    assert z1.stages[0].memory.optimizer_bytes == pytest.approx(plain.stages[0].memory.optimizer_bytes / 16)
    assert z3.stages[0].memory.weights_bytes < plain.stages[0].memory.weights_bytes
    assert plain.time.dp_comm_s > 0 and z1.time.dp_comm_s > 0


def test_megatron_layout_and_the_slowest_replica():
    c = config(global_batch_size=8, dp=2, tp=2, pp=2)
    assert [s.ranks for s in stage_layout(parse_cluster("1x8xA100-80GB"), c)] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    mixed = stage_layout(parse_cluster("1x2xA100-80GB+1x6xV100-32GB"), config(dp=2, tp=2, pp=2, dtype="fp16"))
    assert mixed[0].device_types == ["A100-80GB", "V100-32GB"]
    assert mixed[0].device_type == "V100-32GB" and mixed[0].memory_bytes == get_device("V100-32GB").memory_bytes


def test_stage_devices_pick_ranks_of_each_type_in_cluster_order():
    cluster = parse_cluster("1x4xV100-32GB+1x4xA100-80GB")
    layout = stage_layout(cluster, config(dp=2, tp=2, pp=2, dtype="fp16", stage_devices=("a100-80gb", "V100-32GB")))
    assert [(s.device_type, s.ranks) for s in layout] == [("A100-80GB", [[4, 5], [6, 7]]), ("V100-32GB", [[0, 1], [2, 3]])]


def test_a_slower_stage_paces_the_pipeline():
    model = graph(8)
    cluster = parse_cluster("1x2xA100-80GB+1x2xV100-32GB")
    fast = estimate(model, cluster, config(pp=4, dtype="fp16"))
    assert [s.device_type for s in fast.stages] == ["A100-80GB", "A100-80GB", "V100-32GB", "V100-32GB"]
    assert fast.stages[3].fwd_s > 2 * fast.stages[0].fwd_s
    assert fast.busiest_rank in (2, 3)


def test_a_stage_that_does_not_fit_says_which_term_dominates():
    e = estimate(graph(4, saved=100e9), parse_cluster("1x4xA100-80GB"), config(pp=4))
    assert not e.fits
    assert "stage 0 needs" in e.misfit() and "A100-80GB has 80.0 GiB; activations dominate" in e.misfit()


@pytest.mark.parametrize("kw,message", [
    (dict(dp=2, tp=2, pp=3), r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world_size\(8\)"),
    (dict(dp=2, pp=4, stage_layers=(1, 2, 2, 2)), "sums to 7, the model has 8 layers"),
    (dict(dp=2, pp=4, stage_devices=("A100-80GB", "H100-80GB", "A100-80GB", "A100-80GB")), "'H100-80GB', which is not in the cluster"),
    (dict(dp=1, pp=8, global_batch_size=8, stage_devices=("A100-80GB",) * 8, tp=1), None),
    (dict(dp=1, tp=2, pp=4), "the model has no layer that tensor parallelism can split"),
])
def test_configurations_that_do_not_match_the_model_or_cluster(kw, message):
    run = lambda: estimate(graph(8), parse_cluster("1x8xA100-80GB"), config(**kw))  # noqa: E731
    if message is None:
        run()
        return
    with pytest.raises(EstimateError, match=message):
        run()


def test_too_few_devices_of_a_stage_type():
    with pytest.raises(EstimateError, match="puts 2 stages on V100-32GB: 4 devices .* the cluster has 2"):
        estimate(graph(8), parse_cluster("1x6xA100-80GB+1x2xV100-32GB"),
                 config(dp=2, pp=4, dtype="fp16", stage_devices=("V100-32GB", "V100-32GB", "A100-80GB", "A100-80GB")))


@pytest.mark.parametrize("kw,message", [
    (dict(global_batch_size=6, dp=4), "global batch 6 is not a multiple of dp\\(4\\) \\* micro_batch_size\\(1\\) = 4"),
    (dict(schedule="interleaved", virtual_stages=2, global_batch_size=6), "micro-batches \\(6\\) to be a multiple of pp\\(4\\)"),
    (dict(virtual_stages=2), "virtual stages \\(2\\) need --schedule interleaved"),
    (dict(schedule="pipedream"), "unknown schedule 'pipedream'"),
    (dict(recompute="half"), "unknown recompute 'half'"),
    (dict(zero_stage=4), "unknown zero 4"),
    (dict(stage_layers=(4, 4)), "--stage-layers has 2 entries, pp\\(4\\) = 4 needed"),
    (dict(stage_layers=(4, 4, 0, 0)), "every stage needs a layer"),
    (dict(dp=0), "dp must be a positive integer"),
])
def test_config_checks_itself(kw, message):
    with pytest.raises(EstimateError, match=message):
        config(**kw)


def test_traced_gpt_end_to_end(gpt_path):
    from hetpar.planner.capture import trace_model
    from hetpar.runtime.model_file import load_model_file

    model = trace_model(load_model_file(gpt_path, dict(n_layers=4, hidden=64, heads=4, vocab=128, seq_len=32)))
    e = estimate(model, parse_cluster("1x8xA100-80GB"),
                 EstimateConfig(global_batch_size=32, dp=2, tp=2, pp=2, micro_batch_size=2, dtype="bf16",
                                schedule="interleaved", virtual_stages=2, recompute="full", zero_stage=1))
    assert e.fits and e.predicted.step_time_s > 0 and e.time.tp_comm_s > 0
    # Megatron's split: a block per virtual stage, the embedding with the first and the head with the last;
    # rank r holds stages r and r + 2.
    assert e.layout.startswith("Megatron")
    assert [s.chunks for s in e.stages] == [[(0, 1), (3, 3)], [(2, 2), (4, 5)]]


def gpt_like(blocks):
    """An embedding, ``blocks`` equal blocks and a head, each one layer, as examples/gpt.py traces."""
    layers = [layer(name="tok_emb+pos_emb", flops=1e9), *(layer(name=f"blocks.{i}") for i in range(blocks)),
              layer(name="ln_f+lm_head", flops=3e12)]
    return ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=layers)


def test_default_split_is_megatrons_blocks_evenly_embedding_first_head_last():
    e = estimate(gpt_like(8), parse_cluster("1x4xA100-80GB"), config(pp=4))
    assert [b - a + 1 for s in e.stages for a, b in s.chunks] == [3, 2, 2, 3]
    assert e.layout == "Megatron (blocks evenly, embedding with the first stage, head with the last)"
    assert e.to_dict()["layout"] == e.layout


def test_blocks_that_do_not_divide_by_the_stages_fall_back_to_the_even_split():
    e = estimate(gpt_like(7), parse_cluster("1x4xA100-80GB"), config(pp=4))
    assert [b - a + 1 for s in e.stages for a, b in s.chunks] == [3, 2, 2, 2]
    assert e.layout == "even split of 9 layers"


def test_given_stage_layers_are_kept_and_named():
    e = estimate(gpt_like(8), parse_cluster("1x4xA100-80GB"), config(pp=4, stage_layers=(4, 2, 2, 2)))
    assert [b - a + 1 for s in e.stages for a, b in s.chunks] == [4, 2, 2, 2] and e.layout == "--stage-layers"


def test_layers_of_one_kind_are_timed_once_and_a_layer_that_differs_apart():
    """The estimate and the search time each kind of layer once (``ModelGraph.layer_kinds``: equal in every field
    but the name); a layer that differs in one number is its own kind and costs its own time."""
    model = graph(4)
    assert model.layer_kinds == [0, 0, 0, 0]
    heavy = replace(model.layers[2], fwd_flops=3 * model.layers[2].fwd_flops)
    mixed = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[*model.layers[:2], heavy, model.layers[3]])
    assert mixed.layer_kinds == [0, 0, 2, 0]
    e = estimate(mixed, parse_cluster("1x1xA100-80GB"), config(global_batch_size=1, pp=1))
    each = [layer_timing(l, A100, tp=1, micro_batch_size=1, dtype="bf16") for l in mixed.layers]
    assert e.time.compute_s == pytest.approx(sum(t.fwd_s + t.bwd_s for t in each))
    assert each[2].fwd_s > each[0].fwd_s
