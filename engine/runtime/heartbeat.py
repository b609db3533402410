"""Worker heartbeats: how rank 0 learns that a TP worker has stopped responding before a
collective times out (``--dist-timeout``), so that ``/health`` can say so.

Each TP worker (rank > 0) runs a `Heartbeat`: a daemon thread that increments its counter
``arfusion/heartbeat/<rank>`` in the rendezvous store (the TCPStore that rank 0 hosts at the
``tcp://`` init address, reached over its own connection) every ``interval_s``. Rank 0's
`HeartbeatMonitor` reads the counters every ``interval_s``; a rank whose counter has not moved
for more than ``miss_after_s`` (by rank 0's clock, measured between its own reads, so a late
read of rank 0 never counts against a worker) has missed its heartbeat, until it moves again.
A stopped process (SIGSTOP), a process that holds the GIL, or a lost node stop the beats; a
worker busy in a forward or waiting in a collective keeps beating.

``miss_after_s`` = min(5 s, dist_timeout / 2), ``interval_s`` = miss_after_s / 5: a worker must
miss five beats in a row, and it is reported well before the collective waiting on it fails.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Iterable, Optional
from urllib.parse import urlparse

import torch.distributed as dist

logger = logging.getLogger(__name__)
MAX_MISS_S = 5.0
BEATS_PER_MISS = 5


def miss_after_s(dist_timeout: float) -> float:
    """Seconds without a beat after which a worker has missed its heartbeat."""
    return min(MAX_MISS_S, dist_timeout / 2)


def _key(rank: int) -> str:
    return f"arfusion/heartbeat/{rank}"


def _store(init_method: str, dist_timeout: float) -> dist.TCPStore:
    """A client connection to the rendezvous store at ``tcp://host:port``."""
    address = urlparse(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"heartbeats need a tcp://host:port rendezvous, got {init_method!r}")
    return dist.TCPStore(address.hostname, address.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=dist_timeout))


class _Ticker:
    """A daemon thread calling ``tick()`` every ``interval_s`` until `stop` (or until ``tick``
    raises: the store is gone, the process is exiting)."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._tick()
                if self._stopped.wait(self.interval_s):
                    return
        except Exception as exc:
            logger.debug("%s stops: %s", self._thread.name, exc)

    def stop(self) -> None:
        """End the thread (call before the process group and its store go: a store operation
        on a closed connection logs a C++ stack trace)."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.interval_s + 1)


class Heartbeat(_Ticker):
    """This worker's heartbeat: increments its counter every ``interval_s``."""

    def __init__(self, init_method: str, rank: int, dist_timeout: float) -> None:
        store = _store(init_method, dist_timeout)
        super().__init__("heartbeat", miss_after_s(dist_timeout) / BEATS_PER_MISS, lambda: store.add(_key(rank), 1))


class HeartbeatMonitor(_Ticker):
    """Rank 0's view of the beats of ``ranks``; `missed` is thread safe."""

    def __init__(self, init_method: str, ranks: Iterable[int], dist_timeout: float) -> None:
        self.miss_after_s = miss_after_s(dist_timeout)
        self._store = _store(init_method, dist_timeout)
        now = time.monotonic()
        self._polled = now  # when the counters were last read
        self._beats = {rank: (-1, now) for rank in ranks}  # rank -> (count, when it last changed)
        super().__init__("heartbeat-monitor", self.miss_after_s / BEATS_PER_MISS, self._poll)

    def _poll(self) -> None:
        for rank, (count, _) in list(self._beats.items()):
            now_count = self._store.add(_key(rank), 0)
            if now_count != count:
                self._beats[rank] = (now_count, time.monotonic())
        self._polled = time.monotonic()

    def missed(self) -> Optional[str]:
        """"TP worker rank R missed its heartbeat: ..." for every late rank, else None."""
        polled = self._polled
        late = [(rank, polled - changed) for rank, (_, changed) in sorted(self._beats.items())
                if polled - changed > self.miss_after_s]
        if not late:
            return None
        return "; ".join(f"TP worker rank {rank} missed its heartbeat: none for {silent:.1f} s (one is due every "
                         f"{self.interval_s:.1f} s)" for rank, silent in late)
