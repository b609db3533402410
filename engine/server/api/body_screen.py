"""`build_screen`: the screen the server's parser processes run (`engine.server.http.parser_pool`):
the API's own app answers a request there, and its answer counts only if the app refused the body
before any route ran.

The app is `build_app`'s, over an engine every use of which raises (a route that begins to serve
never gets far). Its answer is returned (byte for byte what the server's app would send, from
the same exception handlers) when FastAPI refused the body itself: `RequestValidationError`
(malformed JSON, a field of the wrong type, a field over its limit) or a body it could not
decode (not UTF-8). That outcome depends on the body, the path and the headers alone, never on
the server's state. Anything else returns None and the server's app serves the request; so does
a body nested too deep for the JSON decoder, whose limit is the recursion depth left where the
decoder runs, which differs between the two processes.
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Message

from arfusion.engine.server.api.app import build_app
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.parser_process import Answer, Job, Screen

REFUSED = "arfusion.body_refused"  # set in the scope by the handlers of a body FastAPI refused


class _RouteReached(Exception):
    """A route began to serve the request: its body passed validation."""


class _NoEngine:
    """An `EngineClient` (and tokenizer) every use of which raises `_RouteReached`."""

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # build_app's tokenizer routes keep it
            return _NoEngine()
        raise _RouteReached(name)


def build_screen() -> Screen:
    """The `Screen` of the module docstring."""
    app = build_app(_NoEngine(), "", Lifecycle())  # type: ignore[arg-type]
    invalid, http_error = app.exception_handlers[RequestValidationError], app.exception_handlers[HTTPException]

    async def refused_invalid(request: Request, exc: Exception) -> Response:
        request.scope[REFUSED] = True
        return await invalid(request, exc)

    async def refused_undecodable(request: Request, exc: Exception) -> Response:
        # FastAPI raises HTTPException from the decoder's error for a body it cannot decode
        if exc.__cause__ is not None and not isinstance(exc.__cause__, RecursionError):
            request.scope[REFUSED] = True
        return await http_error(request, exc)

    app.add_exception_handler(RequestValidationError, refused_invalid)
    app.add_exception_handler(HTTPException, refused_undecodable)

    async def screen(job: Job) -> Optional[Answer]:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": job.method, "scheme": "http", "path": job.path, "raw_path": job.path.encode(),
                 "root_path": "", "query_string": job.query_string, "headers": job.headers,
                 "client": None, "server": None, "state": {}}
        sent: list[Message] = []
        pending = [{"type": "http.request", "body": job.body, "more_body": False}]

        async def receive() -> Message:
            return pending.pop() if pending else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        try:
            await app(scope, receive, send)
        except _RouteReached:
            return None
        if not scope.get(REFUSED):
            return None
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return Answer(start["status"], list(start.get("headers", [])), body)

    return screen
