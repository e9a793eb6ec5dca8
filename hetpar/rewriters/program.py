"""The text of ``train.py``: one file that reads like nanoGPT's ``train.py``.

Top to bottom: a docstring with the ``torchrun`` line and the stage table; the plan's
numbers as constants, each commented with the plan field it comes from; rank setup;
the model shard; the schedule (plans with a pipeline); checkpoints; the training loop.
A program holds only what its plan uses ([Note: what a program holds]). Every value
from the plan is written with ``repr`` after ``plan_text.check_plan_text`` has checked
it ([Note: plan text] in rewriters/plan_text.py).

[Note: what a program holds]
Each feature's code appears only where the plan asks for it:

| code | when |
|---|---|
| ``data_parallel.wrap``, ``grad_sync.reduce()`` | ``data_parallel`` > 1, or a stage offloads |
| compression, robust aggregation options | ``grad_compression`` != none, ``aggregation`` != mean |
| ``grad_sync.after_step`` (local SGD) | ``sync_every`` > 1 |
| ``tied.TiedGradients`` | a weight held by two stages (``tied``, found by ``hetpar compile``) |
| ``rebalance.ReplicaShares`` | ``rebalance_every`` > 0 |
| ``precision.LossScaler`` | dtype fp16 |
| ``precision.allow_tf32`` | dtype tf32 |
| ``torch.autocast`` | dtype bf16 or fp16 |
| ``shard.apply_tensor_parallel`` | a stage with ``tensor_parallel`` > 1 |
| ``sequence_parallel=`` of a stage and of ``shard.cut_stage`` | a stage with ``sequence_parallel`` |
| ``experts.apply_expert_parallel``, ``expert_parallel=`` of a stage, the ``ep`` column | a stage with ``expert_parallel`` > 1 |
| ``CONTEXT_PARALLEL``, ``cp_mesh=``, ``context.split_batches``, ``me.data_replica`` | ``context_parallel`` > 1 |
| the schedule and ``executor`` | more than one stage |
| model chunks (``chunk_ids``) | ``virtual_stages`` > 1 |

A plan of one stage (no pipeline) runs its micro-batches in a plain loop, forward,
loss and backward in view, in the order of the executor under any schedule of one
stage (forward and backward of micro-batch 0, then of 1, ...): the same gradients,
summed in the same order, so training is unchanged.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from pathlib import Path

from hetpar.planner.plan import ParallelPlan, StagePlan
from hetpar.rewriters.launchers import PROGRAM, node_layout
from hetpar.rewriters.plan_text import plan_dtype
from hetpar.vocabulary import AggregationKind, CompressionKind, DType, Sharding, SyncScope

_TORCH_DTYPES = {DType.FP32: "torch.float32", DType.TF32: "torch.float32", DType.BF16: "torch.bfloat16",
                 DType.FP16: "torch.float16"}
RULE = "# " + "-" * 77


@dataclass(frozen=True)
class Features:
    """What of the runtime a plan's program uses; see [Note: what a program holds]."""

    pipelined: bool  # more than one stage: a schedule and executors
    chunked: bool  # virtual_stages > 1: several stages (chunks) per rank
    data_parallel: bool
    compression: bool
    robust: bool
    local_sgd: bool
    node_scope: bool  # local SGD with gradients all-reduced inside each node every step
    powersgd: bool
    tensor_parallel: bool
    expert_parallel: bool  # some stage splits its experts over replicas: runtime.experts
    context_parallel: bool  # every sequence split over cp ranks: runtime.context
    sequence_parallel: bool  # some stage runs its residual stream on 1/tp of the sequence: runtime.sequence
    vocab_loss: bool  # a head split over the vocabulary: the loss runs under loss_parallel
    tied: bool
    rebalance: bool
    weighted: bool  # replicas' micro-batch sizes differ: each replica's loss is weighted
    mixed_degrees: bool  # a stage's replicas differ in tensor-parallel degree (runtime/mixed_sync.py)
    autocast: bool
    fp16: bool
    tf32: bool = False

    @classmethod
    def of(cls, plan: ParallelPlan, tied: bool) -> Features:
        dtype = plan_dtype(plan)
        shares = plan.replica_batch_shares
        return cls(
            pipelined=len(plan.stages) > 1,
            chunked=plan.virtual_stages > 1,
            data_parallel=plan.data_parallel * plan.context_parallel > 1 or any(s.offload for s in plan.stages),
            compression=plan.grad_compression != CompressionKind.NONE,
            robust=plan.aggregation != AggregationKind.MEAN,
            local_sgd=plan.sync_every > 1,
            node_scope=plan.sync_every > 1 and plan.sync_scope == SyncScope.NODE,
            powersgd=plan.grad_compression.startswith(CompressionKind.POWERSGD.value),
            tensor_parallel=any(max(s.replica_degrees) > 1 for s in plan.stages),
            expert_parallel=any(s.expert_parallel > 1 for s in plan.stages),
            context_parallel=plan.context_parallel > 1,
            sequence_parallel=any(s.sequence_parallel for s in plan.stages),
            vocab_loss=any(max(s.replica_degrees) > 1 and Sharding.VOCAB_HEAD.value in {getattr(k, "value", k) for k in
                                                                                 s.tp_sharding.values()}
                           for s in plan.stages),
            tied=tied,
            rebalance=plan.rebalance_every > 0,
            weighted=shares is not None and len(set(shares)) > 1,
            mixed_degrees=any(s.mixed_degrees for s in plan.stages),
            autocast=dtype not in (DType.FP32, DType.TF32),
            fp16=dtype == DType.FP16,
            tf32=dtype == DType.TF32,
        )


