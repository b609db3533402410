"""`BodyLimit`: the request body limit (``--max-request-bytes``), enforced before the app reads
or parses a body.

A request whose ``Content-Length`` exceeds the limit is answered 413 before any of its body is
read. A body without a length (chunked) is read up to the limit and answered 413 as soon as it
passes it. A body within the limit is read whole and handed to the app unchanged, so no body is
parsed that could exceed the limit: JSON parsing and validation on the event loop take at most
the time of ``max_bytes`` bytes. The 413 is the server's OpenAI error object naming the limit,
with ``connection: close``: the rest of the refused body is dropped unparsed while the client
reads the answer (`engine.server.http_protocol.LimitedH11Protocol` lingers).

Default: `max_request_bytes` = 64 bytes per token of the context length, at least 1 MiB. A
prompt of a full context takes a few bytes per token as text (about 4 characters a token, up to
6 bytes per character JSON-escaped) and at most 8 as token ids, so this refuses no request that
could fit the context and still refuses a 20 MB body below a 300k-token context.
"""
from __future__ import annotations

import json
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.protocol import error_body

BYTES_PER_CONTEXT_TOKEN = 64
MIN_REQUEST_BYTES = 1 << 20


def max_request_bytes(given: Optional[int], context_len: int) -> int:
    """``given`` (``--max-request-bytes``), else ``max(1 MiB, 64 x context_len)``."""
    if given is not None:
        return given
    return max(MIN_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * context_len)


class BodyLimit:
    """ASGI middleware: HTTP requests reach ``app`` with their whole body read (within
    ``max_bytes``), or are answered 413 here."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"the request body has {declared} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, "the request body (sent without a Content-Length) is longer")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, what: str) -> None:
        body = json.dumps(error_body(413, f"{what}; the limit is {self.max_bytes} bytes (--max-request-bytes)")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> Optional[int]:
    """The declared body length, None when there is none (a chunked body) or it is not a number
    (the HTTP parser refuses such a request before it gets here)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that first gives ``body`` as the whole request, then passes on ``receive``'s
    messages (the disconnect a streaming response waits for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
