"""``hetpar validate``: run a plan on this host and compare measured against predicted step time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hetpar.commands.common import RunError, console, domain_errors, model_extra_files, print_json, seconds, tied_across_stages
from hetpar.planner import ParallelPlan
from hetpar.rewriters import PROGRAM, compile_plan
from hetpar.vocabulary import Switch

# Steps whose time is dropped: the first builds the process groups' buffers and warms
# the allocator and the autograd graph; the second still pays some of it.
WARMUP_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class Validation:
    """Predicted against measured step time of one plan on this host."""

    predicted_step_time_s: float
    measured_step_time_s: float  # median over the measured steps, warm-up excluded
    relative_error: float  # (predicted - measured) / measured
    measured_steps: int
    world_size: int
    step_times_s: list[float]
    # Per pipeline rank, one micro-batch: {"stage", "predicted_fwd_s", "measured_fwd_s",
    # "predicted_bwd_s", "measured_bwd_s"}; the measured times leave out waits for
    # receives (runtime/training.py report_stage_times). Empty when the plan has no
    # stage prediction.
    stages: list[dict] = field(default_factory=list)


def validate_plan(plan_path: Path, *, steps: int, timeout_s: float, workdir: Path | None = None,
                  compile: str = Switch.AUTO) -> Validation:
    """Compile ``plan_path`` into a temporary directory, run it with torchrun, and compare.

    Args:
        plan_path: a plan JSON file from ``hetpar plan``.
        steps: measured steps; WARMUP_STEPS more are run and dropped.
        timeout_s: the run is killed after this many seconds.
        workdir: where to build (a temporary directory when None).
        compile: the program's ``--compile``; "auto" runs the stages as the plan's costs assume (``plan.compiled``).

    Returns:
        The comparison.

    Raises:
        RunError: the run failed, timed out, or wrote no metrics.
        PlanFileError: the plan file is unreadable.
    """
    if steps < 1:
        raise RunError(f"--steps must be at least 1, got {steps}")
    plan = ParallelPlan.load(plan_path)
    _check_this_host(plan)
    with tempfile.TemporaryDirectory(prefix="hetpar-validate-") as tmp:
        build = Path(workdir or tmp) / "build"
        compile_plan(plan, build, tied=tied_across_stages(plan), extra_files=model_extra_files(plan))  # the program hetpar compile writes
        times, stage_times = _run(build, plan.cluster.world_size, steps + WARMUP_STEPS, timeout_s, compile)
    measured = times[WARMUP_STEPS:] or times
    median = statistics.median(measured)
    predicted = plan.predicted.step_time_s
    return Validation(predicted_step_time_s=predicted, measured_step_time_s=median,
                      relative_error=(predicted - median) / median, measured_steps=len(measured),
                      world_size=plan.cluster.world_size, step_times_s=times, stages=_stages(plan, stage_times))


def _stages(plan: ParallelPlan, measured: list[dict]) -> list[dict]:
    """Predicted against measured seconds per micro-batch of each pipeline rank."""
    p = plan.predicted
    if len(p.stage_fwd_s) != plan.pipeline_parallel or len(measured) != plan.pipeline_parallel:
        return []
    return [{"stage": m["stage"], "predicted_fwd_s": p.stage_fwd_s[m["stage"]], "measured_fwd_s": m["fwd_s"],
             "predicted_bwd_s": p.stage_bwd_s[m["stage"]], "measured_bwd_s": m["bwd_s"]} for m in measured]


def _check_this_host(plan: ParallelPlan) -> None:
    """Refuse a plan for other devices: validate measures it here, against a prediction
    made for devices this host does not have."""
    import torch  # here: hetpar's other commands start without it

    from hetpar.runtime import devices

    device = torch.device("cuda" if torch.cuda.is_available() and devices.needs_accelerator(plan.cluster.device_types) else "cpu")
    found = devices.this_device(device)
    foreign = sorted({t for t in plan.cluster.device_types if not devices.matches(t, found)})
    if foreign:
        raise RunError(
            f"the plan is for {', '.join(foreign)} ranks and this host is {found.describe()}; validate runs the plan "
            f"here, so plan it for this host (for example -c 1x{plan.cluster.world_size}xcpu with --profile)")


def _run(build: Path, world: int, steps: int, timeout_s: float, compile: str) -> tuple[list[float], list[dict]]:
    metrics = build / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=localhost:0", PROGRAM, "--steps", str(steps), "--metrics", str(metrics),
               "--compile", compile]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, cwd=build, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RunError(f"the run did not finish within {timeout_s:.0f} s (raise --timeout)") from None
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise RunError(f"the run failed with exit code {done.returncode}: {last[0].strip()}")
    if not metrics.is_file():
        raise RunError("the run wrote no metrics")
    from hetpar.runtime.training import read_metrics  # here: it imports torch.distributed.tensor, a second at every hetpar start

    times = [r["step_time_s"] for r in read_metrics(metrics, "step")]
    if not times:
        raise RunError("the run wrote no step times")
    stages = next((r["stages"] for r in read_metrics(metrics, "stages")), [])
    return times, stages


@domain_errors
def validate(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON from hetpar plan.", show_default=False)],
    steps: Annotated[int, typer.Option(help=f"Measured steps ({WARMUP_STEPS} warm-up steps more are run and dropped).")] = 10,
    timeout: Annotated[float, typer.Option(help="Kill the run after this many seconds.")] = 300.0,
    nproc_check: Annotated[bool, typer.Option("--nproc-check/--no-nproc-check", help="Refuse plans with more ranks than this host has cores.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON to stdout.")] = False,
    compile: Annotated[Switch, typer.Option(help="The program's --compile: torch.compile each stage; auto runs them "
                                                  "as planned (plan.compiled), as the prediction assumes.")] = Switch.AUTO,
) -> None:
    """Run PLAN_FILE with torchrun on this host and report predicted against measured step time."""
    if nproc_check:
        world = ParallelPlan.load(plan_file).cluster.world_size
        if world > (os.cpu_count() or 1):
            raise RunError(f"the plan has {world} ranks and this host {os.cpu_count()} cores; timings would be meaningless")
    with console.status(f"running {plan_file} with torchrun"):
        result = validate_plan(plan_file, steps=steps, timeout_s=timeout, compile=compile.value)
    console.print(f"predicted {seconds(result.predicted_step_time_s)}, measured {seconds(result.measured_step_time_s)} "
                  f"(median of {result.measured_steps} steps, {result.world_size} ranks): error {result.relative_error:+.1%}")
    if result.stages:
        table = Table(title="per micro-batch, each pipeline rank (receives' waits left out)", title_justify="left")
        for column in ("stage", "forward predicted", "measured", "error", "backward predicted", "measured", "error"):
            table.add_column(column)
        for st in result.stages:
            cells = []
            for p, m in ((st["predicted_fwd_s"], st["measured_fwd_s"]), (st["predicted_bwd_s"], st["measured_bwd_s"])):
                cells += [seconds(p), seconds(m), f"{(p - m) / m:+.1%}" if m > 0 else "-"]
            table.add_row(str(st["stage"]), *cells)
        console.print(table)
    if as_json:
        print_json(asdict(result))
