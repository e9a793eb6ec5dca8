"""``hetpar explain``: a plan's stages, where its time and memory go, and its schedule as a picture."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from hetpar.commands.common import console, domain_errors, gib, print_json, print_parts, seconds
from hetpar.commands.plan import sync_description
from hetpar.planner import ParallelPlan, write_text_atomic
from hetpar.runtime.schedule import Kind


@domain_errors
def explain(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `hetpar plan`.", show_default=False)],
    timeline: Annotated[Optional[Path], typer.Option(help="Write the schedule timeline as SVG to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate of the plan as JSON.")] = False,
) -> None:
    """Show PLAN_FILE's stages, time and memory breakdown, and its pipeline schedule."""
    from hetpar.planner import explain_plan, timeline_svg  # torch: only once the plan reads

    plan = ParallelPlan.load(plan_file)
    with console.status("tracing and estimating the plan"):
        result = explain_plan(plan)
    est = result.estimate
    labels = [f"stage {s.index}" for s in plan.stages]
    if timeline is not None:
        if timeline.suffix.lower() != ".svg":
            console.print(f"[bold red]hetpar: error:[/] --timeline {str(timeline)!r} must end in .svg")
            raise typer.Exit(1)
        title = f"{Path(plan.model.file).name} on {plan.cluster.spec}: {plan.schedule.value}, {plan.num_microbatches} micro-batches"
        write_text_atomic(timeline, timeline_svg(est.timeline, labels, title))
    if as_json:
        report = est.to_dict()
        for stage, row in zip(plan.stages, report["stages"]):
            row["tp_parts"] = stage.tp_parts  # fused projections split part by part ([Note: part-laid Linears])
        print_json(report)
        return
    _print_stages(plan, est)
    print_parts([(f"stage {s.index}", path, s.tp_sharding[path], sizes) for s in plan.stages
                 for path, sizes in s.tp_parts.items()], "stage")
    t = est.time
    console.print(
        f"step {seconds(t.step_s)}: compute {seconds(t.compute_s)}, bubble {seconds(t.bubble_s)}, "
        f"tp comm {seconds(t.tp_comm_s)}, pp comm {seconds(t.pp_comm_s)}, dp comm {seconds(t.dp_comm_s)}, "
        f"optimizer {seconds(t.optimizer_s)}"
        + (f", all-to-all {seconds(t.ep_comm_s)} (experts over ep {est.config.ep})" if est.config.ep > 1 else "")
        + (f", context exchange {seconds(t.cp_comm_s)} (keys and values all-gathered over cp {est.config.cp})"
           if est.config.cp > 1 else "")
        + (f", host link {seconds(t.host_comm_s)} (offloaded state)" if t.host_comm_s else "")
        + f"  ({est.tflops_per_device:.2f} TFLOP/s per device, MFU {est.mfu:.1%})"
    )
    sp = [str(s.index) for s in plan.stages if s.sequence_parallel]
    if sp:
        console.print(f"sequence parallel on stage{'s' if len(sp) > 1 else ''} {', '.join(sp)}: tp comm is reduce-scatters and "
                      "all-gathers over the sequence where tensor parallelism alone all-reduces")
    if plan.data_parallel > 1:
        saved = result.plain_dp_comm_s - t.dp_comm_s
        console.print(f"data-parallel sync: {sync_description(plan)}"
                      + (f"; a plain all-reduce would take {seconds(result.plain_dp_comm_s)} per step "
                         f"({'saves' if saved >= 0 else 'costs'} {seconds(abs(saved))})" if saved else ""))
    console.print(_text_timeline(est.timeline, labels, width=max(20, console.width - 12)), soft_wrap=True)
    if timeline is not None:
        console.print(f"wrote {timeline}")


def _print_stages(plan: ParallelPlan, est) -> None:
    names = plan.model.layer_names
    table = Table(title=f"{Path(plan.model.file).name} on {plan.cluster.spec}", title_justify="left")
    for column in ("stage", "layers", "device", "tp", "fwd/mb", "bwd/mb", "weights", "grads", "optimizer", "activations", "total/device"):
        table.add_column(column)
    for s, e in zip(plan.stages, est.stages):
        m = e.memory
        layers = names[s.layers[0]] if len(s.layers) == 1 else f"{names[s.layers[0]]} .. {names[s.layers[-1]]}"
        table.add_row(str(s.index), layers, plan.stage_device_label(s), f"{s.degree_label}{' sp' if s.sequence_parallel else ''}", seconds(e.fwd_s), seconds(e.bwd_s),
                      gib(m.weights_bytes), gib(m.gradients_bytes), gib(m.optimizer_bytes), gib(m.activations_bytes),
                      gib(m.total_bytes) + ("" if e.fits else " (does not fit)"))
    console.print(table)


def _text_timeline(run, labels: list[str], width: int = 72) -> str:
    """The schedule as text: one row per stage, F/B/W letters, dots for bubbles."""
    span = run.makespan_s or 1.0
    rows = []
    for label, timed in zip(labels, run.ranks):
        cells = ["."] * width
        for t in timed:
            first, last = int(t.start_s / span * width), max(int(t.start_s / span * width), int(t.end_s / span * width) - 1)
            letter = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.WEIGHT: "W"}[t.action.kind]
            for i in range(first, min(last + 1, width)):
                cells[i] = letter
        rows.append(f"{label:>8} |{''.join(cells)}|")
    return "\n".join(rows)
