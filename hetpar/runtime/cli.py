"""The command line every generated program shares, and its world-size check.

    torchrun --nproc_per_node=4 train.py --steps 100 --optimizer adamw --lr 3e-4 \
        --warmup-steps 10 --lr-decay cosine --clip-grad-norm 1.0 --weight-decay 0.1 \
        --init-from init.pt --save-final final.pt --save-hf trained --metrics metrics.jsonl \
        --checkpoint-dir ckpt --checkpoint-every 20 --allow-device-mismatch --data train.bin
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from enum import StrEnum
from typing import Iterator

from hetpar.vocabulary import Optimizer, Switch


class LrDecay(StrEnum):
    """How the learning rate falls after warm-up (``--lr-decay``; runtime.training.LearningRate)."""

    CONSTANT = "constant"  # stays at --lr: the programs' behaviour before schedules existed
    COSINE = "cosine"  # half a cosine from --lr down to --min-lr at --decay-steps
    LINEAR = "linear"  # a straight line from --lr down to --min-lr at --decay-steps


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """Options of one training run."""

    steps: int
    lr: float
    optimizer: str  # "sgd" or "adamw"
    seed: int
    init_from: Path | None  # a full state_dict (torch.save file, DCP or Hugging Face directory): each rank reads its tensors
    save_final: Path | None  # where rank 0 writes the trained full state_dict
    metrics: Path | None  # one JSON line per step
    dist_timeout_s: float  # bound on every collective and on rendezvous
    checkpoint_dir: Path | None = None  # periodic checkpoints; a (re)started run resumes from the newest intact one
    checkpoint_every: int = 100  # steps between checkpoints
    checkpoint_keep: int = 3  # newest checkpoints kept
    powersgd_rank: int = 1  # plan.grad_compression "powersgd": rank of the gradient approximation
    powersgd_start_step: int = 2  # ... and plain all-reduce steps before it compresses
    allow_device_mismatch: bool = False  # warn, not stop, when a rank's device is not the plan's (runtime.devices)
    compile: str = Switch.AUTO  # torch.compile each stage: "on", "off", or "auto" (as planned: plan.compiled)
    data: Path | None = None  # a flat token file: the batches instead of the model file's (runtime.data)
    data_dtype: str = "uint16"  # its token width: a name of runtime.data.TOKEN_DTYPES
    data_column: str = "input_ids"  # a dataset directory's column of token-id lists
    save_hf: Path | None = None  # where rank 0 writes a Hugging Face checkpoint directory (runtime.hf_checkpoint)
    warmup_steps: int = 0  # the learning rate rises linearly from 0 to lr over these steps (runtime.training.LearningRate)
    lr_decay: str = LrDecay.CONSTANT  # ... then falls so, to min_lr at decay_steps
    decay_steps: int | None = None  # the step at which the decay reaches min_lr (None: steps)
    min_lr: float | None = None  # where the decay ends (None: 0.1 * lr)
    clip_grad_norm: float | None = None  # clip gradients to this global L2 norm (runtime.training.GradClipper); None: off
    weight_decay: float | None = None  # AdamW's decay of >= 2-D parameters only; None: torch's default on all of them
    eval_data: Path | None = None  # held-out token file or dataset directory (runtime.training.HeldOut)
    eval_every: int = 0  # steps between held-out losses; 0: after the last step only
    eval_batches: int | None = None  # global batches per evaluation; None: every whole one eval_data holds


def parse_args(description: str | None = None, argv: list[str] | None = None, *, powersgd: bool = False) -> TrainArgs:
    """Parse the program's options; ``description`` is the program's docstring.

    Args:
        description: shown by ``--help``.
        argv: the options (default: ``sys.argv[1:]``).
        powersgd: offer ``--powersgd-rank`` and ``--powersgd-start-step`` (a plan whose
            ``grad_compression`` is PowerSGD); else they keep their defaults.

    Faults for tests are not options of the program: runtime.faults, [Note: test faults].
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (one per global batch)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--optimizer", choices=[Optimizer.SGD.value, Optimizer.ADAMW.value], default=Optimizer.ADAMW.value,
                        help="plain SGD or AdamW (torch defaults)")
    parser.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                        help="raise the learning rate linearly from 0 to --lr over the first N steps")
    parser.add_argument("--lr-decay", choices=[d.value for d in LrDecay], default=LrDecay.CONSTANT.value,
                        help="after warm-up, keep --lr (constant) or lower it to --min-lr at --decay-steps")
    parser.add_argument("--decay-steps", type=int, metavar="N", help="the step the decay reaches --min-lr (default --steps)")
    parser.add_argument("--min-lr", type=float, metavar="LR", help="the learning rate the decay ends at (default 0.1 x --lr)")
    parser.add_argument("--clip-grad-norm", type=float, metavar="X",
                        help="scale the gradients so that their global L2 norm over the whole model is at most X "
                             "(default: no clipping)")
    parser.add_argument("--weight-decay", type=float, metavar="W",
                        help="AdamW's weight decay, on >= 2-D parameters (matmul and embedding weights) only, not on "
                             "norms' weights or biases (default: torch's 0.01 on every parameter)")
    parser.add_argument("--seed", type=int, default=0, help="seeds model init (torch.manual_seed) and the data")
    parser.add_argument("--init-from", type=Path, metavar="PATH",
                        help="full state_dict to start from: a torch.save file, a torch.distributed.checkpoint directory, "
                             "or a Hugging Face checkpoint directory (safetensors); each rank reads only its own tensors")
    parser.add_argument("--save-final", type=Path, metavar="FILE", help="write the trained full state_dict here (rank 0)")
    parser.add_argument("--save-hf", type=Path, metavar="DIR",
                        help="write the trained model as a Hugging Face checkpoint directory (model.safetensors and "
                             "config.json, which from_pretrained loads; rank 0, atomically); a Hugging Face model only")
    parser.add_argument("--metrics", type=Path, metavar="FILE", help="write one JSON line per step (rank 0); the file is truncated at start")
    parser.add_argument("--dist-timeout-s", type=float, default=300.0, help="timeout of collectives and rendezvous")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="save checkpoints here; a (re)started run resumes from the newest intact one in it")
    parser.add_argument("--checkpoint-every", type=int, metavar="N", help="steps between checkpoints (default 100)")
    parser.add_argument("--checkpoint-keep", type=int, default=3, metavar="K", help="newest checkpoints kept")
    if powersgd:
        parser.add_argument("--powersgd-rank", type=int, default=1, metavar="R",
                            help="rank of PowerSGD's low-rank gradient approximation (plan.grad_compression)")
        parser.add_argument("--powersgd-start-step", type=int, default=2, metavar="N",
                            help="steps of plain all-reduce before PowerSGD compresses (>= 2)")
    parser.set_defaults(powersgd_rank=1, powersgd_start_step=2)
    parser.add_argument("--allow-device-mismatch", action="store_true",
                        help="run even where a rank's device is not the plan's device type for it (one warning)")
    parser.add_argument("--compile", choices=[s.value for s in Switch], default=Switch.AUTO.value,
                        help="torch.compile each stage (auto: as the plan says, plan.compiled, which its costs "
                             "assume); a stage that does not compile runs eagerly")
    from hetpar.runtime.data import TOKEN_DTYPES  # numpy and torch: imported once the program has torch

    parser.add_argument("--data", type=Path, metavar="FILE|DIR",
                        help="train on this flat file of token ids (nanoGPT's train.bin), or a dataset directory "
                             "(datasets' save_to_disk, or Parquet files; needs pyarrow), instead of the model file's "
                             "batches: sequences of the model's length + 1 in an order of --seed alone; each replica "
                             "reads only its rows")
    parser.add_argument("--data-dtype", choices=list(TOKEN_DTYPES), default="uint16", help="the token width of --data")
    parser.add_argument("--data-column", default="input_ids",
                        help="a dataset directory's column of token ids, a list per row, concatenated in row order")
    parser.add_argument("--eval-data", type=Path, metavar="FILE|DIR",
                        help="report the mean loss over held-out sequences of this token file or dataset directory "
                             "(read as --data is, in file order), without gradients, every --eval-every steps and "
                             "after the last")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="steps between held-out losses (default 0: after the last step only)")
    parser.add_argument("--eval-batches", type=int, metavar="N",
                        help="global batches of --eval-data per evaluation (default: every whole batch it holds)")
    ns = parser.parse_args(argv)
    if ns.steps < 0:
        parser.error(f"--steps {ns.steps} must be >= 0")
    if ns.checkpoint_every is not None and ns.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    for name in ("checkpoint_every", "checkpoint_keep", "powersgd_rank"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(ns, name)} must be >= 1")
    if ns.powersgd_start_step < 2:
        parser.error(f"--powersgd-start-step {ns.powersgd_start_step} must be >= 2 (PowerSGD needs warm-up steps)")
    _check_loop(parser, ns)
    if ns.init_from is not None and not ns.init_from.exists():
        parser.error(f"--init-from {str(ns.init_from)!r}: no such file or directory")
    return TrainArgs(
        steps=ns.steps,
        lr=ns.lr,
        optimizer=ns.optimizer,
        seed=ns.seed,
        init_from=ns.init_from,
        save_final=ns.save_final,
        metrics=ns.metrics,
        dist_timeout_s=ns.dist_timeout_s,
        checkpoint_dir=ns.checkpoint_dir,
        checkpoint_every=ns.checkpoint_every or 100,
        checkpoint_keep=ns.checkpoint_keep,
        powersgd_rank=ns.powersgd_rank,
        powersgd_start_step=ns.powersgd_start_step,
        allow_device_mismatch=ns.allow_device_mismatch,
        compile=ns.compile,
        data=ns.data,
        data_dtype=ns.data_dtype,
        data_column=ns.data_column,
        save_hf=ns.save_hf,
        warmup_steps=ns.warmup_steps,
        lr_decay=ns.lr_decay,
        decay_steps=ns.decay_steps if ns.decay_steps is not None else ns.steps,
        min_lr=ns.min_lr if ns.min_lr is not None else 0.1 * ns.lr,
        clip_grad_norm=ns.clip_grad_norm,
        weight_decay=ns.weight_decay,
        eval_data=ns.eval_data,
        eval_every=ns.eval_every,
        eval_batches=ns.eval_batches,
    )


