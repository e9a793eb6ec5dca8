"""hetpar profile: fits on synthetic measurements, profile files, --profile, one-line errors."""

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, hetpar

from hetpar.cost_models.calibrate import LAUNCHES_PER_OP, fit_line, fit_profile
from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.devices import ProfileError, dump_profile, get_device, load_profile, profile_to_dict
from hetpar.planner.estimate import EstimateConfig, estimate
from hetpar.planner.model_graph import ModelGraph
from hetpar.cost_models.layers import LayerProfile

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
SMALL_GPT = ["--model-arg", "n_layers=2", "--model-arg", "hidden=32", "--model-arg", "seq_len=8", "--model-arg", "vocab=64"]


def line(fixed_s, rate, sizes):
    return [[x, fixed_s + x / rate] for x in sizes]


def record(fingerprint="test host x2 cores, torch 0, no GPU"):
    # Exact lines, so the fit must give back exactly these parameters.
    return {
        "fingerprint": fingerprint, "date": "2026-01-01", "workers": 2,
        "matmul": {"fp32": line(5e-6, 100e9, [1e6, 1e7, 1e8]), "bf16": line(5e-6, 200e9, [1e6, 1e7, 1e8])},
        "copy": [2e9, 0.25],  # 8 GB/s
        "op_overhead": {"fwd_s_per_op": 6e-6, "fwd_bwd_s_per_op": 15e-6},
        "collectives": {
            "all_reduce": line(200e-6, 1.5e9, [4096, 1 << 20, 16 << 20]),
            "p2p": line(60e-6, 3e9, [4096, 1 << 20, 16 << 20]),
        },
        "step_overhead_s": 1e-3,
    }


def test_fit_line_recovers_an_exact_line():
    fixed, rate = fit_line([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)])  # t = 1 + x / 0.5
    assert fixed == pytest.approx(1.0)
    assert rate == pytest.approx(0.5)


def test_fit_line_clamps_a_negative_intercept_and_rejects_flat_data():
    assert fit_line([(1.0, 0.5), (2.0, 1.5)])[0] == 0.0
    with pytest.raises(ProfileError, match="two or more sizes"):
        fit_line([(1.0, 1.0)])
    with pytest.raises(ProfileError, match="noisy"):
        fit_line([(1.0, 2.0), (2.0, 1.0)])


def test_fit_line_survives_one_outlier_that_tips_the_weighted_fit():
    # t = 1e-4 + x / 1e9, but the middle size was timed at a twentieth of its time:
    # least relative error trusts that point most and finds no growth at all.
    line = lambda x: 1e-4 + x / 1e9
    points = [(4096.0, line(4096)), (1048576.0, line(1048576) / 20), (4194304.0, line(4194304))]
    fixed, rate = fit_line(points)
    assert rate == pytest.approx(1e9, rel=1e-6)
    assert fixed == pytest.approx(1e-4, rel=1e-3)


def assert_round_trips(p, tmp_path):
    """``p`` reads back equal from TOML and from JSON."""
    for path, text in ((tmp_path / "host.toml", dump_profile(p)), (tmp_path / "host.json", json.dumps(profile_to_dict(p)))):
        path.write_text(text)
        assert load_profile(path) == p


def test_fit_profile_takes_each_parameter_from_its_measurement():
    p = fit_profile(record(), get_device("cpu"))
    assert p.peak_flops_per_s["fp32"] == pytest.approx(100e9)
    assert p.peak_flops_per_s["bf16"] == pytest.approx(200e9)
    assert p.matmul_efficiency == 1.0
    assert p.mem_bw_bytes_per_s == pytest.approx(8e9)
    assert p.op_overhead_s == pytest.approx(15e-6 / LAUNCHES_PER_OP)
    assert p.step_overhead_s == pytest.approx(1e-3)
    assert p.collectives["all_reduce"].latency_s == pytest.approx(200e-6)
    assert p.collectives["all_reduce"].bw_bytes_per_s == pytest.approx(1.5e9)
    assert p.intra_node_latency_s == pytest.approx(60e-6)
    assert p.intra_node_bw_bytes_per_s == pytest.approx(3e9)
    stamp = "fitted from hetpar profile on 2026-01-01, test host x2 cores, torch 0, no GPU"
    for key in ("peak_flops_per_s.fp32", "op_overhead_s", "step_overhead_s", "collectives.p2p", "mem_bw_bytes_per_s"):
        assert p.sources[key].startswith(stamp)
    assert p.memory_bytes == get_device("cpu").memory_bytes  # unmeasured: kept from the base


def test_a_geforce_host_measured_takes_its_measured_link_not_the_staged_rate(tmp_path):
    # RTX 2080 Ti's built-in profile states a staged rate through host memory (4.0e9 B/s);
    # a profile measured on such a host sends at what its cards measured (3e9 in record()).
    p = fit_profile(record(), get_device("RTX2080Ti-11GB"))
    assert p.intra_node_staged_bw_bytes_per_s is None and "intra_node_staged_bw_bytes_per_s" not in p.sources
    assert p.node_link_bw_bytes_per_s == pytest.approx(3e9)
    assert_round_trips(p, tmp_path)


