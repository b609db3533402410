"""`BodyLimit`: the request body limits, enforced before the app reads or parses a body: its size
(``--max-request-bytes``) and the time it may take to arrive (``--request-body-timeout``).

A request whose ``Content-Length`` exceeds the limit is answered 413 before any of its body is
read. A body without a length (chunked) is read up to the limit and answered 413 as soon as it
passes it. A body within the limit is read whole and handed to the app unchanged, so no body is
parsed that could exceed the limit: JSON parsing and validation on the event loop take at most
the time of ``max_bytes`` bytes. The 413 is the server's OpenAI error object naming the limit,
with ``connection: close``: the rest of the refused body is dropped unparsed while the client
reads the answer (`engine.server.http.protocol.LimitedH11Protocol` lingers).

A body not complete ``timeout_s`` seconds after its request's head (a client that declares a
longer Content-Length than it sends, or sends a few bytes at a time) is answered 408 the same
way, and logged: no client holds a connection (and an app task) for longer. The time a request
head may take is `LimitedH11Protocol`'s limit.

Default: `max_request_bytes` = 64 bytes per token of the context length, at least 1 MiB. A
prompt of a full context takes a few bytes per token as text (about 4 characters a token, up to
6 bytes per character JSON-escaped) and at most 8 as token ids, so this refuses no request that
could fit the context and still refuses a 20 MB body below a 300k-token context.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arfusion.engine.server.http.errors import error_body

logger = logging.getLogger(__name__)
BYTES_PER_CONTEXT_TOKEN = 64
MIN_REQUEST_BYTES = 1 << 20


def max_request_bytes(given: Optional[int], context_len: int) -> int:
    """``given`` (``--max-request-bytes``), else ``max(1 MiB, 64 x context_len)``."""
    if given is not None:
        return given
    return max(MIN_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * context_len)


class BodyLimit:
    """ASGI middleware: HTTP requests reach ``app`` with their whole body read (within
    ``max_bytes``, within ``timeout_s`` seconds), or are answered 413 or 408 here."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, 413, f"the request body has {declared} bytes; the limit is {self.max_bytes} bytes "
                                     f"(--max-request-bytes)")
            return
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                client = scope.get("client")
                expected = f"of {declared} " if declared is not None else ""
                logger.warning("408 to %s: %d %sbody bytes of %s %s in %g s (--request-body-timeout)",
                               f"{client[0]}:{client[1]}" if client else "a client", size, expected,
                               scope.get("method"), scope.get("path"), self.timeout_s)
                await _refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                         f"({size} {expected}bytes came; --request-body-timeout)")
                return
            if message["type"] == "http.disconnect":
                return  # the client left (or the server shuts down) before the body was complete: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, 413, f"the request body (sent without a Content-Length) is longer; the limit "
                                         f"is {self.max_bytes} bytes (--max-request-bytes)")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay_body(b"".join(chunks), receive), send)


async def _refuse(send: Send, status: int, message: str) -> None:
    """Answer ``status`` with the error object naming ``message``, and ``connection: close``."""
    await send_json(send, status, error_body(status, message), close=True)


async def send_json(send: Send, status: int, content: dict[str, Any], close: bool = False) -> None:
    """Answer ``status`` with ``content`` as JSON (and ``connection: close`` if ``close``)."""
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})


def content_length(scope: Scope) -> Optional[int]:
    """The declared body length, None when there is none (a chunked body) or it is not a number
    (the HTTP parser refuses such a request before it gets here)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that first gives ``body`` as the whole request, then passes on ``receive``'s
    messages (the disconnect a streaming response waits for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
