"""Device profiles fitted to the user's own runs: what ``hetpar calibrate`` computes.

[Note: calibrating from runs]
A run is a configuration the estimate can score (a plan, or a published run typed in:
benchmarks/sailor_bench.py) and what it measured. A run of another framework is a plan
of its configuration (``hetpar plan`` with every choice pinned) and its measured
seconds per step (``read_step_run``). A hetpar program's metrics file
(``--metrics``) gives both kinds of measurement: its ``stages`` record holds each
pipeline rank's measured seconds per micro-batch, forward and backward, receive waits
left out (``runtime.training.report_stage_times``), comparable with the estimate's
stage times (the layers, their tensor-parallel collectives and ZeRO-3's gathers); its
``step`` records the whole step.

For each device type some run's stages ran on, the fit finds the training kernel
efficiency under which the estimate's stage times on that type add up to the measured
ones, over every stage of every run on it: forward times fix ``kernel_efficiency``,
backward times then ``backward_kernel_efficiency``. Each trial re-estimates the runs
with the trial profiles, so the model's other parts (memory-bound ops, per-op
overheads, collectives, the pipeline's bubble) stay as they are and only that rate
moves; the estimate's time falls as the efficiency rises, and bisection on its
logarithm finds it. One number per type and pass, fitted to a sum over all its stages,
so a single stage or run cannot pull it beyond its share; the report shows the spread
of the per-stage ratios left, measured over predicted with the fit, and says when a
type comes from one run only, and when the times fitted to are mostly fixed costs
(under half of the time moves with the rate, SENSITIVITY_FLOOR). The fit never sets an
efficiency that would put a matmul above the device's peak (``matmul_efficiency *
efficiency <= 1``): measured times faster than that are reported and the efficiency
capped. Types that only runs without stage times cover are fitted as [Note: fitting
steps] says.

[Note: fitting steps]
A run that records its step alone (a published run, a metrics file without stage
times) mixes two things the datasheets know unequally: the kernels' rate, which the
published runs pin to within about 10% (TRAINING_KERNEL_EFFICIENCY), and the per-op
overhead (``op_overhead_s``: dispatch, launch and the framework's Python per op and
pass, charged for every micro-batch), which depends on the host and the framework
and is known to a factor of a few. Sailor's GH200 runs (Megatron-DeepSpeed, fp32 with
TF32 matmuls) show the second is what a datasheet prediction misses: fitted to any
one of them alone, the overhead comes out 1.6 to 4.2 times the profile's 8 us and the
other runs then follow within a few percent at every micro-batch size, where one
factor on the kernels' rate fitted to a run of one micro-batch size misses the others
by up to 2x (docs/benchmarks/sailor-dev_*). So the step-only fit moves both: one
factor on both efficiencies and one on the per-op overhead, shared by every type the
step-only runs pace. It minimises the squared log-ratios of the estimated to the
measured steps; where the runs cannot tell the two apart (one run; runs that all mix
them in the same shares) it takes, of the fits that meet them equally well, the least
change measured in each quantity's prior spread (KERNEL_RATE_SPREAD,
OP_OVERHEAD_SPREAD): a prior of weight falling to 0 (PRIOR_WEIGHTS), solved by
Gauss-Newton on the factors' logarithms with finite-difference derivatives. Runs that
mix them in different shares (micro-batches of different sizes, so a different count
of launches per sample) give both back as they are. One run is thus met exactly, and
which of the two took how much is the prior's choice, which the report shows; the
kernels' rate keeps its cap at the peak and the overhead stays within a factor of
OVERHEAD_RANGE; a factor held at its bound stays there while the other moves. Runs that
would take the overhead to OVERHEAD_RANGE are refused (a step in milliseconds given as
seconds is 1000x; a plan that is not the run's configuration): such a profile would
price every plan by them. The report flags a fit whose steps are mostly neither (under half
moves with the two: links and latencies), as with stage times.

What it does not fit: links (data-parallel synchronisation, pipeline sends) apart from
what a step-time fit absorbs, and the per-degree tensor-parallel costs, which the stage
times include and the efficiency then absorbs for that degree.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import DEFAULT_OP_OVERHEAD_S, training_efficiency
from hetpar.cost_models.devices import DeviceProfile
from hetpar.planner.estimate import EstimateConfig, estimate
from hetpar.planner.explain import estimate_config, plan_graph_of
from hetpar.planner.plan import ParallelPlan

_BISECTION_STEPS = 40  # halvings of [EFFICIENCY_FLOOR, the peak's cap] in log space: under 1e-11 relative
EFFICIENCY_FLOOR = 1e-4
FIELDS = ("kernel_efficiency", "backward_kernel_efficiency")
# Below this sensitivity of the fitted time to the efficiency, the runs' times are mostly
# fixed costs: a fit to them is reported as such (``Fit.fixed_cost_bound``). A documented
# choice: half the time moving with the rate.
SENSITIVITY_FLOOR = 0.5
# [Note: fitting steps]: how far each quantity a step-only fit moves is believed to be off before any run,
# as a standard deviation of its logarithm. The kernels' rate: the spread of the published runs about the
# fitted TRAINING_KERNEL_EFFICIENCY (its test rows' mean |error| 7.9%, docs/benchmarks/cost-model-published_*).
# The per-op overhead: published per-op times span a factor of 4 (2 us for a bare op without autograd,
# pytorch/pytorch issue 41383; 8 us for torch.add on an A100, the A100 profile's source), and a framework's
# modules add their own; a factor of 4 either way is one spread.
KERNEL_RATE_SPREAD = 0.1
OP_OVERHEAD_SPREAD = math.log(4.0)
# The prior only chooses among fits the runs cannot tell apart: its weight falls stage by stage towards 0.
PRIOR_WEIGHTS = (1e-3, 1e-6, 1e-9)
OVERHEAD_RANGE = 1e3  # the overhead factor stays within [1/1000, 1000]
_FIT_ITERATIONS = 40
_FIT_STEP = 1e-4  # finite-difference step in spread units
_BACKTRACKS = 30


class CalibrationError(ValueError):
    """A run cannot be used, or nothing is left to fit; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """A configuration the estimate scores, and what it measured."""

    name: str  # how the report names it: the metrics file's path
    graph: Any  # the ModelGraph the configuration runs
    cluster_spec: str
    config: EstimateConfig
    measured: list[dict] = field(default_factory=list)  # per pipeline rank {"stage", "fwd_s", "bwd_s"}; empty: step only
    step_s: float | None = None  # the measured step, where no stage times are