def test_fit_profile_recovers_the_optimizer_and_tensor_parallel_costs():
    # Synthetic measurements built from known costs, as the probes would see them.
    tensor_s, bytes_per_s, module_s = 40e-6, 4e9, 2e-3
    data = record()
    data["optimizer"] = {"optimizer": "adamw", "tensor_s": tensor_s, "param_s": 28 / bytes_per_s}
    per_op, alpha = data["op_overhead"]["fwd_bwd_s_per_op"], 200e-6
    block_s = 3 * per_op + 2 * alpha + 2 * module_s  # 3 ops, 2 all-reduces, 2 sharded modules
    data["tp_op_overhead"] = {"fwd_bwd_s_per_op": block_s / 3, "ops_per_block": 3, "all_reduces_per_block": 2}
    p = fit_profile(data, get_device("cpu"))
    assert p.optimizer_tensor_overhead_s == pytest.approx(tensor_s)
    assert p.optimizer_bytes_per_s == pytest.approx(bytes_per_s)
    assert p.tp_module_overhead_s == pytest.approx(module_s)
    assert p.step_overhead_s == pytest.approx(1e-3 - 4 * tensor_s)  # the probe's four tensors are charged per tensor
    assert p.kernel_efficiency == 1.0
    for key in ("optimizer_tensor_overhead_s", "optimizer_bytes_per_s", "tp_module_overhead_s", "kernel_efficiency"):
        assert p.sources[key].startswith("fitted from hetpar profile")


def test_a_dispatch_probe_in_groups_of_two_is_charged_the_all_reduce_of_two_ranks():
    # Four workers probe DTensor in two groups of two: the block's all-reduces are
    # 2-rank all-reduces, charged from the 4-rank fit scaled down (a third of its alpha).
    module_s = 2e-3
    data = {**record(), "workers": 4}
    per_op, alpha4 = data["op_overhead"]["fwd_bwd_s_per_op"], 200e-6
    block_s = 3 * per_op + 2 * (alpha4 * 2 / 6) + 2 * module_s
    data["tp_op_overhead"] = {"fwd_bwd_s_per_op": block_s / 3, "ops_per_block": 3, "all_reduces_per_block": 2, "tp": 2}
    assert fit_profile(data, get_device("cpu")).tp_module_overhead_s == pytest.approx(module_s)
    # A record from before the groups probed over all workers: the 4-rank alpha.
    del data["tp_op_overhead"]["tp"]
    assert fit_profile(data, get_device("cpu")).tp_module_overhead_s == pytest.approx(module_s - 2 * alpha4 * 2 / 3 / 2)


def test_the_reference_workload_sets_forward_and_backward_efficiencies():
    from hetpar.cost_models.compute import layer_timing
    layers = [LayerProfile(name=f"l{i}", fwd_flops=4e6 * (i + 1), bwd_flops=8e6 * (i + 1), params=1000,
                           saved_activation_bytes=2e4, boundary_bytes=1e3, num_ops=12) for i in range(3)]
    plain = fit_profile(record(), get_device("cpu"))
    batch, fwd_eff, bwd_eff = 4, 0.6, 0.35
    # What the reference run would measure on a machine that reaches those fractions.
    at = lambda eff: [layer_timing(l, plain, tp=1, micro_batch_size=batch, dtype="fp32", kernel_efficiency=eff) for l in layers]
    fwd_s = sum(t.fwd_s for t in at(fwd_eff))
    bwd_s = sum(t.bwd_s for t in at(bwd_eff))
    data = record()
    data["reference"] = {"batch_size": batch, "fwd_s": fwd_s, "fwd_bwd_s": fwd_s + bwd_s}
    p = fit_profile(data, get_device("cpu"), layers)
    assert p.kernel_efficiency == pytest.approx(fwd_eff)
    assert p.backward_kernel_efficiency == pytest.approx(bwd_eff)
    timed = [layer_timing(l, p, tp=1, micro_batch_size=batch, dtype="fp32") for l in layers]
    assert sum(t.fwd_s for t in timed) == pytest.approx(fwd_s)
    assert sum(t.bwd_s for t in timed) == pytest.approx(bwd_s)
    assert fit_profile(data, get_device("cpu")).kernel_efficiency == 1.0  # no layers: no fit


def test_a_measured_profile_uses_its_own_kernel_efficiency_unless_one_is_given():
    from hetpar.cost_models.compute import TRAINING_KERNEL_EFFICIENCY, layer_timing
    measured = fit_profile(record(), get_device("cpu"))
    layer = _tiny_graph().layers[0]
    own = layer_timing(layer, measured, tp=1, micro_batch_size=4, dtype="fp32")
    given = layer_timing(layer, measured, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=1.0)
    derated = layer_timing(layer, measured, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=TRAINING_KERNEL_EFFICIENCY)
    assert own == given and derated.fwd_s > own.fwd_s
    builtin = get_device("cpu")
    assert layer_timing(layer, builtin, tp=1, micro_batch_size=4, dtype="fp32") == layer_timing(
        layer, builtin, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=TRAINING_KERNEL_EFFICIENCY)


