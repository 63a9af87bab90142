"""Per-micro-batch times of one rank in one step, for the online refit.

Why marks and not a timer per micro-batch: under Megatron's schedule HSP sees only the start of
each micro-batch (its ``forward_step_func`` call); the backward of micro-batch ``m`` runs inside
the schedule between that call and the next one. So the clock records a mark at each micro-batch's
start and one at the end of the last backward; micro-batch ``m`` took ``mark[m + 1] - mark[m]``
(its forward, loss and backward, for the no-pipelining schedule: forward m, backward m, forward
m + 1, ...).

On CUDA the marks are ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream and
read once per step, after the step's end (``read``): one synchronisation on the last event per
step, none per micro-batch, so the host keeps queueing kernels ahead of the GPU. On the CPU the
marks are ``time.perf_counter`` values.
"""

from __future__ import annotations

import time
from typing import Any


class MicrobatchClock:
    """Marks at micro-batch starts and at the end of the last one; ``read`` gives durations."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.marks: list[Any] = []
        self.ended = False

    def start_step(self) -> None:
        self.marks = []
        self.ended = False

    def _now(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        """A micro-batch starts (ignored once the step's micro-batches ended)."""
        if not self.ended:
            self.marks.append(self._now())

    def end(self) -> None:
        """The last micro-batch's backward is done; later calls in the step are no-ops (the
        end may be signalled before the gradient reduction and again when the schedule
        returns)."""
        if not self.ended and self.marks:
            self.marks.append(self._now())
            self.ended = True

    def read(self) -> list[float]:
        """Seconds of each micro-batch of the step (empty if none was marked or it never
        ended). On CUDA: waits for the last event, once."""
        if not self.ended or len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [
                a.elapsed_time(b) / 1e3
                for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)
            ]
        return [b - a for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)]