# ----------------------------------------------------------------------------- docstring


def torchrun_line(plan: ParallelPlan) -> str:
    """The command that runs the program on one host."""
    return f"torchrun --nproc_per_node={plan.cluster.world_size} {PROGRAM}"


def _layer_summary(plan: ParallelPlan, stage: StagePlan) -> str:
    names = [plan.model.layer_names[i] for i in stage.layers]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    span = f"{stage.layers[0]}" if len(stage.layers) == 1 else f"{stage.layers[0]}-{stage.layers[-1]}"
    return f"{span}: {shown}"


def stage_table(plan: ParallelPlan) -> str:
    """The stage -> layers -> ranks -> device type -> tp table of the docstring (and ep,
    where a stage splits its experts)."""
    ep = any(s.expert_parallel > 1 for s in plan.stages)
    header = ("stage", "layers", "ranks[d][t]", "device", "tp", *(("ep",) if ep else ()))
    rows = [
        (str(s.index), _layer_summary(plan, s), str(s.ranks), plan.stage_device_label(s), s.degree_label,
         *((str(s.expert_parallel),) if ep else ()))
        for s in plan.stages
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _docstring(plan: ParallelPlan, model_name: str, f: Features) -> str:
    nodes, per_node = node_layout(plan)
    multi = f"\nOn {nodes} hosts of {per_node} processes, run ./launch.sh on each (see its header).\n" if nodes > 1 else ""
    table = "\n".join(("    " + line).rstrip() for line in stage_table(plan).splitlines())
    shape = f"dp {plan.data_parallel}{f' x cp {plan.context_parallel}' if f.context_parallel else ''} x pp " \
            f"{plan.pipeline_parallel}"
    schedule = f", schedule {plan.schedule.value}" if f.pipelined else ""
    return f'''"""Train {model_name} on {plan.cluster.world_size} processes, as hetpar planned it.

    {torchrun_line(plan)} --steps 10
{multi}
Options (steps, lr, optimizer, seed, init/save, metrics, checkpoints): python {PROGRAM} --help.
Plan: cluster {plan.cluster.spec}, {shape}{schedule}, predicted {plan.predicted.step_time_s:.4g} s/step.

{table}

Generated by `hetpar compile`; change the plan and compile again rather than this file.
"""'''


def _imports(f: Features) -> str:
    modules = ["checkpoint", "cli", "data", "devices", "distributed", "hf_checkpoint", "materialize", "shard", "timing",
               "training"]
    modules += [name for name, used in (("context", f.context_parallel),
                                        ("data_parallel", f.data_parallel), ("executor", f.pipelined),
                                        ("experts", f.expert_parallel),
                                        ("precision", f.fp16 or f.tf32), ("rebalance", f.rebalance),
                                        ("schedule", f.pipelined), ("tied", f.tied)) if used]
    names = ", ".join(sorted(modules))
    lines = ["from dataclasses import replace"] if f.chunked else []
    lines += ["from pathlib import Path", "", "import torch"]
    if f.vocab_loss and not f.pipelined:
        lines.append("from torch.distributed.tensor.parallel import loss_parallel")
    lines += ["", _wrapped(f"from hetpar.runtime import ({names})", indent=" " * len("from hetpar.runtime import (")),
              "from hetpar.runtime.distributed import StageSpec", "from hetpar.runtime.model_file import load_model_file"]
    return "\n".join(lines)


def _wrapped(text: str, indent: str, width: int = 116) -> str:
    """``text`` broken after commas so that no line exceeds ``width``."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


# ----------------------------------------------------------------------------- the plan


def _rank_list_source(values: list[str]) -> str:
    """A per-rank list as runs, ``['A100-80GB'] * 8 + ['V100-32GB'] * 8``, short for any world size."""
    runs: list[list] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return " + ".join(f"[{value!r}] * {count!r}" for value, count in runs) or "[]"


def _stage_spec_source(plan: ParallelPlan, stage: StagePlan) -> str:
    first, last = stage.layers[0], stage.layers[-1]
    names = plan.model.layer_names
    lines = [
        "    StageSpec(",
        f"        layers=({first!r}, {last!r}),  # {names[first]} .. {names[last]}",
        f"        device_type={stage.device_type!r}, tensor_parallel={stage.tensor_parallel!r}, "
        f"zero_stage={stage.zero_stage!r}, recompute={getattr(stage.recompute, 'value', stage.recompute)!r},",
        f"        ranks={stage.ranks!r},",
    ]
    if stage.expert_parallel > 1:  # [Note: expert parallelism] in hetpar/runtime/experts.py
        lines.append(f"        expert_parallel={stage.expert_parallel!r},  # experts split over runs of this many "
                     f"replicas")
    if stage.sequence_parallel:  # [Note: sequence parallelism] in hetpar/runtime/sequence.py
        lines.append(f"        sequence_parallel={stage.sequence_parallel!r},  # norms and residuals on 1/tp of the "
                     f"sequence")
    if stage.offload:  # [Note: offload through FSDP2] in hetpar/runtime/data_parallel.py
        lines.append(f"        offload={stage.offload!r},  # the ZeRO-3 shard in host memory, stepped by the CPUs")
    if stage.context_parallel > 1:  # [Note: context parallelism] in hetpar/runtime/context.py
        lines.append(f"        context_parallel={stage.context_parallel!r},  # each sequence split over runs of this "
                     f"many replicas")
    if stage.tp_sharding:
        lines.append("        tp_sharding={")
        lines += [f"            {path!r}: {getattr(kind, 'value', kind)!r}," for path, kind in stage.tp_sharding.items()]
        lines.append("        },")
    if stage.tp_parts:  # fused projections split part by part: [Note: part-laid Linears] in hetpar/runtime/parts.py
        lines.append("        tp_parts={")
        lines += [f"            {path!r}: {list(parts)!r}," for path, parts in stage.tp_parts.items()]
        lines.append("        },")
    lines.append("    ),")
    return "\n".join(lines)


def _positive(value: object) -> float:
    """A plan's number as a finite float literal: itself when finite and positive, else 0.0."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0


def _constants(plan: ParallelPlan, model_name: str, f: Features) -> str:
    lines = [
        RULE,
        "# the plan",
        f"MODEL_FILE = {model_name!r}  # plan.model.file, copied next to this program",
        f"MODEL_ARGS = {dict(plan.model.args)!r}  # plan.model.args",
        f"LAYER_NAMES = {list(plan.model.layer_names)!r}  # plan.model.layer_names",
        f"LEAF_MODULES = {tuple(plan.model.leaf_modules)!r}  # plan.model.leaf_modules: modules traced as opaque calls",
        f"WORLD_SIZE = {plan.cluster.world_size!r}  # plan.cluster.world_size",
        f"DEVICE_TYPES = {_rank_list_source(plan.cluster.device_types)}  # plan.cluster.device_types: of each global rank",
        f"DATA_PARALLEL = {plan.data_parallel!r}  # plan.data_parallel",
        *([f"CONTEXT_PARALLEL = {plan.context_parallel!r}  # plan.stages[*].context_parallel: each sequence split "
           f"over this many ranks of a replica"] if f.context_parallel else []),
        f"MICRO_BATCH_SIZE = {plan.micro_batch_size!r}  # plan.micro_batch_size",
        f"REPLICA_MICRO_BATCH_SIZES = {plan.replica_micro_batch_sizes!r}  # plan.replica_batch_shares: micro-batch "
        f"size of each replica",
        f"NUM_MICROBATCHES = {plan.num_microbatches!r}  # plan.num_microbatches",
        f"GLOBAL_BATCH_SIZE = {plan.global_batch_size!r}  # plan.global_batch_size = NUM_MICROBATCHES * "
        f"sum(REPLICA_MICRO_BATCH_SIZES)",
        f"MODEL_FLOPS_PER_STEP = {_positive(plan.predicted.model_flops_per_step)!r}  # plan.predicted: "
        f"the model's FLOPs of one step, for MFU (0: unknown)",
        f"PEAK_FLOPS_PER_S = {_positive(plan.predicted.peak_flops_per_s)!r}  # plan.predicted: the devices' summed "
        f"peak FLOP/s in the plan's dtype",
    ]
    if f.pipelined:
        lines += [f"SCHEDULE = {plan.schedule.value!r}  # plan.schedule",
                  f"PIPELINE_RANKS = {plan.pipeline_parallel!r}  # plan.pipeline_parallel"]
    if f.chunked:
        lines.append(f"VIRTUAL_STAGES = {plan.virtual_stages!r}  # plan.virtual_stages: stage s runs on the ranks of "
                     f"stage s % PIPELINE_RANKS")
    dtype = plan_dtype(plan)
    lines.append(f"DTYPE = {_TORCH_DTYPES[dtype]}  # plan.dtype {dtype.value!r}: "
                 + ("autocast compute dtype; parameters stay float32" if f.autocast else "float32 throughout"))
    if f.compression:
        lines.append(f"GRAD_COMPRESSION = {plan.grad_compression!r}  # plan.grad_compression (runtime.sync_spec)")
    if f.robust:
        lines.append(f"AGGREGATION = {plan.aggregation!r}  # plan.aggregation: robust rule (runtime.robust)")
    if f.local_sgd:
        lines.append(f"SYNC_EVERY = {plan.sync_every!r}  # plan.sync_every: local SGD, replicas averaged every "
                     f"SYNC_EVERY steps")
    if f.node_scope:
        lines.append(f"SYNC_SCOPE, NODE_RANKS = {plan.sync_scope!r}, {node_layout(plan)[1]!r}  # plan.sync_scope: "
                     f"gradients all-reduced every step inside each node of NODE_RANKS ranks")
    if f.rebalance:
        lines.append(f"REBALANCE_EVERY = {plan.rebalance_every!r}  # plan.rebalance_every: shares moved by "
                     f"measured speed")
    lines.append("PLAN_STAGES = [  # plan.stages: layers (first, last), ranks[d][t] = rank of replica d, tp index t")
    lines += [_stage_spec_source(plan, s) for s in plan.stages]
    lines.append("]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- rank setup and model shard


def _replica(f: Features) -> str:
    """The program's expression for this rank's data replica: its row, or under context
    parallelism the row // cp (``Placement.data_replica``)."""
    return "me.data_replica" if f.context_parallel else "me.replica"


def _rank_setup(plan: ParallelPlan, f: Features, replan: str) -> str:
    node_ranks = ", ranks_per_node=NODE_RANKS" if f.node_scope else ""
    lines = [
        RULE,
        "# rank setup: which stage, data-parallel replica and tp index this process is",
        f"args = cli.parse_args(__doc__{', powersgd=True' if f.powersgd else ''})",
        "cli.check_launch(WORLD_SIZE, __file__, replan=cli.Replan(  # torchrun started WORLD_SIZE processes? else how "
        "to go on",
        f"    model_file=MODEL_FILE, plan_options={replan!r}, device_types=DEVICE_TYPES, "
        "checkpoint_dir=args.checkpoint_dir))",
        "device = distributed.init_distributed(args.dist_timeout_s, accelerator=devices.needs_accelerator(DEVICE_TYPES))",
        "devices.check_device_types(DEVICE_TYPES, device, allow_mismatch=args.allow_device_mismatch)  # each rank on "
        "its type?",
        "me = distributed.locate(PLAN_STAGES, torch.distributed.get_rank())  # me.stage: the plan stage this rank runs",
        f"groups = distributed.build_groups(PLAN_STAGES, me, device{node_ranks})  # collective: all build all groups",
        "stage_plan = PLAN_STAGES[me.stage]  # this rank's row of the table above",
    ]
    if f.tf32:
        lines.append("precision.allow_tf32(device)  # plan.dtype 'tf32': float32 matmuls and convolutions on TF32 tensor "
                     "cores")
    if f.chunked:
        lines.append("chunk_ids = list(range(me.stage, len(PLAN_STAGES), PIPELINE_RANKS))  # the VIRTUAL_STAGES "
                     "stages (model chunks) this rank runs")
    return "\n".join(lines)


def _model_shard(plan: ParallelPlan, f: Features) -> str:
    lines = [
        RULE,
        "# the model shard: the whole model built on the meta device (no memory), cut to this rank's stage",
        "model_file = load_model_file(Path(__file__).with_name(MODEL_FILE), MODEL_ARGS)",
        "torch.manual_seed(args.seed)",
        "model, construction = materialize.build_on_meta(model_file.build_model)  # with the log of how it is built",
        "with cli.one_line_errors(data.DataError):  # --data or --eval-data that does not fit: one line, exit 2",
        "    if args.data:  # batches from a token file instead of the model file's: [Note: token data] in "
        "hetpar/runtime/data.py",
        "        model_file = data.token_model_file(model_file, model, args.data, dtype=args.data_dtype,",
        "                                           column=args.data_column, global_batch_size=GLOBAL_BATCH_SIZE)",
        "    held_out = training.HeldOut.of(args, model_file, model, GLOBAL_BATCH_SIZE, NUM_MICROBATCHES, device"
        f"{', (CONTEXT_PARALLEL, me.context_index)' if f.context_parallel else ''})  # --eval-data: [Note: held-out "
        "loss]",
        "if args.save_hf:  # refused now, not after training, for a model without a Hugging Face config",
        "    with cli.one_line_errors(hf_checkpoint.HFCheckpointError):",
        "        hf_checkpoint.check_savable(model)",
    ]
    recompute = "  # recompute: each layer under torch.utils.checkpoint"
    # tensor parallel: the stage's shape constants made local ([Note: local shape constants] in hetpar/runtime/parts.py)
    local = ",\n                       tensor_parallel={0}.degree(me.replica), tp_sharding={0}.tp_sharding" \
        if f.tensor_parallel else ""
    # context parallel: cut for the rank's share of each sequence ([Note: context parallelism] in hetpar/runtime/context.py)
    local += ", cp_mesh=groups.cp_mesh" if f.context_parallel else ""
    # sequence parallel: norms and residuals on 1/tp of the sequence ([Note: sequence parallelism] in hetpar/runtime/sequence.py)
    local += ",\n                       sequence_parallel={0}.sequence_parallel" if f.sequence_parallel else ""
    if f.chunked:
        lines += [
            f"chunks = {{{recompute}",
            f"    s: shard.cut_stage(model, model_file, REPLICA_MICRO_BATCH_SIZES[{_replica(f)}], PLAN_STAGES[s].layers,",
            "                       LAYER_NAMES, LEAF_MODULES, recompute=PLAN_STAGES[s].recompute"
            f"{local.format('PLAN_STAGES[s]')})",
            "    for s in chunk_ids",
            "}",
            "model_shard = shard.rank_module([chunks[s].module for s in chunk_ids])  # this rank's chunks as one module",
        ]
        stage_ids, modules = "chunk_ids", "[chunks[s].module for s in chunk_ids]"
    else:
        lines += [
            f"stage = shard.cut_stage(model, model_file, REPLICA_MICRO_BATCH_SIZES[{_replica(f)}], stage_plan.layers, "
            "LAYER_NAMES,",
            f"                        LEAF_MODULES, recompute=stage_plan.recompute{local.format('stage_plan')}){recompute}",
            "model_shard = stage.module  # this rank's part of the model: what it trains and checkpoints",
        ]
        stage_ids, modules = "[me.stage]", "[stage.module]"
    if f.tied:
        lines.append(f"tied_grads = tied.TiedGradients(model, model_shard, {stage_ids}, PLAN_STAGES, me, "
                     "announce=me.rank == 0)  # a weight two stages hold")
    if f.tensor_parallel:
        lines += [
            "",
            "# tensor parallel: shard the stage's Linears column- or row-wise over its tp ranks (on meta: nothing "
            "allocated yet)",
            *(["# (sequence_parallel: rowwise outputs reduce-scattered over the sequence, colwise inputs gathered)"]
              if f.sequence_parallel else []),
            "if stage_plan.degree(me.replica) > 1:  # this replica's degree (replicas may differ: "
            "runtime/mixed_sync.py)",
            "    shard.apply_tensor_parallel(model_shard, groups.tp_mesh, stage_plan.tp_sharding, stage_plan.tp_parts)",
        ]
    if f.expert_parallel:
        lines += [
            "",
            "# expert parallel: replica d keeps experts [(d % ep) E / ep, (d % ep + 1) E / ep) of each module of E "
            "experts;",
            "# tokens travel to their experts and back by all-to-all (on meta: nothing allocated yet)",
            "if stage_plan.expert_parallel > 1:",
            "    experts.apply_expert_parallel(model_shard, groups.ep_mesh)",
        ]
    lines += [
        "# this rank's tensors alone are made, as build_model() under --seed makes them, or read from --init-from",
        "with cli.one_line_errors(materialize.InitFromError):  # an --init-from that does not fit: one line, exit 2",
        "    materialize.materialize_stages(model, model_shard, construction, device, init_from=args.init_from,",
        "                                   keep_unused=me.rank == 0)",
        f"shard.compile_stages({modules}, device, args.compile, planned={plan.compiled!r}, "
        "announce=me.rank == 0)",
    ]
    lines += _data_parallel(plan, f)
    lines += ["optimizer = training.make_optimizer(args.optimizer, model_shard.parameters(), args.lr,",
              "                                    weight_decay=args.weight_decay)  # --weight-decay: on >= 2-D "
              "parameters only"]
    if f.fp16:
        lines.append("scaler = precision.LossScaler(enabled=True)  # fp16: dynamic loss scaling")
    return "\n".join(lines)


def _data_parallel(plan: ParallelPlan, f: Features) -> list[str]:
    if not f.data_parallel:
        announce = ("for s in chunk_ids:  # \"stage 0 (layers 0-1): tp 1, one replica, recompute none\"\n"
                    "    training.announce(replace(me, stage=s), PLAN_STAGES[s])" if f.chunked
                    else "training.announce(me, stage_plan)  # \"stage 0 (layers 0-1): tp 1, one replica, recompute none\"")
        return [announce]
    options = [name for name, used in (("compression=GRAD_COMPRESSION", f.compression),
                                       ("aggregation=AGGREGATION", f.robust),
                                       ("sync_every=SYNC_EVERY", f.local_sgd),
                                       ("sync_scope=SYNC_SCOPE", f.node_scope),
                                       ("powersgd_rank=args.powersgd_rank", f.powersgd),
                                       ("powersgd_start_step=args.powersgd_start_step", f.powersgd)) if used]
    how = "local SGD" if f.local_sgd else "robust aggregation" if f.robust else "compressed all-reduce" \
        if f.compression else "all-reduce"
    if any(s.zero_stage > 0 for s in plan.stages):
        how = f"ZeRO through FSDP2 where stage_plan.zero_stage > 0, else {how}"
    if any(s.offload for s in plan.stages):
        how = f"{how} (the shard in host memory where stage_plan.offload)"

    call = _wrapped(f"grad_sync = data_parallel.wrap({', '.join(['model_shard', 'stage_plan', 'groups', *options])})",
                    indent=" " * len("grad_sync = data_parallel.wrap("))
    lines = [f"# data parallel: {how} over the replicas", call]
    if f.expert_parallel:
        lines.insert(1, "# (gradients of split experts: over the replicas that hold the same experts, also / dp)")
    if f.chunked:
        lines += ["for s in chunk_ids:  # \"stage 0 (layers 0-1): tp 1, all-reduce over 2 replicas, recompute none\"",
                  "    training.announce(replace(me, stage=s), PLAN_STAGES[s], grad_sync)"]
    else:
        lines.append("training.announce(me, stage_plan, grad_sync)  # \"stage 0 (layers 0-1): tp 1, all-reduce over 2 "
                     "replicas, ...\"")
    return lines


# ----------------------------------------------------------------------------- schedule


def _schedule(f: Features) -> str:
    options = ["stage=chunks[s]" if f.chunked else "stage=stage",
               "peers=distributed.peers_of(PLAN_STAGES, replace(me, stage=s))" if f.chunked
               else "peers=distributed.peers_of(PLAN_STAGES, me)",
               "loss_fn=model_file.loss", "num_microbatches=NUM_MICROBATCHES", "device=device", "compute_dtype=DTYPE"]
    if f.weighted:
        options.append(f"loss_weight=shard.loss_weight(REPLICA_MICRO_BATCH_SIZES, {_replica(f)})")
    if f.fp16:
        options.append("loss_scaler=scaler")
    if f.data_parallel:
        options.append("before_backward=grad_sync.before_backward")
    options.append("index=s" if f.chunked else "index=me.stage")
    virtual = ", VIRTUAL_STAGES" if f.chunked else ""
    lines = [
        RULE,
        "# the schedule: this rank's actions, e.g. 0F0 0F1 0B0 0F2 0B1 ... (runtime/schedule.py)",
        f"actions = schedule.make_schedule(SCHEDULE, PIPELINE_RANKS, NUM_MICROBATCHES{virtual})[me.stage]",
    ]
    if f.chunked:
        body = _wrapped(", ".join(options) + ",", indent=" " * 8, width=112)
        lines += ["pipeline = {  # one executor per stage this rank runs; actions name their stage",
                  "    s: executor.StageExecutor(", f"        {body}", "    )", "    for s in chunk_ids", "}"]
    else:
        body = _wrapped(", ".join(options) + ",", indent=" " * 4, width=112)
        lines += ["pipeline = {me.stage: executor.StageExecutor(  # runs the actions: forwards, backwards, sends, "
                  "receives", f"    {body}", ")}"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- training loop


def _held_out_forward(f: Features) -> str:
    """The program's forwards of a held-out batch: ``executor.evaluate_actions`` or ``training.evaluate_stage``."""
    if f.pipelined:
        return "lambda batch: executor.evaluate_actions(pipeline, actions, batch, device)"
    weight = ", shares.loss_weight" if f.rebalance else ", loss_weight" if f.weighted else ""
    return f"lambda batch: training.evaluate_stage(stage, batch, model_file.loss, device, DTYPE{weight})"


def _loop(f: Features) -> str:
    scaler = ", scaler" if f.fp16 else ""
    last_stage = "PIPELINE_RANKS - 1" if f.pipelined else "0"
    clip_options = (", tied=tied_grads" if f.tied else "") + (", per_replica=True" if f.local_sgd else "")
    lines = [
        RULE,
        "learning_rate = training.LearningRate.of(args)  # --lr, --warmup-steps, --lr-decay, --decay-steps, --min-lr",
        "clipper = None  # --clip-grad-norm: gradients clipped to their global norm over every rank",
        "if args.clip_grad_norm:",
        f"    clipper = training.GradClipper(args.clip_grad_norm, model_shard, me, PLAN_STAGES{clip_options})",
        "checkpoints = checkpoint.Checkpointer.for_run(args, model, GLOBAL_BATCH_SIZE,  # --checkpoint-dir, of any "
        "plan of this model",
        "                                              loop=training.loop_record(args))  # a resume continues this "
        "loop",
        f"start_step = checkpoints.resume(model_shard, optimizer{scaler})  # the newest intact checkpoint's step, or 0",
        "",
        RULE,
        "# training loop: one optimizer step per global batch",
        "logger = training.StepLogger(enabled=me.rank == 0, total_steps=args.steps, "
        "global_batch_size=GLOBAL_BATCH_SIZE,",
        "                             metrics=args.metrics, start_step=start_step,",
        "                             tokens_per_sample=training.tokens_per_sample(model_file),  # T, for tokens/s",
        "                             model_flops_per_step=MODEL_FLOPS_PER_STEP, peak_flops_per_s=PEAK_FLOPS_PER_S)",
        f"losses = training.LossReport(me, logger, last_stage={last_stage}, data_parallel=DATA_PARALLEL"
        f"{', context_parallel=CONTEXT_PARALLEL' if f.context_parallel else ''})  # the global mean loss",
    ]
    if f.rebalance:
        lines += [
            "shares = rebalance.ReplicaShares(REPLICA_MICRO_BATCH_SIZES, NUM_MICROBATCHES, me, every=REBALANCE_EVERY,",
            "                                 announce=me.rank == 0)  # each replica's micro-batch size, moved by "
            "measured speed",
            "data = shares.batches(model_file, GLOBAL_BATCH_SIZE, args.seed, start_step=start_step)  # this "
            "replica's rows",
        ]
    else:
        lines += [
            f"rows = shard.replica_rows(REPLICA_MICRO_BATCH_SIZES, NUM_MICROBATCHES, {_replica(f)})  # this replica's "
            "rows of each batch",
            "data = shard.replica_batches(model_file, GLOBAL_BATCH_SIZE, args.seed, rows=rows, start_step=start_step)",
        ]
    if f.context_parallel:
        lines.append("data = context.split_batches(data, CONTEXT_PARALLEL, me.context_index)  # chunks j and 2 cp - 1 - j "
                     "of every sequence")
    if f.weighted and not f.pipelined:
        lines.append(f"loss_weight = shard.loss_weight(REPLICA_MICRO_BATCH_SIZES, {_replica(f)})  # replicas' shares "
                     "differ: weigh this one's loss")
    lines += [
        "timer = timing.StepTimer(device)  # steps end in a device synchronize; forwards and backwards timed on the "
        "device",
        "for step in range(start_step + 1, args.steps + 1):",
        "    timer.start()",
        "    inputs, targets = next(data)  # this replica's rows of global batch `step`",
        "    microbatches = shard.microbatches(inputs, targets, num_microbatches=NUM_MICROBATCHES, device=device)",
        "    optimizer.zero_grad(set_to_none=True)",
        "    lr = learning_rate.apply(optimizer, step)  # --warmup-steps, then --lr-decay: a function of the step alone",
    ]
    lines += _step(f)
    if f.data_parallel:
        lines.append("    grad_sync.reduce()  # agree on the gradients over the replicas (FSDP2 already has)")
    if f.tied:
        lines.append("    tied_grads.reduce()  # sum the gradients of a weight two stages hold, so its copies stay "
                     "equal")
    clip = "grad_norm = clipper.clip() if clipper else None  # --clip-grad-norm: the whole model's norm, then clip"
    if f.fp16:
        lines += ["    grad_norm = None",
                  "    if scaler.unscale_and_check(model_shard.parameters()):  # False only when fp16 overflowed on "
                  "some rank",
                  f"        {clip}",
                  "        optimizer.step()"]
    else:
        lines += [f"    {clip}", "    optimizer.step()"]
    if f.local_sgd:
        lines.append("    grad_sync.after_step(step, optimizer, last=step == args.steps)  # local SGD: average every "
                     "SYNC_EVERY steps")
    lines.append("    losses.submit(step, local_loss, timer.stop(), lr=lr, grad_norm=grad_norm)  # logs the step "
                 "before: [Note: loss report]")
    if f.rebalance:
        lines.append("    shares.observe(step, timer)  # every REBALANCE_EVERY steps: shares by measured speed "
                     "(collective)")
    lines += [
        "    if held_out and held_out.due(step, last=step == args.steps):  # --eval-data: a held-out loss "
        "(collective)",
        f"        held_out.run(step, losses, model_shard, {'shares.rows' if f.rebalance else 'rows'}, "
        f"{_held_out_forward(f)})",
        "    if checkpoints.due(step, last=step == args.steps):",
        "        losses.flush()  # the metrics reach this step before its checkpoint does",
        *(["    # a stage whose replicas differ in tp degree: replica 0 writes it (runtime/mixed_sync.py)"]
          if f.mixed_degrees else []),
        f"    checkpoints.maybe_save(step, model_shard, optimizer{scaler}, last=step == args.steps"
        + (",\n                           copy=me.replica > 0 and stage_plan.mixed_degrees)" if f.mixed_degrees else ")"),
        "losses.flush()",
        "training.report_stage_times(me, timer.steps, NUM_MICROBATCHES, logger)  # per micro-batch, for hetpar "
        "validate",
        "logger.close()",
    ]
    return "\n".join(lines)


def _step(f: Features) -> list[str]:
    """The forward and backward passes of one step: the executor's schedule, or a plain loop."""
    if f.pipelined:
        return ["    local_loss = executor.run_actions(pipeline, actions, microbatches, device, timer)  # forwards, "
                "backwards, sends",
                "    # local_loss: on the last stage, the sum of the micro-batch losses / NUM_MICROBATCHES"]
    weight = " * shares.loss_weight" if f.rebalance else " * loss_weight" if f.weighted else ""
    forward = "        with timer.measure(forward=True)"
    forward += ", torch.autocast(device.type, dtype=DTYPE):" if f.autocast else ":"
    lines = [
        "    local_loss = torch.zeros((), device=device)",
        "    for i, (mb_inputs, mb_targets) in enumerate(microbatches):  # gradients accumulate over micro-batches",
        forward,
        "            output = stage.module(*[mb_inputs[k] for k in stage.model_inputs])  # the model's forward",
    ]
    loss = f"loss = model_file.loss(output, mb_targets) / NUM_MICROBATCHES{weight}"
    if f.vocab_loss:
        lines += ["            with loss_parallel():  # the head's logits are split over the vocabulary "
                  "(tp_sharding vocab_head)", f"                {loss}"]
    else:
        lines.append(f"            {loss}")
    lines.append("        with timer.measure(forward=False):")
    indent = " " * 12
    if f.data_parallel:
        lines.append(f"{indent}grad_sync.before_backward(last=i == NUM_MICROBATCHES - 1)  # the last one starts "
                     "the gradient sync")
    if f.vocab_loss:
        lines.append(f"{indent}with loss_parallel():")
        indent += "    "
    lines.append(f"{indent}(loss * scaler.scale).backward()  # fp16: backward from the scaled loss" if f.fp16
                 else f"{indent}loss.backward()")
    lines.append("        local_loss += training.local(loss.detach())  # a replicated DTensor under loss_parallel"
                 if f.vocab_loss else "        local_loss += loss.detach()")
    return lines


def _teardown(f: Features) -> str:
    names = ["optimizer", *(["pipeline"] if f.pipelined else []), *(["grad_sync"] if f.data_parallel else []),
             *(["tied_grads"] if f.tied else []), "chunks" if f.chunked else "stage", "model_shard", "model", "full_state"]
    return "\n".join([
        RULE,
        "# save the trained full state_dict (rank 0) and tear down",
        "full_state = training.gather_full_state(model, model_shard, me) if args.save_final or args.save_hf else None",
        "if full_state is not None and args.save_final:  # on rank 0: a torch.save of the state_dict",
        "    training.save_atomic(full_state, args.save_final)",
        "if full_state is not None and args.save_hf:  # on rank 0: model.safetensors and config.json",
        "    hf_checkpoint.save_pretrained(args.save_hf, full_state, model)",
        f"del {', '.join(names)}",
        "distributed.shutdown()",
    ])


def program_source(plan: ParallelPlan, *, tied: bool | None = None, replan: str = "") -> str:
    """The text of ``train.py`` for ``plan``, which ``plan_text.check_plan_text`` has passed.

    Args:
        plan: the plan.
        tied: whether a weight is held by more than one stage (``runtime.tied.tied_across_stages``);
            None when not looked for: then a plan of several stages gets the tied code.
        replan: the ``hetpar plan`` options that ask for this plan again (``replan_options``).
    """
    f = Features.of(plan, tied=bool(tied) if tied is not None else len(plan.stages) > 1)
    model_name = Path(plan.model.file).name
    sections = [
        _docstring(plan, model_name, f),
        _imports(f),
        _constants(plan, model_name, f),
        _rank_setup(plan, f, replan),
        _model_shard(plan, f),
        *([_schedule(f)] if f.pipelined else []),
        _loop(f),
        _teardown(f),
    ]
    return "\n\n".join(sections) + "\n"


__all__ = ["Features", "program_source", "stage_table", "torchrun_line"]
