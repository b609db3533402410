"""`LargeBodies`: ASGI middleware that has a `ParserPool` screen each request body over its
``min_bytes`` before the app sees it (`engine.server.http.parser_pool`).

A body the pool answers (the app's own answer to a body it refuses before any route runs: not
JSON, not valid, a field over its limit) is answered from that answer, byte for byte what the
app would have sent, and never parsed in this process; any other (the pool says the app must
serve it, or no parser could take it) goes on to the app unchanged, which parses it as before.
A body the full pool cannot take (``processes`` screening, ``queue`` waiting) is answered 503 and
logged. Smaller bodies, and requests that declare a length within ``min_bytes``, go straight to
the app. Behind `BodyLimit`, the body arrives whole; it is handed on as one message.
"""
from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from arfusion.engine.server.http.errors import error_body
from arfusion.engine.server.http.limits import content_length, replay_body, send_json
from arfusion.engine.server.http.parser_pool import ParserPool, ParserUnavailable, PoolBusy
from arfusion.engine.server.http.parser_process import Job

logger = logging.getLogger(__name__)


class LargeBodies:
    """ASGI middleware: HTTP request bodies over ``min_bytes`` are screened by ``pool`` first."""

    def __init__(self, app: ASGIApp, pool: ParserPool, min_bytes: int) -> None:
        self.app = app
        self.pool = pool
        self.min_bytes = min_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = content_length(scope) if scope["type"] == "http" else None
        if scope["type"] != "http" or (declared is not None and declared <= self.min_bytes):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: no one to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) > self.min_bytes:
            job = Job(scope["method"], scope["path"], scope.get("query_string", b""), list(scope["headers"]), body)
            try:
                answer = await self.pool.screen(job)
            except PoolBusy:
                client = scope.get("client")
                logger.warning("503 to %s: %d large request bodies are being parsed, the limit (--body-parsers, "
                               "--body-parser-queue)", f"{client[0]}:{client[1]}" if client else "a client",
                               self.pool.pending)
                await send_json(send, 503, error_body(503, f"the server is parsing {self.pool.pending} large request "
                                                           f"bodies, its limit (--body-parsers, --body-parser-queue); "
                                                           f"try again later"))
                return
            except ParserUnavailable:
                answer = None  # the app parses it (the pool logged why)
            if answer is not None:
                await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
                await send({"type": "http.response.body", "body": answer.body})
                return
        await self.app(scope, replay_body(body, receive), send)
