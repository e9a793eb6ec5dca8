"""``hetpar estimate``: score a parallel configuration the user gives, without searching."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.compute import TRAINING_KERNEL_EFFICIENCY
from hetpar.commands.common import profiles_option
from hetpar.commands.common import console, model_source, domain_errors, gib, print_json, rank_ranges, seconds
from hetpar.commands.common import default_compiled, default_dtype
from hetpar.planner import Estimate, EstimateConfig, EstimateError
from hetpar.planner.estimate import estimate as estimate_plan
from hetpar.vocabulary import DType, Optimizer, Recompute, Schedule


@domain_errors
def estimate(
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster shorthand like 4x8xA100-80GB@200gx8, or a TOML file.")],
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="Samples per optimizer step, over the whole cluster.")],
    dp: Annotated[int, typer.Option(help="Data-parallel degree.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")],
    pp: Annotated[int, typer.Option(help="Pipeline-parallel degree (pipeline ranks).")],
    micro_batch_size: Annotated[int, typer.Option(help="Samples per micro-batch.")],
    model_file: Annotated[Optional[Path], typer.Argument(help="Python file defining build_model() and example_inputs() (or --hf instead).", show_default=False)] = None,
    cp: Annotated[int, typer.Option(help="Context parallelism: every sequence split over this many ranks (the cluster holds dp * cp * tp * pp devices).")] = 1,
    sp: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism on every stage with tp > 1.")] = False,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="Keep every stage's ZeRO-3 shard in host memory and step it on the CPUs (needs --zero 3; devices whose profile states their host).")] = False,
    ep: Annotated[int, typer.Option(help="Expert parallelism: the experts split over this many data-parallel replicas (divides dp).")] = 1,
    expert_imbalance: Annotated[float, typer.Option(help="Under expert parallelism, the busiest rank receives this many times the uniform share of routed tokens (1: uniform routing).")] = 1.0,
    stage_layers: Annotated[Optional[str], typer.Option(help="Layers per stage, e.g. 7,9,9,9 (pp * virtual-stages entries) \\[default: Megatron's, blocks evenly with the embedding first and the head last; else even].")] = None,
    stage_devices: Annotated[Optional[str], typer.Option(help="Device type per pipeline rank, e.g. A100-80GB,V100-32GB \\[default: Megatron's rank order].")] = None,
    schedule: Annotated[Schedule, typer.Option(help="Pipeline schedule.")] = Schedule.ONE_F_ONE_B,
    virtual_stages: Annotated[int, typer.Option(help="Model chunks per pipeline rank (interleaved schedule).")] = 1,
    recompute: Annotated[Recompute, typer.Option(help="Activation recomputation.")] = Recompute.NONE,
    zero: Annotated[int, typer.Option(help="ZeRO stage, 0 to 3.")] = 0,
    dtype: Annotated[Optional[DType], typer.Option(help="Training precision \\[default: fp32 on cpu, bf16 else, fp16 where a device lacks bf16].")] = None,
    compiled: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Stages under torch.compile (fewer, fused kernels) \\[default: on where every device is an NVIDIA or AMD GPU].", show_default=False)] = None,
    optimizer: Annotated[Optimizer, typer.Option(help="Optimizer whose state is held.")] = Optimizer.ADAMW,
    scatter_gather: Annotated[bool, typer.Option(help="Megatron's scatter/gather of pipeline sends over tensor-parallel ranks.")] = True,
    overlap_grad_reduce: Annotated[bool, typer.Option(help="Overlap the gradient all-reduce with the last backward.")] = False,
    kernel_efficiency: Annotated[Optional[float], typer.Option(help=f"Fraction of microbenchmark rates training kernels reach (docs/cost-model.md); default: a measured --profile's own, else {TRAINING_KERNEL_EFFICIENCY}.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON to stdout.")] = False,
    model_arg: Annotated[Optional[list[str]], typer.Option("--model-arg", "-a", help="key=value passed to build_model(); repeatable.")] = None,
    hf: Annotated[Optional[str], typer.Option("--hf", help="Instead of MODEL_FILE: a Hugging Face config.json, a checkpoint directory holding one, or an org/name in the local Hugging Face cache; the model is built from its config (nothing is downloaded).", show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="With --hf: tokens per sequence \\[default: 2048].", show_default=False)] = None,
    profile: Annotated[Optional[list[Path]], typer.Option("--profile", help="Device profile from hetpar profile; replaces the built-in profile of that device type. Repeatable.")] = None,
    leaf_module: Annotated[Optional[list[str]], typer.Option(help="Module path to keep opaque when tracing; repeatable.")] = None,
) -> None:
    """Predict step time, memory per stage and throughput of one configuration of MODEL_FILE."""
    model_file, model_args = model_source(model_file, hf, seq_len, model_arg)
    the_cluster = parse_cluster(cluster, profiles=profiles_option(profile))
    config = EstimateConfig(
        global_batch_size=global_batch, dp=dp, tp=tp, pp=pp, micro_batch_size=micro_batch_size, ep=ep, expert_imbalance=expert_imbalance,
        cp=cp, sequence_parallel=sp, offload=offload, dtype=dtype.value if dtype else default_dtype(the_cluster.device_types()),
        schedule=schedule.value, virtual_stages=virtual_stages, recompute=recompute.value, zero_stage=zero,
        optimizer=optimizer.value, stage_layers=_layer_counts(stage_layers), stage_devices=_names(stage_devices),
        scatter_gather=scatter_gather, overlap_grad_reduce=overlap_grad_reduce, kernel_efficiency=kernel_efficiency,
    )
    from hetpar.planner import compiled_graph, traced_model

    with console.status("tracing the model on the meta device"):
        graph = traced_model(model_file, model_args, tuple(leaf_module or ())).graph
    if default_compiled(the_cluster.device_types()) if compiled is None else compiled:
        graph = compiled_graph(graph)
    result = estimate_plan(graph, the_cluster, config)
    print_summary(result, [layer.name for layer in graph.layers])
    if as_json:
        print_json(result.to_dict())


def _layer_counts(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise EstimateError(f"--stage-layers {text!r} is not a comma-separated list of layer counts, e.g. 7,9,9,9") from None


def _names(text: Optional[str]) -> Optional[tuple[str, ...]]:
    return None if text is None else tuple(part.strip() for part in text.split(","))


def print_summary(result: Estimate, layer_names: list[str]) -> None:
    """The estimate as a rich table and a few lines on stderr."""
    c = result.config
    table = Table(title=f"hetpar estimate on {result.cluster_spec}", title_justify="left")
    for column in ("stage", "layers", "device", "ranks", "fwd / bwd", "state", "activations", "total / device", "fits"):
        table.add_column(column)
    for s in result.stages:
        layers = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in s.chunks)
        m = s.memory
        table.add_row(
            str(s.index), layers, s.device_type, rank_ranges(s.ranks), f"{seconds(s.fwd_s)} / {seconds(s.bwd_s)}",
            gib(m.weights_bytes + m.gradients_bytes + m.optimizer_bytes), gib(m.activations_bytes),
            f"{gib(m.total_bytes)} of {gib(s.capacity_bytes)}", "yes" if s.fits else "[bold red]no[/]",
        )
    console.print(table)
    console.print(f"layers: {', '.join(f'{i} {name}' for i, name in enumerate(layer_names))}" if len(layer_names) <= 8 else
                  f"layers: 0 {layer_names[0]} .. {len(layer_names) - 1} {layer_names[-1]}")
    console.print(f"layout: {result.layout}")
    sched = c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else "")
    console.print(f"dp={c.dp}{f' ep={c.ep}' if c.ep > 1 else ''} tp={c.tp} pp={c.pp}  micro-batch {c.micro_batch_size} x {c.num_microbatches}  schedule {sched}  "
                  f"recompute {c.recompute}  zero {c.zero_stage}{' offload' if c.offload else ''}  dtype {c.dtype}")
    t, p = result.time, result.predicted
    console.print(
        f"predicted step {seconds(p.step_time_s)}  ({p.throughput_samples_per_s:.1f} samples/s, "
        f"{result.tflops_per_device:.1f} TFLOP/s per device, MFU {result.mfu:.1%})"
    )
    console.print(
        f"  compute {seconds(t.compute_s)}, bubble {seconds(t.bubble_s)}, tp comm {seconds(t.tp_comm_s)}, "
        f"pp comm {seconds(t.pp_comm_s)}, dp comm {seconds(t.dp_comm_s)}, optimizer {seconds(t.optimizer_s)}"
        + (f", all-to-all {seconds(t.ep_comm_s)}" if t.ep_comm_s else "")
        + (f", context exchange {seconds(t.cp_comm_s)}" if t.cp_comm_s else "")
        + (f", host link {seconds(t.host_comm_s)}" if t.host_comm_s else "")
    )
    if not result.fits:
        console.print(f"[bold red]does not fit:[/] {result.misfit()}")
