"""``hetpar trace``: what the tracer saw, layer by layer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from hetpar.commands.common import console, domain_errors, gib, print_json
from planner.trace import trace_model
from runtime.model_file import load_model_file, parse_model_args


@domain_errors
def trace(
    model_file: Annotated[Path, typer.Argument(help="Python file defining build_model() and example_inputs().", show_default=False)],
    model_arg: Annotated[Optional[list[str]], typer.Option("--model-arg", "-a", help="key=value passed to build_model(); repeatable.")] = None,
    batch_size: Annotated[int, typer.Option(help="Samples the per-layer numbers are for.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the layer table as JSON.")] = False,
    leaf_module: Annotated[Optional[list[str]], typer.Option(help="Module path to keep opaque when tracing; repeatable.")] = None,
) -> None:
    """Trace MODEL_FILE on the meta device and print its layers."""
    graph = trace_model(load_model_file(model_file, parse_model_args(model_arg or [])), tuple(leaf_module or ()))
    rows = [
        {
            "name": l.name,
            "params": l.params,
            "fwd_flops": l.fwd_flops * batch_size,
            "bwd_flops": l.bwd_flops * batch_size,
            "saved_activation_bytes": l.saved_activation_bytes * batch_size,
            "boundary_bytes": l.boundary_bytes * batch_size,
        }
        for l in graph.layers
    ]
    totals = {k: sum(r[k] for r in rows) for k in ("params", "fwd_flops", "bwd_flops", "saved_activation_bytes")}
    if as_json:
        print_json({"batch_size": batch_size, "layers": rows, "totals": totals})
        return
    table = Table(title=f"{model_file.name}: {len(rows)} layers, batch size {batch_size}", title_justify="left")
    for column in ("layer", "params", "fwd GFLOP", "bwd GFLOP", "saved activations", "to next layer"):
        table.add_column(column, justify="right" if column != "layer" else "left")
    for r in rows:
        table.add_row(r["name"], f"{r['params']:,}", f"{r['fwd_flops'] / 1e9:.3f}", f"{r['bwd_flops'] / 1e9:.3f}",
                      gib(r["saved_activation_bytes"]), gib(r["boundary_bytes"]))
    table.add_row("total", f"{totals['params']:,}", f"{totals['fwd_flops'] / 1e9:.3f}", f"{totals['bwd_flops'] / 1e9:.3f}",
                  gib(totals["saved_activation_bytes"]), "", style="bold")
    console.print(table)
