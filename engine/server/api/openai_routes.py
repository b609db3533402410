"""The OpenAI routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models. Prompts
are tokenized and chat templates rendered in a worker thread (`asyncio.to_thread`), never on the
event loop; building log-probabilities and echoes runs in a worker thread too."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request

from arfusion.engine.common.generation import GenerationChunk
from arfusion.engine.server.api.logprobs_format import TokenTexts
from arfusion.engine.server.api.openai_outputs import CompletionOutput, chat_logprobs_of
from arfusion.engine.server.api.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, Usage,
)
from arfusion.engine.server.api.request_handling import RequestHandler, sse_events, unless_disconnected
from arfusion.engine.server.http.streaming import ClosingStreamingResponse


def add_openai_routes(app: FastAPI, server: RequestHandler) -> None:
    """Serve the OpenAI routes of ``app`` with ``server``."""

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        server.check(req)
        ids = await asyncio.to_thread(server.completion_ids, req.prompt)
        params = server.params(req, len(ids), 16 if req.max_tokens is None else req.max_tokens, bool(req.echo))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        output = CompletionOutput(server.engine.tokenizer, req.prompt, ids, bool(req.echo), req.logprobs)

        def response(choices: list[CompletionChoice], usage: Optional[Usage] = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=server.model, choices=choices, usage=usage)

        if not req.stream:
            out = await unless_disconnected(request, server.complete(ids, params))
            choice = await asyncio.to_thread(output.whole, out) if output.extra else output.whole(out)
            return response([choice], Usage.of(out.last.prompt_tokens, out.last.completion_tokens))
        started = await server.start_stream(request, ids, params)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[CompletionResponse]:
            async for chunk in chunks:
                echoed = output.echoed(chunk) if chunk is started[0] else None
                for choice in (echoed, output.chunk(chunk)):
                    if choice is not None:
                        yield response([choice])
            if req.include_usage():
                yield response([], Usage.of(chunk.prompt_tokens, chunk.completion_tokens))

        return ClosingStreamingResponse(sse_events(started, events), started[1])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        server.check(req)
        ids = await asyncio.to_thread(server.chat_ids, req)
        params = server.params(req, len(ids), req.max_tokens if req.max_completion_tokens is None
                               else req.max_completion_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        texts = TokenTexts(server.engine.tokenizer)
        if not req.stream:
            out = await unless_disconnected(request, server.complete(ids, params))
            logprobs = await asyncio.to_thread(chat_logprobs_of, texts, out.logprobs) if req.logprobs else None
            choice = ChatChoice(message=ChatResponseMessage(content=out.text), finish_reason=out.last.finish_reason,
                                logprobs=logprobs)
            return ChatCompletionResponse(id=rid, created=created, model=server.model, choices=[choice],
                                          usage=Usage.of(out.last.prompt_tokens, out.last.completion_tokens))
        started = await server.start_stream(request, ids, params)

        def chunk_of(choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=server.model, choices=choices, usage=usage)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[ChatCompletionChunk]:
            yield chunk_of([ChatChunkChoice(delta={"role": "assistant"})])
            async for chunk in chunks:
                if chunk.text or chunk.finish_reason or chunk.logprobs:
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield chunk_of([ChatChunkChoice(delta=delta, finish_reason=chunk.finish_reason,
                                                    logprobs=chat_logprobs_of(texts, chunk.logprobs))])
            if req.include_usage():
                yield chunk_of([], Usage.of(chunk.prompt_tokens, chunk.completion_tokens))

        return ClosingStreamingResponse(sse_events(started, events), started[1])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": server.model, "object": "model", "created": int(time.time()), "owned_by": "arfusion",
                "max_model_len": server.engine.context_length}
        return {"object": "list", "data": [card]}