@dataclass(frozen=True, kw_only=True)
class Fit:
    """What moved for one device type, and from what."""

    device_type: str
    field: str  # "kernel_efficiency", "backward_kernel_efficiency" or, fitted to steps, "op_overhead_s"
    before: float
    after: float
    measured_s: float  # the measured seconds fitted to, summed
    predicted_before_s: float  # ... predicted with the profiles as they were
    what: str  # "stages" (per micro-batch) or "steps"
    count: int  # stages or steps fitted to
    runs: list[str]
    ratios: list[float]  # measured over predicted with the fit, per stage or step
    capped: bool  # the fit wanted matmuls above the peak
    # how much of the fitted time moves with what was fitted, at the fit: -d ln(time) / d ln(efficiency) for
    # stage times; for steps that plus d ln(time) / d ln(op_overhead) ([Note: fitting steps]). 1 or more where
    # all of it is kernels and launches, near 0 where other fixed costs (links, collectives' latency) dominate
    sensitivity: float = 1.0

    @property
    def fixed_cost_bound(self) -> bool:
        """Whether the times fitted to are mostly fixed costs that the fitted quantities cannot explain
        (SENSITIVITY_FLOOR): the fit then moves them far to cover those costs."""
        return self.sensitivity < SENSITIVITY_FLOOR