def _check_loop(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse schedule, clipping and weight-decay options that do not make sense, in one line."""
    if ns.warmup_steps < 0:
        parser.error(f"--warmup-steps {ns.warmup_steps} must be >= 0")
    decay_steps = ns.decay_steps if ns.decay_steps is not None else ns.steps
    if ns.lr_decay != LrDecay.CONSTANT and decay_steps <= ns.warmup_steps:
        parser.error(f"--lr-decay {ns.lr_decay} needs --decay-steps ({decay_steps}) > --warmup-steps "
                     f"({ns.warmup_steps})")
    for name in ("min_lr", "weight_decay"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(ns, name)} must be >= 0")
    if ns.clip_grad_norm is not None and not ns.clip_grad_norm > 0:
        parser.error(f"--clip-grad-norm {ns.clip_grad_norm} must be > 0")
    if ns.weight_decay is not None and ns.optimizer != Optimizer.ADAMW:
        parser.error(f"--weight-decay is AdamW's; --optimizer {ns.optimizer} takes none")
    for name in ("eval_every", "eval_batches"):
        value = getattr(ns, name)
        if ns.eval_data is None and value not in (None, 0):
            parser.error(f"--{name.replace('_', '-')} needs --eval-data (the held-out token file)")
    if ns.eval_every < 0:
        parser.error(f"--eval-every {ns.eval_every} must be >= 0")
    if ns.eval_batches is not None and ns.eval_batches < 1:
        parser.error(f"--eval-batches {ns.eval_batches} must be >= 1")


@contextmanager
def one_line_errors(*errors: type[BaseException]) -> Iterator[None]:
    """Stop the program on ``errors`` raised inside: the first rank prints the message as
    one line, every rank leaves the process group and exits with code 2.

    For checks of input every rank reads alike (``--data``, ``--init-from``, ``--save-hf``), which fail
    on every rank at the same point, before any collective that one of them would miss.
    """
    try:
        yield
    except errors as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"hetpar: {exc}", file=sys.stderr, flush=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(2) from None


def world_size_from_env() -> int | None:
    """The world size torchrun set, or None when the program runs without torchrun."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


@dataclass(frozen=True, kw_only=True)
class Replan:
    """What a program needs to say how to go on when it is started on other nodes than
    planned ([Note: membership change]): the ``hetpar plan`` request of its plan and
    where its checkpoints are."""

    model_file: str  # MODEL_FILE, next to the program
    plan_options: str  # hetpar plan options that ask for this plan again, e.g. "--global-batch 8 --dtype fp32"
    device_types: list[str]  # DEVICE_TYPES: the plan's device type of each rank
    checkpoint_dir: Path | None  # --checkpoint-dir


def check_launch(expected: int, program: str, replan: Replan | None = None) -> None:
    """Exit with code 2 and one line on stderr unless torchrun started ``expected``
    processes that can meet; with ``replan``, a start on other nodes than planned (an
    elastic job's membership changed) says how to re-plan and resume.

    A plan for one process also runs as plain ``python train.py``: the rendezvous
    variables torchrun would set are filled in for a single local process.
    ``torchrun --master-port 0`` hands the workers port 0 instead of the port it bound,
    so they would wait for the whole timeout; that is refused at once.
    """
    check_world_size(expected, program, replan)
    if os.environ.get("MASTER_PORT") == "0":
        _fail(
            "torchrun --master-port 0 gives the workers port 0, so they cannot meet; pass a free port, "
            "or --rdzv-backend=c10d --rdzv-endpoint=localhost:0"
        )


def check_world_size(expected: int, program: str, replan: Replan | None = None) -> None:
    """Exit with code 2 and one line on stderr unless torchrun started ``expected`` processes.

    [Note: membership change]
    An elastic job (``hetpar compile --elastic MIN:MAX``: torchrun ``--nnodes=MIN:MAX``
    with the c10d rendezvous) goes on when a node is lost or added: torchrun stops every
    worker and starts them again with the new world size. A plan is for one world size,
    so the program then stops before it joins the others: the first process of each host
    prints one line with the ``hetpar plan ... --resume-from`` command that plans for the
    nodes there are and continues from the newest checkpoint, and every process exits
    with code 2. torchrun counts that as a failure and, while restarts are left, tries a
    new rendezvous, which trains on if the planned nodes are back; otherwise the job
    ends with that line. The launch files set ``HETPAR_ELASTIC``; a start on several
    nodes (``GROUP_WORLD_SIZE`` > 1) says the same.
    """
    started = world_size_from_env()
    if started is None and expected == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    if started == expected:
        return
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    if replan is not None and started is not None and (os.environ.get("HETPAR_ELASTIC") or nodes > 1):
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or started)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"hetpar: {replan_message(expected, nodes, per_node, program, replan)}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    name = Path(program).name
    got = "it was started without torchrun" if started is None else (
        f"torchrun started {started} process{'es' if started != 1 else ''}"
    )
    _fail(f"this program was compiled for world size {expected} but {got}; run: torchrun --nproc_per_node={expected} {name}")