def test_tensor_parallel_dispatch_is_charged_per_sharded_module_only_under_tp():
    from dataclasses import replace
    from hetpar.cost_models.compute import layer_timing
    measured = replace(fit_profile(record(), get_device("cpu")), tp_module_overhead_s=3e-3,
                       sources={**fit_profile(record(), get_device("cpu")).sources, "tp_module_overhead_s": "test"})
    plain = LayerProfile(name="l", fwd_flops=1e6, bwd_flops=2e6, params=1000, saved_activation_bytes=1e3,
                         boundary_bytes=1e3, num_ops=10, tp_split_flops_fraction=0.0)
    sharded = replace(plain, tp_sharded_modules=4)
    t = lambda layer, tp: layer_timing(layer, measured, tp=tp, micro_batch_size=1, dtype="fp32")
    assert t(sharded, 1) == t(plain, 1)
    extra = (t(sharded, 2).fwd_s + t(sharded, 2).bwd_s) - (t(plain, 2).fwd_s + t(plain, 2).bwd_s)
    assert extra == pytest.approx(4 * 3e-3)


def test_the_optimizer_step_costs_per_tensor_with_a_measured_profile():
    from dataclasses import replace
    base = fit_profile(record(), get_device("cpu"))
    cluster = lambda p: parse_cluster("1x1xcpu", profiles={"CPU": p})
    few = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[replace(_tiny_graph().layers[0], param_tensors=2)] * 4)
    many = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[replace(_tiny_graph().layers[0], param_tensors=12)] * 4)
    cfg = EstimateConfig(global_batch_size=4, dp=1, tp=1, pp=1, micro_batch_size=4, dtype="fp32")
    costly = replace(base, optimizer_tensor_overhead_s=1e-4, sources={**base.sources, "optimizer_tensor_overhead_s": "test"})
    step = lambda g: estimate(g, cluster(costly), cfg).time.optimizer_s
    assert step(many) - step(few) == pytest.approx(4 * 10 * 1e-4)


def test_the_tensor_parallel_step_splits_into_per_collective_and_per_tensor_costs():
    # Synthetic measurements from known costs: what the reference model's TP step would
    # take with `per_collective` more per collective and `per_tensor` more per DTensor
    # parameter tensor than the estimator charges without them.
    from dataclasses import replace
    from hetpar.cost_models.compute import layer_timing, optimizer_rates
    from hetpar.cost_models.memory import OPTIMIZER_BYTES_PER_PARAM
    collectives = (("forward", "all_reduce", 4e3), ("backward", "all_reduce", 4e3), ("forward", "all_gather", 8e3))
    layers = [LayerProfile(name=f"l{i}", fwd_flops=4e6, bwd_flops=8e6, params=1000, saved_activation_bytes=2e4,
                           boundary_bytes=1e3, num_ops=12, param_tensors=3, tp_split_flops_fraction=0.9, tp_split_params=900,
                           tp_sharded_modules=2, tp_sharded_tensors=2, tp_collectives=collectives) for i in range(2)]
    data = record()
    data["collectives"]["all_gather"] = line(100e-6, 2e9, [4096, 1 << 20, 16 << 20])
    data["optimizer"] = {"optimizer": "adamw", "tensor_s": 2e-5, "param_s": 1e-9}
    data["tp_op_overhead"] = {"fwd_bwd_s_per_op": 1e-4, "ops_per_block": 3, "all_reduces_per_block": 2}
    batch, per_collective, per_tensor = 4, 7e-4, 3e-4
    plain = fit_profile(data, get_device("cpu"))
    at_one = [layer_timing(l, plain, tp=1, micro_batch_size=batch, dtype="fp32", kernel_efficiency=1.0) for l in layers]
    data["reference"] = {"batch_size": batch, "fwd_s": sum(t.fwd_s for t in at_one),
                         "fwd_bwd_s": sum(t.fwd_s + t.bwd_s for t in at_one)}
    calibrated = fit_profile(data, get_device("cpu"), layers)  # efficiencies 1, no TP step yet
    assert calibrated.tp_collective_overhead_s is None
    per_microbatch = sum(t.fwd_s + t.bwd_s for t in (layer_timing(l, calibrated, tp=2, micro_batch_size=batch, dtype="fp32")
                                                      for l in layers))
    fits = {"all_reduce": calibrated.collectives["all_reduce"], "all_gather": calibrated.collectives["all_gather"]}
    per_microbatch += 2 * sum(fits[k].latency_s + b * batch / fits[k].bw_bytes_per_s + per_collective for _, k, b in collectives)
    optimizer_s = optimizer_rates(calibrated).seconds(2 * layers[0].params_at(2) * OPTIMIZER_BYTES_PER_PARAM["adamw"], 6) + 4 * per_tensor
    # [micro-batches, forwards and backwards (a first micro-batch costs a little more), optimizer step]
    data["reference_tp_step"] = {"steps": [[m, 1e-3 + m * per_microbatch, optimizer_s] for m in (1, 2, 4)], "batch_size": batch,
                                 "tp": 2}
    p = fit_profile(data, get_device("cpu"), layers)
    assert p.tp_collective_overhead_s == pytest.approx(per_collective)
    assert p.tp_optimizer_tensor_overhead_s == pytest.approx(per_tensor)
    assert p.tp_module_overhead_s == calibrated.tp_module_overhead_s  # the tiny block's, untouched
    assert p.sources["tp_collective_overhead_s"].startswith("fitted from hetpar profile")
    # The estimator charges both where tensor parallelism runs, and neither where it does not.
    graph = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=layers)
    cluster = lambda prof: parse_cluster("1x2xcpu", profiles={"CPU": prof})
    cfg = lambda tp: EstimateConfig(global_batch_size=batch, dp=3 - tp, tp=tp, pp=1, micro_batch_size=batch // (3 - tp),
                                    dtype="fp32")
    bare = replace(p, tp_collective_overhead_s=None, tp_optimizer_tensor_overhead_s=None)
    with_tp, without = estimate(graph, cluster(p), cfg(2)), estimate(graph, cluster(bare), cfg(2))
    assert with_tp.time.tp_comm_s - without.time.tp_comm_s == pytest.approx(2 * len(collectives) * per_collective)
    assert with_tp.time.optimizer_s - without.time.optimizer_s == pytest.approx(4 * per_tensor)
    assert estimate(graph, cluster(p), cfg(1)).predicted.step_time_s == estimate(graph, cluster(bare), cfg(1)).predicted.step_time_s


