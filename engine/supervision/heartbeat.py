"""Worker heartbeats: how rank 0 learns that a TP worker has stopped responding.

Each TP worker (rank > 0) runs a `Heartbeat`: a daemon thread that increments its counter
``arfusion/heartbeat/<rank>`` in the rendezvous store (the TCPStore that rank 0 hosts at the
``tcp://`` init address, reached over its own connection) every ``interval_s``, and, once the
worker's runner exists (`Heartbeat.watch_steps`), raises ``arfusion/step/<rank>`` to the last forward
step that has finished on its device (`engine.runtime.step_progress`). Rank 0's
`HeartbeatMonitor` reads both every ``poll_s``; a rank whose counter has not moved for more than
``miss_after_s`` (by rank 0's clock, measured between its own reads, so a late read of rank 0
never counts against a worker) has missed its heartbeat, until it moves again. A stopped process
(SIGSTOP), a process that holds the GIL, or a lost node stop the beats; a worker busy in a forward
or waiting in a collective or a GPU kernel keeps beating.

``miss_after_s`` = min(5 s, dist_timeout / 2), ``interval_s`` = miss_after_s / 5: a worker must
miss five beats in a row, and it is reported well before the collective waiting on it fails.
``poll_s`` = interval_s / 4: rank 0 sees a beat at most ``poll_s`` after it was sent.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Iterable, Optional
from urllib.parse import urlparse

import torch.distributed as dist

from arfusion.engine.runtime.step_progress import StepProgress

logger = logging.getLogger(__name__)
MAX_MISS_S = 5.0
BEATS_PER_MISS = 5
POLLS_PER_BEAT = 4


def miss_after_s(dist_timeout: float) -> float:
    """Seconds without a beat after which a worker has missed its heartbeat."""
    return min(MAX_MISS_S, dist_timeout / 2)


def interval_s(dist_timeout: float) -> float:
    """Seconds between two beats of a worker."""
    return miss_after_s(dist_timeout) / BEATS_PER_MISS


def poll_s(dist_timeout: float) -> float:
    """Seconds between two reads of the beats (and of the finished steps) by rank 0."""
    return interval_s(dist_timeout) / POLLS_PER_BEAT


def _key(rank: int) -> str:
    return f"arfusion/heartbeat/{rank}"


def _step_key(rank: int) -> str:
    return f"arfusion/step/{rank}"


def _store(init_method: str, dist_timeout: float) -> dist.TCPStore:
    """A client connection to the rendezvous store at ``tcp://host:port``."""
    address = urlparse(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"heartbeats need a tcp://host:port rendezvous, got {init_method!r}")
    return dist.TCPStore(address.hostname, address.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=dist_timeout))


class _Ticker:
    """A daemon thread calling ``tick()`` every ``period_s`` until `stop` (or until ``tick``
    raises: the store is gone, the process is exiting)."""

    def __init__(self, name: str, period_s: float, tick: Callable[[], None]) -> None:
        self.period_s = period_s
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._tick()
                if self._stopped.wait(self.period_s):
                    return
        except Exception as exc:
            logger.debug("%s stops: %s", self._thread.name, exc)

    def stop(self) -> None:
        """End the thread (call before the process group and its store go: a store operation
        on a closed connection logs a C++ stack trace)."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.period_s + 1)


class Heartbeat(_Ticker):
    """This worker's heartbeat: increments its counter every ``interval_s``, and publishes the
    last finished step of the `StepProgress` given to `watch_steps`."""

    def __init__(self, init_method: str, rank: int, dist_timeout: float) -> None:
        self._store = _store(init_method, dist_timeout)
        self._rank = rank
        self._progress: Optional[StepProgress] = None
        self._published = 0  # the step the store holds for this rank
        super().__init__("heartbeat", interval_s(dist_timeout), self._beat)

    def watch_steps(self, progress: StepProgress) -> None:
        """From the next beat on, also publish ``progress.poll()``, the last finished step."""
        self._progress = progress

    def _beat(self) -> None:
        self._store.add(_key(self._rank), 1)
        if self._progress is not None:
            finished = self._progress.poll()
            if finished > self._published:
                self._store.add(_step_key(self._rank), finished - self._published)
                self._published = finished


class HeartbeatMonitor(_Ticker):
    """Rank 0's view of the beats of ``ranks``; `missed` is thread safe."""

    def __init__(self, init_method: str, ranks: Iterable[int], dist_timeout: float) -> None:
        self.miss_after_s = miss_after_s(dist_timeout)
        self._store = _store(init_method, dist_timeout)
        now = time.monotonic()
        self._polled = now  # when the counters were last read
        self._beats = {rank: (-1, now) for rank in ranks}  # rank -> (count, when it last changed)
        self._steps = {rank: 0 for rank in ranks}  # rank -> the last step it finished
        self.interval_s = interval_s(dist_timeout)
        super().__init__("heartbeat-monitor", poll_s(dist_timeout), self._poll)

    def _poll(self) -> None:
        for rank, (count, _) in list(self._beats.items()):
            now_count = self._store.add(_key(rank), 0)
            if now_count != count:
                self._beats[rank] = (now_count, time.monotonic())
            self._steps[rank] = self._store.add(_step_key(rank), 0)
        self._polled = time.monotonic()

    def silences(self) -> dict[int, float]:
        """Each rank's seconds without a beat, as of rank 0's last read."""
        polled = self._polled
        return {rank: max(0.0, polled - changed) for rank, (_, changed) in sorted(self._beats.items())}

    def finished_steps(self) -> dict[int, int]:
        """The last step each rank published as finished (0: none yet), as of the last read."""
        return dict(sorted(self._steps.items()))

    def missed(self) -> Optional[str]:
        """"TP worker rank R missed its heartbeat: ..." for every late rank, else None."""
        late = [(rank, silent) for rank, silent in self.silences().items() if silent > self.miss_after_s]
        if not late:
            return None
        return "; ".join(f"TP worker rank {rank} missed its heartbeat: none for {silent:.1f} s (one is due every "
                         f"{self.interval_s:.1f} s)" for rank, silent in late)
