"""hetpar's pipeline executor: runs one stage's action list (see runtime/schedule.py).

[Note: pipeline communication]
``F i`` receives the stage's ``recv`` tensors of micro-batch i from the previous stage
(shapes and dtypes are known from ``Stage.recv``, so no metadata travels), runs the
stage module on the model inputs it reads (taken from local data, never sent) and the
received tensors, and sends its outputs to the next stage. The last stage instead
computes ``loss_fn(output, targets) * loss_weight / num_microbatches``, so that the
summed gradients of a step are those of the mean loss (``loss_weight`` is 1 unless
replicas take unequal shares of the batch; see ``runtime.shard.loss_weight``). Under
fp16 the backward starts from the loss times the loss scaler's scale.

``B i`` receives the gradients of the stage's floating-point outputs from the next
stage (the last stage starts from its loss), runs autograd, and sends the gradients of
its received floating-point inputs to the previous stage. Integer and bool tensors
cross boundaries without gradients. Tensors travel in the dtype the stage boundary
was recorded with (``TensorSpec.dtype``), whatever autocast made of them.

Sends are ``dist.isend``s whose handles are kept until ``finish()``; receives are
``dist.irecv(...).wait()``. Sends therefore never block, a rank only waits for data it
needs next, and ``runtime.schedule.simulate`` models exactly that to prove a schedule
free of deadlocks. Every message carries a tag naming the sending stage, the direction
and the micro-batch (``_tag``): under the interleaved schedule a rank holds several
stages, so activations and gradients flow between the same two ranks in both
directions and in an order that differs between sender and receiver; the tag makes
each receive take its own message. (gloo matches on tags; NCCL ignores them and
matches per pair in order, so on GPUs the interleaved schedule relies on both ranks
posting in the same order, which hetpar does not yet arrange.)

[Note: W actions]
Under a schedule with W actions (ZB-H1), ``B i`` computes only the gradients of the
stage's received inputs, ``torch.autograd.backward(..., inputs=received,
retain_graph=True)``, sends them, and keeps the graph; ``W i`` runs the backward
again from the same output gradients with ``inputs=`` the stage's parameters, which
accumulates their ``.grad`` and frees the graph. Each gradient is computed once into
the place it belongs, so the result equals the plain backward's; the price is that W
re-traverses the part of the graph between the outputs and the deepest parameter
(autograd cannot resume a backward half-way), which makes W as costly as a backward
rather than the third of it the schedule assumes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hetpar.runtime.distributed import Peers
from hetpar.runtime.graph import Stage, TensorSpec
from hetpar.runtime.precision import LossScaler
from hetpar.runtime.schedule import Action, Kind, forwards_only
from hetpar.runtime.shard import Microbatch
from hetpar.runtime.timing import StepTimer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo cannot send bool


MAX_STAGES = 1024  # tags are unique per (stage, direction, micro-batch) below this many stages


def _tag(sender_stage: int, backward: bool, microbatch: int) -> int:
    return (microbatch * MAX_STAGES + sender_stage) * 2 + int(backward)


@dataclass
class _InFlight:
    """What a forward keeps for its backward."""

    received: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]  # tensors sent on, or the loss on the last stage


@dataclass
class StageExecutor:
    """Runs one stage's actions on this rank; see [Note: pipeline communication]."""

    stage: Stage
    peers: Peers
    loss_fn: LossFn
    num_microbatches: int
    device: torch.device
    compute_dtype: torch.dtype = torch.float32  # autocast dtype; parameters stay as built
    loss_weight: float = 1.0  # factor on this replica's loss (runtime.shard.loss_weight)
    loss_scaler: LossScaler | None = None  # fp16: backward starts from loss * scale
    before_backward: Callable[[bool], None] | None = None  # told whether a backward is the step's last
    index: int = 0  # the stage's number in the plan: tags its messages
    _in_flight: dict[int, _InFlight] = field(default_factory=dict, init=False, repr=False)
    _pending_sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list, init=False, repr=False)
    _awaiting_weights: dict[int, tuple[list, list]] = field(default_factory=dict, init=False, repr=False)
    timer: StepTimer | None = field(default=None, init=False, repr=False)  # set by run_actions when timing

    def run(self, actions: list[Action], data: list[Microbatch]) -> torch.Tensor:
        """Run one step's actions on this step's micro-batches.

        Returns:
            The sum of the micro-batch losses times ``loss_weight`` divided by the number
            of micro-batches (the mean loss of this replica's share of the batch, weighted)
            on the last stage; zero elsewhere.
        """
        return run_actions({self.index: self}, actions, data, self.device)

    def forward(self, microbatch: int, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, *,
                keep: bool = True) -> torch.Tensor | None:
        """``F``: returns the scaled loss on the last stage, None elsewhere; without ``keep``
        (an evaluation, under ``torch.no_grad``) nothing is kept for a backward."""
        received = self._recv(self.stage.recv, self.peers.recv_activations_from, _tag(self.index - 1, False, microbatch))
        for t in received:
            if t.is_floating_point() and keep:
                t.requires_grad_(True)  # a leaf: backward leaves its gradient in t.grad
        model_inputs = [inputs[i] for i in self.stage.model_inputs]
        autocast = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            out = self.stage.module(*model_inputs, *received)
            if self.stage.is_last:
                with _loss_context(out):  # [Note: vocab-parallel loss]
                    loss = self.loss_fn(out, targets) / self.num_microbatches
                if self.loss_weight != 1.0:
                    loss = loss * self.loss_weight
        if self.stage.is_last:
            if keep:
                self._in_flight[microbatch] = _InFlight(received=received, outputs=(loss,))
            return loss
        outputs = tuple(out)
        for t, spec in zip(outputs, self.stage.send, strict=True):
            self._send(t.detach().to(spec.dtype), self.peers.send_activations_to, _tag(self.index, False, microbatch))
        if keep:
            self._in_flight[microbatch] = _InFlight(received=received, outputs=outputs)
        return None

    def backward(self, microbatch: int, *, weights_later: bool = False) -> None:
        """``B``: backpropagates one micro-batch through the stage; with ``weights_later``
        only to its received inputs, leaving the parameters to ``weight``
        (see [Note: W actions])."""
        state = self._in_flight.pop(microbatch)
        if self.stage.is_last:
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            tensors, grads = list(state.outputs), [None if scale == 1.0 else torch.full_like(state.outputs[0], scale)]
        else:
            floats = [(t, spec) for t, spec in zip(state.outputs, self.stage.send) if spec.dtype.is_floating_point]
            received = self._recv(tuple(spec for _, spec in floats), self.peers.recv_grads_from,
                                  _tag(self.index + 1, True, microbatch))
            pairs = [(t, g.to(t.dtype)) for (t, _), g in zip(floats, received)]
            tensors = [t for t, _ in pairs if t.requires_grad]
            grads = [g for t, g in pairs if t.requires_grad]
        with _loss_context(tensors):  # the loss's backward too ([Note: vocab-parallel loss])
            if weights_later:
                inputs = [t for t in state.received if t.requires_grad]
                if tensors and inputs:
                    torch.autograd.backward(tensors, grads, inputs=inputs, retain_graph=True)
                self._awaiting_weights[microbatch] = (tensors, grads)
            elif tensors:
                torch.autograd.backward(tensors, grads)
        for t, spec in zip(state.received, self.stage.recv):
            if spec.dtype.is_floating_point:
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._send(grad.to(spec.dtype), self.peers.send_grads_to, _tag(self.index, True, microbatch))

    def weight(self, microbatch: int) -> None:
        """``W``: the parameter gradients of a micro-batch whose ``B`` ran with
        ``weights_later``; see [Note: W actions]."""
        tensors, grads = self._awaiting_weights.pop(microbatch)
        params = [p for p in self.stage.module.parameters() if p.requires_grad]
        if tensors and params:
            with _loss_context(tensors):
                torch.autograd.backward(tensors, grads, inputs=params)

    def finish(self) -> None:
        """Wait for every send of this step."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()
        for pending, what in ((self._in_flight, "a backward"), (self._awaiting_weights, "a weight-gradient action")):
            if pending:
                left = ", ".join(str(i) for i in sorted(pending))
                pending.clear()
                raise RuntimeError(f"the schedule left micro-batches {left} of stage {self.index} without {what}")

    def _recv(self, specs: tuple[TensorSpec, ...], src: int | None, tag: int) -> tuple[torch.Tensor, ...]:
        if not specs:
            return ()
        if src is None:
            raise RuntimeError("a stage with pipeline inputs has no peer to receive them from")
        tensors = []
        for spec in specs:
            buffer = torch.empty(spec.shape, dtype=_wire_dtype(spec.dtype), device=self.device)
            start = self.timer.mark() if self.timer is not None else None
            dist.irecv(buffer, src=src, tag=tag).wait()
            if self.timer is not None:
                self.timer.exclude(start, self.timer.mark())
            tensors.append(buffer.to(spec.dtype) if spec.dtype == torch.bool else buffer)
        return tuple(tensors)

    def _send(self, tensor: torch.Tensor, dsts: tuple[int, ...], tag: int) -> None:
        wire = tensor.to(_wire_dtype(tensor.dtype)).contiguous()
        for dst in dsts:
            self._pending_sends.append((dist.isend(wire, dst=dst, tag=tag), wire))


# [Note: vocab-parallel loss]
# A stage whose output layer is split over the vocabulary (tp_sharding "vocab_head":
# ColwiseParallel keeping its output a DTensor sharded on the last dimension) hands the
# loss function logits of which each tensor-parallel rank holds a slice. The loss runs
# under ``torch.distributed.tensor.parallel.loss_parallel``, where cross-entropy on such
# logits reduces the per-token maximum, sum of exponentials and target logit over the
# ranks (three all-reduces of one number per token) instead of gathering the
# vocabulary, as Megatron's vocab-parallel cross-entropy does (Shoeybi et al. 2019,
# section 3). The loss comes back replicated; its backward leaves each rank the
# gradient of its own slice. A loss function must therefore use ops loss_parallel
# supports on the logits (cross-entropy, reshapes), as the model files here do.
def _loss_context(out: Any) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the stage's output holds vocab-split logits, else nothing."""
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else (out,)  # a ModelOutput: its fields
    return loss_parallel() if any(isinstance(v, DTensor) for v in values) else contextlib.nullcontext()


