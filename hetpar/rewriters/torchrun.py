"""ParallelPlan -> a self-contained directory that torchrun runs.

``compile_plan`` writes ``train.py`` (a short program in the style of nanoGPT: the
plan's numbers as constants, then rank setup, the model shard, tensor and data
parallelism, the schedule, checkpoints and the training loop, with the logic in
``runtime``), its launch files (``launch.sh``, ``slurm.sbatch``, ``pytorchjob.yaml``;
see rewriters.launchers), and a copy of the model file. See docs/running.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from hetpar.planner.plan import ParallelPlan, StagePlan
from hetpar.rewriters.launchers import (
    LAUNCHER, PROGRAM, PYTORCHJOB, SLURM, elastic_problem, launcher_source, node_layout, pytorchjob_source, slurm_source,
)


# plan.dtype -> the torch dtype the program autocasts to
_DTYPES = {
    "fp32": "torch.float32",
    "float32": "torch.float32",
    "bf16": "torch.bfloat16",
    "bfloat16": "torch.bfloat16",
    "fp16": "torch.float16",
    "float16": "torch.float16",
}


class CompileError(Exception):
    """A plan cannot be compiled; the message is one line that says what to do."""


def compile_plan(plan: ParallelPlan, out_dir: Path, *, elastic: tuple[int, int] | None = None) -> list[Path]:
    """Write the program for ``plan`` into ``out_dir``.

    All files are written to a temporary directory first and then renamed into place,
    so a failure leaves ``out_dir`` as it was.

    Args:
        plan: the plan to compile.
        out_dir: where the program, its launch files and the model file go; created
            if missing; other files in it are left alone.
        elastic: ``(min_nodes, max_nodes)``: launch files for an elastic job (torchrun
            ``--nnodes=MIN:MAX``, c10d rendezvous), whose program stops with the command
            that re-plans and resumes when its nodes change (see rewriters.launchers).

    Returns:
        The paths written: ``train.py``, ``launch.sh``, ``slurm.sbatch``,
        ``pytorchjob.yaml``, the model file.

    Raises:
        CompileError: the model file is missing or changed since planning, or the plan
            uses something the program cannot run.
    """
    out_dir = Path(out_dir)
    model_path = _checked_model_file(plan)
    if elastic is not None and (problem := elastic_problem(plan, elastic)):
        raise CompileError(problem)
    name = f"hetpar-{model_path.stem}"
    texts = {
        PROGRAM: program_source(plan),
        LAUNCHER: launcher_source(plan, elastic=elastic),
        SLURM: slurm_source(plan, job_name=name, elastic=elastic),
        PYTORCHJOB: pytorchjob_source(plan, job_name=name, build_dir=out_dir.name, elastic=elastic),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for script in (LAUNCHER, SLURM):
            (tmp / script).chmod((tmp / script).stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        shutil.copyfile(model_path, tmp / model_path.name)
        names = [*texts, model_path.name]
        if not out_dir.exists():
            os.replace(tmp, out_dir)
        else:
            for name in names:
                os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / name for name in names]


def _checked_model_file(plan: ParallelPlan) -> Path:
    path = Path(plan.model.file)
    if not path.is_file():
        raise CompileError(f"model file {path} not found; restore it or re-run hetpar plan")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != plan.model.fingerprint.removeprefix("sha256:"):
        raise CompileError(f"model file {path} changed since planning; re-run hetpar plan")
    if path.name in (PROGRAM, LAUNCHER, SLURM, PYTORCHJOB):
        raise CompileError(f"model file {path} is named like the program; rename it (e.g. model.py) and re-run hetpar plan")
    if not path.name.endswith(".py") or not path.stem.isidentifier():
        raise CompileError(f"model file {path} must be a .py file with a Python identifier as its name")
    if plan.dtype not in _DTYPES:
        raise CompileError(f"plan dtype {plan.dtype!r} is not one of {', '.join(_DTYPES)}; re-run hetpar plan with --dtype")
    return path


def replan_options(plan: ParallelPlan) -> str:
    """The ``hetpar plan`` options that ask for ``plan``'s request again, the cluster aside
    (the program prints them when an elastic job's nodes change: [Note: membership change])."""
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(plan.dtype, plan.dtype)
    model_args = "".join(f" --model-arg {key}={value}" for key, value in plan.model.args.items())
    return f"--global-batch {plan.global_batch_size} --dtype {dtype}{model_args}"


def torchrun_line(plan: ParallelPlan) -> str:
    """The command that runs the program on one host."""
    return f"torchrun --nproc_per_node={plan.cluster.world_size} {PROGRAM}"


# ----------------------------------------------------------------------------- train.py


def _layer_summary(plan: ParallelPlan, stage: StagePlan) -> str:
    names = [plan.model.layer_names[i] for i in stage.layers]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    span = f"{stage.layers[0]}" if len(stage.layers) == 1 else f"{stage.layers[0]}-{stage.layers[-1]}"
    return f"{span}: {shown}"


def stage_table(plan: ParallelPlan) -> str:
    """The stage -> layers -> ranks -> device type -> tp table of the docstring."""
    header = ("stage", "layers", "ranks[d][t]", "device", "tp")
    rows = [
        (str(s.index), _layer_summary(plan, s), str(s.ranks), s.device_type, str(s.tensor_parallel))
        for s in plan.stages
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _stage_spec_source(plan: ParallelPlan, stage: StagePlan) -> str:
    first, last = stage.layers[0], stage.layers[-1]
    names = plan.model.layer_names
    lines = [
        "    StageSpec(",
        f"        layers=({first}, {last}),  # {names[first]} .. {names[last]}",
        f"        device_type={stage.device_type!r}, tensor_parallel={stage.tensor_parallel}, zero_stage={stage.zero_stage}, "
        f"recompute={stage.recompute!r},",
        f"        ranks={stage.ranks!r},",
    ]
    if stage.tp_sharding:
        lines.append("        tp_sharding={")
        lines += [f"            {path!r}: {kind.value!r}," for path, kind in stage.tp_sharding.items()]
        lines.append("        },")
    lines.append("    ),")
    return "\n".join(lines)


def program_source(plan: ParallelPlan) -> str:
    """The text of ``train.py`` for ``plan``."""
    model_name = Path(plan.model.file).name
    nodes, per_node = node_layout(plan)
    multi = (
        f"\nOn {nodes} hosts of {per_node} processes, run ./launch.sh on each (see its header).\n" if nodes > 1 else ""
    )
    table = "\n".join(("    " + l).rstrip() for l in stage_table(plan).splitlines())
    stages = "\n".join(_stage_spec_source(plan, s) for s in plan.stages)
    return _PROGRAM_TEMPLATE.format(
        model_name=model_name,
        world=plan.cluster.world_size,
        torchrun=torchrun_line(plan),
        multi=multi,
        cluster=plan.cluster.spec,
        schedule=plan.schedule.value,
        dp=plan.data_parallel,
        pp=plan.pipeline_parallel,
        v=plan.virtual_stages,
        step_time=plan.predicted.step_time_s,
        table=table,
        model_args=repr(dict(plan.model.args)),
        layer_names=repr(list(plan.model.layer_names)),
        leaf_modules=repr(tuple(plan.model.leaf_modules)),
        mbs=plan.micro_batch_size,
        m=plan.num_microbatches,
        gbs=plan.global_batch_size,
        replica_mbs=plan.replica_micro_batch_sizes,
        compression=plan.grad_compression,
        aggregation=plan.aggregation,
        sync_every=plan.sync_every,
        sync_scope=plan.sync_scope,
        rebalance_every=plan.rebalance_every,
        node_ranks=per_node if plan.sync_scope == "node" else None,
        compiled=plan.compiled,
        dtype=_DTYPES[plan.dtype],
        plan_dtype=plan.dtype,
        stages=stages,
        device_types=_rank_list_source(plan.cluster.device_types),
        program=PROGRAM,
        replan=replan_options(plan),
    )


def _rank_list_source(values: list[str]) -> str:
    """A per-rank list as runs, ``['A100-80GB'] * 8 + ['V100-32GB'] * 8``, short for any world size."""
    runs: list[list] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return " + ".join(f"[{value!r}] * {count}" for value, count in runs) or "[]"


_PROGRAM_TEMPLATE = '''\
"""Train {model_name} on {world} processes, as hetpar planned it.

    {torchrun} --steps 10
{multi}
Options (steps, lr, optimizer, seed, init/save, metrics, checkpoints): python {program} --help.
Plan: cluster {cluster}, dp {dp} x pp {pp}, schedule {schedule}, predicted {step_time:.4g} s/step.

{table}

Generated by `hetpar compile`; change the plan and compile again rather than this file.
"""

from dataclasses import replace
from pathlib import Path

import torch

from hetpar.runtime import (checkpoint, cli, data_parallel, devices, distributed, executor, faults, materialize,
                            precision, rebalance, schedule, shard, tied, timing, training)
from hetpar.runtime.distributed import StageSpec
from hetpar.runtime.model_file import load_model_file

# -----------------------------------------------------------------------------
# the plan
MODEL_FILE = {model_name!r}  # plan.model.file, copied next to this program
MODEL_ARGS = {model_args}  # plan.model.args
LAYER_NAMES = {layer_names}  # plan.model.layer_names
LEAF_MODULES = {leaf_modules}  # plan.model.leaf_modules: modules traced as opaque calls
WORLD_SIZE = {world}  # plan.cluster.world_size
DEVICE_TYPES = {device_types}  # plan.cluster.device_types: of each global rank
DATA_PARALLEL = {dp}  # plan.data_parallel
MICRO_BATCH_SIZE = {mbs}  # plan.micro_batch_size
REPLICA_MICRO_BATCH_SIZES = {replica_mbs!r}  # plan.replica_batch_shares: micro-batch size of each replica
NUM_MICROBATCHES = {m}  # plan.num_microbatches
GLOBAL_BATCH_SIZE = {gbs}  # plan.global_batch_size = NUM_MICROBATCHES * sum(REPLICA_MICRO_BATCH_SIZES)
SCHEDULE = {schedule!r}  # plan.schedule
PIPELINE_RANKS = {pp}  # plan.pipeline_parallel
VIRTUAL_STAGES = {v}  # plan.virtual_stages: stage s runs on the ranks of stage s % PIPELINE_RANKS
DTYPE = {dtype}  # plan.dtype {plan_dtype!r}: autocast compute dtype; parameters stay float32
GRAD_COMPRESSION, AGGREGATION = {compression!r}, {aggregation!r}  # plan.grad_compression, plan.aggregation (runtime.sync_spec)
# plan.sync_every, .sync_scope: local SGD if SYNC_EVERY > 1 (NODE_RANKS: per host, scope 'node'); plan.rebalance_every
SYNC_EVERY, SYNC_SCOPE, NODE_RANKS, REBALANCE_EVERY = {sync_every}, {sync_scope!r}, {node_ranks}, {rebalance_every}
STAGES = [  # plan.stages: layers (first, last), ranks[d][t] = rank of replica d, tp index t
{stages}
]

# -----------------------------------------------------------------------------
# rank setup: which stage, data-parallel replica and tp index this process is
args = cli.parse_args(__doc__)
cli.check_launch(WORLD_SIZE, __file__, replan=cli.Replan(  # torchrun started WORLD_SIZE processes? else how to go on
    model_file=MODEL_FILE, plan_options={replan!r}, device_types=DEVICE_TYPES, checkpoint_dir=args.checkpoint_dir))
device = distributed.init_distributed(args.dist_timeout_s, accelerator=devices.needs_accelerator(DEVICE_TYPES))
devices.check_device_types(DEVICE_TYPES, device, allow_mismatch=args.allow_device_mismatch)  # each rank on its type?
me = distributed.locate(STAGES, torch.distributed.get_rank())  # me.stage: this rank's first stage
groups = distributed.build_groups(STAGES, me, device, ranks_per_node=NODE_RANKS)  # collective: all build all groups
my_stages = list(range(me.stage, len(STAGES), PIPELINE_RANKS))  # VIRTUAL_STAGES of them (model chunks)
my_stage = STAGES[me.stage]

# -----------------------------------------------------------------------------
# the model shard: the whole model built on the meta device (no memory), cut to this rank's stages
model_file = load_model_file(Path(__file__).with_name(MODEL_FILE), MODEL_ARGS)
torch.manual_seed(args.seed)
model, construction = materialize.build_on_meta(model_file.build_model)  # with the log of how it is built
stages = {{  # recompute: each layer of the stage under torch.utils.checkpoint
    s: shard.cut_stage(model, model_file, REPLICA_MICRO_BATCH_SIZES[me.replica], STAGES[s].layers, LAYER_NAMES,
                       LEAF_MODULES, recompute=STAGES[s].recompute)
    for s in my_stages
}}
module = shard.rank_module([stages[s].module for s in my_stages])  # the stage, or its chunks as one module
tied_grads = tied.TiedGradients(model, module, my_stages, STAGES, me, announce=me.rank == 0)  # GPT-2's wte = lm_head

# tensor parallel: shard the stage's Linears column- or row-wise over its tp ranks (on meta: nothing allocated yet)
if my_stage.tensor_parallel > 1:
    shard.apply_tensor_parallel(module, groups.tp_mesh, my_stage.tp_sharding)
# this rank's tensors (tp shards) alone are made, as build_model() under --seed makes them, or read from --init-from
materialize.materialize_stages(model, module, construction, device, init_from=args.init_from, keep_unused=me.rank == 0)
shard.compile_stages([stages[s].module for s in my_stages], device, args.compile, planned={compiled}, announce=me.rank == 0)
# data parallel: all-reduce, compression, robust aggregation, local SGD, or ZeRO through FSDP2 (my_stage.zero_stage)
grad_sync = data_parallel.wrap(module, my_stage, groups, GRAD_COMPRESSION, AGGREGATION, SYNC_EVERY, SYNC_SCOPE,
                               powersgd_rank=args.powersgd_rank, powersgd_start_step=args.powersgd_start_step)
faults.inject(module, me.rank, bad_gradients=args.inject_bad_gradients, slowdown=args.inject_slowdown)  # tests only
for s in my_stages:  # "stage 0 (layers 0-1): tp 1, ZeRO-2 through FSDP2 over 2 replicas, ..."
    training.announce(replace(me, stage=s), STAGES[s], grad_sync)
optimizer = training.make_optimizer(args.optimizer, module.parameters(), args.lr)
scaler = precision.LossScaler(enabled=DTYPE == torch.float16)  # fp16: dynamic loss scaling

# -----------------------------------------------------------------------------
shares = rebalance.ReplicaShares(REPLICA_MICRO_BATCH_SIZES, NUM_MICROBATCHES, me,  # each replica's micro-batch size,
                                 every=REBALANCE_EVERY, announce=me.rank == 0)  # moved by measured speed
# the schedule: this rank's actions, e.g. 0F0 0F1 0B0 0F2 0B1 ... (runtime/schedule.py)
actions = schedule.make_schedule(SCHEDULE, PIPELINE_RANKS, NUM_MICROBATCHES, VIRTUAL_STAGES)[me.stage]
pipeline = {{  # one executor per stage this rank holds; actions name their stage
    s: executor.StageExecutor(
        stage=stages[s], peers=distributed.peers_of(STAGES, replace(me, stage=s)),
        loss_fn=model_file.loss, num_microbatches=NUM_MICROBATCHES,
        device=device, compute_dtype=DTYPE,
        loss_weight=shares.loss_weight,  # 1.0 unless replicas' shares differ
        loss_scaler=scaler, before_backward=grad_sync.before_backward, index=s,
    )
    for s in my_stages
}}

# -----------------------------------------------------------------------------
checkpoints = checkpoint.Checkpointer.for_run(args, model, GLOBAL_BATCH_SIZE)  # --checkpoint-dir, of any plan of this model
start_step = checkpoints.resume(module, optimizer, scaler)  # the newest intact checkpoint's step, or 0: a fresh start

# -----------------------------------------------------------------------------
# training loop: one optimizer step per global batch
logger = training.StepLogger(enabled=me.rank == 0, total_steps=args.steps, global_batch_size=GLOBAL_BATCH_SIZE,
                             metrics=args.metrics, start_step=start_step)
losses = training.LossReport(me, logger, last_stage=PIPELINE_RANKS - 1, data_parallel=DATA_PARALLEL)  # the global mean loss
data = shares.batches(model_file, GLOBAL_BATCH_SIZE, args.seed, start_step=start_step)  # this replica's rows
timer = timing.StepTimer(device)  # steps end in a device synchronize; actions timed by CUDA events on GPUs
for step in range(start_step + 1, args.steps + 1):
    timer.start()
    inputs, targets = next(data)  # this replica's rows of global batch `step`
    micro = shard.microbatches(inputs, targets, num_microbatches=NUM_MICROBATCHES, device=device)
    optimizer.zero_grad(set_to_none=True)
    local_loss = executor.run_actions(pipeline, actions, micro, device, timer)  # micro-batch losses / NUM_MICROBATCHES
    grad_sync.reduce()  # average over the replicas (FSDP2 already has)
    tied_grads.reduce()  # sum the gradients of a weight two stages hold, so its copies stay equal
    if scaler.unscale_and_check(module.parameters()):  # False only when fp16 overflowed on some rank
        optimizer.step()
    grad_sync.after_step(step, optimizer, last=step == args.steps)  # local SGD: average every SYNC_EVERY steps
    losses.submit(step, local_loss, timer.stop())  # logs the step before; see [Note: loss report]
    shares.observe(step, timer, pipeline)  # every REBALANCE_EVERY steps: shares by measured speed (collective)
    if checkpoints.due(step, last=step == args.steps):
        losses.flush()  # the metrics reach this step before its checkpoint does
    checkpoints.maybe_save(step, module, optimizer, scaler, last=step == args.steps)
losses.flush()
training.report_stage_times(me, timer.steps, NUM_MICROBATCHES, logger)  # per micro-batch, for hetpar validate
logger.close()

# -----------------------------------------------------------------------------
# save the trained full state_dict (rank 0) and tear down
if args.save_final:
    training.save_full_state(args.save_final, model, module, me)
del optimizer, pipeline, grad_sync, tied_grads, stages, module, model
distributed.shutdown()
'''


__all__ = ["CompileError", "compile_plan", "program_source", "replan_options", "stage_table", "torchrun_line"]