def test_fit_profile_names_missing_measurements():
    data = record()
    del data["copy"]
    with pytest.raises(ProfileError, match="copy"):
        fit_profile(data, get_device("cpu"))


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_profile_file_round_trip(tmp_path, suffix):
    p = fit_profile(record(), get_device("cpu"))
    path = tmp_path / f"host{suffix}"
    path.write_text(json.dumps(profile_to_dict(p)) if suffix == ".json" else dump_profile(p))
    assert load_profile(path) == p


def test_builtin_profiles_have_no_calibrated_fields():
    cpu = get_device("cpu")
    assert cpu.op_overhead_s is None and cpu.fingerprint is None


def _tiny_graph():
    layer = LayerProfile(name="l", fwd_flops=1e6, bwd_flops=2e6, params=1000, saved_activation_bytes=1e3,
                         boundary_bytes=1e3, num_ops=10)
    return ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=[layer] * 4)


def test_profile_changes_the_prediction_through_the_cluster():
    measured = fit_profile(record(), get_device("cpu"))
    builtin = parse_cluster("1x2xcpu")
    calibrated = parse_cluster("1x2xcpu", profiles={"CPU": measured})
    assert calibrated.profile("cpu") is measured
    assert builtin.profile("cpu") == get_device("cpu")
    assert calibrated.groups[0].intra_node_bw_bytes_per_s == pytest.approx(3e9)
    cfg = EstimateConfig(global_batch_size=8, dp=1, tp=1, pp=2, micro_batch_size=2, dtype="fp32")
    before = estimate(_tiny_graph(), builtin, cfg).predicted.step_time_s
    after = estimate(_tiny_graph(), calibrated, cfg).predicted.step_time_s
    assert after != pytest.approx(before)
    assert after > measured.step_overhead_s  # the step overhead is part of the step


def one_line_error(result, fragment):
    assert_one_line_error(result, fragment)


def test_estimate_with_a_foreign_profile_warns_in_one_line(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(profile_to_dict(fit_profile(record("some other machine"), get_device("cpu")))))
    args = ["estimate", GPT, *SMALL_GPT, "-c", "1x2xcpu", "-b", "4", "--dp", "2", "--tp", "1", "--pp", "1",
            "--micro-batch-size", "2", "--json"]
    with_profile = hetpar(*args, "--profile", str(path))
    assert with_profile.returncode == 0, with_profile.stderr
    warnings = [l for l in with_profile.stderr.splitlines() if "warning" in l]
    assert len(warnings) == 1 and "some other machine" in with_profile.stderr
    without = hetpar(*args)
    step = lambda r: json.loads(r.stdout)["predicted"]["step_time_s"]
    assert step(with_profile) != pytest.approx(step(without))


def test_bad_inputs_are_one_line_errors(tmp_path):
    one_line_error(hetpar("profile", "-o", str(tmp_path / "p.txt")), ".json or .toml")
    one_line_error(hetpar("profile", "-o", str(tmp_path / "p.json"), "--nproc", "0"), "--nproc must be at least 1")
    one_line_error(hetpar("estimate", GPT, "-c", "1x2xcpu", "-b", "4", "--dp", "2", "--tp", "1", "--pp", "1",
                          "--micro-batch-size", "2", "--profile", str(tmp_path / "missing.json")), "not found")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    one_line_error(hetpar("plan", GPT, "-c", "1x2xcpu", "-b", "4", "--profile", str(bad)), "not valid JSON")


@pytest.mark.slow
def test_quick_profile_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "host.json"
    result = hetpar("profile", "-o", str(out), "--quick")
    assert result.returncode == 0, result.stderr
    p = load_profile(out)
    assert p.fingerprint and p.op_overhead_s > 0 and "all_reduce" in p.collectives
    assert p.late_receive_s > 0
    assert (tmp_path / "host.measurements.json").is_file()


@pytest.mark.slow
def test_four_workers_probe_tensor_parallelism_in_groups_of_two_and_time_each_pass(tmp_path):
    out = tmp_path / "four.json"
    result = hetpar("profile", "-o", str(out), "--quick", "--nproc", "4", "--passes", "1")
    assert result.returncode == 0, result.stderr
    measured = json.loads((tmp_path / "four.measurements.json").read_text())
    assert measured["workers"] == 4
    assert measured["tp_op_overhead"]["tp"] == 2 and measured["reference_tp_step"]["tp"] == 2
    passes = measured["reference_step"]["passes"]
    assert [row[0] for row in passes] == [row[0] for row in measured["reference_step"]["steps"]]
    for (m, fwd_s, bwd_s), (_, compute_s, *_) in zip(passes, measured["reference_step"]["steps"]):
        assert 0 < fwd_s < compute_s and 0 < bwd_s < compute_s  # the passes inside the step's compute
    assert load_profile(out).tp_module_overhead_s is not None


