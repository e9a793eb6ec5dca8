"""Step and action times that are true on every device.

[Note: device timing]
On a CPU an operation has finished when the call returns, so ``time.perf_counter()``
around it is its time. On a GPU a call only queues kernels: the host runs ahead, and a
host timer around a forward measures its launches, not its work. So:

- A step's time is host time from its start to a ``synchronize`` at its end
  (``StepTimer.stop``): one wait per step, where the step ends anyway, so timing
  costs no overlap inside the step. The previous step's ``stop`` left the device idle,
  so the step's start is the host's start.
- An action's time (a forward, a backward) comes from a pair of CUDA events recorded
  on the compute stream around it (``StepTimer.mark``), read after ``stop``'s
  synchronize; recording an event queues a few bytes and never waits.
- A receive's wait is left out of its action: ``irecv(...).wait()`` blocks the host on
  gloo and makes the compute stream wait on NCCL, and a pair of marks around it catches
  either (``StepTimer.exclude``).

On a CPU the marks are ``perf_counter()`` readings and ``synchronize`` does nothing,
so one code path serves both.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch


class Span(NamedTuple):
    """Two marks on the device's timeline: part of a forward's or a backward's time, or
    (``excluded``) a receive's wait inside one."""

    forward: bool
    start: object  # a perf_counter() reading, or a recorded torch.cuda.Event
    end: object
    excluded: bool

    def seconds(self) -> float:
        """The span's length; on CUDA, once the device has passed ``end``."""
        if isinstance(self.start, float):
            return self.end - self.start
        return self.start.elapsed_time(self.end) / 1e3  # CUDA events measure milliseconds

class StepTimer:
    """Times each step, and inside it each rank's forwards and backwards.

    ``steps`` holds the settled (forward_s, backward_s) of every stopped step that ran
    actions under this timer: its actions' time less their receives' waits (W actions
    count as backward), as ``hetpar validate`` compares them with the predicted stage
    times.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.steps: list[tuple[float, float]] = []
        self.spans: list[Span] = []  # marked since the last settle
        self._forward = True  # the kind of the action running now: receives' waits go to it
        self._started_s: float | None = None

    def mark(self):
        """A point on the device's timeline: an event recorded on the current stream, or now."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (nothing on a CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        """The step starts now."""
        self._started_s = time.perf_counter()

    def action(self, forward: bool) -> None:
        """The next marks belong to a forward (True) or a backward or W action (False)."""
        self._forward = forward

    @contextmanager
    def measure(self, *, forward: bool) -> Iterator[None]:
        """Count the time of the block as a forward's (True) or a backward's (False)."""
        self.action(forward)
        start = self.mark()
        yield
        self.include(start, self.mark())

    def include(self, start, end) -> None:
        """Count the span between two marks as the current action's time."""
        self.spans.append(Span(self._forward, start, end, excluded=False))

    def exclude(self, start, end) -> None:
        """Take the span between two marks (a receive's wait) out of the current action's time."""
        self.spans.append(Span(self._forward, start, end, excluded=True))

    def stop(self) -> float:
        """End the step: wait for the device, settle its action times; returns the step's seconds."""
        self.synchronize()
        elapsed = time.perf_counter() - self._started_s if self._started_s is not None else 0.0
        self._started_s = None
        self.settle()
        return elapsed

    def settle(self) -> None:
        """Turn the marks taken since the last settle into one (forward_s, backward_s) in
        ``steps``; the device must have finished the work they mark (``synchronize``)."""
        if not self.spans:
            return
        split = [0.0, 0.0]
        for span in self.spans:
            split[0 if span.forward else 1] += -span.seconds() if span.excluded else span.seconds()
        self.spans.clear()
        self.steps.append((max(split[0], 0.0), max(split[1], 0.0)))


__all__ = ["Span", "StepTimer"]
