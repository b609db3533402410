"""`DistWatchdog`: TP rank 0 enforces ``--dist-timeout`` itself, whether or not any collective
or kernel ever returns.

A fused kernel that waits on a peer's flags in GPU memory spins until the peer arrives, and
rank 0's scheduler thread with it; the watchdog is a thread of its own that needs neither the
scheduler nor the device. It calls ``on_timeout(reason)`` once, on the first of:

- **a silent worker**: rank R's heartbeat (`engine.supervision.heartbeat`) has been missing for
  ``dist_timeout``: "TP worker rank R sent no heartbeat for S s (--dist-timeout T s)";
- **a stalled step**: rank 0's oldest unfinished forward step (`engine.runtime.step_progress`)
  began more than ``dist_timeout`` ago while no worker misses its heartbeat (all ranks alive, a
  kernel or collective waits for something that never comes): "FusionTimeoutError: step N has
  been in flight for S s (--dist-timeout T s) ...; ranks that did not finish it: 0, 1" (from
  the steps the workers published, `HeartbeatMonitor.finished_steps`). While a worker misses
  its heartbeat, the first rule decides: it names the silent rank.

Bounds: it checks every ``poll_s`` (the monitor's read period), so it fires at most
`detection_bound_s` after the silence or the step passed ``dist_timeout`` (measured from the
last beat rank 0 saw, and from the step's start on rank 0). It never fires earlier.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.engine.supervision.heartbeat import HeartbeatMonitor, poll_s
from arfusion.fusion.errors import FusionTimeoutError

logger = logging.getLogger(__name__)


def detection_bound_s(dist_timeout: float) -> float:
    """Most seconds between a worker's last beat + ``dist_timeout`` and ``on_timeout``: the
    beat is read up to one poll late, the silence is measured at reads, the check runs a poll
    later (three polls)."""
    return 3 * poll_s(dist_timeout)


class DistWatchdog:
    def __init__(self, monitor: HeartbeatMonitor, dist_timeout: float, on_timeout: Callable[[str], None]) -> None:
        """Watch ``monitor``'s workers from now on (and rank 0's steps from `watch_steps` on)."""
        self.monitor = monitor
        self.dist_timeout = dist_timeout
        self._on_timeout = on_timeout
        self._progress: Optional[StepProgress] = None
        self._stopped = threading.Event()
        self._checker = threading.Thread(target=self._run, name="dist-watchdog", daemon=True)
        self._poller: Optional[threading.Thread] = None
        self._checker.start()

    def watch_steps(self, progress: StepProgress) -> None:
        """Also bound rank 0's forward steps: a thread of its own polls ``progress`` (CUDA event
        queries may block; the checks never wait for them)."""
        self._progress = progress
        self._poller = threading.Thread(target=self._poll_steps, name="step-poller", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stopped.set()
        for thread in (self._checker, self._poller):
            if thread is not None:
                thread.join(timeout=2 * poll_s(self.dist_timeout) + 1)

    def _poll_steps(self) -> None:
        while not self._stopped.wait(poll_s(self.dist_timeout)):
            self._progress.poll()

    def _run(self) -> None:
        while not self._stopped.wait(poll_s(self.dist_timeout)):
            reason = self.timeout_reason()
            if reason is not None:
                logger.error("--dist-timeout %g s passed: %s", self.dist_timeout, reason)
                self._on_timeout(reason)
                return

    def timeout_reason(self) -> Optional[str]:
        """Why the server must go down now (see the module docstring), or None."""
        silent = [(rank, s) for rank, s in self.monitor.silences().items() if s >= self.dist_timeout]
        if silent:
            return "; ".join(f"TP worker rank {rank} sent no heartbeat for {s:.1f} s (--dist-timeout "
                             f"{self.dist_timeout:g} s)" for rank, s in silent)
        oldest = self._progress.oldest_unfinished() if self._progress is not None else None
        if oldest is None or self.monitor.missed() is not None:
            return None
        step, began_at = oldest
        in_flight = time.monotonic() - began_at
        if in_flight < self.dist_timeout:
            return None
        behind = [0] + [rank for rank, done in self.monitor.finished_steps().items() if done < step]
        error = FusionTimeoutError(
            f"step {step} has been in flight for {in_flight:.1f} s (--dist-timeout {self.dist_timeout:g} s) while "
            f"every TP worker's heartbeat beats (a fused kernel or a collective waits for a peer that never "
            f"arrives); ranks that did not finish it: {', '.join(map(str, behind))}")
        return f"{type(error).__name__}: {error}"


class GroupWatch:
    """Rank 0's watch over a TP group of more than one rank: the workers' heartbeats (for
    ``/health``: `missed`) and the `DistWatchdog` over them and, from `watch_steps` on, over
    rank 0's steps. `quiesce` stops the watchdog (a clean shutdown begins: no step or beat is
    due any more); `stop` stops both (idempotent)."""

    def __init__(self, init_method: str, tp_size: int, dist_timeout: float, on_timeout: Callable[[str], None]) -> None:
        self.monitor = HeartbeatMonitor(init_method, range(1, tp_size), dist_timeout)
        self.watchdog = DistWatchdog(self.monitor, dist_timeout, on_timeout)

    def watch_steps(self, progress: StepProgress) -> None:
        self.watchdog.watch_steps(progress)

    def missed(self) -> Optional[str]:
        return self.monitor.missed()

    def quiesce(self) -> None:
        self.watchdog.stop()

    def stop(self) -> None:
        self.watchdog.stop()
        self.monitor.stop()