def test_matmul_rows_are_measured_rates_over_the_fitted_peak(tmp_path):
    data = record()  # fp32 peak 100 GFLOP/s
    rates = {1: 20e9, 16: 60e9, 256: 120e9}  # the last above the peak slope: noise, clamped to 1
    data["matmul_rows"] = {
        "forward": [[m, 2.0 * m * 512 * 512, 2.0 * m * 512 * 512 / r] for m, r in rates.items()],
        "backward": [[m, 4.0 * m * 512 * 512, 4.0 * m * 512 * 512 / (r / 2)] for m, r in rates.items()],
    }
    p = fit_profile(data, get_device("cpu"))
    assert p.matmul_rows_efficiency["forward"] == pytest.approx({1: 0.2, 16: 0.6, 256: 1.0})
    assert p.matmul_rows_efficiency["backward"] == pytest.approx({1: 0.1, 16: 0.3, 256: 0.6})
    assert "matmul_rows_efficiency" in p.sources and p.weight_stream_bytes_per_s == pytest.approx(8e9)
    assert_round_trips(p, tmp_path)
    assert fit_profile(record(), get_device("cpu")).matmul_rows_efficiency == {}  # not measured: none


def test_the_late_receive_wait_is_kept_round_trips_and_slows_gpipe_not_1f1b(tmp_path):
    data = {**record(), "late_receive": {"mean_s": 2e-3, "median_s": 1.5e-3, "bytes": 65536, "repeats": 60}}
    p = fit_profile(data, get_device("cpu"))
    assert p.late_receive_s == pytest.approx(2e-3)
    assert p.sources["late_receive_s"].startswith("fitted from hetpar profile")
    assert fit_profile(record(), get_device("cpu")).late_receive_s is None  # not measured: none
    assert_round_trips(p, tmp_path)
    (tmp_path / "bad.toml").write_text(dump_profile(p).replace("late_receive_s = 0.002\n", "late_receive_s = -1.0\n"))
    with pytest.raises(ProfileError, match="late_receive_s must be >= 0 when given, got -1.0"):
        load_profile(tmp_path / "bad.toml")
    del data["late_receive"]["mean_s"]
    with pytest.raises(ProfileError, match="late_receive lacks its mean_s"):
        fit_profile(data, get_device("cpu"))
    # Two equal stages whose last stage is a little slower (the loss): GPipe's second
    # stage reaches each forward after it was sent, while the first still computes.
    layers = [LayerProfile(name=f"l{i}", fwd_flops=2e8 * (1.2 if i == 3 else 1.0), bwd_flops=4e8, params=1000,
                           saved_activation_bytes=1e4, boundary_bytes=1e3, num_ops=10) for i in range(4)]
    model = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=layers)
    plain = fit_profile(record(), get_device("cpu"))

    def step(profile, schedule: str) -> float:
        config = EstimateConfig(global_batch_size=8, dp=1, tp=1, pp=2, micro_batch_size=2, dtype="fp32", schedule=schedule)
        cluster = parse_cluster("1x2xcpu", profiles={profile.name: profile})
        return estimate(model, cluster, config).predicted.step_time_s

    assert step(p, "1f1b") == pytest.approx(step(plain, "1f1b"))
    assert step(p, "gpipe") > step(plain, "gpipe") + 2e-3


def test_the_narrow_rows_curve_is_fitted_kept_and_needs_its_width(tmp_path):
    data = record()  # fp32 peak 100 GFLOP/s
    for key, k, rate in (("matmul_rows", 512, 80e9), ("matmul_rows_narrow", 128, 40e9)):
        data[key] = {"forward": [[m, 2.0 * m * k * k, 2.0 * m * k * k / rate] for m in (1, 256)],
                     "backward": [[m, 4.0 * m * k * k, 4.0 * m * k * k / rate] for m in (1, 256)]}
    data["matmul_rows_narrow"]["width"] = 128
    p = fit_profile(data, get_device("cpu"))
    assert p.matmul_narrow_width == 128 and p.matmul_narrow_efficiency["forward"] == pytest.approx({1: 0.4, 256: 0.4})
    assert p.matmul_rows_efficiency["backward"] == pytest.approx({1: 0.8, 256: 0.8})
    assert_round_trips(p, tmp_path)
    (tmp_path / "bad.toml").write_text(dump_profile(p).replace("matmul_narrow_width = 128\n", ""))
    with pytest.raises(ProfileError, match="matmul_narrow_efficiency needs matmul_narrow_width"):
        load_profile(tmp_path / "bad.toml")
    del data["matmul_rows_narrow"]["width"]
    with pytest.raises(ProfileError, match="matmul_rows_narrow lacks its width"):
        fit_profile(data, get_device("cpu"))


def test_a_row_curve_outside_zero_to_one_is_refused(tmp_path):
    p = fit_profile(record(), get_device("cpu"))
    text = dump_profile(p) + '\n[matmul_rows_efficiency.forward]\n"4" = 1.5\n'
    (tmp_path / "bad.toml").write_text(text.replace("[sources]", '[sources]\nmatmul_rows_efficiency = "test"', 1))
    with pytest.raises(ProfileError, match="matmul_rows_efficiency.forward"):
        load_profile(tmp_path / "bad.toml")


