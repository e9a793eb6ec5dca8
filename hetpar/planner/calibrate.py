"""Device profiles fitted to the user's own runs: what ``hetpar calibrate`` computes.

[Note: calibrating from runs]
A run is a plan and the metrics file its program wrote (``--metrics``). The program's
``stages`` record holds each pipeline rank's measured seconds per micro-batch, forward
and backward, receive waits left out (``runtime.training.report_stage_times``); the plan
holds what the estimate predicted for the same numbers (``predicted.stage_fwd_s``,
``stage_bwd_s``: the layers, their tensor-parallel collectives and ZeRO-3's gathers).

For each device type the runs' stages ran on, the fit finds the training kernel
efficiency under which the estimate's stage times on that type add up to the measured
ones, over every stage of every run on it: forward times fix ``kernel_efficiency``,
backward times then ``backward_kernel_efficiency``. Each trial re-estimates the runs'
own plans with the trial profile, so the model's other parts (memory-bound ops, per-op
overheads, collectives) stay as they are and only that one rate moves; the estimate's
stage time falls as the efficiency rises, and bisection on its logarithm finds it. One
number per type and pass, fitted to the sum over all its stages: a single stage or
run cannot pull it alone beyond its share, and the report shows the spread of the
per-stage ratios (measured over predicted with the fit) so that a fit that explains
one stage and not another is visible. A type seen in only one run is fitted and said
to be ("from 1 run"). The fit never sets an efficiency that would put a matmul above
the device's peak (``matmul_efficiency * kernel_efficiency <= 1``): measured stages
faster than that are reported and the efficiency capped.

What it does not fit: links (data-parallel synchronisation, pipeline sends) and the
per-degree tensor-parallel costs; the stage times it reads include a stage's
tensor-parallel collectives, which the efficiency then absorbs for that degree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import training_efficiency
from hetpar.cost_models.devices import DeviceProfile
from hetpar.planner.estimate import estimate
from hetpar.planner.explain import estimate_config, plan_graph_of
from hetpar.planner.plan import ParallelPlan

_BISECTION_STEPS = 40  # halvings of [EFFICIENCY_FLOOR, the peak's cap] in log space: under 1e-11 relative
EFFICIENCY_FLOOR = 1e-4


class CalibrationError(ValueError):
    """A run cannot be used, or nothing is left to fit; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """A plan and the stage times its program measured."""

    name: str  # how the report names it: the metrics file's path
    plan: ParallelPlan
    measured: list[dict]  # per pipeline rank: {"stage", "fwd_s", "bwd_s"} per micro-batch


@dataclass(frozen=True, kw_only=True)
class Fit:
    """What moved for one device type, and from what."""

    device_type: str
    field: str  # "kernel_efficiency" or "backward_kernel_efficiency"
    before: float
    after: float
    measured_s: float  # the type's stages' measured seconds per micro-batch, summed
    predicted_before_s: float  # ... predicted with the profile as it was
    stages: int
    runs: list[str]
    ratios: list[float]  # measured over predicted with the fit, per stage
    capped: bool  # the fit wanted matmuls above the peak


def read_run(plan_path: Path, metrics_path: Path) -> Run:
    """A run from a plan file and its program's metrics file.

    Raises:
        CalibrationError: the metrics hold no per-stage times, or not as many as the plan has pipeline ranks,
            or the plan has no per-stage prediction (heterogeneous data-parallel plans).
        PlanFileError: the plan file is not a plan.
    """
    plan = ParallelPlan.load(plan_path)
    records = []
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except OSError as exc:
        raise CalibrationError(f"cannot read metrics file {str(metrics_path)!r}: {exc.strerror}") from None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == "stages":
            records.append(record["stages"])
    if not records:
        raise CalibrationError(f"{metrics_path} holds no per-stage times; run the program with --metrics FILE for "
                               "at least 2 steps (its last record of kind 'stages' is read)")
    measured = records[-1]
    pp = plan.pipeline_parallel
    if sorted(m.get("stage") for m in measured) != list(range(pp)) or not all(
            isinstance(m.get(k), (int, float)) and m[k] > 0 for m in measured for k in ("fwd_s", "bwd_s")):
        raise CalibrationError(f"{metrics_path}: its stage times do not match {plan_path}'s {pp} pipeline ranks; "
                               "give each metrics file with the plan its program was compiled from")
    if len(plan.predicted.stage_fwd_s) != pp:
        raise CalibrationError(f"{plan_path} has no per-stage prediction (a heterogeneous data-parallel plan); "
                               "calibrate from pipeline plans")
    return Run(name=str(metrics_path), plan=plan, measured=sorted(measured, key=lambda m: m["stage"]))


