"""`Supervisor`: brings the server down, once, when a TP worker or the scheduler fails.

The first failure reported (from the worker monitor, the ``--dist-timeout`` watchdog or the
scheduler thread) wins; the others block. It names the culprit in the log (the worker that died
or stopped, with the reported error beside it when both are known), answers every request in
flight with a 500 error naming the culprit (else the reported error) through `Engine.fail_all`
(a stream gets an error event, then ``[DONE]``), waits a moment for those answers to leave,
kills the workers and exits the process with 1. It needs nothing from the scheduler thread,
which may be blocked for good (in a CUDA sync behind a kernel that waits on a stopped peer).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import NoReturn, Optional

from engine.common.generation import EngineError
from engine.server.engine import Engine
from engine.server.lifecycle import Lifecycle
from engine.server.workers import KILL_WAIT_S, WorkerSet

logger = logging.getLogger("engine.launch_server")
CULPRIT_WAIT_S = 1.0  # how long a scheduler error waits for a worker's death to show
ANSWER_WAIT_S = 3.0  # how long the errors sent to the clients in flight get to leave
SHUTDOWN_BOUND_S = CULPRIT_WAIT_S + ANSWER_WAIT_S + KILL_WAIT_S  # most seconds `fail` waits before the exit


class Supervisor:
    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers
        self.engine: Optional[Engine] = None
        self.lifecycle: Optional[Lifecycle] = None
        self._once = threading.Lock()

    def serving(self, engine: Engine, lifecycle: Lifecycle) -> None:
        """From now on a failure answers the clients of ``engine`` before the exit."""
        self.engine, self.lifecycle = engine, lifecycle

    def fail(self, reason: str) -> NoReturn:
        """Bring the server down because of ``reason`` (any thread; never returns)."""
        if not self._once.acquire(blocking=False):
            threading.Event().wait()  # another thread is already bringing the server down
        culprit = self.workers.wait_for_failure(CULPRIT_WAIT_S)
        message = reason if culprit is None or culprit == reason else f"{culprit} ({reason})"
        logger.error("%s: shutting the server down", message)
        if self.engine is not None and self.lifecycle is not None:
            ended = self.engine.fail_all(EngineError(500, f"{culprit or reason}; the server is shutting down"))
            deadline = time.monotonic() + ANSWER_WAIT_S
            while ended and self.lifecycle.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
        self.workers.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
