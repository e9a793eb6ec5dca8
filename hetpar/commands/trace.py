"""``hetpar trace``: what the tracer saw, layer by layer (and node by node with --nodes)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from hetpar.commands.common import console, model_source, domain_errors, fail, gib, print_json, print_parts
from hetpar.planner import ModelGraph

# Per-sample quantities that scale with the batch size; parameters and shapes do not.
_SCALED_LAYER_KEYS = ("fwd_flops", "bwd_flops", "saved_activation_bytes", "boundary_bytes", "fwd_elementwise_flops",
                      "bwd_elementwise_flops", "fwd_bytes_accessed", "bwd_bytes_accessed", "routed_bytes")
_SCALED_NODE_KEYS = ("fwd_flops", "bwd_flops", "fwd_elementwise_flops", "bwd_elementwise_flops", "fwd_bytes_accessed",
                     "bwd_bytes_accessed", "saved_activation_bytes", "output_bytes")
_TOTAL_KEYS = ("params", "fwd_flops", "bwd_flops", "saved_activation_bytes", "fwd_bytes_accessed", "bwd_bytes_accessed")


@domain_errors
def trace(
    model_file: Annotated[Optional[Path], typer.Argument(help="Python file defining build_model() and example_inputs() (or --hf instead).", show_default=False)] = None,
    model_arg: Annotated[Optional[list[str]], typer.Option("--model-arg", "-a", help="key=value passed to build_model(); repeatable.")] = None,
    hf: Annotated[Optional[str], typer.Option("--hf", help="Instead of MODEL_FILE: a Hugging Face config.json, a checkpoint directory holding one, or an org/name in the local Hugging Face cache; the model is built from its config (nothing is downloaded).", show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="With --hf: tokens per sequence \\[default: 2048].", show_default=False)] = None,
    batch_size: Annotated[int, typer.Option(help="Samples the per-layer numbers are for.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the layer table as JSON.")] = False,
    nodes: Annotated[bool, typer.Option("--nodes", help="Also list every graph node with its measurements.")] = False,
    leaf_module: Annotated[Optional[list[str]], typer.Option(help="Module path to keep opaque when tracing; repeatable.")] = None,
) -> None:
    """Trace MODEL_FILE (or --hf) on the meta device and print its layers."""
    model_file, model_args = model_source(model_file, hf, seq_len, model_arg)
    if batch_size < 1:
        fail(f"--batch-size must be positive, got {batch_size}")
    from hetpar.planner import traced_model

    # always traced afresh, and kept for the plan or estimate after it ([Note: the trace cache])
    graph = traced_model(model_file, model_args, tuple(leaf_module or ()), refresh=True).graph
    report = trace_report(graph, batch_size, with_nodes=nodes)
    if as_json:
        print_json(report)
        return
    print_layers(model_file.name, report)
    print_parts([(r["name"], path, r["tp_sharding"][path], sizes) for r in report["layers"]
                 for path, sizes in r["tp_parts"].items()], "layer")
    if nodes:
        print_nodes(report)


def trace_report(graph: ModelGraph, batch_size: int = 1, *, with_nodes: bool = False) -> dict[str, Any]:
    """The layer table of ``graph`` for ``batch_size`` samples, as ``hetpar trace --json`` prints it."""
    rows = []
    shardings = graph.tp_sharding or [{} for _ in graph.layers]
    sources = graph.tp_source or ["" for _ in graph.layers]
    parts = graph.tp_parts or [{} for _ in graph.layers]
    for layer, boundary, sharding, source, layer_parts in zip(graph.layers, graph.boundaries or [[] for _ in graph.layers],
                                                              shardings, sources, parts):
        row: dict[str, Any] = {"name": layer.name, "params": layer.params}
        row.update({k: getattr(layer, k) * batch_size for k in _SCALED_LAYER_KEYS})
        row["tied_params"] = layer.tied_params
        # its modules of experts ([Note: experts in a layer]): routed_bytes (scaled above) is one dispatch's rows
        row.update(expert_params=layer.expert_params, num_experts=layer.num_experts,
                   expert_flops_fraction=layer.expert_flops_fraction)
        row["boundary_shapes_per_sample"] = [{"shape": list(t.shape), "dtype": t.dtype} for t in boundary]
        # how tensor parallelism splits the layer, and who said so ("finder", "base_model_tp_plan")
        row["tp_sharding"] = {path: how.value for path, how in sharding.items()}
        row["tp_source"] = source
        # the part sizes of its fused projections, each part split over the ranks ([Note: part-laid Linears])
        row["tp_parts"] = {path: list(sizes) for path, sizes in layer_parts.items()}
        rows.append(row)
    report: dict[str, Any] = {
        "batch_size": batch_size,
        "capture": graph.capture,
        "measured_layers": graph.measured_layers,
        "layers": rows,
        "totals": {k: sum(r[k] for r in rows) for k in _TOTAL_KEYS},
    }
    if with_nodes:
        report["nodes"] = [
            {k: (v * batch_size if k in _SCALED_NODE_KEYS else v) for k, v in asdict(n).items()} for n in graph.nodes
        ]
    return report


def print_layers(title: str, report: dict[str, Any]) -> None:
    """The layer table of a ``trace_report`` on stderr."""
    rows, totals = report["layers"], report["totals"]
    table = Table(title=f"{title}: {len(rows)} layers, batch size {report['batch_size']}, captured with "
                        f"{'torch.fx' if report['capture'] == 'fx' else 'torch.export'}", title_justify="left")
    table.add_column("layer", overflow="fold")
    experts = any(r["num_experts"] for r in rows)  # a mixture of experts: its experts' count and share of FLOPs
    for column in ("params", "fwd GFLOP", "bwd GFLOP", "saved activations", "to next layer", *(("experts",) if experts else ())):
        table.add_column(column, justify="right")
    for r in rows:
        share = (f"{r['num_experts']} ({r['expert_flops_fraction']:.0%})" if r["num_experts"] else "",) if experts else ()
        table.add_row(r["name"], f"{r['params']:,}", f"{r['fwd_flops'] / 1e9:.3f}", f"{r['bwd_flops'] / 1e9:.3f}",
                      gib(r["saved_activation_bytes"]), gib(r["boundary_bytes"]), *share)
    table.add_row("total", f"{totals['params']:,}", f"{totals['fwd_flops'] / 1e9:.3f}", f"{totals['bwd_flops'] / 1e9:.3f}",
                  gib(totals["saved_activation_bytes"]), "", *(("",) if experts else ()), style="bold")
    if experts:
        table.caption = "experts: the layer's experts (the share of its FLOPs they run)"
        table.caption_justify = "left"
    console.print(table)


def print_nodes(report: dict[str, Any]) -> None:
    """The node table of a ``trace_report`` made ``with_nodes``, parameter reads left out, on stderr."""
    table = Table(title="nodes", title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("node", overflow="fold")
    table.add_column("op", overflow="fold")
    for column in ("fwd MFLOP", "bwd MFLOP", "fwd bytes", "saved", "output"):
        table.add_column(column, justify="right")
    for n in report["nodes"]:
        if n["op"].endswith((".weight", ".bias")) and not n["fwd_bytes_accessed"]:
            continue  # a parameter read; its bytes show in the node that uses it
        table.add_row(str(n["layer"]), n["name"], n["op"], f"{n['fwd_flops'] / 1e6:.2f}", f"{n['bwd_flops'] / 1e6:.2f}",
                      gib(n["fwd_bytes_accessed"]), gib(n["saved_activation_bytes"]), gib(n["output_bytes"]))
    console.print(table)