def replan_message(expected: int, nodes: int, per_node: int, program: str, replan: Replan) -> str:
    """The line of [Note: membership change]: what torchrun started, and the commands that
    re-plan for it and resume from the newest checkpoint in ``replan.checkpoint_dir``."""
    from hetpar.runtime.checkpoint import list_complete

    started = nodes * per_node
    kinds = sorted(set(replan.device_types))
    one_type = len(kinds) == 1
    cluster = f"{nodes}x{per_node}x{kinds[0]}" if one_type else "<the nodes there are>"
    model = Path(program).resolve().with_name(replan.model_file)
    found = list_complete(replan.checkpoint_dir) if replan.checkpoint_dir is not None else []
    resume = f" --resume-from {replan.checkpoint_dir}" if found else ""
    if found:
        where = f"resume from the newest checkpoint (step {found[0].step} in {replan.checkpoint_dir})"
    elif replan.checkpoint_dir is not None:
        where = f"start again (no checkpoint in {replan.checkpoint_dir} yet, so from step 0)"
    else:
        where = "start again (no --checkpoint-dir, so from step 0)"
    return (
        f"the job's nodes changed: torchrun started {started} process{'es' if started != 1 else ''} "
        f"({nodes} node{'s' if nodes != 1 else ''} of {per_node}), this program is planned for {expected}; it stops "
        f"here. To go on with these nodes, re-plan and {where}: hetpar plan {model} --cluster {cluster} "
        f"{replan.plan_options}{resume} -o plan.json && hetpar compile plan.json -o "
        f"{'build-' + cluster if one_type else '<new build dir>'}, then launch the new build"
    )


def _fail(message: str) -> None:
    print(f"hetpar: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def free_port() -> int:
    """A TCP port on this host that no one listens on now, for a rendezvous to take."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["LrDecay", "Replan", "TrainArgs", "check_launch", "check_world_size", "free_port", "one_line_errors", "parse_args",
           "replan_message", "world_size_from_env"]
