"""`Supervisor`: brings the server down, once, when a TP worker or the scheduler fails.

The first `fail` wins; a later one, from any thread, blocks for good. It logs the culprit (the
worker that died or stopped, with the reason given beside it; else that reason), ends every
request in flight with a 500 error naming it through the ``fail_all`` given to `serving`, waits
up to ``ANSWER_WAIT_S`` for those answers to leave, kills the workers and exits the process with
1. It needs nothing from the scheduler thread, which may be blocked for good.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, NoReturn, Optional

from arfusion.engine.common.generation import EngineError
from arfusion.engine.supervision.workers import KILL_WAIT_S, WorkerSet

logger = logging.getLogger("arfusion.engine.launch_server")
CULPRIT_WAIT_S = 1.0  # how long a scheduler error waits for a worker's death to show
ANSWER_WAIT_S = 3.0  # how long the errors sent to the clients in flight get to leave
SHUTDOWN_BOUND_S = CULPRIT_WAIT_S + ANSWER_WAIT_S + KILL_WAIT_S  # most seconds `fail` waits before the exit


class Supervisor:
    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers
        self._fail_all: Optional[Callable[[EngineError], int]] = None
        self._in_flight: Callable[[], int] = lambda: 0
        self._once = threading.Lock()

    def serving(self, fail_all: Callable[[EngineError], int], in_flight: Callable[[], int]) -> None:
        """From now on a failure answers the clients before the exit: ``fail_all(error)`` ends
        every request in flight with ``error`` (returns how many), ``in_flight()`` counts the
        responses not sent yet."""
        self._fail_all, self._in_flight = fail_all, in_flight

    def fail(self, reason: str, detail: Optional[str] = None) -> NoReturn:
        """Bring the server down because of ``reason`` (any thread; never returns). ``detail``
        (a traceback) follows the one line naming the culprit: at debug level when a worker is
        to blame (a collective's error on the other ranks says only that a peer is gone), else
        at error level (a fault of rank 0's own)."""
        if not self._once.acquire(blocking=False):
            threading.Event().wait()  # another thread is already bringing the server down
        culprit = self.workers.wait_for_failure(CULPRIT_WAIT_S)
        message = reason if culprit is None or culprit == reason else f"{culprit} ({reason})"
        logger.error("%s: shutting the server down", message)
        if detail is not None:
            logger.log(logging.ERROR if culprit is None else logging.DEBUG, "the failure's traceback:\n%s", detail)
        if self._fail_all is not None:
            ended = self._fail_all(EngineError(500, f"{culprit or reason}; the server is shutting down"))
            deadline = time.monotonic() + ANSWER_WAIT_S
            while ended and self._in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.workers.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
