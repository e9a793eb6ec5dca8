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
free of deadlocks. Messages between two ranks go in one direction per pair (activations
forward, gradients backward) and in action-list order, so they match without tags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from runtime.distributed import Peers
from runtime.graph import Stage, TensorSpec
from runtime.precision import LossScaler
from runtime.schedule import Action, Kind
from runtime.shard import Microbatch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo cannot send bool


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
    _in_flight: dict[int, _InFlight] = field(default_factory=dict, init=False, repr=False)
    _pending_sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list, init=False, repr=False)

    def run(self, actions: list[Action], data: list[Microbatch]) -> torch.Tensor:
        """Run one step's actions on this step's micro-batches.

        Returns:
            The sum of the micro-batch losses times ``loss_weight`` divided by the number
            of micro-batches (the mean loss of this replica's share of the batch, weighted)
            on the last stage; zero elsewhere.
        """
        loss_sum = torch.zeros((), device=self.device)
        last_backward = max((i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD), default=-1)
        for i, action in enumerate(actions):
            inputs, targets = data[action.microbatch]
            if action.kind is Kind.FORWARD:
                loss = self.forward(action.microbatch, inputs, targets)
                if loss is not None:
                    loss_sum += loss.detach()
            else:
                if self.before_backward is not None:
                    self.before_backward(i == last_backward)
                self.backward(action.microbatch)
        self.finish()
        return loss_sum

    def forward(self, microbatch: int, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor | None:
        """``F``: returns the scaled loss on the last stage, None elsewhere."""
        received = self._recv(self.stage.recv, self.peers.recv_activations_from)
        for t in received:
            if t.is_floating_point():
                t.requires_grad_(True)  # a leaf: backward leaves its gradient in t.grad
        model_inputs = [inputs[i] for i in self.stage.model_inputs]
        autocast = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            out = self.stage.module(*model_inputs, *received)
            if self.stage.is_last:
                loss = self.loss_fn(out, targets) / self.num_microbatches
                if self.loss_weight != 1.0:
                    loss = loss * self.loss_weight
        if self.stage.is_last:
            self._in_flight[microbatch] = _InFlight(received=received, outputs=(loss,))
            return loss
        outputs = tuple(out)
        for t, spec in zip(outputs, self.stage.send, strict=True):
            self._send(t.detach().to(spec.dtype), self.peers.send_activations_to)
        self._in_flight[microbatch] = _InFlight(received=received, outputs=outputs)
        return None

    def backward(self, microbatch: int) -> None:
        """``B``: backpropagates one micro-batch through the stage."""
        state = self._in_flight.pop(microbatch)
        if self.stage.is_last:
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            tensors, grads = list(state.outputs), [None if scale == 1.0 else torch.full_like(state.outputs[0], scale)]
        else:
            floats = [(t, spec) for t, spec in zip(state.outputs, self.stage.send) if spec.dtype.is_floating_point]
            received = self._recv(tuple(spec for _, spec in floats), self.peers.recv_grads_from)
            pairs = [(t, g.to(t.dtype)) for (t, _), g in zip(floats, received)]
            tensors = [t for t, _ in pairs if t.requires_grad]
            grads = [g for t, g in pairs if t.requires_grad]
        if tensors:
            torch.autograd.backward(tensors, grads)
        for t, spec in zip(state.received, self.stage.recv):
            if spec.dtype.is_floating_point:
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._send(grad.to(spec.dtype), self.peers.send_grads_to)

    def finish(self) -> None:
        """Wait for every send of this step."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()
        if self._in_flight:
            left = ", ".join(str(i) for i in sorted(self._in_flight))
            raise RuntimeError(f"the schedule left micro-batches {left} without a backward")

    def _recv(self, specs: tuple[TensorSpec, ...], src: int | None) -> tuple[torch.Tensor, ...]:
        if not specs:
            return ()
        if src is None:
            raise RuntimeError("a stage with pipeline inputs has no peer to receive them from")
        tensors = []
        for spec in specs:
            buffer = torch.empty(spec.shape, dtype=_wire_dtype(spec.dtype), device=self.device)
            dist.irecv(buffer, src=src).wait()
            tensors.append(buffer.to(spec.dtype) if spec.dtype == torch.bool else buffer)
        return tuple(tensors)

    def _send(self, tensor: torch.Tensor, dsts: tuple[int, ...]) -> None:
        wire = tensor.to(_wire_dtype(tensor.dtype)).contiguous()
        for dst in dsts:
            self._pending_sends.append((dist.isend(wire, dst=dst), wire))


__all__ = ["LossFn", "StageExecutor"]