def calibrate(runs: list[Run], profiles: dict[str, DeviceProfile] | None = None) -> tuple[dict[str, DeviceProfile], list[Fit]]:
    """Fit each device type's training kernel efficiencies to ``runs``; see [Note: calibrating from runs].

    Args:
        runs: plans with their measured stage times.
        profiles: device name -> profile to start from in place of the built-in one.

    Returns:
        The fitted profiles by device name, and what moved.

    Raises:
        CalibrationError: no run.
        PlanFileError: a plan's model file is gone or changed since planning.
    """
    if not runs:
        raise CalibrationError("no run to calibrate from; give PLAN METRICS pairs")
    inputs = [(run, plan_graph_of(run.plan)) for run in runs]
    start = dict(profiles or {})
    types = sorted({run.plan.stages[r].device_type for run in runs for r in range(run.plan.pipeline_parallel)})
    fitted = {t: start.get(t) or _profile_of(runs, t, start) for t in types}
    # what each pass ran at before: the backward at its own efficiency, else the forward's
    before = {(t, "kernel_efficiency"): training_efficiency(fitted[t]) for t in types}
    before |= {(t, "backward_kernel_efficiency"): fitted[t].backward_kernel_efficiency or training_efficiency(fitted[t])
               for t in types}
    fits = []
    for field, key, pass_name in (("kernel_efficiency", "fwd_s", "forward"), ("backward_kernel_efficiency", "bwd_s", "backward")):
        for t in types:
            fit, fitted[t] = _fit_one(inputs, fitted, t, field, key, pass_name, before[t, field])
            fits.append(fit)
    return fitted, fits


def _profile_of(runs: list[Run], device_type: str, profiles: dict[str, DeviceProfile]) -> DeviceProfile:
    for run in runs:
        cluster = parse_cluster(run.plan.cluster.spec, profiles=profiles)
        if device_type in cluster.count_by_type():
            return cluster.profile(device_type)
    raise CalibrationError(f"no run's cluster holds {device_type}")


def _stage_times(inputs, profiles: dict[str, DeviceProfile], device_type: str, key: str) -> list[tuple[str, float, float]]:
    """(run, predicted, measured) seconds per micro-batch of each stage on ``device_type``."""
    rows = []
    for run, graph in inputs:
        stages = [r for r in range(run.plan.pipeline_parallel) if run.plan.stages[r].device_type == device_type]
        if not stages:
            continue
        cluster = parse_cluster(run.plan.cluster.spec, profiles=profiles)
        result = estimate(graph, cluster, estimate_config(run.plan, graph))
        for r in stages:
            rows.append((run.name, getattr(result.stages[r], key), run.measured[r][key]))
    return rows


def _fit_one(inputs, profiles: dict[str, DeviceProfile], device_type: str, field: str, key: str, pass_name: str,
             before: float) -> tuple[Fit, DeviceProfile]:
    base = profiles[device_type]
    cap = 1.0 / base.matmul_efficiency

    def total(efficiency: float) -> tuple[float, list[tuple[str, float, float]]]:
        trial = {**profiles, device_type: _with(base, field, efficiency)}
        rows = _stage_times(inputs, trial, device_type, key)
        return sum(p for _, p, _ in rows), rows

    predicted_before, rows = total(before)
    measured = sum(m for _, _, m in rows)
    lo, hi = math.log(EFFICIENCY_FLOOR), math.log(cap)
    capped = total(cap)[0] > measured  # faster than the model allows at the peak
    if capped:
        efficiency = cap
    else:
        for _ in range(_BISECTION_STEPS):
            mid = (lo + hi) / 2
            if total(math.exp(mid))[0] > measured:
                lo = mid  # too slow: raise the efficiency
            else:
                hi = mid
        efficiency = math.exp((lo + hi) / 2)
    runs = sorted({name for name, _, _ in rows})
    _, after_rows = total(efficiency)
    profile = _with(base, field, efficiency, source=(
        f"[fitted] hetpar calibrate: {pass_name} stage times of {len(rows)} stage(s) of {len(runs)} run(s) "
        f"({', '.join(runs)}), {measured * 1e3:.4g} ms measured per micro-batch against {predicted_before * 1e3:.4g} ms "
        f"predicted at {before:.4g}" + ("; capped at the device's peak" if capped else "")))
    fit = Fit(device_type=device_type, field=field, before=before, after=efficiency, measured_s=measured,
              predicted_before_s=predicted_before, stages=len(rows), runs=runs,
              ratios=[m / p for _, p, m in after_rows], capped=capped)
    return fit, profile


def _with(profile: DeviceProfile, field: str, value: float, source: str | None = None) -> DeviceProfile:
    sources = dict(profile.sources)
    if source is not None:
        sources[field] = source
    else:
        sources.setdefault(field, "[fitted] hetpar calibrate (trial)")
    return replace(profile, **{field: value}, sources=sources)


def describe(fit: Fit) -> str:
    """One line: what moved for a type, by how much, from which runs."""
    spread = f"per-stage measured/fitted {min(fit.ratios):.3f}-{max(fit.ratios):.3f}" if fit.ratios else ""
    one = " (from 1 run: check it on another)" if len(fit.runs) == 1 else ""
    cap = "; capped: the stages ran faster than the device's peak allows" if fit.capped else ""
    return (f"{fit.device_type} {fit.field}: {fit.before:.4g} -> {fit.after:.4g} (x{fit.after / fit.before:.3f}) from "
            f"{fit.stages} stage(s) of {len(fit.runs)} run(s){one}: {fit.measured_s * 1e3:.4g} ms measured per "
            f"micro-batch, {fit.predicted_before_s * 1e3:.4g} ms predicted before; {spread}{cap}")


__all__ = ["CalibrationError", "Fit", "Run", "calibrate", "describe", "read_run"]
