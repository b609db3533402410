"""`Progress`: log lines about a long start-up phase (loading weights, capturing CUDA graphs,
warming up), at most one every ``interval_s`` seconds whatever the number of items.

    loading weights: 130/291 tensors, 210.4/491.4 MB, 35.1 MB/s, 6 s
    ...
    loading weights: done, 291 tensors, 491.4 MB in 14 s (35.1 MB/s)

A phase logs a line when it starts, then (`advance`) at most one line per ``interval_s`` seconds
of its clock, and one when it is done. Lines go to the ``engine.progress`` logger at INFO, so
``--log-level warning`` silences them; a `Progress` made with ``enabled=False`` (TP ranks other
than 0) logs nothing.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, Optional, TypeVar

logger = logging.getLogger("arfusion.engine.progress")
DEFAULT_INTERVAL_S = 5.0
T = TypeVar("T")


class Progress:
    def __init__(self, phase: str, total: int, unit: str, total_bytes: Optional[int] = None,
                 interval_s: float = DEFAULT_INTERVAL_S, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``phase`` names the work (``"loading weights"``), ``total`` its items of ``unit``
        (``"tensors"``); ``total_bytes``: the bytes of all items, when they are counted."""
        self.phase, self.total, self.unit, self.total_bytes = phase, total, unit, total_bytes
        self.interval_s = interval_s
        self.enabled = enabled and logger.isEnabledFor(logging.INFO)
        self.clock = clock
        self.done_items, self.done_bytes = 0, 0
        self.start = self._last = clock()
        if self.enabled:
            size = f" ({_mb(total_bytes)} MB)" if total_bytes is not None else ""
            logger.info("%s: %d %s%s", phase, total, unit, size)

    def advance(self, items: int = 1, nbytes: int = 0) -> None:
        """``items`` more done (``nbytes`` of them); logs a line if ``interval_s`` has passed since the last."""
        self.done_items += items
        self.done_bytes += nbytes
        now = self.clock()
        if self.enabled and now - self._last >= self.interval_s:
            self._last = now
            logger.info("%s: %s", self.phase, self._status(now))

    def finish(self) -> None:
        """Log the phase's last line: how much it did, in how long."""
        if self.enabled:
            elapsed = self.clock() - self.start
            size = f", {_mb(self.done_bytes)} MB" if self.total_bytes is not None else ""
            rate = f" ({_mb(self.done_bytes / elapsed)} MB/s)" if self.total_bytes is not None and elapsed > 0 else ""
            logger.info("%s: done, %d %s%s in %.0f s%s", self.phase, self.done_items, self.unit, size, elapsed, rate)

    def _status(self, now: float) -> str:
        elapsed = now - self.start
        parts = [f"{self.done_items}/{self.total} {self.unit}"]
        if self.total_bytes is not None:
            parts.append(f"{_mb(self.done_bytes)}/{_mb(self.total_bytes)} MB")
            if elapsed > 0:
                parts.append(f"{_mb(self.done_bytes / elapsed)} MB/s")
        parts.append(f"{elapsed:.0f} s")
        return ", ".join(parts)


def track(items: Iterable[T], progress: Progress, nbytes: Callable[[T], int] = lambda item: 0) -> Iterator[T]:
    """Yield ``items``, advancing ``progress`` by one (and ``nbytes(item)``) after each has been
    used (when the next is asked for), and finishing it at the end."""
    for item in items:
        yield item
        progress.advance(1, nbytes(item))
    progress.finish()


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"