def test_the_reference_step_through_the_runtime_scales_both_efficiencies():
    from dataclasses import replace
    from hetpar.cost_models.compute import layer_timing
    layers = [LayerProfile(name=f"l{i}", fwd_flops=4e6 * (i + 1), bwd_flops=8e6 * (i + 1), params=1000,
                           saved_activation_bytes=2e4, boundary_bytes=1e3, num_ops=12, param_tensors=2) for i in range(3)]
    data = record()
    data["optimizer"] = {"optimizer": "adamw", "tensor_s": 2e-5, "param_s": 1e-9}
    plain = fit_profile(data, get_device("cpu"))
    batch, fwd_eff, bwd_eff, scale = 4, 0.6, 0.35, 0.8
    at = lambda eff: [layer_timing(l, plain, tp=1, micro_batch_size=batch, dtype="fp32", kernel_efficiency=eff) for l in layers]
    fwd_s = sum(t.fwd_s for t in at(fwd_eff))
    bwd_s = sum(t.bwd_s for t in at(bwd_eff))
    data["reference"] = {"batch_size": batch, "fwd_s": fwd_s, "fwd_bwd_s": fwd_s + bwd_s}
    # The runtime's step: each micro-batch's layers at the efficiencies times `scale`,
    # plus what the estimator charges besides the layers.
    layer_s = sum(t.fwd_s for t in at(fwd_eff * scale)) + sum(t.bwd_s for t in at(bwd_eff * scale))
    # Once per step: the gradient all-reduce, taking `sync_scale` times its charge, partly
    # under the last backward, partly waited for after it.
    params, sync_scale = 3000, 1.7
    reduce = plain.collectives["all_reduce"]
    sync = sync_scale * (reduce.latency_s + 4.0 * params / reduce.bw_bytes_per_s)
    # [micro-batches, forwards and backwards, the all-reduce's wait, optimizer step]
    data["reference_step"] = {"steps": [[m, m * layer_s + sync / 3, 2 * sync / 3, 5e-3] for m in (1, 2, 4)],
                              "batch_size": batch, "workers": 2}
    p = fit_profile(data, get_device("cpu"), layers)
    assert p.kernel_efficiency == pytest.approx(fwd_eff * scale)
    assert p.backward_kernel_efficiency == pytest.approx(bwd_eff * scale)
    assert p.grad_sync_scale == pytest.approx(sync_scale)
    assert "training step through the program's runtime" in p.sources["kernel_efficiency"]
    assert p.sources["grad_sync_scale"].startswith("fitted from hetpar profile")
    # The estimator's gradient all-reduce takes that factor, on top of the collective's fit.
    graph = ModelGraph(file="synthetic.py", args={}, fingerprint="", layers=layers)
    cfg = EstimateConfig(global_batch_size=2 * batch, dp=2, tp=1, pp=1, micro_batch_size=batch, dtype="fp32")
    on = lambda prof: estimate(graph, parse_cluster("1x2xcpu", profiles={"CPU": prof}), cfg).time.dp_comm_s
    assert on(p) == pytest.approx(sync_scale * on(replace(p, grad_sync_scale=None)))


def test_the_reference_step_timed_pass_by_pass_sets_each_efficiency_apart():
    # The loop's split of forward and backward (data["reference"]) is not the program's:
    # inside the step the forwards may fall further short than the backwards. With the
    # passes timed apart, each efficiency follows its own pass.
    from hetpar.cost_models.compute import layer_timing
    layers = [LayerProfile(name=f"l{i}", fwd_flops=4e6 * (i + 1), bwd_flops=8e6 * (i + 1), params=1000,
                           saved_activation_bytes=2e4, boundary_bytes=1e3, num_ops=12, param_tensors=2) for i in range(3)]
    data = record()
    plain = fit_profile(data, get_device("cpu"))
    batch, fwd_eff, bwd_eff = 4, 0.6, 0.35
    at = lambda eff: [layer_timing(l, plain, tp=1, micro_batch_size=batch, dtype="fp32", kernel_efficiency=eff) for l in layers]
    data["reference"] = {"batch_size": batch, "fwd_s": sum(t.fwd_s for t in at(fwd_eff)),
                         "fwd_bwd_s": sum(t.fwd_s for t in at(fwd_eff)) + sum(t.bwd_s for t in at(bwd_eff))}
    in_step_fwd, in_step_bwd = 0.4, 0.5  # the forward slower, the backward faster than in the loop
    fwd_s, bwd_s = sum(t.fwd_s for t in at(in_step_fwd)), sum(t.bwd_s for t in at(in_step_bwd))
    data["reference_step"] = {"steps": [[m, m * (fwd_s + bwd_s) + 1e-3, 1e-3, 5e-3] for m in (1, 2, 4)],
                              "passes": [[m, m * fwd_s, m * bwd_s + 1e-3] for m in (1, 2, 4)],
                              "batch_size": batch, "workers": 2}
    p = fit_profile(data, get_device("cpu"), layers)
    assert p.kernel_efficiency == pytest.approx(in_step_fwd)
    assert p.backward_kernel_efficiency == pytest.approx(in_step_bwd)
    assert "each pass timed apart" in p.sources["kernel_efficiency"]
    timed = [layer_timing(l, p, tp=1, micro_batch_size=batch, dtype="fp32") for l in layers]
    assert sum(t.fwd_s for t in timed) == pytest.approx(fwd_s)
    assert sum(t.bwd_s for t in timed) == pytest.approx(bwd_s)
    # Without the passes, one factor on both keeps the loop's split.
    del data["reference_step"]["passes"]
    one = fit_profile(data, get_device("cpu"), layers)
    assert one.kernel_efficiency / one.backward_kernel_efficiency == pytest.approx(fwd_eff / bwd_eff)


