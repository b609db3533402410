"""GET /health (200 while the engine is healthy; 503 with the reason while it is not or the
server drains) and GET /get_server_info (server args, fusion status, memory, load)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from arfusion.engine.server.api.request_handling import RequestHandler


def add_health_routes(app: FastAPI, server: RequestHandler) -> None:
    """Serve the health and info routes of ``app`` with ``server``."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if server.lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        problem = server.engine.health_problem()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server.engine.server_info()
