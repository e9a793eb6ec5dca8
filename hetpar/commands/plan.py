"""``hetpar plan``: trace a model, cost it on a cluster, search, write the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetpar.cost_models.cluster import parse_cluster
from hetpar.cost_models.devices import get_device
from hetpar.commands.common import profiles_option
from hetpar.commands.common import console, model_label, model_source, default_compiled, default_dtype, domain_errors, fail, gib, print_json, rank_ranges, seconds
from hetpar.planner import ParallelPlan, SearchOptions, default_split, proof_scope
from hetpar.vocabulary import AggregationKind, CompressionKind, DType, ObjectiveKind, Recompute, Schedule, SplitSolver, Switch, SyncScope


@domain_errors
def plan(
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster shorthand like 2x8xA100-80GB+1x8xV100-32GB, or a TOML file.")],
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="Samples per optimizer step, over the whole cluster.")],
    model_file: Annotated[Optional[Path], typer.Argument(help="Python file defining build_model() and example_inputs() (or --hf instead).", show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write the plan \\[default: plan.json, or nowhere with --json].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON to stdout.")] = False,
    model_arg: Annotated[Optional[list[str]], typer.Option("--model-arg", "-a", help="key=value passed to build_model(); repeatable.")] = None,
    hf: Annotated[Optional[str], typer.Option("--hf", help="Instead of MODEL_FILE: a Hugging Face config.json, a checkpoint directory holding one, or an org/name in the local Hugging Face cache; the model is built from its config (nothing is downloaded).", show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="With --hf: tokens per sequence \\[default: 2048].", show_default=False)] = None,
    profile: Annotated[Optional[list[Path]], typer.Option("--profile", help="Device profile from hetpar profile; replaces the built-in profile of that device type. Repeatable.")] = None,
    dp: Annotated[Optional[int], typer.Option(help="Pin the data-parallel degree.")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Pin the tensor-parallel degree.")] = None,
    pp: Annotated[Optional[int], typer.Option(help="Pin the number of pipeline stages.")] = None,
    expert_imbalance: Annotated[float, typer.Option(help="Under expert parallelism, the busiest rank receives this many times the uniform share of routed tokens (1: uniform routing; a program's metrics report its own as expert_imbalance).")] = 1.0,
    cp: Annotated[Optional[int], typer.Option(help="Pin context parallelism: every sequence split over this many ranks (an early and a late chunk each), keys and values all-gathered for attention \\[default: searched among powers of two up to --max-cp that divide the replicas and cut the sequence into 2 cp chunks; 1 for a model without token inputs and attention].", show_default=False)] = None,
    max_cp: Annotated[int, typer.Option(help="Largest context-parallel degree the search offers.")] = 16,
    sp: Annotated[Switch, typer.Option("--sp", help="Sequence parallelism inside each stage's tensor-parallel group (norms, dropout and residuals on 1/tp of the sequence): auto: on every stage with tp > 1 whose sequence divides by tp under recompute (it holds 1/tp of the activations and moves the same bytes), searched per stage without recompute (one more all-gather per colwise input in backward); on: on every such stage (a model it cannot split is refused); off: never.")] = Switch.AUTO,
    offload: Annotated[Switch, typer.Option("--offload", help="Keep a ZeRO-3 stage's shard (weights, gradients, optimizer state) in host memory and step it on the CPUs (FSDP2's CPU offload): auto: searched per stage only when no plan fits without it; on: on every stage (needs schedule 1f1b or gpipe; at dp 1 too, one GPU with its state in host memory); off: never. Only devices whose profile states their host link and host memory bandwidth offload (A100, H100, H200, GH200, V100); CPU workers never.")] = Switch.AUTO,
    ep: Annotated[Optional[int], typer.Option(help="Pin expert parallelism: each stage's experts split over this many data-parallel replicas, tokens exchanged by all-to-all \\[default: searched among the divisors of the experts per layer that divide dp; 1 for a model without experts].", show_default=False)] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option(help="Pin the micro-batch size.")] = None,
    schedule: Annotated[Optional[Schedule], typer.Option(help="Pin the pipeline schedule (zb is ZB-H1) \\[default: 1f1b, zb and interleaved are searched; gpipe only when pinned].")] = None,
    virtual_stages: Annotated[Optional[int], typer.Option(help="Pin model chunks per pipeline rank; > 1 means --schedule interleaved (tp 1, pp * N <= layers) \\[default: 2..4 searched].")] = None,
    recompute: Annotated[Optional[Recompute], typer.Option(help="Pin activation recomputation of every stage \\[default: none or full, chosen per stage].")] = None,
    zero: Annotated[Optional[int], typer.Option(help="Pin the ZeRO stage (0-3) of every stage; > 0 needs dp > 1 (at dp 1, 3 with --offload on) and schedule 1f1b or gpipe \\[default: 0, 2 or 3 per stage].")] = None,
    stage_layers: Annotated[Optional[str], typer.Option(help="Pin layers per stage, e.g. 7,9,9,9 (see hetpar trace for the layers), or auto: the search's best split under the other pins \\[default: with --pp, Megatron's split (blocks evenly, embedding with the first stage, head with the last); else searched].")] = None,
    stage_devices: Annotated[Optional[str], typer.Option(help="Pin the device type of each stage, e.g. A100-80GB,A100-80GB,V100-32GB.")] = None,
    dtype: Annotated[Optional[DType], typer.Option(help="Training precision the costs assume \\[default: fp32 on cpu, bf16 else].")] = None,
    compiled: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Plan for stages under torch.compile (fewer, fused kernels) \\[default: on where every device is an NVIDIA or AMD GPU].", show_default=False)] = None,
    max_tp: Annotated[int, typer.Option(help="Largest tensor-parallel degree to consider.")] = 8,
    work_limit: Annotated[float, typer.Option(help="CP-SAT work limit per interleaved candidate (the others are solved exactly by dynamic programming), in deterministic seconds (about one second of one core, the same on every machine): the plan does not depend on the machine's speed or load.")] = 10.0,
    split_solver: Annotated[SplitSolver, typer.Option(help="How each candidate's layer split is solved: auto, exactly by dynamic programming where every pipeline rank holds one chunk and by CP-SAT where the schedule interleaves; cp-sat, every candidate by CP-SAT (the search before the programme, for comparison).")] = SplitSolver.AUTO,
    time_limit: Annotated[Optional[float], typer.Option(help="Wall-clock safety net per candidate, seconds; a candidate it stops makes the plan depend on the machine (the status says so) \\[default: none].", show_default=False)] = None,
    leaf_module: Annotated[Optional[list[str]], typer.Option(help="Module path to keep opaque when tracing; repeatable.")] = None,
    objective: Annotated[ObjectiveKind, typer.Option(help="time: the fastest plan on all devices; cost: the fewest dollars per step over sub-clusters; energy: the fewest joules per step over sub-clusters (grams of CO2 reported where the cluster file gives carbon_g_per_kwh).")] = ObjectiveKind.TIME,
    price: Annotated[Optional[list[str]], typer.Option(help="TYPE=USD: price of one device of TYPE per hour, for --objective cost; repeatable (overrides the cluster file's).")] = None,
    min_throughput: Annotated[float, typer.Option(help="Throughput target in samples/s the plan must reach.")] = 0.0,
    hetero_dp: Annotated[Switch, typer.Option(help="Data-parallel replicas on different device types (mixed clusters): auto keeps the faster plan, on forces it, off never.")] = Switch.AUTO,
    grad_compression: Annotated[Optional[str], typer.Option(help="Pin how data-parallel gradients travel: none|bf16|fp16|powersgd:R|topk:F|sign (lossy but none; docs/running.md) \\[default: none, or the search's choice with --allow-lossy-sync].", show_default=False)] = None,
    allow_lossy_sync: Annotated[bool, typer.Option(help="Let the search pick a lossy gradient compression (bf16, powersgd:4, topk:0.01, sign) where it is predicted at least 2% faster.")] = False,
    aggregation: Annotated[str, typer.Option(help="How replicas' gradients combine: mean|trimmed-mean:B|median|krum:F (robust to F bad replicas; gathers every gradient).")] = AggregationKind.MEAN,
    sync_every: Annotated[int, typer.Option(help="Local SGD: replicas step alone and average parameters and optimizer state every K steps (1: plain data parallelism).")] = 1,
    sync_scope: Annotated[str, typer.Option(help="With --sync-every K: all (every replica waits K steps), or node (gradients all-reduced inside a node every step, across nodes every K).")] = SyncScope.ALL,
    rebalance_every: Annotated[int, typer.Option(help="Move samples between replicas every N steps by their measured speed (one pipeline stage; 0: never).")] = 0,
    resume_from: Annotated[Optional[Path], typer.Option(help="Checkpoint directory of a run to continue on this cluster (a program's --checkpoint-dir, any plan of this model): checks it holds this model's checkpoints and says which step the new plan's program continues from.")] = None,
) -> None:
    """Find the fastest parallel plan for MODEL_FILE (or --hf) on a cluster (or the cheapest, on part of it) and write it as JSON."""
    model_file, model_args = model_source(model_file, hf, seq_len, model_arg)
    the_cluster = parse_cluster(cluster, profiles=profiles_option(profile))
    options = SearchOptions(
        global_batch_size=global_batch,
        dtype=(dtype.value if dtype else default_dtype(the_cluster.device_types())),
        dp=dp, tp=tp, pp=pp, ep=ep, expert_imbalance=expert_imbalance, cp=cp, max_cp=max_cp, sequence_parallel=sp.value,
        offload=offload.value,
        micro_batch_size=micro_batch_size,
        schedule=schedule.value if schedule else None,
        recompute=recompute.value if recompute else None,
        virtual_stages=virtual_stages, zero=zero,
        stage_layers=None if stage_layers == "auto" else _int_list("--stage-layers", stage_layers),
        megatron_split=pp is not None and stage_layers is None,
        stage_devices=tuple(get_device(name.strip()).name for name in stage_devices.split(",")) if stage_devices else None,
        max_tp=max_tp,
        work_limit_s=work_limit,
        split_solver=split_solver.value,
        time_limit_s=time_limit,
        compiled=default_compiled(the_cluster.device_types()) if compiled is None else compiled,
    )
    resume = None
    if resume_from:
        from hetpar.planner.resume import find_resume_point  # here: torch.distributed.checkpoint takes a second to import

        resume = find_resume_point(model_file, model_args, resume_from)
    from hetpar.planner import DataParallelSync, Objective, plan_model, resolve_prices  # torch, the solver: past the checks

    notes: list[str] = []
    traced: list = []
    status = console.status("tracing the model on the meta device")
    status.start()
    with Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=None, visible=False)
        result = plan_model(
            model_file, the_cluster, options,
            model_args=model_args,
            leaf_modules=tuple(leaf_module or ()),
            objective=Objective(kind=objective.value, usd_per_device_hour=_prices(price or []),
                                min_throughput_samples_per_s=min_throughput),
            hetero_dp=hetero_dp.value,
            sync=DataParallelSync(grad_compression=grad_compression, aggregation=aggregation, sync_every=sync_every,
                                  sync_scope=sync_scope, rebalance_every=rebalance_every, allow_lossy=allow_lossy_sync),
            on_traced=lambda graph: (traced.append(graph), status.stop(), bar.update(task, visible=True),
                                     notes.extend(measured_layers_notes(graph, the_cluster))),
            progress=lambda done, total, what: bar.update(task, completed=done, total=total, description=what),
        )
    status.stop()
    for note in notes:
        console.print(note)
    if output is None and not as_json:
        output = Path("plan.json")
    if output is not None:
        if output.is_dir():
            fail(f"--output {str(output)!r} is a directory; give a file name such as plan.json")
        result.save(output)
    print_summary(result, output, resolve_prices(the_cluster, _prices(price or [])) if objective is ObjectiveKind.COST else None)
    layout = stage_layout_note(result, traced[0], options, stage_layers) if traced else None
    if layout:
        console.print(layout)
    if resume is not None:  # see docs/running.md, "Re-planning for another cluster"
        console.print(f"hetpar: {resume.describe(resume_from, global_batch)}", soft_wrap=True)
    if as_json:
        print_json(__import__("json").loads(result.to_json()))


def sync_description(plan: ParallelPlan) -> str:
    """How the plan's replicas agree, and what the choice saves per step against the other
    compressions planned (its ``alternatives``)."""
    parts = []
    if plan.sync_every > 1:
        scope = ", gradients all-reduced inside each node every step" if plan.sync_scope == SyncScope.NODE else ""
        parts.append(f"local SGD, parameters and optimizer state averaged every {plan.sync_every} steps{scope}")
    elif plan.aggregation != AggregationKind.MEAN:
        parts.append(f"robust aggregation {plan.aggregation} of the gathered gradients")
    elif plan.grad_compression != CompressionKind.NONE:
        parts.append(f"gradients compressed {plan.grad_compression} (lossy)")
    else:
        parts.append("exact all-reduce of the gradients")
    if plan.rebalance_every:
        parts.append(f"replica shares moved by measured speed every {plan.rebalance_every} steps")
    parts.append(f"dp comm {seconds(plan.predicted.dp_comm_time_s)} per step")
    for other in (a for a in plan.alternatives if a.get("grad_compression", plan.grad_compression) != plan.grad_compression):
        saved = other["step_time_s"] - plan.predicted.step_time_s
        parts.append(f"{'saves' if saved >= 0 else 'costs'} {seconds(abs(saved))} per step against {other['grad_compression']}")
    return "; ".join(parts)


def stage_layout_note(plan: ParallelPlan, graph, options: SearchOptions, stage_layers: Optional[str]) -> Optional[str]:
    """Which rule split the layers over the stages, when the user pinned the pipeline ([Note: default stage split])."""
    if stage_layers == "auto":
        return "stage layout: the search's best split under the pins (--stage-layers auto)"
    if options.stage_layers is not None:
        return "stage layout: --stage-layers"
    if options.megatron_split and plan.replica_batch_shares is None:
        chunks = plan.pipeline_parallel * plan.virtual_stages
        return f"stage layout: {default_split(graph.layers, chunks).layout} (--stage-layers auto searches the split)"
    return None


def measured_layers_notes(graph, cluster) -> list[str]:
    """One line per measured profile with timed layers: how many of this model's layers it
    times ([Note: measured layers] in cost_models/compute.py); the others keep the layer model."""
    notes = []
    for name in cluster.count_by_type():
        timed = cluster.profile(name).layer_corrections
        if timed:
            hits = sum(layer.cost_key in timed for layer in graph.layers)
            notes.append(f"{name} profile: measured times for {hits} of this model's {len(graph.layers)} layers"
                         + (" (used at tensor-parallel degree 1)" if hits else " (profile it with --model to use them)"))
    return notes


def _prices(items: list[str]) -> dict[str, float]:
    prices = {}
    for item in items:
        name, _, usd = item.partition("=")
        try:
            value = float(usd)
        except ValueError:
            fail(f"--price {item!r} is not TYPE=USD, e.g. --price A100-80GB=2.5 (US dollars per device-hour)")
        prices[get_device(name.strip()).name] = value
    return prices


def _int_list(flag: str, text: Optional[str]) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        fail(f"{flag} {text!r} is not a comma-separated list of integers, e.g. 7,9,9,9")


def print_summary(plan: ParallelPlan, output: Optional[Path], prices: Optional[dict[str, float]] = None) -> None:
    """The plan as a rich table on stderr."""
    names = plan.model.layer_names
    table = Table(title=f"hetpar plan: {model_label(plan)} on {plan.cluster.spec}", title_justify="left")
    for column in ("stage", "layers", "device", "tp", "ranks", "recompute", "zero", "memory/device"):
        table.add_column(column)
    for s in plan.stages:
        layers = names[s.layers[0]] if len(s.layers) == 1 else f"{names[s.layers[0]]} .. {names[s.layers[-1]]} ({len(s.layers)})"
        ranks = rank_ranges(s.ranks)
        memory = plan.predicted.peak_memory_bytes[s.index % plan.pipeline_parallel]
        table.add_row(str(s.index), layers, plan.stage_device_label(s), f"{s.degree_label}{' sp' if s.sequence_parallel else ''}", ranks, s.recompute, f"{s.zero_stage}{' offload' if s.offload else ''}", gib(memory))
    console.print(table)
    p = plan.predicted
    console.print(
        f"dp={plan.data_parallel}{f' ep={plan.stages[0].expert_parallel}' if plan.stages[0].expert_parallel > 1 else ''}"
        f"{f' cp={plan.context_parallel}' if plan.context_parallel > 1 else ''} "
        f"tp={plan.stages[0].degree_label}{' sp' if any(s.sequence_parallel for s in plan.stages) else ''} pp={plan.pipeline_parallel}  "
        f"micro-batch {plan.micro_batch_size} x {plan.num_microbatches}  schedule {plan.schedule.value}"
        f"{f' v={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}  dtype {plan.dtype}{'  compiled' if plan.compiled else ''}"
    )
    console.print(
        f"predicted step {seconds(p.step_time_s)}  ({p.throughput_samples_per_s:.1f} samples/s; "
        f"bubble {seconds(p.bubble_time_s)}, dp comm {seconds(p.dp_comm_time_s)}, tp comm {seconds(p.tp_comm_time_s)}"
        f"{f', all-to-all {seconds(p.ep_comm_time_s)}' if p.ep_comm_time_s else ''}"
        f"{f', context exchange {seconds(p.cp_comm_time_s)}' if p.cp_comm_time_s else ''}"
        f"{f', host link {seconds(p.host_comm_time_s)}' if p.host_comm_time_s else ''})"
    )
    if prices:
        from hetpar.planner import usd_per_step  # the strategies import the solver

        console.print(f"cost: ${usd_per_step(plan, prices):.4g} per step on {plan.cluster.world_size} devices ({plan.cluster.spec})")
    if p.energy_j_per_step is not None:
        co2 = f"; {p.co2_g_per_step:.4g} g CO2" if p.co2_g_per_step is not None else ""
        console.print(f"energy: {p.energy_j_per_step:.4g} J per step ({p.energy_j_per_step / p.step_time_s:.4g} W on "
                      f"{plan.cluster.world_size} devices, {plan.cluster.spec}){co2}")
    if plan.replica_batch_shares is not None:
        console.print(f"heterogeneous data parallelism: micro-batch size per replica {plan.replica_batch_shares}")
    if plan.data_parallel > 1:
        console.print(f"data-parallel sync: {sync_description(plan)}")
    info = plan.solver
    status = f"{info.status}: {info.reason}" if info.reason else info.status
    trace = "trace cached" if info.trace_cached else "trace"
    console.print(f"solver: {status} over {info.candidates} candidates; {trace} {info.trace_time_s:.2f} s, search {info.search_time_s:.2f} s")
    bound = proof_scope(plan)
    if bound:
        console.print(bound)
    if output is not None:
        console.print(f"wrote {output}")