def test_passes_keep_the_median_of_every_number_and_the_sizes_as_they_are():
    from hetpar.profiler import median_record
    a = {"copy": [2e9, 0.25], "matmul": {"fp32": [[1e6, 1.0], [1e7, 5.0]]}, "workers": 2, "model": "m.py"}
    b = {"copy": [2e9, 0.35], "matmul": {"fp32": [[1e6, 3.0], [1e7, 4.0]]}, "workers": 2, "model": "m.py"}
    c = {"copy": [2e9, 0.30], "matmul": {"fp32": [[1e6, 2.0], [1e7, 9.0]]}, "workers": 2, "model": "m.py"}
    assert median_record([a, b, c]) == {"copy": [2e9, 0.30], "matmul": {"fp32": [[1e6, 2.0], [1e7, 5.0]]}, "workers": 2,
                                        "model": "m.py"}
    assert median_record([a]) == a


def test_passes_below_one_are_refused(tmp_path):
    one_line_error(hetpar("profile", "-o", str(tmp_path / "p.json"), "--passes", "0"), "--passes")
    assert not (tmp_path / "p.json").exists()


def test_a_pass_whose_worker_died_is_measured_once_more(monkeypatch):
    # gloo can abort a worker on a busy host; one more pass with fresh workers is taken,
    # a second death (or a worker that raised) is a one-line error.
    from hetpar import profiler
    from hetpar.commands.profiling import _one_pass
    calls, shown = [], []

    def dies_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise profiler.WorkerDied("a profiling worker died (process 1 terminated with signal SIGABRT)")
        return {"measured": len(calls)}

    monkeypatch.setattr(profiler, "host_measurements", dies_once)
    assert _one_pass(2, [64], [4096], 1, None, None, shown.append) == {"measured": 2}
    assert shown == ["a profiling worker died (process 1 terminated with signal SIGABRT); measuring this pass again"]

    def fails(error):
        def host_measurements(*args, **kwargs):
            raise error
        return host_measurements

    monkeypatch.setattr(profiler, "host_measurements", fails(profiler.WorkerDied("a profiling worker died (signal)")))
    with pytest.raises(ProfileError, match=r"died \(signal\); run hetpar profile again"):
        _one_pass(2, [64], [4096], 1, None, None, shown.append)
    monkeypatch.setattr(profiler, "host_measurements", fails(profiler.WorkerFailed("a profiling worker failed: boom")))
    with pytest.raises(ProfileError, match="^a profiling worker failed: boom$"):
        _one_pass(2, [64], [4096], 1, None, None, shown.append)


def test_a_narrow_width_below_one_is_refused(tmp_path):
    data = record()
    for key, k in (("matmul_rows", 512), ("matmul_rows_narrow", 128)):
        data[key] = {curve: [[m, 2.0 * m * k * k, 2.0 * m * k * k / 50e9] for m in (1, 256)] for curve in ("forward", "backward")}
    data["matmul_rows_narrow"]["width"] = 128
    text = dump_profile(fit_profile(data, get_device("cpu"))).replace("matmul_narrow_width = 128\n", "matmul_narrow_width = 0\n")
    (tmp_path / "zero.toml").write_text(text)
    with pytest.raises(ProfileError, match="matmul_narrow_width must be at least 1, got 0"):
        load_profile(tmp_path / "zero.toml")


def one_worker_gpu_record():
    """What one GPU worker measures: no collectives, no row curves, bf16 reference steps."""
    data = {key: value for key, value in record("test host x16 cores, torch 0, NVIDIA H200").items() if key != "collectives"}
    return {**data, "device": "cuda", "workers": 1}


def test_one_gpu_worker_keeps_the_datasheet_links_and_the_gpu_name(tmp_path):
    h200 = get_device("H200-141GB")
    p = fit_profile(one_worker_gpu_record(), h200)
    assert p.name == "H200-141GB" and p.fingerprint.endswith("NVIDIA H200")
    assert p.collectives == h200.collectives
    for key in ("intra_node_latency_s", "intra_node_bw_bytes_per_s", "memory_bytes", "default_nic_bw_bytes_per_s"):
        assert getattr(p, key) == getattr(h200, key) and p.sources[key] == h200.sources[key]
    assert p.peak_flops_per_s["bf16"] == pytest.approx(200e9)  # measured, not the datasheet's
    assert p.op_overhead_s == pytest.approx(15e-6 / LAUNCHES_PER_OP)
    assert p.sources["op_overhead_s"].startswith("fitted from hetpar profile")
    assert p.weight_stream_bytes_per_s is None  # a GPU's weight reads hide under its FLOPs
    assert_round_trips(p, tmp_path)
    # A measured CPU record with collectives replaces the base's, as before.
    assert "all_reduce" in fit_profile(record(), get_device("cpu")).collectives


