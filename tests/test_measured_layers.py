"""`hetpar profile --model`: layers timed on the host correct the layer model ([Note: measured layers])."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, hetpar
from test_profile import record

from hetpar.cost_models.calibrate import fit_profile
from hetpar.cost_models.compute import layer_timing
from hetpar.cost_models.devices import ProfileError, dump_profile, get_device, load_profile, profile_to_dict
from hetpar.cost_models.layers import LayerProfile
from hetpar.planner.capture import trace_model
from hetpar.runtime.model_file import load_model_file
from hetpar.profiler.layers import chained_pass_s, layer_stages, layer_times

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
TINY_GPT = {"n_layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 8}


def _layer(name: str, flops: float) -> LayerProfile:
    return LayerProfile(name=name, fwd_flops=flops, bwd_flops=2 * flops, params=1000, saved_activation_bytes=1e3,
                        boundary_bytes=1e3, num_ops=10)


# Layers a and b cost the same (twins, as a transformer's blocks), c differs.
LAYERS = [_layer("a", 1e6), _layer("b", 1e6), _layer("c", 4e6)]
FACTORS = {  # what the host takes over what the layer model says, by micro-batch: (forward, backward)
    "a": {1: (2.0, 1.5), 4: (1.2, 0.9)},
    "b": {1: (2.2, 1.5), 4: (1.4, 0.9)},
    "c": {1: (0.5, 3.0), 4: (0.8, 1.0)},
}


def _timed(profile):
    """The record's ``model_layers`` as a host that runs each layer FACTORS times the model would time it."""
    rows = []
    for layer in LAYERS:
        times = []
        for batch, (f, b) in FACTORS[layer.name].items():
            t = layer_timing(layer, profile, tp=1, micro_batch_size=batch, dtype="fp32")
            times.append([batch, t.fwd_s * f, t.bwd_s * b])
        rows.append({"name": layer.name, "times": times})
    return {"model": "synthetic.py", "model_args": {}, "layers": rows}


def _measured_profile():
    plain = fit_profile(record(), get_device("cpu"))
    data = record()
    data["model_layers"] = _timed(plain)
    return plain, fit_profile(data, get_device("cpu"), model_layers=LAYERS)


def test_twins_share_a_cost_key_and_a_different_layer_does_not():
    assert LAYERS[0].cost_key == LAYERS[1].cost_key != LAYERS[2].cost_key
    assert replace(LAYERS[0], params=1001).cost_key != LAYERS[0].cost_key


def test_the_profile_keeps_measured_over_modelled_per_layer_cost():
    _, p = _measured_profile()
    assert set(p.layer_corrections) == {LAYERS[0].cost_key, LAYERS[2].cost_key}
    twins = p.layer_corrections[LAYERS[0].cost_key]
    assert twins["forward"] == pytest.approx({1: 2.1, 4: 1.3})  # the median of a and b
    assert twins["backward"] == pytest.approx({1: 1.5, 4: 0.9})
    assert p.layer_corrections[LAYERS[2].cost_key]["backward"] == pytest.approx({1: 3.0, 4: 1.0})
    assert "synthetic.py" in p.sources["layer_corrections"]
    assert fit_profile(record(), get_device("cpu")).layer_corrections == {}  # nothing timed: nothing kept


def test_layer_timing_applies_the_ratio_interpolated_in_log_micro_batch_and_flat_beyond():
    plain, p = _measured_profile()
    c = LAYERS[2]

    def ratio(batch, attribute):
        return getattr(layer_timing(c, p, tp=1, micro_batch_size=batch, dtype="fp32"), attribute) / getattr(
            layer_timing(c, plain, tp=1, micro_batch_size=batch, dtype="fp32"), attribute)

    assert ratio(1, "fwd_s") == pytest.approx(0.5) and ratio(4, "fwd_s") == pytest.approx(0.8)
    assert ratio(2, "fwd_s") == pytest.approx(0.65)  # halfway in log between 1 and 4
    assert ratio(64, "fwd_s") == pytest.approx(0.8)  # beyond the measured sizes: the last ratio
    assert ratio(1, "bwd_input_s") == pytest.approx(3.0) and ratio(1, "bwd_weight_s") == pytest.approx(3.0)
    # A layer the profile did not time, a tensor-parallel rank's share (timed at tp 1 only)
    # and an explicit efficiency keep the layer model.
    other = _layer("d", 9e6)
    assert layer_timing(c, p, tp=2, micro_batch_size=1, dtype="fp32") == layer_timing(c, plain, tp=2, micro_batch_size=1, dtype="fp32")
    assert layer_timing(other, p, tp=1, micro_batch_size=4, dtype="fp32") == layer_timing(other, plain, tp=1, micro_batch_size=4, dtype="fp32")
    assert layer_timing(c, p, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=0.5) == layer_timing(
        c, plain, tp=1, micro_batch_size=4, dtype="fp32", kernel_efficiency=0.5)