def read_run(plan_path: Path, metrics_path: Path) -> Run:
    """A run from a plan file and its program's metrics file: its stage times, else its steps' median.

    Raises:
        CalibrationError: the metrics hold neither stage times matching the plan's pipeline ranks nor two
            steps, or the plan has no per-stage prediction (heterogeneous data-parallel plans).
        PlanFileError: the plan file is not a plan, or its model file changed since planning.
    """
    plan = ParallelPlan.load(plan_path)
    stages, steps = [], []
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
            stages.append(record["stages"])
        elif isinstance(record, dict) and record.get("kind") == "step" and isinstance(record.get("step_time_s"), (int, float)):
            steps.append(float(record["step_time_s"]))
    base = dict(name=str(metrics_path), **_configuration(plan, plan_path))
    if stages:
        measured = stages[-1]
        pp = plan.pipeline_parallel
        if sorted(m.get("stage") for m in measured) != list(range(pp)) or not all(
                isinstance(m.get(k), (int, float)) and m[k] > 0 for m in measured for k in ("fwd_s", "bwd_s")):
            raise CalibrationError(f"{metrics_path}: its stage times do not match {plan_path}'s {pp} pipeline ranks; "
                                   "give each metrics file with the plan its program was compiled from")
        return Run(**base, measured=sorted(measured, key=lambda m: m["stage"]))
    if len(steps) < 2:
        raise CalibrationError(f"{metrics_path} holds no per-stage times and fewer than 2 steps; run the program with "
                               "--metrics FILE for at least 2 steps")
    return Run(**base, step_s=statistics.median(steps[1:]))  # the first step warms up


def read_step_run(plan_path: Path, step_s: float) -> Run:
    """A run from a plan file of the configuration that ran (``hetpar plan`` with every choice pinned, for a run
    of another framework) and its measured seconds per step.

    Raises:
        CalibrationError: ``step_s`` is not a positive number of seconds, or the plan has no per-stage prediction.
        PlanFileError: the plan file is not a plan, or its model file changed since planning.
    """
    if not (math.isfinite(step_s) and step_s > 0):
        raise CalibrationError(f"a measured step of {step_s:g} s: give the seconds per step the run measured, > 0")
    plan = ParallelPlan.load(plan_path)
    return Run(name=f"{plan_path} ({step_s:g} s per step)", **_configuration(plan, plan_path), step_s=float(step_s))


def _configuration(plan: ParallelPlan, plan_path: Path) -> dict[str, Any]:
    """``Run``'s graph, cluster_spec and config from ``plan``, which must be a pipeline plan."""
    if len(plan.predicted.stage_fwd_s) != plan.pipeline_parallel:
        raise CalibrationError(f"{plan_path} has no per-stage prediction (a heterogeneous data-parallel plan); "
                               "calibrate from pipeline plans")
    graph = plan_graph_of(plan)
    return dict(graph=graph, cluster_spec=plan.cluster.spec, config=estimate_config(plan, graph))


def calibrate(runs: list[Run], profiles: dict[str, DeviceProfile] | None = None) -> tuple[dict[str, DeviceProfile], list[Fit]]:
    """Fit each device type's training kernel efficiencies to ``runs``; see [Note: calibrating from runs].

    Args:
        runs: configurations with what they measured.
        profiles: device name -> profile to start from in place of the built-in one.

    Returns:
        The fitted profiles by device name, and what moved.

    Raises:
        CalibrationError: no run.
    """
    if not runs:
        raise CalibrationError("no run to calibrate from; give PLAN METRICS pairs")
    start = dict(profiles or {})
    paced = {run.name: _stage_types(run, start) for run in runs}
    by_stages = sorted({t for run in runs if run.measured for t in paced[run.name]})
    by_steps = sorted({t for run in runs if not run.measured for t in paced[run.name]} - set(by_stages))
    fitted = {t: _profile_of(runs, t, start) for t in by_stages + by_steps}
    before = {(t, f): _efficiency(fitted[t], f) for t in fitted for f in FIELDS}
    fits = []
    for f, key, pass_name in (("kernel_efficiency", "fwd_s", "forward"), ("backward_kernel_efficiency", "bwd_s", "backward")):
        for t in by_stages:
            fit, fitted[t] = _fit_stages(runs, paced, fitted, t, f, key, pass_name, before[t, f])
            fits.append(fit)
    if by_steps:
        step_runs = [run for run in runs if not run.measured and set(paced[run.name]) & set(by_steps)]
        step_fits, fitted = _fit_steps(step_runs, fitted, by_steps, before)
        fits += step_fits
    return fitted, fits


def _efficiency(profile: DeviceProfile, field_name: str) -> float:
    """What a pass runs at: the backward at its own efficiency, else the forward's."""
    if field_name == "backward_kernel_efficiency" and profile.backward_kernel_efficiency is not None:
        return profile.backward_kernel_efficiency
    return training_efficiency(profile)


def _stage_types(run: Run, profiles: dict[str, DeviceProfile]) -> list[str]:
    """The device type that paces each pipeline rank of ``run`` ([Note: estimate rank layout])."""
    result = estimate(run.graph, parse_cluster(run.cluster_spec, profiles=profiles), run.config)
    return [s.device_type for s in result.stages]


