"""`DrainingServer`: uvicorn's server with a graceful shutdown on SIGTERM/SIGINT.

On the first signal the server keeps listening but drains: `Lifecycle.draining` makes the app
answer new generation requests with 503, and the requests in flight get ``grace_s`` seconds to
finish. Then ``end_requests()`` ends the rest with an error (their clients get a JSON error, or
an error event and ``[DONE]``), and once every response has been sent (or ``ANSWER_WAIT_S``
later) uvicorn stops: no request is cut mid-response and no task is cancelled, so the log holds
no traceback. A second signal ends the grace period at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Callable, Optional

import uvicorn

from engine.server.lifecycle import Lifecycle

logger = logging.getLogger("engine.launch_server")
ANSWER_WAIT_S = 3.0  # after the grace period: time for the ended requests' errors to be sent
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float,
                 end_requests: Callable[[], int]) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self.end_requests = end_requests  # ends every request still in flight; returns how many
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._grace_over: Optional[asyncio.Event] = None
        self._drain: Optional[asyncio.Task[None]] = None

    async def serve(self, sockets: Optional[list] = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._grace_over = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """The signal handler uvicorn installs: start draining, or end the grace period early.
        (Runs between two bytecodes of the event loop's thread: only hand work to the loop.)"""
        assert self._loop is not None and self._grace_over is not None  # installed by serve()
        if self._drain is None:
            self._loop.call_soon_threadsafe(self._start_draining, sig)
        else:
            self._loop.call_soon_threadsafe(self._grace_over.set)

    def _start_draining(self, sig: int) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit(signal.Signals(sig).name))

    async def _drain_then_exit(self, signal_name: str) -> None:
        self.lifecycle.draining = True
        logger.info("%s: taking no new requests; %d in flight may run for up to %.1f s (--shutdown-timeout)",
                    signal_name, self.lifecycle.in_flight, self.grace_s)
        await self._until_idle(self.grace_s)
        if self.lifecycle.in_flight:
            ended = self.end_requests()
            logger.info("ended %d requests still running after the grace period", ended)
            await self._until_idle(ANSWER_WAIT_S)
        self.should_exit = True

    async def _until_idle(self, timeout_s: float) -> None:
        """Wait until no request is in flight, ``timeout_s`` has passed or a second signal came."""
        assert self._grace_over is not None
        deadline = time.monotonic() + timeout_s
        while self.lifecycle.in_flight and time.monotonic() < deadline and not self._grace_over.is_set():
            await asyncio.sleep(POLL_S)
