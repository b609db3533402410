"""The SGLang-style routes: POST /generate (text or token ids in, the cumulative text and ids
streamed out; a sampling field it does not know is refused by name, as the OpenAI routes refuse
those they cannot honour) and POST /flush_cache."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from arfusion.engine.common.generation import GenerationChunk
from arfusion.engine.server.api.protocol import APIError, GenerateRequest
from arfusion.engine.server.api.request_handling import RequestHandler, sse_events, unless_disconnected
from arfusion.engine.server.http.streaming import ClosingStreamingResponse


def add_native_routes(app: FastAPI, server: RequestHandler) -> None:
    """Serve the SGLang-style routes of ``app`` with ``server``."""

    @app.post("/generate", response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Any:
        fields = req.sampling_params.as_fields()
        server.check(fields)
        unknown = req.sampling_params.unknown_fields()
        if unknown:
            raise APIError(400, f"not supported: {', '.join(unknown)}")
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids")
        ids = await asyncio.to_thread(server.completion_ids, req.text if req.input_ids is None else req.input_ids)
        params = server.params(fields, len(ids), 16 if fields.max_tokens is None else fields.max_tokens)

        def body(text: str, output_ids: list[int], chunk: GenerationChunk) -> dict[str, Any]:
            meta = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
                    "finish_reason": chunk.finish_reason}
            return {"text": text, "output_ids": output_ids, "meta_info": meta}

        if not req.stream:
            out = await unless_disconnected(request, server.complete(ids, params))
            return body(out.text, out.token_ids, out.last)
        started = await server.start_stream(request, ids, params)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[dict[str, Any]]:
            text, output_ids = "", []
            async for chunk in chunks:  # SGLang streams the cumulative text and ids
                text, output_ids = text + chunk.text, output_ids + chunk.token_ids
                yield body(text, output_ids, chunk)

        return ClosingStreamingResponse(sse_events(started, events), started[1])

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, str]:
        if not await server.engine.flush_cache():
            raise APIError(400, "cannot flush the cache while requests are running")
        return {"status": "ok"}
