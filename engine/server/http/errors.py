"""The server's error object, OpenAI's shape: ``{"error": {"message", "type", "code"}}``. The HTTP
layer answers what it refuses before the app (`engine.server.http.limits`,
`engine.server.http.protocol`) in it, and the API answers every other error in it
(`engine.server.api.error_responses`)."""
from __future__ import annotations

from typing import Any

# OpenAI's error "type" per HTTP status (other 4xx: invalid_request_error, other 5xx: internal_error).
ERROR_TYPES = {404: "not_found_error", 503: "service_unavailable"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "code"}}`` (``code``: the HTTP status)."""
    kind = ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}
