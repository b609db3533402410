"""`LimitedH11Protocol`: uvicorn's h11 protocol with the connection-level limits uvicorn lacks,
answering what it refuses with an HTTP answer in the server's OpenAI error format instead of a
connection reset.

- A request head (request line and headers) longer than ``MAX_HEAD_BYTES`` is answered 431, any
  other malformed head 400 (uvicorn answers both with a plain-text 400; h11 takes a head of any
  length that arrives in one read).
- A head that is not complete ``head_timeout_s`` seconds after the connection was made (its
  first request) or after the request's first byte arrived (later requests on a kept-alive
  connection; the idle time before it is uvicorn's ``timeout_keep_alive``) is answered 408, and
  logged: a client that sends nothing, or a byte at a time, holds no connection for longer.
  (The body's deadline is `engine.server.http.limits.BodyLimit`'s.)
- A connection made while ``max_connections`` are open is answered 503 at once and closed, and
  logged. (uvicorn's ``limit_concurrency`` counts the same connections but refuses only a
  complete request head, in plain text: a connection that never completes one is never refused.)
- At shutdown, a request whose body is still arriving is answered 503 and its app task ends
  (its ``receive`` says the client left), instead of being cancelled by uvicorn's graceful
  shutdown timeout with a traceback in the log.
- A connection closed while its client may still be sending (a refused head, a body refused
  unread: `BodyLimit`'s 413 and 408) lingers: it is half-closed (the answer, then FIN) and what
  the client still sends is dropped unparsed, until the client closes or ``DRAIN_S`` seconds have
  passed (``SHUTDOWN_DRAIN_S`` at shutdown, within uvicorn's graceful shutdown time). Closing a
  socket with unread input sends a reset, which can destroy the answer before the client reads
  it (a 200 KB header got a reset, not an answer). A lingering connection no longer counts
  towards ``max_connections``: it has had its answer, and its socket closes within ``DRAIN_S``.

Pass ``functools.partial(LimitedH11Protocol, head_timeout_s=..., max_connections=...)`` as
uvicorn's ``http`` with ``h11_max_incomplete_event_size=MAX_HEAD_BYTES``
(`engine.server.http.server.http_config`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from arfusion.engine.server.http.errors import error_body

logger = logging.getLogger(__name__)
MAX_HEAD_BYTES = 32 * 1024
DRAIN_S = 5.0
SHUTDOWN_DRAIN_S = 1.0


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring."""

    def __init__(self, *args: Any, head_timeout_s: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections
        self.refused = False  # answered here (not by the app): the client may still be sending
        self._head_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._linger = _LingeringTransport(transport, self)
        super().connection_made(self._linger)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            logger.warning("503 to %s: %d connections are open, the limit is %d (--max-connections)",
                           _address(self.client), len(self.connections) - 1, self.max_connections)
            self._refuse(503, f"the server has {self.max_connections} open connections, its limit "
                              f"(--max-connections); try again later")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # lingering: drop what the client still sends
            return
        if self.conn.their_state is h11.IDLE and _head_length(self.conn.trailing_data[0] + data) > self.max_head_bytes:
            self._refuse(431, f"the request line and headers exceed {self.max_head_bytes} bytes")
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # a head has begun (or is still arriving); uvicorn's keep-alive timer is off
        else:
            self._cancel_head_timer()  # the head is complete: BodyLimit times the body

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when h11 cannot parse the request: 431 when h11 gave up on a head
        (or a chunk header) longer than the limit, else 400."""
        if len(self.conn.trailing_data[0]) > self.max_head_bytes:
            self._refuse(431, f"the request line and headers exceed {self.max_head_bytes} bytes")
        else:
            self._refuse(400, "malformed HTTP request")

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown of this connection; a request whose body is still
        arriving is answered 503 and its app sees a disconnect (the module docstring)."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.conn.their_state is not h11.SEND_BODY:
            super().shutdown()
            return
        cycle.disconnected = True
        cycle.message_event.set()  # BodyLimit's receive returns http.disconnect: the app task ends
        self._linger.drain_s = SHUTDOWN_DRAIN_S
        self._refuse(503, "the server is shutting down and takes no new requests")

    def client_may_be_sending(self) -> bool:
        """Whether the client may still be sending the current request (a head refused here, or
        a body the answer did not wait for)."""
        return self.refused or self.conn.their_state in (h11.SEND_BODY, h11.ERROR)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        received = len(self.conn.trailing_data[0])
        logger.warning("408 to %s: %d bytes of a request head in %g s (--request-head-timeout)",
                       _address(self.client), received, self.head_timeout_s)
        self._refuse(408, f"the request line and headers did not arrive within {self.head_timeout_s:g} s "
                          f"(--request-head-timeout)")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with the error object and ``connection: close``, then close (linger)."""
        self._cancel_head_timer()
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.refused = True
        self.transport.close()


class _LingeringTransport:
    """A connection's transport whose first `close` lingers for ``drain_s`` while the client
    may still be sending (see the module docstring); a second `close`, or one with nothing
    unread, closes."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._lingering = False
        self.drain_s = DRAIN_S

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        if (self._lingering or self._transport.is_closing() or not self._protocol.client_may_be_sending()
                or not self._transport.can_write_eof()):
            self._transport.close()
            return
        self._lingering = True
        self._protocol.connections.discard(self._protocol)  # its slot of --max-connections is free now
        self._transport.write_eof()  # FIN once the answer is out; the client's input still arrives
        self._transport.resume_reading()
        asyncio.get_running_loop().call_later(self.drain_s, self._transport.close)


def _address(client: Optional[tuple[str, int]]) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def _head_length(pending: bytes) -> int:
    """Bytes of the request head in ``pending`` (unparsed input from a request's start): up to
    the blank line that ends it, or all of it while that has not arrived."""
    end = pending.find(b"\r\n\r\n")
    return len(pending) if end < 0 else end
