"""`LimitedH11Protocol`: uvicorn's h11 protocol, answering what it refuses with an HTTP answer in
the server's OpenAI error format instead of a connection reset.

- A request head (request line and headers) longer than ``MAX_HEAD_BYTES`` is answered 431, any
  other malformed head 400 (uvicorn answers both with a plain-text 400; h11 takes a head of any
  length that arrives in one read).
- A connection closed while its client may still be sending (a head refused here, a body
  refused unread: `engine.server.http_limits.BodyLimit`'s 413) lingers: it is half-closed (the
  answer, then FIN) and what the client still sends is dropped unparsed, until the client closes
  or ``DRAIN_S`` seconds have passed. Closing a socket with unread input sends a reset, which
  can destroy the answer before the client reads it (a 200 KB header got a reset, not an answer).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from engine.server.protocol import error_body

MAX_HEAD_BYTES = 32 * 1024
DRAIN_S = 5.0


class LimitedH11Protocol(H11Protocol):
    """Pass as ``uvicorn.Config(http=LimitedH11Protocol, h11_max_incomplete_event_size=MAX_HEAD_BYTES)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        self.refused_head = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # lingering: drop what the client still sends
            return
        if self.conn.their_state is h11.IDLE and _head_length(self.conn.trailing_data[0] + data) > self.max_head_bytes:
            self._refuse(431)
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when h11 cannot parse the request: 431 when h11 gave up on a head
        (or a chunk header) longer than the limit, else 400."""
        self._refuse(431 if len(self.conn.trailing_data[0]) > self.max_head_bytes else 400)

    def client_may_be_sending(self) -> bool:
        """Whether the client may still be sending the current request (a refused head, or a
        body the answer did not wait for)."""
        return self.refused_head or self.conn.their_state in (h11.SEND_BODY, h11.ERROR)

    def _refuse(self, status: int) -> None:
        """Answer ``status`` with the error object and ``connection: close``, then close (linger)."""
        if status == 431:
            message = f"the request line and headers exceed {self.max_head_bytes} bytes"
        else:
            message = "malformed HTTP request"
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.refused_head = True
        self.transport.close()


class _LingeringTransport:
    """A connection's transport whose first `close` lingers while the client may still be
    sending (see the module docstring); a second `close`, or one with nothing unread, closes."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._lingering = False

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
        self._transport.write_eof()  # FIN once the answer is out; the client's input still arrives
        self._transport.resume_reading()
        asyncio.get_running_loop().call_later(DRAIN_S, self._transport.close)


def _head_length(pending: bytes) -> int:
    """Bytes of the request head in ``pending`` (unparsed input from a request's start): up to
    the blank line that ends it, or all of it while that has not arrived."""
    end = pending.find(b"\r\n\r\n")
    return len(pending) if end < 0 else end
