"""`DrainingServer`: uvicorn's server with a graceful shutdown on SIGTERM/SIGINT.

On the first signal the server keeps listening but drains: `Lifecycle.draining` makes the app
answer new generation requests with 503, and the requests in flight get ``grace_s`` seconds to
finish. Then ``end_requests()`` ends the rest with an error (their clients get a JSON error, or
an error event and ``[DONE]``), and once every response has been sent (or ``ANSWER_WAIT_S``
later) uvicorn stops: no request is cut mid-response and no task is cancelled, so the log holds
no traceback. A second signal ends the grace period at once.

Readiness: the launcher binds the port with `bind_http_socket` before the model loads (a taken
port fails at once), but listens only when uvicorn starts serving it: until then a client's
connection is refused, not queued. ``on_serving`` is called once the socket accepts requests.
`http_config` is uvicorn's configuration for the app: the request limits (`HttpLimits`) of
`engine.server.http.limits` and `engine.server.http.protocol`, and, with a `ParserPool`, large
bodies screened in its parser processes (`engine.server.http.large_bodies`). The server starts
the pool before it listens and stops it once it no longer serves.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import signal
import socket
import time
from dataclasses import dataclass
from types import FrameType
from typing import Callable, Optional

import uvicorn
from starlette.types import ASGIApp

from arfusion.engine.server.http.large_bodies import LargeBodies
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.limits import BodyLimit
from arfusion.engine.server.http.parser_pool import ParserPool
from arfusion.engine.server.http.protocol import MAX_HEAD_BYTES, LimitedH11Protocol

logger = logging.getLogger("arfusion.engine.launch_server")
ANSWER_WAIT_S = 3.0  # after the grace period: time for the ended requests' errors to be sent
POLL_S = 0.05
GRACEFUL_SHUTDOWN_S = 3.0  # uvicorn's wait for the connections to close once the server stops
LISTEN_BACKLOG = 2048  # uvicorn's default


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not listening yet (`DrainingServer` listens when it
    serves). Bound exclusively (no SO_REUSEADDR), so that a second server fails to bind the port
    even while this one still loads; only when that fails for connections of an earlier run
    (TIME_WAIT) is it bound with SO_REUSEADDR, which succeeds while no server listens on it.
    ValueError naming the address when it cannot be bound (another server has it, a host that
    is not this machine's)."""
    try:
        return _bound(host, port, reuse=False)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise _unavailable(host, port, exc) from None
    try:
        return _bound(host, port, reuse=True)
    except OSError as exc:
        raise _unavailable(host, port, exc) from None


def _bound(host: str, port: int, reuse: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class HttpLimits:
    """What one client may take of the HTTP server (`http_config`): a request body of at most
    ``max_request_bytes``, sent within ``body_timeout_s`` of its head (else 413 / 408,
    `BodyLimit`); a head within ``head_timeout_s`` (else 408) and one of at most
    ``max_connections`` open connections (else 503), `LimitedH11Protocol`."""

    max_request_bytes: int
    head_timeout_s: float
    body_timeout_s: float
    max_connections: int


@dataclass(frozen=True)
class BodyParsing:
    """Request bodies over ``min_bytes`` are screened by ``pool`` (`LargeBodies`)."""

    pool: ParserPool
    min_bytes: int


def http_config(app: ASGIApp, limits: HttpLimits, log_level: str,
                parsing: Optional[BodyParsing] = None) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` behind ``limits`` (and ``parsing``); heads over
    ``MAX_HEAD_BYTES`` get 431."""
    protocol = functools.partial(LimitedH11Protocol, head_timeout_s=limits.head_timeout_s,
                                 max_connections=limits.max_connections)
    if parsing is not None:
        app = LargeBodies(app, parsing.pool, parsing.min_bytes)
    return uvicorn.Config(BodyLimit(app, limits.max_request_bytes, limits.body_timeout_s), log_level=log_level,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, http=protocol,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES)


def _unavailable(host: str, port: int, exc: OSError) -> ValueError:
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return ValueError(f"cannot serve on {url} (--host, --port): {(exc.strerror or str(exc)).lower()}")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float,
                 end_requests: Callable[[], int], on_serving: Callable[[], None] = lambda: None,
                 parsers: Optional[ParserPool] = None) -> None:
        super().__init__(config)
        self.parsers = parsers  # started before the server listens, stopped once it no longer serves
        self.on_serving = on_serving
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self.end_requests = end_requests  # ends every request still in flight; returns how many
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._grace_over: Optional[asyncio.Event] = None
        self._drain: Optional[asyncio.Task[None]] = None

    async def serve(self, sockets: Optional[list] = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._grace_over = asyncio.Event()
        try:
            if self.parsers is not None:
                await self.parsers.start()
            await super().serve(sockets)
        finally:
            if self.parsers is not None:
                await self.parsers.stop()

    async def startup(self, sockets: Optional[list] = None) -> None:
        """uvicorn's start-up (it listens on ``sockets``, or binds its host and port), then
        ``on_serving``. ValueError naming the address when a socket cannot listen (another server
        began listening on the port since it was bound)."""
        for sock in sockets or ():
            try:
                # the connections it accepts inherit SO_REUSEADDR: theirs in TIME_WAIT, after
                # this server exits, do not keep the next one from binding the port
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.listen(LISTEN_BACKLOG)
            except OSError as exc:
                raise _unavailable(*sock.getsockname()[:2], exc) from None
        await super().startup(sockets)
        if self.started:
            self.on_serving()

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
