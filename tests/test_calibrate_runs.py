"""``hetpar calibrate`` (issue 34, item 3): profiles fitted to a user's runs. Synthetic runs
whose stages took a known factor of their prediction must give that factor back, per
device type and pass; bad input is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env
from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import training_efficiency
from hetpar.cost_models.devices import get_device, load_profile
from hetpar.planner.api import plan_model
from hetpar.planner.calibrate import (KERNEL_RATE_SPREAD, OP_OVERHEAD_SPREAD, CalibrationError, Run, calibrate, describe,
                                     read_run)
from hetpar.planner.estimate import estimate
from hetpar.planner.explain import estimate_config, plan_graph_of
from hetpar.planner.options import SearchOptions

GPT = ROOT / "benchmarks" / "published" / "gpt.py"
ARGS = {"n_layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 256}


def _run_files(tmp_path, cluster: str, slowdown: dict[str, tuple[float, float]], name: str = "run", *,
               scale_times: bool = False, **pins):
    """A plan of ``cluster`` and a metrics file as its program writes it (runtime.training.report_stage_times),
    whose stages ran with each device type's training kernels ``slowdown[type]`` = (forward, backward) times
    slower than its profile says: the stage times the estimate gives with ``kernel_efficiency`` and
    ``backward_kernel_efficiency`` divided by them. ``scale_times``: the predicted stage times times the factors."""
    the_cluster = parse_cluster(cluster)
    plan = plan_model(GPT, the_cluster, SearchOptions(global_batch_size=8, dtype="fp16", **pins), model_args=ARGS)
    plan_path = tmp_path / f"{name}.json"
    plan.save(plan_path)
    if scale_times:
        p = plan.predicted
        fwd = [p.stage_fwd_s[r] * slowdown[plan.stages[r].device_type][0] for r in range(plan.pipeline_parallel)]
        bwd = [p.stage_bwd_s[r] * slowdown[plan.stages[r].device_type][1] for r in range(plan.pipeline_parallel)]
    else:
        slowed = {}
        for t, (f, b) in slowdown.items():
            device = the_cluster.profile(t) if t in the_cluster.count_by_type() else None
            if device is not None:
                e = training_efficiency(device)
                sources = {**device.sources, "kernel_efficiency": "test", "backward_kernel_efficiency": "test"}
                slowed[t] = dataclasses.replace(device, kernel_efficiency=e / f, backward_kernel_efficiency=e / b,
                                                sources=sources)
        fwd, bwd = _stage_times(plan, slowed)
    stages = [{"stage": r, "fwd_s": fwd[r], "bwd_s": bwd[r]} for r in range(plan.pipeline_parallel)]
    metrics = tmp_path / f"{name}.jsonl"
    metrics.write_text(json.dumps({"kind": "step", "step": 1, "loss": 1.0, "step_time_s": 1.0}) + "\n"
                       + json.dumps({"kind": "stages", "stages": stages}) + "\n")
    return plan, plan_path, metrics, (fwd, bwd)


def _stage_times(plan, profiles):
    graph = plan_graph_of(plan)
    result = estimate(graph, parse_cluster(plan.cluster.spec, profiles=profiles), estimate_config(plan, graph))
    return [s.fwd_s for s in result.stages], [s.bwd_s for s in result.stages]


def test_a_run_slowed_by_a_known_factor_gives_the_factor_back(tmp_path):
    plan, plan_path, metrics, (fwd0, bwd0) = _run_files(tmp_path, "1x4xA100-80GB", {"A100-80GB": (1.3, 1.2)}, pp=2, dp=2, tp=1)
    fitted, fits = calibrate([read_run(plan_path, metrics)])
    assert set(fitted) == {"A100-80GB"} and [f.field for f in fits] == ["kernel_efficiency", "backward_kernel_efficiency"]
    e = training_efficiency(get_device("A100-80GB"))
    assert fitted["A100-80GB"].kernel_efficiency == pytest.approx(e / 1.3, rel=1e-6)
    assert fitted["A100-80GB"].backward_kernel_efficiency == pytest.approx(e / 1.2, rel=1e-6)
    fwd, bwd = _stage_times(plan, fitted)
    assert fwd == pytest.approx(fwd0, rel=1e-6) and bwd == pytest.approx(bwd0, rel=1e-6)
    assert all(f.after < f.before for f in fits)  # slower stages: a lower efficiency
    assert "from 1 run" in describe(fits[0]) and "A100-80GB kernel_efficiency" in describe(fits[0])


def test_each_device_type_of_a_mixed_cluster_gets_its_own_factor(tmp_path):
    factors = {"A100-80GB": (1.25, 1.4), "V100-32GB": (0.9, 1.1)}
    plan, plan_path, metrics, _ = _run_files(tmp_path, "1x2xA100-80GB+1x2xV100-32GB", factors, pp=2, dp=2, tp=1,
                                             stage_devices=("A100-80GB", "V100-32GB"))
    _, other_path, other_metrics, _ = _run_files(tmp_path, "1x4xV100-32GB", factors, name="other", pp=2, dp=2, tp=1)
    fitted, fits = calibrate([read_run(plan_path, metrics), read_run(other_path, other_metrics)])
    for t, (f, b) in factors.items():
        e = training_efficiency(get_device(t))
        assert fitted[t].kernel_efficiency == pytest.approx(e / f, rel=1e-6)
        assert fitted[t].backward_kernel_efficiency == pytest.approx(e / b, rel=1e-6)
    v100 = next(f for f in fits if f.device_type == "V100-32GB" and f.field == "kernel_efficiency")
    assert len(v100.runs) == 2 and v100.after > v100.before


def test_stages_faster_than_the_peak_allows_cap_the_fit(tmp_path):
    plan, plan_path, metrics, _ = _run_files(tmp_path, "1x2xA100-80GB", {"A100-80GB": (0.05, 0.05)}, pp=2, dp=1, tp=1,
                                             scale_times=True)
    fitted, fits = calibrate([read_run(plan_path, metrics)])
    device = fitted["A100-80GB"]
    assert all(f.capped for f in fits) and "capped" in describe(fits[0])
    assert device.matmul_efficiency * device.kernel_efficiency == pytest.approx(1.0)


def test_bad_runs_are_refused_in_one_line(tmp_path):
    plan, plan_path, metrics, _ = _run_files(tmp_path, "1x2xA100-80GB", {"A100-80GB": (1.0, 1.0)}, pp=2, dp=1, tp=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "step", "step": 1}) + "\n")
    with pytest.raises(CalibrationError, match="no per-stage times"):
        read_run(plan_path, empty)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"kind": "stages", "stages": [{"stage": 0, "fwd_s": 1.0, "bwd_s": 2.0}]}) + "\n")
    with pytest.raises(CalibrationError, match="do not match"):
        read_run(plan_path, wrong)


def _calibrate_cli(plan_path, measured: str, out, reported: str):
    """``hetpar calibrate PLAN MEASURED -o OUT`` as a user runs it: it succeeds and reports ``reported``; the profile."""
    run = subprocess.run([sys.executable, "-m", "hetpar", "calibrate", str(plan_path), measured, "-o", str(out)],
                         capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert reported in run.stderr + run.stdout
    return load_profile(out)


def test_the_cli_writes_a_profile_that_plan_and_estimate_read(tmp_path):
    plan, plan_path, metrics, (fwd0, _) = _run_files(tmp_path, "1x4xA100-80GB", {"A100-80GB": (1.5, 1.5)}, pp=2, dp=2, tp=1)
    profile = _calibrate_cli(plan_path, str(metrics), tmp_path / "a100.toml", "A100-80GB kernel_efficiency")
    assert "[fitted] hetpar calibrate" in profile.sources["kernel_efficiency"]
    fwd, _ = _stage_times(plan, {profile.name: profile})
    assert fwd == pytest.approx(fwd0, rel=1e-6)
    odd = subprocess.run([sys.executable, "-m", "hetpar", "calibrate", str(plan_path), "-o", str(tmp_path / "x.toml")],
                         capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
    assert odd.returncode != 0 and "Traceback" not in odd.stderr and "PLAN METRICS" in odd.stderr
    assert not (tmp_path / "x.toml").exists()


def _slowed(device, rate: float, overhead: float):
    """``device`` with its training kernels ``rate`` times slower and its per-op overhead ``overhead`` times longer."""
    e = training_efficiency(device)
    return dataclasses.replace(device, kernel_efficiency=e / rate, backward_kernel_efficiency=e / rate,
                               op_overhead_s=device.op_overhead_s * overhead,
                               sources={**device.sources, "kernel_efficiency": "test", "backward_kernel_efficiency": "test"})


def _step_run(name: str, graph, cluster: str, config, profiles) -> Run:
    step = estimate(graph, parse_cluster(cluster, profiles=profiles), config).predicted.step_time_s
    return Run(name=name, graph=graph, cluster_spec=cluster, config=config, step_s=step)


def _a100_plan_and_step(tmp_path, rate: float, overhead: float):
    """A pp 2, dp 2 plan on four A100s and the step it takes with kernels ``rate`` times slower and the per-op
    overhead ``overhead`` times longer: (plan, its path, its graph, its estimate config, the device, the step)."""
    plan, plan_path, _, _ = _run_files(tmp_path, "1x4xA100-80GB", {"A100-80GB": (1.0, 1.0)}, pp=2, dp=2, tp=1)
    device = get_device("A100-80GB")
    graph = plan_graph_of(plan)
    config = estimate_config(plan, graph)
    step = _step_run("x", graph, plan.cluster.spec, config, {device.name: _slowed(device, rate, overhead)}).step_s
    return plan, plan_path, graph, config, device, step


def test_a_run_with_only_its_steps_is_met_by_the_least_change(tmp_path):
    """A metrics file without stage times: the median step after the first is fitted by one factor on both
    efficiencies and one on the per-op overhead. One run cannot tell them apart: the fit meets its step
    exactly, and of all such fits takes the least change in units of each one's spread ([Note: fitting
    steps]), where the change is parallel to the gradient of the step's log-ratio (Lagrange's condition)."""
    plan, plan_path, graph, config, device, step = _a100_plan_and_step(tmp_path, 1.25, 1.0)
    metrics = tmp_path / "steps.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "step", "step": i, "loss": 1.0, "step_time_s": t}) + "\n"
                               for i, t in enumerate([10 * step, step, step * 1.01, step * 0.99], start=1)))
    run = read_run(plan_path, metrics)
    assert run.step_s == pytest.approx(step) and not run.measured  # the first step (warm-up) left out
    fitted, fits = calibrate([run])
    assert {f.what for f in fits} == {"steps"}
    assert [f.field for f in fits] == ["kernel_efficiency", "backward_kernel_efficiency", "op_overhead_s"]
    a100 = fitted["A100-80GB"]
    assert a100.kernel_efficiency == pytest.approx(a100.backward_kernel_efficiency, rel=1e-12)
    assert "per-step measured/fitted 1.000-1.000" in describe(fits[0]) and "x" in a100.sources["op_overhead_s"]
    again = estimate(graph, parse_cluster(plan.cluster.spec, profiles=fitted), config).predicted.step_time_s
    assert again == pytest.approx(step, rel=1e-6)
    # slower steps: the kernels slower and the overhead longer, both
    assert a100.kernel_efficiency < training_efficiency(device) and a100.op_overhead_s > device.op_overhead_s
    u = (math.log(a100.kernel_efficiency / training_efficiency(device)) / KERNEL_RATE_SPREAD,
         math.log(a100.op_overhead_s / device.op_overhead_s) / OP_OVERHEAD_SPREAD)

    def log_step(du: float, dv: float) -> float:
        trial = dataclasses.replace(a100, kernel_efficiency=a100.kernel_efficiency * math.exp(du * KERNEL_RATE_SPREAD),
                                    backward_kernel_efficiency=a100.kernel_efficiency * math.exp(du * KERNEL_RATE_SPREAD),
                                    op_overhead_s=a100.op_overhead_s * math.exp(dv * OP_OVERHEAD_SPREAD))
        return math.log(estimate(graph, parse_cluster(plan.cluster.spec, profiles={trial.name: trial}), config)
                        .predicted.step_time_s)

    h = 1e-4
    grad = ((log_step(h, 0) - log_step(-h, 0)) / (2 * h), (log_step(0, h) - log_step(0, -h)) / (2 * h))
    assert abs(u[0] * grad[1] - u[1] * grad[0]) <= 1e-3 * math.hypot(*u) * math.hypot(*grad)


@pytest.mark.parametrize("kernels_s,overhead_s,measured_s", [(1.0, 1.0, 1.5), (1.0, 1e-3, 3.0)])
def test_a_factor_at_its_bound_leaves_the_other_to_meet_the_step(kernels_s, overhead_s, measured_s):
    """The fit's two factors on a step of kernels_s / rate + overhead_s * overhead, the rate capped at 1.
    A step shorter than the kernels at the cap allow holds the rate there and leaves the overhead to meet it (the
    overhead comes down to 0.5); a slower one is met however the prior splits it. Either way the step is met,
    which a step pushed against a bound and clipped does not do."""
    import types

    from hetpar.planner.calibrate import _least_change

    def steps(rate: float, overhead: float) -> list[float]:
        return [kernels_s / rate + overhead_s * overhead]

    rate, overhead, capped = _least_change([types.SimpleNamespace(step_s=measured_s)], steps, cap=1.0)
    assert steps(rate, overhead)[0] == pytest.approx(measured_s, rel=1e-6)
    assert rate <= 1.0 + 1e-12 and capped == (measured_s < kernels_s + overhead_s)
    if capped:
        assert overhead == pytest.approx((measured_s - kernels_s) / overhead_s, rel=1e-6)


def test_steps_at_two_micro_batch_sizes_give_both_factors_back():
    """Runs whose steps mix the two in different shares (eight micro-batches of one sample, one of eight) tell
    the kernels' rate from the per-op overhead: slowed by 1.25 and 3 on a V100 pair, both come back."""
    from hetpar.planner.capture import trace_model
    from hetpar.planner.estimate import EstimateConfig
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file(str(GPT), ARGS))
    device = get_device("V100-32GB")
    cluster = "1x2xV100-32GB"
    truth = {device.name: _slowed(device, 1.25, 3.0)}
    runs = [_step_run(f"mbs{m}", graph, cluster, EstimateConfig(global_batch_size=16, dp=2, tp=1, pp=1, micro_batch_size=m,
                                                                  dtype="fp16"), truth) for m in (1, 8)]
    fitted, fits = calibrate(runs)
    v100 = fitted[device.name]
    assert v100.kernel_efficiency == pytest.approx(training_efficiency(device) / 1.25, rel=1e-3)
    assert v100.op_overhead_s == pytest.approx(device.op_overhead_s * 3.0, rel=1e-3)
    assert all(r == pytest.approx(1.0, abs=1e-6) for r in fits[0].ratios)


