"""The server's log lines (`LOG_FORMAT`: each with its time) and `StartupStages`: the stages of a process's start-up (file, tokenizer, config, weights, graphs,
warm-up, ...), each logged when it starts and when it ends, on one wall clock that starts with
the process, so that the times a user reads add up:

    total = now - origin = sum of the stages' seconds + other

where "other" is the time between stages (imports, spawning processes). A stage that runs work
on a device ends when the device has finished it (``synchronize``).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

# Every log line of a server's processes: when, which TP rank, what (``.format(rank=r)`` first).
LOG_FORMAT = "%(asctime)s [tp{rank}] %(levelname)s %(name)s: %(message)s"


class StartupStages:
    """Stages timed from ``origin`` (``time.perf_counter()``; default: now), logged to ``logger``
    (None: timed only, e.g. on ranks other than 0)."""

    def __init__(self, logger: Optional[logging.Logger], origin: Optional[float] = None) -> None:
        self.logger = logger
        self.origin = time.perf_counter() if origin is None else origin
        self.seconds: dict[str, float] = {}  # per stage, in the order they first ran

    def _since_origin(self) -> float:
        return time.perf_counter() - self.origin

    @contextmanager
    def stage(self, name: str, synchronize: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Time the block as stage ``name`` (a stage that runs twice adds up); logs its start
        and, once it has finished (``synchronize`` called), its end with its seconds."""
        start = time.perf_counter()
        if self.logger is not None:
            self.logger.info("start-up: %s ... (at %.1f s)", name, start - self.origin)
        yield
        synchronize()
        seconds = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if self.logger is not None:
            self.logger.info("start-up: %s done in %.1f s (at %.1f s)", name, seconds, self._since_origin())

    def summary(self) -> str:
        """``start-up T s: stage s, ..., other s``: T is the wall clock since the origin, the
        parts add up to it."""
        total = self._since_origin()
        other = max(total - sum(self.seconds.values()), 0.0)
        parts = [f"{name} {s:.1f} s" for name, s in self.seconds.items()] + [f"other {other:.1f} s"]
        return f"start-up {total:.1f} s: {', '.join(parts)}"
