"""The parts of a training step around the pipeline: optimizer, learning-rate schedule,
the reported loss, progress and metrics, and the final state_dict gathered to rank 0.
(Data-parallel gradients: runtime.data_parallel; loss scaling: runtime.precision;
checkpoints: runtime.checkpoint.)"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from hetpar.runtime.cli import LrDecay
from hetpar.runtime.context import split_sequence
from hetpar.runtime.data import DataError, TokenFile, held_out_tokens
from hetpar.runtime.distributed import Peers, Placement, StageSpec
from hetpar.runtime.executor import LossFn, StageExecutor, evaluate_actions
from hetpar.runtime.experts import ROUTING_LOAD
from hetpar.runtime.graph import Stage
from hetpar.runtime.parts import layouts_of
from hetpar.runtime.schedule import Action, Kind
from hetpar.runtime.shard import Microbatch, chunk_modules, microbatches
from hetpar.vocabulary import Optimizer


def make_optimizer(name: str, params: Iterable[nn.Parameter], lr: float, *, weight_decay: float | None = None
                   ) -> torch.optim.Optimizer:
    """Plain SGD (no momentum) or AdamW with torch's defaults, at learning rate ``lr``.

    With ``weight_decay`` (AdamW's), two parameter groups as nanoGPT and torchtitan make
    them: parameters of two or more dimensions (matmul and embedding weights) decay by it,
    the others (norms' weights, biases) do not; a sharded parameter counts by its global
    shape. Without it, torch's default (0.01) applies to every parameter, as before the
    option existed.

    AdamW on GPU parameters is torch's fused kernel (one launch for all tensors, as
    torchtitan does), and so on shards FSDP2 offloaded to host memory beside a GPU ([Note:
    offload through FSDP2]); on a CPU worker the default implementation, whose arithmetic
    the distributed tests compare with one process.

    Raises:
        ValueError: an unknown optimizer, or ``weight_decay`` for SGD.
    """
    params = list(params)
    if name == Optimizer.SGD:
        if weight_decay is not None:
            raise ValueError("weight decay is AdamW's; sgd takes none")
        return torch.optim.SGD(params, lr=lr)
    if name == Optimizer.ADAMW:
        fused = bool(params) and all(_fused_adamw_runs(p) for p in params)
        return torch.optim.AdamW(decay_groups(params, weight_decay) if weight_decay is not None else params, lr=lr,
                                 fused=fused or None)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


def _fused_adamw_runs(param: nn.Parameter) -> bool:
    """Whether ``param`` sits on a GPU, or is a shard offloaded to host memory beside one."""
    mesh = getattr(param, "device_mesh", None)  # a DTensor's
    return param.device.type == "cuda" or (param.device.type == "cpu" and mesh is not None and mesh.device_type != "cpu")


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups: ``weight_decay`` for parameters of >= 2 dimensions, 0 for
    the rest (``make_optimizer``); an empty group is left out."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [group for group in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
            if group["params"]]


@dataclass(frozen=True, kw_only=True)
class LearningRate:
    """The learning rate of each step: a function of the step number alone.

    [Note: learning-rate schedule]
    With peak ``lr``, W ``warmup_steps``, D ``decay_steps`` and ``min_lr``, step s
    (1-based, the s-th optimizer step) trains at

    - ``lr * s / W`` for s <= W (a linear warm-up from 0; step W reaches ``lr``);
    - then ``lr`` under ``constant`` decay, the programs' behaviour before schedules;
    - under ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``, under
      ``linear``: ``min_lr + (lr - min_lr) * (1 - p)``, with ``p = (s - W) / (D - W)``,
      so step D and every later step train at ``min_lr``.

    As torchtitan's and nanoGPT's schedules, by the step and nothing else: the program
    sets every parameter group's ``lr`` before each optimizer step, so a run resumed from
    a checkpoint after step k continues the schedule exactly. The options are recorded in
    every checkpoint and a resume with other ones is refused (runtime.checkpoint,
    [Note: resume]).
    """

    lr: float
    warmup_steps: int = 0
    decay: str = LrDecay.CONSTANT
    decay_steps: int = 0  # D; not read under constant decay
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps({self.warmup_steps}) must be >= 0")
        if self.decay not in tuple(LrDecay):
            raise ValueError(f"lr decay {self.decay!r} must be one of {', '.join(LrDecay)}")
        if self.decay != LrDecay.CONSTANT and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps({self.decay_steps}) must exceed warmup_steps({self.warmup_steps})")

    @classmethod
    def of(cls, args: Any) -> LearningRate:
        """The schedule of a program's options (runtime.cli.TrainArgs), its defaults filled in:
        ``decay_steps`` = ``steps``, ``min_lr`` = 0.1 ``lr``."""
        return cls(lr=args.lr, warmup_steps=args.warmup_steps, decay=args.lr_decay,
                   decay_steps=args.decay_steps if args.decay_steps is not None else args.steps,
                   min_lr=args.min_lr if args.min_lr is not None else 0.1 * args.lr)

    def at(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based); see [Note: learning-rate schedule]."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == LrDecay.CONSTANT:
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        factor = (1 + math.cos(math.pi * progress)) / 2 if self.decay == LrDecay.COSINE else 1 - progress
        return self.min_lr + (self.lr - self.min_lr) * factor

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every parameter group of ``optimizer`` to step ``step``'s rate; returns it."""
        lr = self.at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the schedule: the options that decide its rates
        (``decay_steps`` and ``min_lr`` only where the rate decays)."""
        decays = self.decay != LrDecay.CONSTANT
        return {"lr": self.lr, "warmup_steps": self.warmup_steps, "lr_decay": str(self.decay),
                **({"decay_steps": self.decay_steps, "min_lr": self.min_lr} if decays else {})}


def loop_record(args: Any) -> dict[str, Any]:
    """The options of a run's loop (runtime.cli.TrainArgs) that a resumed run must share
    with the run it continues: what a checkpoint records (runtime.checkpoint)."""
    given = {k: getattr(args, k) for k in ("clip_grad_norm", "weight_decay") if getattr(args, k) is not None}
    return {**LearningRate.of(args).record(), **given}


class GradClipper:
    """Clips the gradients of the whole model to a global L2 norm (``--clip-grad-norm``),
    as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    [Note: global gradient norm]
    The norm is over every parameter of the whole model once. Each rank adds the squares
    of the gradient elements it is the first holder of, and one all-reduce over the
    world sums them (collective: every rank clips every step), after the data-parallel
    and tied-weight reductions and, under fp16, after unscaling:

    - pipeline stages hold disjoint parameters, so every stage adds its own;
    - a DTensor gradient (tensor-parallel, FSDP2 or expert shards) adds its local shard
      on the ranks whose coordinate is 0 along every mesh axis it is replicated over
      (a partial one is made whole first), so shards count once each and a replicated
      parameter once, not tp times;
    - copies on other data-parallel rows (replicas, and context-parallel rows, whose
      gradients the sync made equal) count once: a plain tensor on row 0 and tp index 0
      only, a DTensor only where its mesh covers row 0 (an FSDP2 mesh covers every row,
      whose shards all add; an expert-parallel mesh the first ep rows);
    - a weight tied across stages counts on its first stage only
      (``tied.TiedGradients.later_copies``).

    Every rank then scales its gradients by ``min(1, max_norm / (norm + 1e-6))``, torch's
    factor, so all copies stay equal. Under local SGD (``per_replica``) replicas step on
    their own gradients: each clips by its own replica's norm, every rank adding into its
    row's slot of one all-reduced vector.
    """

    def __init__(self, max_norm: float, module: nn.Module, me: Placement, stages: list[StageSpec], *,
                 tied: Any = None, per_replica: bool = False):
        """Args:
            max_norm: the norm the gradients are clipped to.
            module: this rank's stage module (or chunks), after tensor and data parallelism.
            me: this rank's place; stages: the program's stages (their ranks).
            tied: the program's ``tied.TiedGradients``, where a weight is tied across stages.
            per_replica: each data-parallel row clips by its own norm (local SGD).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm({max_norm}) must be > 0")
        self.max_norm, self.me, self.per_replica = max_norm, me, per_replica
        self.params = list(module.parameters())
        self.rows = [set(row) for row in stages[me.stage].ranks]
        later = {id(p) for p in tied.later_copies()} if tied is not None else set()
        self._counted = [id(p) not in later for p in self.params]

    def clip(self) -> torch.Tensor:
        """Clip this rank's gradients (collective).

        Returns:
            The global norm before clipping, a 0-d float32 tensor on the gradients' device.
        """
        grads = [(p.grad, counted) for p, counted in zip(self.params, self._counted) if p.grad is not None]
        # the squares travel where the backend reduces: a GPU under nccl even when offloaded
        # gradients sit in host memory ([Note: offload through FSDP2] in runtime/data_parallel.py)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else \
            grads[0][0].device if grads else torch.device("cpu")
        squares = torch.zeros(len(self.rows), dtype=torch.float32, device=device)
        for grad, counted in grads:
            whole = _whole(grad)  # collective over a partial gradient's mesh: on every rank of it
            if counted and self._first_holder(whole):
                squares[self.me.replica] += local(whole).float().square().sum().to(device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        norm = (squares[self.me.replica] if self.per_replica else squares.sum()).sqrt()
        factor = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for grad, _ in grads:
            local(grad).mul_(factor.to(grad.device, grad.dtype))
        return norm

    def _first_holder(self, grad: torch.Tensor) -> bool:
        """Whether this rank adds ``grad``'s local elements ([Note: global gradient norm])."""
        if not isinstance(grad, DTensor):
            return self.me.tp_index == 0 and (self.per_replica or self.me.replica == 0)
        mesh = grad.device_mesh
        coordinate = mesh.get_coordinate()
        if any(c != 0 for c, p in zip(coordinate, grad.placements) if isinstance(p, Replicate)):
            return False
        covered = set(mesh.mesh.flatten().tolist())
        return self.per_replica or bool(self.rows[0] & covered)


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """``grad``, a partial DTensor summed over its mesh (replicated) first."""
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in grad.placements])
    return grad


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a loss under ``loss_parallel``); any other tensor as it is (a replica at tp 1)."""
    return t.to_local() if isinstance(t, DTensor) else t



def announce(me: Placement, stage: StageSpec, grad_sync: object = "one replica") -> None:
    """One line on stderr per stage, from its first rank: how it is run, e.g.
    ``hetpar: stage 1 (layers 2-3): tp 1, ZeRO-3 through FSDP2 over 2 replicas, recompute full``
    (``grad_sync``: the stage's data-parallel sync, runtime.data_parallel)."""
    if me.replica == 0 and me.tp_index == 0:
        first, last = stage.layers
        cp = f", cp {stage.context_parallel}" if stage.context_parallel > 1 else ""
        sp = " (sequence-parallel)" if stage.sequence_parallel else ""  # [Note: sequence parallelism] in runtime/sequence.py
        tp = "/".join(map(str, dict.fromkeys(len(r) for r in stage.ranks)))  # "1/2": replica 0's degree first
        print(f"hetpar: stage {me.stage} (layers {first}-{last}): tp {tp}{sp}{cp}, {grad_sync}, "
              f"recompute {stage.recompute}", file=sys.stderr, flush=True)


class LossReport:
    """The mean loss of each step's global batch, reduced without holding up the next step.

    [Note: loss report]
    ``local_loss`` is a replica's mean over its micro-batches on the last stage. The
    tensor-parallel index 0 of each replica of the last stage contributes
    ``local_loss / dp``, every other rank zero, and one all-reduce over the world sums.
    Under context parallelism each of a replica's cp rows holds the mean over its own
    equal share of the tokens and contributes ``local_loss / (dp * cp)`` ([Note: context
    parallelism] in runtime/context.py).
    The all-reduce is asynchronous and a step's line is logged once the next step's
    report starts (or at ``flush``): a blocking one would hold every rank at the end of
    each step until the last stage finished, where a pipeline's first stages would
    otherwise start the next step's forwards while the last ones finish the step (as a
    hand-written ``torch.distributed.pipelining`` loop does). By the time step k + 1
    ends, every rank has passed step k's report, so waiting for it stalls nothing.
    ``flush`` before a checkpoint keeps the metrics file complete up to the checkpoint.
    """

    def __init__(self, me: Placement, logger: "StepLogger", *, last_stage: int, data_parallel: int,
                 context_parallel: int = 1):
        self.me, self.logger = me, logger
        self.last_stage, self.data_parallel = last_stage, data_parallel * context_parallel  # the reporting rows
        self._pending: tuple | None = None

    def submit(self, step: int, local_loss: torch.Tensor, step_time_s: float, *, lr: float | None = None,
               grad_norm: torch.Tensor | None = None) -> None:
        """Start step ``step``'s all-reduce (collective) and log the step before it; ``lr``:
        the step's learning rate, ``grad_norm``: its global gradient norm before clipping
        (``GradClipper``)."""
        reports = self.me.stage == self.last_stage and self.me.tp_index == 0
        value = (local_loss.detach().float() / self.data_parallel) if reports else torch.zeros((), device=local_loss.device)
        value = value.reshape(1).clone()
        work = dist.all_reduce(value, op=dist.ReduceOp.SUM, async_op=True)
        self.flush()
        self._pending = (step, step_time_s, value, work, ROUTING_LOAD.take(), lr, grad_norm)

    def flush(self) -> None:
        """Wait for the pending report, if any, and log it."""
        if self._pending is not None:
            step, step_time_s, value, work, load, lr, grad_norm = self._pending
            self._pending = None
            work.wait()
            self.logger.log(step, float(value.item()), step_time_s, expert_imbalance=load, lr=lr,
                            grad_norm=float(grad_norm) if grad_norm is not None else None)


class HeldOut:
    """The loss of held-out data, every ``--eval-every`` steps and after the last.

    [Note: held-out loss]
    ``--eval-data`` names a token file or dataset directory read as ``--data`` is, its
    sequences in file order ([Note: token data] in runtime/data.py): held-out global
    batch b holds sequences ``[bB, bB + B)`` for the plan's global batch size B (the
    shapes every stage was cut for), and ``--eval-batches`` of them (default: every
    whole batch the file holds) make one evaluation. Each replica takes its own rows of
    each batch, cut into the plan's micro-batches (and, under cp, into its chunks of
    every sequence), and runs forwards only, without gradients: a pipeline runs its
    schedule's forwards (``executor.evaluate_actions``), one stage its micro-batches
    (``evaluate_stage``). The modules are in ``eval()`` mode meanwhile (dropout
    off; a graph that fx captured with ``training`` as a constant keeps it). Routing
    counted by expert layers during an evaluation is dropped, not charged to the next
    step.

    A batch's loss is what a training step would report for it ([Note: loss report]):
    the last stage's tensor-parallel index 0 of each replica (of each cp row) holds its
    weighted mean over its micro-batches and contributes it / (dp x cp). The evaluation
    sums over batches, all-reduces once over the world (collective: every rank calls
    ``run``) and logs the mean over batches after the step's own line: a line on stderr
    and a record ``{"kind": "eval", "step", "loss", "batches", "sequences", "time_s"}``
    in the metrics file. Under any plan the figure is one process's mean loss over those
    sequences with the step's weights, up to float rounding.
    """

    def __init__(self, tokens: TokenFile, *, every: int, num_batches: int | None, global_batch_size: int,
                 num_microbatches: int, device: torch.device, context: tuple[int, int] = (1, 0)):
        """``context``: (cp, this rank's cp index). Raises ``DataError`` when the file holds
        fewer than ``num_batches`` global batches."""
        available = tokens.num_sequences // global_batch_size
        if num_batches is not None and num_batches > available:
            raise DataError(f"--eval-batches {num_batches} needs {num_batches * global_batch_size} sequences of "
                            f"{tokens.seq_len} + 1 tokens; --eval-data {tokens.path} holds {tokens.num_sequences} "
                            f"({available} global batches of {global_batch_size})")
        self.tokens, self.every = tokens, every
        self.num_batches = available if num_batches is None else num_batches
        self.global_batch_size, self.num_microbatches, self.device = global_batch_size, num_microbatches, device
        self.context = context

    @classmethod
    def of(cls, args: Any, model_file: Any, model: nn.Module, global_batch_size: int, num_microbatches: int,
           device: torch.device, context: tuple[int, int] = (1, 0)) -> HeldOut | None:
        """The run's evaluation under ``--eval-data``, checked before training; None without it.

        Raises:
            DataError: the held-out data does not fit the model or the batch.
        """
        if args.eval_data is None:
            return None
        tokens = held_out_tokens(model_file, model, args.eval_data, dtype=args.data_dtype, column=args.data_column,
                                 global_batch_size=global_batch_size)
        return cls(tokens, every=args.eval_every, num_batches=args.eval_batches, global_batch_size=global_batch_size,
                   num_microbatches=num_microbatches, device=device, context=context)

    def due(self, step: int, *, last: bool) -> bool:
        """Whether step ``step`` is followed by an evaluation."""
        return last or (self.every > 0 and step % self.every == 0)

    def run(self, step: int, losses: LossReport, module: nn.Module, rows: range,
            forward: Callable[[list], torch.Tensor]) -> float:
        """Evaluate after step ``step`` (collective) and log it after the step's line;
        returns the held-out loss.

        Args:
            losses: the run's loss report: its placement, reporting rows and logger.
            module: the rank's stage modules, put in ``eval()`` mode meanwhile.
            rows: this replica's rows of every global batch.
            forward: a held-out batch's micro-batches -> this rank's share of its loss,
                as a training step's ``local_loss`` (zero off the last stage).
        """
        losses.flush()
        started = time.perf_counter()
        was_training = module.training
        module.eval()
        total = torch.zeros((), device=self.device)
        try:
            for inputs, targets in self.tokens.in_order(self.global_batch_size, rows=rows,
                                                        num_batches=self.num_batches):
                if self.context[0] > 1:
                    inputs = tuple(split_sequence(t, *self.context) for t in inputs)
                    targets = split_sequence(targets, *self.context)
                batch = microbatches(inputs, targets, num_microbatches=self.num_microbatches, device=self.device)
                total += forward(batch).detach().float()
        finally:
            module.train(was_training)
            ROUTING_LOAD.take()
        me = losses.me
        reports = me.stage == losses.last_stage and me.tp_index == 0
        value = (total / losses.data_parallel if reports else torch.zeros_like(total)).reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        loss = float(value.item()) / self.num_batches
        losses.logger.log_eval(step, loss, batches=self.num_batches,
                               sequences=self.num_batches * self.global_batch_size,
                               time_s=time.perf_counter() - started)
        return loss


def evaluate_stage(stage: Stage, data: list[Microbatch], loss_fn: LossFn, device: torch.device,
                   compute_dtype: torch.dtype = torch.float32, loss_weight: float = 1.0) -> torch.Tensor:
    """``executor.evaluate_actions`` for a stage holding the whole model (no pipeline): its
    micro-batches' forwards in order, without gradients; the loss as a training step's
    ``local_loss`` ([Note: held-out loss])."""
    alone = Peers(recv_activations_from=None, send_activations_to=(), recv_grads_from=None, send_grads_to=())
    only = StageExecutor(stage=stage, peers=alone, loss_fn=loss_fn, num_microbatches=len(data), device=device,
                         compute_dtype=compute_dtype, loss_weight=loss_weight)
    return evaluate_actions({0: only}, [Action(0, Kind.FORWARD, i) for i in range(len(data))], data, device)


class StepLogger:
    """A progress line per step on stderr, and one JSON line per step in ``metrics``.

    [Note: metrics file]
    The metrics file holds one JSON object per line. A step's line is
    ``{"kind": "step", "step", "loss", "step_time_s", "samples_per_s", "time_left_s"}``,
    with ``"tokens_per_s"`` (samples/s x the model's sequence length T) for a model of
    token sequences, ``"mfu"`` (the plan's model FLOPs per step over the step time and
    the devices' summed peak) where the plan gives both, ``"lr"`` where the program reports it, and ``"grad_norm"`` under
    ``--clip-grad-norm``. ``time_left_s`` is the mean step time of this run so far times
    the steps left. Every other
    record names another ``kind`` (``"stages"``: each pipeline rank's seconds per
    micro-batch, which ``hetpar validate`` reads; ``"eval"``: a held-out loss, [Note:
    held-out loss]), and a reader of steps skips it (``step_records``). docs/running.md documents the contract.

    Only the rank that logs (rank 0) writes. The metrics file is truncated at start; a
    run resumed after step ``start_step`` keeps the step and eval records up to it and drops
    later ones (steps the interrupted run did after its last checkpoint), so the file
    ends up with every step once.
    """

    def __init__(self, *, enabled: bool, total_steps: int, global_batch_size: int, metrics: Path | None,
                 start_step: int = 0, tokens_per_sample: int | None = None, model_flops_per_step: float = 0.0,
                 peak_flops_per_s: float = 0.0):
        """``tokens_per_sample``: the model's sequence length T (``tokens_per_sample``), or
        None for a model of other inputs (no tokens/s then); ``model_flops_per_step`` and
        ``peak_flops_per_s``: the plan's, for MFU (none where either is 0)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self.tokens_per_sample = tokens_per_sample
        self.model_flops_per_step, self.peak_flops_per_s = model_flops_per_step, peak_flops_per_s
        self._step_times_s: list[float] = []
        self._file = None
        if enabled and metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            kept = _records_up_to(metrics, start_step) if start_step > 0 else []
            self._file = open(metrics, "w")
            self._file.writelines(kept)
            self._file.flush()

    def log(self, step: int, loss: float, step_time_s: float, *, expert_imbalance: float | None = None,
            lr: float | None = None, grad_norm: float | None = None) -> None:
        """Record step ``step`` (1-based); ``expert_imbalance``: its routing's (runtime.experts.RoutingLoad),
        where this rank dispatched to experts split over ranks; ``lr``: its learning rate;
        ``grad_norm``: the global gradient norm before clipping, under ``--clip-grad-norm``."""
        if not self.enabled:
            return
        samples_per_s = self.global_batch_size / step_time_s if step_time_s > 0 else float("inf")
        self._step_times_s.append(step_time_s)
        time_left_s = statistics.fmean(self._step_times_s) * (self.total_steps - step)
        record: dict[str, Any] = {"kind": "step", "step": step, "loss": loss, "step_time_s": step_time_s,
                                  "samples_per_s": samples_per_s}
        if self.tokens_per_sample is not None:
            record["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.model_flops_per_step > 0 and self.peak_flops_per_s > 0 and step_time_s > 0:
            record["mfu"] = self.model_flops_per_step / step_time_s / self.peak_flops_per_s
        record["time_left_s"] = time_left_s
        for key, value in (("lr", lr), ("grad_norm", grad_norm), ("expert_imbalance", expert_imbalance)):
            if value is not None:
                record[key] = value
        print(_step_line(record, self.total_steps), file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def log_eval(self, step: int, loss: float, *, batches: int, sequences: int, time_s: float) -> None:
        """Record the held-out loss after step ``step`` ([Note: held-out loss])."""
        if not self.enabled:
            return
        record = {"kind": "eval", "step": step, "loss": loss, "batches": batches, "sequences": sequences,
                  "time_s": time_s}
        width = len(str(self.total_steps))
        print(f"eval {step:>{width}}/{self.total_steps} | held-out loss {loss:.6f} | {sequences} sequences in "
              f"{batches} batches | {time_s:.1f} s", file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def log_stages(self, stages: list[dict]) -> None:
        """Record each pipeline rank's seconds per micro-batch (``report_stage_times``)."""
        if not self.enabled:
            return
        times = ", ".join(f"stage {s['stage']} forward {s['fwd_s'] * 1e3:.2f} ms backward {s['bwd_s'] * 1e3:.2f} ms" for s in stages)
        print(f"per micro-batch: {times}", file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(json.dumps({"kind": "stages", "stages": stages}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_line(record: dict[str, Any], total_steps: int) -> str:
    """``step  3/10 | loss 5.123456 |   15.2 ms |    526.3 samples/s | 8420 tokens/s | lr 3e-04 | ... | 0:00:01 left``."""
    width = len(str(total_steps))
    parts = [f"step {record['step']:>{width}}/{total_steps}", f"loss {record['loss']:.6f}",
             f"{record['step_time_s'] * 1e3:8.1f} ms", f"{record['samples_per_s']:9.1f} samples/s"]
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.3g}")
    if "grad_norm" in record:
        parts.append(f"grad norm {record['grad_norm']:.4g}")
    left = round(record["time_left_s"])
    parts.append(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left")
    return " | ".join(parts)


def tokens_per_sample(model_file: Any) -> int | None:
    """T, the tokens of one sample: the second dimension of the model file's
    ``example_inputs(1)`` where its first input is integer token ids ``[1, T]``; None for
    a model of other inputs."""
    first = model_file.example_inputs(1)[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def report_stage_times(me: Placement, times: list[tuple[float, float]], num_microbatches: int, logger: StepLogger) -> None:
    """Log each pipeline rank's forward and backward seconds per micro-batch (collective).

    ``times`` holds this rank's (forward, backward) seconds of each step, receives'
    waits left out (``StepTimer.steps``); a rank's figure is the median over the
    steps divided by the micro-batches. Replica 0, tensor-parallel index 0 of each
    pipeline rank reports; rank 0 logs them (``StepLogger.log_stages``).
    """
    mine = None
    if me.replica == 0 and me.tp_index == 0 and times:
        mine = {"stage": me.stage, "fwd_s": statistics.median(f for f, _ in times) / num_microbatches,
                "bwd_s": statistics.median(b for _, b in times) / num_microbatches}
    gathered: list | None = [None] * dist.get_world_size() if me.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        logger.log_stages(sorted((g for g in gathered if g is not None), key=lambda g: g["stage"]))


def read_metrics(metrics: Path, kind: str = "step") -> list[dict]:
    """The records of one ``kind`` in a metrics file, in file order ([Note: metrics file]).

    A line cut short (a crash mid-write) is skipped.
    """
    records = []
    for line in Path(metrics).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == kind:
            records.append(record)
    return records


def _records_up_to(metrics: Path, step: int) -> list[str]:
    if not metrics.is_file():
        return []
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if isinstance(record, dict) and record.get("kind") in ("step", "eval") and isinstance(record.get("step"), int) \
                and record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def gather_full_state(model: nn.Module, stage_module: nn.Module, me: Placement) -> dict[str, torch.Tensor] | None:
    """The trained full state_dict, gathered to rank 0 (collective): whole tensors on the
    CPU, keyed and ordered as ``model.state_dict()``; None on every other rank.

    Every rank turns its stage's DTensors into full tensors (collective within its
    tensor-parallel group); replica 0, tensor-parallel index 0 of each stage sends its
    stage's tensors to rank 0. Rank 0 orders the keys as ``model.state_dict()`` does;
    a key no stage holds (a parameter no layer uses) keeps rank 0's value. A part-laid
    tensor is written in the user's layout ([Note: part-laid Linears] in runtime/parts.py).
    """
    held = {}
    for chunk in chunk_modules(stage_module):  # the stage, or each chunk under the interleaved schedule
        layouts = layouts_of(chunk)
        for k, v in chunk.state_dict().items():
            full = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            held[k] = layouts[k].to_user(full) if k in layouts else full
    mine = held if (me.replica, me.tp_index) == (0, 0) else {}
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size())] if me.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if me.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return {k: merged[k] if k in merged else local(v).detach().cpu() for k, v in model.state_dict().items()}


def save_atomic(obj: object, path: Path) -> None:
    """``torch.save`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["GradClipper", "HeldOut", "evaluate_stage", "LearningRate", "LossReport", "StepLogger", "announce", "decay_groups", "gather_full_state", "local",
           "loop_record", "make_optimizer", "read_metrics", "report_stage_times", "save_atomic", "tokens_per_sample"]