def _profile_of(runs: list[Run], device_type: str, profiles: dict[str, DeviceProfile]) -> DeviceProfile:
    if device_type in profiles:
        return profiles[device_type]
    for run in runs:
        cluster = parse_cluster(run.cluster_spec, profiles=profiles)
        if device_type in cluster.count_by_type():
            return cluster.profile(device_type)
    raise CalibrationError(f"no run's cluster holds {device_type}")


def _sensitivity(total, at: float) -> float:
    """-d ln(total) / d ln(efficiency) at ``at``, by a 1% step either side."""
    up, down = total(at * 1.01), total(at / 1.01)
    return math.log(down / up) / math.log(1.01 ** 2) if up > 0 and down > 0 else 1.0


def _bisect(total, measured: float, cap: float) -> tuple[float, bool]:
    """The efficiency (or factor) at which ``total`` meets ``measured``, capped at ``cap``; and whether capped."""
    if total(cap) > measured:  # faster than the model allows at the peak
        return cap, True
    lo, hi = math.log(EFFICIENCY_FLOOR), math.log(cap)
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if total(math.exp(mid)) > measured:
            lo = mid  # too slow: raise the efficiency
        else:
            hi = mid
    return math.exp((lo + hi) / 2), False


def _fit_stages(runs: list[Run], paced: dict, profiles: dict[str, DeviceProfile], device_type: str, field_name: str,
                key: str, pass_name: str, before: float) -> tuple[Fit, DeviceProfile]:
    base = profiles[device_type]

    def rows(efficiency: float) -> list[tuple[str, float, float]]:
        trial = {**profiles, device_type: _with(base, field_name, efficiency)}
        out = []
        for run in runs:
            stages = [r for r, t in enumerate(paced[run.name]) if t == device_type]
            if not run.measured or not stages:
                continue
            result = estimate(run.graph, parse_cluster(run.cluster_spec, profiles=trial), run.config)
            out += [(run.name, getattr(result.stages[r], key), run.measured[r][key]) for r in stages]
        return out

    start = rows(before)
    measured = sum(m for _, _, m in start)
    total = lambda e: sum(p for _, p, _ in rows(e))  # noqa: E731
    efficiency, capped = _bisect(total, measured, 1.0 / base.matmul_efficiency)
    names = sorted({name for name, _, _ in start})
    predicted_before = sum(p for _, p, _ in start)
    source = (f"[fitted] hetpar calibrate: {pass_name} stage times of {len(start)} stage(s) of {len(names)} run(s) "
              f"({', '.join(names)}), {measured * 1e3:.4g} ms measured per micro-batch against "
              f"{predicted_before * 1e3:.4g} ms predicted at {before:.4g}" + ("; capped at the device's peak" if capped else ""))
    fit = Fit(device_type=device_type, field=field_name, before=before, after=efficiency, measured_s=measured,
              predicted_before_s=predicted_before, what="stages", count=len(start), runs=names,
              ratios=[m / p for _, p, m in rows(efficiency)], capped=capped, sensitivity=_sensitivity(total, efficiency))
    return fit, _with(base, field_name, efficiency, source=source)


