"""Every error as ``{"error": {"message", "type", "code"}}``: bad input 400 (FastAPI's 422 too,
and bodies that are not UTF-8 JSON; a field over its limit is answered with its own message),
unknown paths 404, wrong methods 405, an `APIError` with its status, any other fault while
serving one request 500; a request whose client left is logged as 499 (`ClientGone`)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from arfusion.engine.server.api.protocol import REQUEST_LIMIT, APIError
from arfusion.engine.server.api.request_handling import ClientGone
from arfusion.engine.server.http.errors import error_body

CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the shape above."""

    @app.exception_handler(APIError)
    async def _api_error_response(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, _validation_message(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = _http_error_message(request, exc)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # never delivered: for the access log

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)


def _validation_message(exc: RequestValidationError) -> str:
    """``field.path: reason`` for the first errors; malformed JSON says so; a field over its
    limit (`REQUEST_LIMIT`) is answered alone, with the engine's message naming it."""
    errors = exc.errors()
    over = next((err for err in errors if err.get("type") == REQUEST_LIMIT), None)
    if over is not None:
        return over["msg"]
    parts = []
    for err in errors[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _union_member(p))
        if not loc:
            return "the request body must be a JSON object (Content-Type: application/json)"
        parts.append(f"{loc}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def _union_member(part: object) -> bool:
    """A location part naming a member of a union type (``str``, ``list[int]``, ``function-after[...]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _http_error_message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no such endpoint: {request.method} {request.url.path}"
    if exc.status_code == 405:
        return f"method {request.method} is not allowed on {request.url.path}"
    if exc.__cause__ is not None:  # FastAPI could not parse the body (not UTF-8, nested too deep, ...)
        return f"the request body is not valid JSON: {exc.__cause__}"
    return str(exc.detail)