def evaluate_actions(stages: dict[int, StageExecutor], actions: list[Action], data: list[Microbatch],
                     device: torch.device) -> torch.Tensor:
    """Run the forward actions of ``actions`` (``schedule.forwards_only``) without
    gradients: the last stage's summed scaled micro-batch losses, as ``run_actions``
    returns them, with nothing kept for a backward ([Note: held-out loss] in
    runtime/training.py)."""
    loss_sum = torch.zeros((), device=device)
    for stage in stages.values():
        stage.timer = None  # an evaluation is no step's time
    with torch.no_grad():
        for action in forwards_only(actions):
            inputs, targets = data[action.microbatch]
            loss = stages[action.stage].forward(action.microbatch, inputs, targets, keep=False)
            if loss is not None:
                loss_sum += loss.to_local() if isinstance(loss, DTensor) else loss
        for stage in stages.values():
            stage.finish()
    return loss_sum


def run_actions(stages: dict[int, StageExecutor], actions: list[Action], data: list[Microbatch],
                device: torch.device, times: StepTimer | None = None) -> torch.Tensor:
    """Run one step's actions of this rank, each on the stage it names (a rank holds
    several stages under the interleaved schedule), then wait for every send.

    Each ``before_backward`` hook is told whether a backward is the last of its stage
    in the step. In a list with W actions, backwards leave parameter gradients to the
    W actions ([Note: W actions]).

    With ``times``, marks each action and each receive's wait on the device's timeline
    ([Note: device timing]); ``times.stop()`` at the step's end settles this step's
    (forward, backward) seconds of the rank, receives' waits left out.

    Returns:
        The last stage's summed scaled micro-batch losses (see ``StageExecutor.run``);
        zero on a rank without the last stage.

    Raises:
        KeyError: an action names a stage this rank does not hold.
    """
    loss_sum = torch.zeros((), device=device)
    weights_later = any(a.kind is Kind.WEIGHT for a in actions)
    last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD}
    for stage in stages.values():
        stage.timer = times
    for i, action in enumerate(actions):
        stage = stages[action.stage]
        if times is not None:
            times.action(forward=action.kind is Kind.FORWARD)
            start = times.mark()
        inputs, targets = data[action.microbatch]
        if action.kind is Kind.FORWARD:
            loss = stage.forward(action.microbatch, inputs, targets)
            if loss is not None:
                detached = loss.detach()
                loss_sum += detached.to_local() if isinstance(detached, DTensor) else detached
        elif action.kind is Kind.BACKWARD:
            if stage.before_backward is not None:
                stage.before_backward(i == last_backward[action.stage])
            stage.backward(action.microbatch, weights_later=weights_later)
        else:
            stage.weight(action.microbatch)
        if times is not None:
            times.include(start, times.mark())
    for stage in stages.values():
        stage.finish()
    return loss_sum


__all__ = ["LossFn", "StageExecutor", "evaluate_actions", "run_actions"]
