"""`Lifecycle`: what the HTTP app and the process around it share about the server's life.

``in_flight`` counts the HTTP requests whose response has not ended yet (a stream counts until
its last event); ``draining`` is set on SIGTERM/SIGINT, after which the app refuses new
generation requests with 503 while the ones in flight may finish.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class InFlightMiddleware:
    """ASGI middleware keeping ``lifecycle.in_flight`` (HTTP requests only)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
