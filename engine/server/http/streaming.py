"""Server-sent events: the ``data: {json}\\n\\n`` framing, the engine-chunk iterator behind a
stream, and a streaming response that always closes its body (so a disconnect aborts the request).
"""
from __future__ import annotations

import json
from typing import Any, AsyncGenerator, AsyncIterator, Union

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from arfusion.engine.common.generation import GenerationChunk

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Union[BaseModel, dict[str, Any]]) -> str:
    """One SSE event: ``data: <compact json>`` and a blank line."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def until_finished(first: GenerationChunk,
                         rest: AsyncGenerator[GenerationChunk, None]) -> AsyncIterator[GenerationChunk]:
    """``first``, then the chunks of ``rest`` up to and including the one with a finish_reason.

    ``rest`` is closed on every exit, normal or not: closing the engine's generator before it
    finished is what aborts the request and frees its KV slots. A stream that ends without a
    finish_reason raises RuntimeError.
    """
    try:
        chunk = first
        while True:
            yield chunk
            if chunk.finish_reason is not None:
                return
            try:
                chunk = await rest.__anext__()
            except StopAsyncIteration:
                raise RuntimeError("the engine stream ended without a finish_reason") from None
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """An SSE `StreamingResponse` that, when the response ends for any reason (done, client
    disconnect, cancellation), closes its ``body`` generator and then ``upstream`` (the engine's
    generator, which the body may not have reached yet if the client left before the first
    event). Starlette only stops iterating the body; closing it would otherwise wait for GC."""

    def __init__(self, body: AsyncGenerator[str, None], upstream: AsyncGenerator[Any, None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._closing = (body, upstream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                for generator in self._closing:
                    await generator.aclose()