def _fit_steps(runs: list[Run], profiles: dict[str, DeviceProfile], types: list[str], before: dict
               ) -> tuple[list[Fit], dict[str, DeviceProfile]]:
    """Two factors shared by every type in ``types``, fitted to the runs' steps: one on both efficiencies and one
    on the per-op overhead; see [Note: fitting steps]."""
    overhead_before = {t: profiles[t].op_overhead_s or DEFAULT_OP_OVERHEAD_S for t in types}
    cap = min(1.0 / (profiles[t].matmul_efficiency * max(before[t, f] for f in FIELDS)) for t in types)

    def trial(rate: float, overhead: float, sources: tuple[str, str] | None = None) -> dict[str, DeviceProfile]:
        out = dict(profiles)
        for t in types:
            for f in FIELDS:
                out[t] = _with(out[t], f, before[t, f] * rate, source=sources and sources[0])
            out[t] = _with(out[t], "op_overhead_s", overhead_before[t] * overhead, source=sources and sources[1])
        return out

    def steps(rate: float, overhead: float) -> list[float]:
        fitted = trial(rate, overhead)
        return [estimate(run.graph, parse_cluster(run.cluster_spec, profiles=fitted), run.config).predicted.step_time_s
                for run in runs]

    rate, overhead, capped = _least_change(runs, steps, cap)
    measured = sum(run.step_s for run in runs)
    predicted_before = sum(steps(1.0, 1.0))
    if abs(math.log(overhead)) >= math.log(OVERHEAD_RANGE) - 1e-9:  # at its bound, as _least_change's cap
        raise CalibrationError(
            f"the runs' steps ({measured:.4g} s measured against {predicted_before:.4g} s predicted) would take the "
            f"per-op overhead of {', '.join(types)} past x{OVERHEAD_RANGE if overhead > 1 else 1 / OVERHEAD_RANGE:g}"
            + (": give the seconds per step (not milliseconds)" if overhead > 1 else
               ", the kernels at the devices' peak: give the seconds per step") + " of a run whose configuration the plan pins")
    ratios = [run.step_s / p for run, p in zip(runs, steps(rate, overhead))]
    # the share of the steps the two factors move: the rest (links, latencies) they cannot explain
    sensitivity = _sensitivity(lambda x: sum(steps(x, overhead)), rate) + _sensitivity(lambda x: sum(steps(rate, overhead / x)), 1.0)
    names = [run.name for run in runs]
    what = (f"from the steps of {len(runs)} run(s) ({', '.join(names)}), {measured:.4g} s measured against "
            f"{predicted_before:.4g} s predicted" + ("; capped at the device's peak" if capped else ""))
    on = ", ".join(types)
    out = trial(rate, overhead, (f"[fitted] hetpar calibrate: x{rate:.4g} on both passes of {on} {what}",
                                 f"[fitted] hetpar calibrate: x{overhead:.4g} on the per-op overhead of {on} {what}"))
    fits = []
    for t in types:
        for f, old, new in [(f, before[t, f], before[t, f] * rate) for f in FIELDS] + [
                ("op_overhead_s", overhead_before[t], overhead_before[t] * overhead)]:
            fits.append(Fit(device_type=t, field=f, before=old, after=new, measured_s=measured, predicted_before_s=predicted_before,
                            what="steps", count=len(runs), runs=names, ratios=ratios, capped=capped and f in FIELDS,
                            sensitivity=sensitivity))
    return fits, out


def _least_change(runs: list[Run], steps, cap: float) -> tuple[float, float, bool]:
    """(rate factor, overhead factor, capped): the factors under which ``steps`` meets the runs' measured steps
    best, and of those the least change in units of each quantity's prior spread ([Note: fitting steps])."""
    measured = [run.step_s for run in runs]
    spreads = (KERNEL_RATE_SPREAD, OP_OVERHEAD_SPREAD)
    lo, hi = (math.log(EFFICIENCY_FLOOR), math.log(1 / OVERHEAD_RANGE)), (math.log(cap), math.log(OVERHEAD_RANGE))

    def residuals(u: list[float]) -> list[float]:
        times = steps(*(math.exp(x * s) for x, s in zip(u, spreads)))
        return [math.log(t / m) for t, m in zip(times, measured)]

    u = [0.0, 0.0]  # each factor's logarithm over its spread
    r = residuals(u)
    for weight in PRIOR_WEIGHTS:
        for _ in range(_FIT_ITERATIONS):
            def objective(u: list[float], r: list[float]) -> float:
                return sum(x * x for x in r) + weight * sum(x * x for x in u)

            columns = []
            for k in range(2):
                shifted = list(u)
                shifted[k] += _FIT_STEP
                columns.append([(a - b) / _FIT_STEP for a, b in zip(residuals(shifted), r)])
            # a factor at its bound that the step pushes further out stays there; the other moves alone
            held = [k for k in range(2) if (u[k] <= lo[k] / spreads[k] + 1e-12 and _descent(columns[k], r, u[k], weight) < 0)
                    or (u[k] >= hi[k] / spreads[k] - 1e-12 and _descent(columns[k], r, u[k], weight) > 0)]
            step = _damped_step([[0.0] * len(r) if k in held else col for k, col in enumerate(columns)], r,
                                [0.0 if k in held else x for k, x in enumerate(u)], weight)
            step = [0.0 if k in held else d for k, d in enumerate(step)]
            cost = objective(u, r)
            for _ in range(_BACKTRACKS):  # halve a step that does not lower the objective (the model is not linear)
                new = [min(max(x + d, lo[k] / spreads[k]), hi[k] / spreads[k]) for k, (x, d) in enumerate(zip(u, step))]
                new_r = residuals(new)
                if objective(new, new_r) <= cost:
                    break
                step = [d / 2 for d in step]
            else:
                break  # no step lowers it: converged to rounding
            moved = max(abs(x - y) for x, y in zip(new, u))
            u, r = new, new_r
            if moved < 1e-10:
                break
    rate, overhead = (math.exp(x * s) for x, s in zip(u, spreads))
    return rate, overhead, u[0] * spreads[0] >= hi[0] - 1e-9