def test_the_cli_takes_a_run_of_another_framework_as_a_plan_and_its_seconds_per_step(tmp_path):
    """A run hetpar did not make: a plan of its configuration and the seconds per step it measured, given as a
    number where a metrics file would go. The fitted profile meets that step; a number that is not seconds is
    refused in one line and writes nothing, as is a step no overhead within x1000 meets (milliseconds given as
    seconds; a step shorter than the kernels at the peak allow)."""
    plan, plan_path, graph, config, device, step = _a100_plan_and_step(tmp_path, 1.0, 3.0)
    profile = _calibrate_cli(plan_path, repr(step), tmp_path / "a100.toml", "A100-80GB op_overhead_s")
    assert "[fitted] hetpar calibrate" in profile.sources["op_overhead_s"] and profile.op_overhead_s > device.op_overhead_s
    again = estimate(graph, parse_cluster(plan.cluster.spec, profiles={profile.name: profile}), config).predicted.step_time_s
    assert again == pytest.approx(step, rel=1e-6)
    for bad in ("0", "nan", repr(step * 1000), repr(step / 1e4)):
        refused = subprocess.run([sys.executable, "-m", "hetpar", "calibrate", str(plan_path), bad, "-o", str(tmp_path / "b.toml")],
                                 capture_output=True, text=True, env=subprocess_env(), cwd=ROOT)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr and "seconds per step" in refused.stderr
        assert not (tmp_path / "b.toml").exists()