def test_one_worker_reference_step_sets_efficiencies_in_its_dtype_and_no_sync_scale():
    from hetpar.cost_models.compute import layer_timing
    layers = [LayerProfile(name=f"l{i}", fwd_flops=4e9 * (i + 1), bwd_flops=8e9 * (i + 1), params=1000,
                           saved_activation_bytes=2e6, boundary_bytes=1e3, num_ops=12, param_tensors=2) for i in range(3)]
    data = one_worker_gpu_record()
    plain = fit_profile(data, get_device("H200-141GB"))
    batch, fwd_eff, bwd_eff = 4, 0.6, 0.35
    at = lambda eff: [layer_timing(l, plain, tp=1, micro_batch_size=batch, dtype="bf16", kernel_efficiency=eff) for l in layers]
    fwd_s, bwd_s = sum(t.fwd_s for t in at(fwd_eff)), sum(t.bwd_s for t in at(bwd_eff))
    data["reference"] = {"batch_size": batch, "fwd_s": fwd_s, "fwd_bwd_s": fwd_s + bwd_s, "dtype": "bf16"}
    data["reference_step"] = {"steps": [[m, m * (fwd_s + bwd_s), 0.0, 5e-3] for m in (1, 2, 4)],
                              "passes": [[m, m * fwd_s, m * bwd_s] for m in (1, 2, 4)],
                              "batch_size": batch, "workers": 1, "dtype": "bf16"}
    p = fit_profile(data, get_device("H200-141GB"), layers)
    assert p.kernel_efficiency == pytest.approx(fwd_eff)
    assert p.backward_kernel_efficiency == pytest.approx(bwd_eff)
    assert p.grad_sync_scale is None and "grad_sync_scale" not in p.sources


def test_nproc_defaults_to_the_visible_gpus_and_may_not_exceed_them(monkeypatch):
    from hetpar.commands.profiling import workers
    assert workers(None, "cpu") == 2 and workers(1, "cpu") == 1
    with pytest.raises(ProfileError, match="--nproc must be at least 1, got 0"):
        workers(0, "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert workers(None, "cuda") == 1
    with pytest.raises(ProfileError, match="--nproc 2 is more than the 1 visible GPU "):
        workers(2, "cuda")


def test_a_gpu_host_profiles_as_its_builtin_type(monkeypatch):
    from hetpar.commands import profiling as command
    from hetpar.runtime.devices import FoundDevice
    found = {0: FoundDevice(name="NVIDIA H200", memory_bytes=150_106_652_672),
             1: FoundDevice(name="NVIDIA H200", memory_bytes=150_106_652_672)}
    monkeypatch.setattr(command.devices, "this_device", lambda device: found[device.index])
    assert command.host_profile("cuda", 2).name == "H200-141GB"
    assert command.host_profile("cpu", 2).name == "cpu"
    found[1] = FoundDevice(name="NVIDIA A100-SXM4-80GB", memory_bytes=85_100_000_000)
    assert command.host_profile("cuda", 1).name == "H200-141GB"
    with pytest.raises(ProfileError, match="the GPUs differ"):
        command.host_profile("cuda", 2)
    found[0] = FoundDevice(name="NVIDIA RTX 9000", memory_bytes=48_000_000_000)
    with pytest.raises(ProfileError, match=r"no built-in profile matches this GPU \(NVIDIA RTX 9000 .*--base NAME"):
        command.host_profile("cuda", 1)


@pytest.mark.slow
def test_one_cpu_worker_profiles_without_collectives_and_says_so_once(tmp_path):
    out = tmp_path / "one.json"
    result = hetpar("profile", "-o", str(out), "--quick", "--nproc", "1")
    assert result.returncode == 0, result.stderr
    said = [l for l in result.stderr.splitlines() if "collectives" in l]
    assert said == ["hetpar: one worker: collectives not measured, keeping the cpu profile's links"]
    measured = json.loads((tmp_path / "one.measurements.json").read_text())
    assert measured["workers"] == 1 and "collectives" not in measured and "late_receive" not in measured
    assert measured["reference_step"]["workers"] == 1
    p = load_profile(out)
    assert p.collectives == get_device("cpu").collectives and p.op_overhead_s > 0
    estimated = hetpar("estimate", GPT, *SMALL_GPT, "-c", "1x1xcpu", "-b", "4", "--dp", "1", "--tp", "1", "--pp", "1",
                       "--micro-batch-size", "2", "--profile", str(out), "--json")
    assert estimated.returncode == 0, estimated.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_microbenchmarks_wait_for_the_device_and_the_host_maps_to_its_type():
    """Rates timed with a synchronize around each region stay below the datasheet's
    peaks (a host clock without one would time the launches: far above them)."""
    from hetpar.commands.profiling import host_profile
    from hetpar.profiler import micro
    from hetpar.profiler.clock import compute_dtype
    device = torch.device("cuda", 0)
    datasheet = host_profile("cuda", 1)
    dtype = compute_dtype(device)
    (flops, seconds), = micro.matmul_times([8192], dtype, repeats=5, device=device, region_flops=1e12)
    assert 0.2 * datasheet.peak_flops(dtype) < flops / seconds < 1.1 * datasheet.peak_flops(dtype)
    nbytes, seconds = micro.copy_bandwidth(1 << 30, repeats=5, device=device, inner=5)
    assert 0.2 * datasheet.mem_bw_bytes_per_s < nbytes / seconds < 1.1 * datasheet.mem_bw_bytes_per_s
    per_op = micro.op_overhead_times(blocks=20, repeats=5, device=device)
    assert 1e-6 < per_op["fwd_s_per_op"] < per_op["fwd_bwd_s_per_op"] < 1e-3