def _descent(column: list[float], r: list[float], x: float, weight: float) -> float:
    """Which way one factor lowers the objective (> 0: up): the negative of its gradient, -(column . r + weight x)."""
    return -(sum(c * e for c, e in zip(column, r)) + weight * x)


def _damped_step(columns: list[list[float]], r: list[float], u: list[float], weight: float) -> list[float]:
    """The Gauss-Newton step d of |r + J d|^2 + weight |u + d|^2 for J's two ``columns``: -(J'J + weight I)^-1
    (J'r + weight u), through J'J's eigenvectors, so a direction the runs cannot see (eigenvalue 0) moves by
    -u's part along it exactly."""
    a = sum(x * x for x in columns[0])
    b = sum(x * y for x, y in zip(*columns))
    c = sum(y * y for y in columns[1])
    g = [sum(x * y for x, y in zip(col, r)) for col in columns]
    half, mean = math.hypot((a - c) / 2, b), (a + c) / 2
    if half == 0.0:
        vectors = [(1.0, 0.0), (0.0, 1.0)]
    else:  # the eigenvector of the larger eigenvalue, and its normal
        angle = math.atan2(b, (a - c) / 2) / 2
        vectors = [(math.cos(angle), math.sin(angle)), (-math.sin(angle), math.cos(angle))]
    values = [mean + half, max(0.0, mean - half)]
    step = [0.0, 0.0]
    for (v0, v1), value in zip(vectors, values):
        along = -(v0 * (g[0] + weight * u[0]) + v1 * (g[1] + weight * u[1])) / (value + weight)
        step[0] += along * v0
        step[1] += along * v1
    return step


def _with(profile: DeviceProfile, field_name: str, value: float, source: str | None = None) -> DeviceProfile:
    sources = dict(profile.sources)
    if source is not None:
        sources[field_name] = source
    else:
        sources.setdefault(field_name, "[fitted] hetpar calibrate (trial)")
    return replace(profile, **{field_name: value}, sources=sources)


def describe(fit: Fit) -> str:
    """One line: what moved for a type, by how much, from which runs."""
    spread = f"per-{fit.what[:-1]} measured/fitted {min(fit.ratios):.3f}-{max(fit.ratios):.3f}" if fit.ratios else ""
    one = " (from 1 run: check it on another)" if len(fit.runs) == 1 else ""
    cap = "; capped: the runs were faster than the device's peak allows" if fit.capped else ""
    if fit.fixed_cost_bound and fit.what == "stages":
        cap += (f"; only {fit.sensitivity:.0%} of these times moves with the kernels' rate (the rest is fixed costs), "
                "so the fit stretches it to cover them: calibrate on a run of a typical batch")
    elif fit.fixed_cost_bound:
        cap += (f"; only {fit.sensitivity:.0%} of these steps moves with the kernels' rate and the per-op overhead (the "
                "rest is links and latencies, which calibrate does not fit), so the fit stretches them to cover it")
    unit = "ms measured per micro-batch" if fit.what == "stages" else "ms measured per step"
    return (f"{fit.device_type} {fit.field}: {fit.before:.4g} -> {fit.after:.4g} (x{fit.after / fit.before:.3f}) from "
            f"{fit.count} {fit.what[:-1]}(s) of {len(fit.runs)} run(s){one}: {fit.measured_s * 1e3:.4g} {unit}, "
            f"{fit.predicted_before_s * 1e3:.4g} ms predicted before; {spread}{cap}")


__all__ = ["CalibrationError", "Fit", "Run", "calibrate", "describe", "read_run", "read_step_run"]