def test_a_timed_layer_the_model_lacks_is_refused():
    plain = fit_profile(record(), get_device("cpu"))
    data = record()
    data["model_layers"] = _timed(plain)
    with pytest.raises(ProfileError, match="layer 'c' is not one of the model's"):
        fit_profile(data, get_device("cpu"), model_layers=LAYERS[:2])


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_layer_corrections_round_trip_and_malformed_ones_are_refused(tmp_path, suffix):
    _, p = _measured_profile()
    path = tmp_path / f"host{suffix}"
    path.write_text(json.dumps(profile_to_dict(p)) if suffix == ".json" else dump_profile(p))
    assert load_profile(path) == p
    data = profile_to_dict(p)
    key = LAYERS[0].cost_key
    data["layer_corrections"][key]["forward"] = {"4": -1.0}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"layer_corrections.{key}"):
        load_profile(bad)


def test_layers_are_cut_and_named_as_the_planner_traces_them():
    spec = load_model_file(GPT, TINY_GPT)
    planned = [l.name for l in trace_model(spec).layers]
    timed = layer_times(str(GPT), TINY_GPT, [1, 3], repeats=1)
    assert [row["name"] for row in timed["layers"]] == planned
    for row in timed["layers"]:
        assert [t[0] for t in row["times"]] == [1, 3]
        assert all(fwd > 0 and bwd > 0 for _, fwd, bwd in row["times"])


def test_the_chained_layers_train_as_the_whole_model_does():
    spec = load_model_file(GPT, TINY_GPT)
    torch.manual_seed(0)
    model = spec.build_model()
    _, stages, inputs, targets = layer_stages(model, spec, 2)
    chained_pass_s(stages, inputs, targets, spec.loss)
    chained = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    spec.loss(model(*inputs), targets).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(chained[name], p.grad, msg=name)


def test_profile_refuses_bad_batch_sizes_and_a_missing_model_before_measuring(tmp_path):
    out = tmp_path / "p.json"
    assert_one_line_error(hetpar("profile", "-o", str(out), "--model", str(GPT), "--batch-sizes", "4,x"), "--batch-sizes")
    assert_one_line_error(hetpar("profile", "-o", str(out), "--model", str(GPT), "--batch-sizes", "0,4"), "--batch-sizes")
    assert_one_line_error(hetpar("profile", "-o", str(out), "--model", str(tmp_path / "none.py")), "none.py")
    assert not out.exists()


@pytest.mark.slow
def test_profile_with_a_model_corrects_that_models_plans(tmp_path):
    out = tmp_path / "host.json"
    args = [x for k, v in TINY_GPT.items() for x in ("-a", f"{k}={v}")]
    result = hetpar("profile", "-o", str(out), "--quick", "--model", str(GPT), *args, "--batch-sizes", "1,4")
    assert result.returncode == 0, result.stderr
    p = load_profile(out)
    layers = trace_model(load_model_file(GPT, TINY_GPT)).layers
    assert {l.cost_key for l in layers} == set(p.layer_corrections)
    assert all(set(e["forward"]) == {1, 4} for e in p.layer_corrections.values())


def test_plan_says_how_many_of_the_models_layers_the_profile_timed(tmp_path):
    spec = load_model_file(GPT, TINY_GPT)
    layers = trace_model(spec).layers
    plain = fit_profile(record(), get_device("cpu"))
    data = record()
    data["model_layers"] = {"model": "gpt.py", "model_args": TINY_GPT, "layers": [
        {"name": l.name, "times": [[b, 2 * t.fwd_s, 2 * t.bwd_s] for b in (1, 4)
                                   for t in [layer_timing(l, plain, tp=1, micro_batch_size=b, dtype="fp32")]]}
        for l in layers if not l.name.startswith("tok_emb")]}  # every layer but the embedding
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile_to_dict(fit_profile(data, get_device("cpu"), model_layers=layers))))
    args = [x for k, v in TINY_GPT.items() for x in ("-a", f"{k}={v}")]
    result = hetpar("plan", str(GPT), *args, "-c", "1x2xcpu", "-b", "4", "--profile", str(path), "-o", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    assert f"measured times for {len(layers) - 1} of this model's {len(layers)} layers" in " ".join(result.stderr.split())
