"""`StepProgress`: which forward steps of this TP rank have begun, and which have finished on
its device.

Steps are numbered 1, 2, ... in the order they begin. Every rank runs the same plans in the
same order (rank 0 broadcasts them, warm-up included), so step n is the same step on every rank.
A step begins when `ModelRunner.forward` starts and its work is all queued at the end of
`ModelRunner.commit_tokens` (`end`; a step with no `end` is taken to end when the next one
begins). It has finished when that work has run: on a GPU, when a CUDA event recorded at `end`
has completed (the host does not wait for the device, so a step can be queued long before it
finishes); on the CPU, at `end`.

Threads: `begin` and `end` run on the thread that drives the runner; `poll` (which queries CUDA
events, and so may block if the driver does) runs on a monitoring thread or at `end`;
`oldest_unfinished` and `finished` touch no device and never block, so a watchdog that reads
them keeps running whatever the device and the other threads do. No thread may `poll` while
another captures a CUDA graph (an event query would break the capture): the engine polls only
once its runner is built, after the capture.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class _Step:
    number: int
    began_at: float  # time.monotonic() at `begin`
    ended: bool = False
    event: Optional[torch.cuda.Event] = None  # completes when the step's device work has run


class StepProgress:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._begun = 0
        self._finished = 0
        self._pending: deque[_Step] = deque()  # begun, not known to have finished; oldest first

    def begin(self) -> int:
        """A new step begins now (ending the previous one if it had no `end`); returns its number.
        Polls first, so the steps kept are only those the device has not run yet."""
        self._end_open()
        self.poll()
        with self._lock:
            self._begun += 1
            self._pending.append(_Step(self._begun, time.monotonic()))
            return self._begun

    def end(self) -> None:
        """The current step's work is all queued (no step begun: nothing to end)."""
        self._end_open()
        self.poll()

    def _end_open(self) -> None:
        """Mark the newest step ended, recording its completion event on the current stream."""
        with self._lock:
            step = self._pending[-1] if self._pending and not self._pending[-1].ended else None
        if step is None:
            return
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
            step.event = event
        step.ended = True

    def poll(self) -> int:
        """Advance `finished` past every ended step whose device work has run (queries CUDA
        events, never waits for them); returns `finished`."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0].ended:
                    return self._finished
                head = self._pending[0]
            if head.event is not None and not self._query(head.event):
                return self._finished
            with self._lock:
                if self._pending and self._pending[0] is head:
                    self._pending.popleft()
                    self._finished = head.number

    def _query(self, event: torch.cuda.Event) -> bool:
        with torch.cuda.device(self.device):
            return event.query()

    @property
    def finished(self) -> int:
        """The last step known to have finished (0: none), as of the last `poll`."""
        with self._lock:
            return self._finished

    def oldest_unfinished(self) -> Optional[tuple[int, float]]:
        """(number, time.monotonic() it began) of the oldest step not known to have finished,
        or None when every step begun has finished."""
        with self._lock:
            return (self._pending[0].number, self._pending[0].began_at) if self._pending else None
