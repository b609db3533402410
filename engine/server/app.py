"""The OpenAI-compatible HTTP layer: `build_app(engine, served_model_name)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
POST /generate (SGLang style), POST /flush_cache, GET /get_server_info, and the tokenizer's
(`engine.server.tokenizer_routes`): POST /tokenize, POST /detokenize, GET /tokenizer_info.
Prompts are tokenized and chat templates rendered in a worker thread (`asyncio.to_thread`), never
on the event loop: a huge prompt delays only its own request; building log-probabilities and
echoes runs in a worker thread too. Every error is answered as
``{"error": {"message", "type", "code"}}``: bad input 400 (FastAPI's 422 too, and bodies that
are not UTF-8 JSON), unknown paths 404, wrong methods 405, an `EngineError` with its status
(400, 500, 503), any other fault while serving one request 500; inside a stream that already
started, an error event and then ``[DONE]``. While the server drains (`Lifecycle.draining`) new
generation requests get 503. A client disconnect aborts its request in both modes: streams
close the engine's generator when they end; a non-streaming request is cancelled as soon as its
client leaves.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from engine.common.sampling_params import SamplingParams
from engine.common.generation import EngineError, GenerationChunk
from engine.server.engine_client import EngineClient
from engine.server.lifecycle import InFlightMiddleware, Lifecycle
from engine.server.logprobs_format import TokenTexts
from engine.server.openai_outputs import Collected, CompletionOutput, chat_logprobs_of
from engine.server.protocol import (
    APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, GenerateRequest, SamplingFields,
    Usage, error_body,
)
from engine.server.streaming import SSE_DONE, ClosingStreamingResponse, sse, until_finished
from engine.server.tokenizer_routes import add_tokenizer_routes

Started = tuple[GenerationChunk, AsyncGenerator[GenerationChunk, None]]
Events = Callable[[AsyncIterator[GenerationChunk]], AsyncIterator[Any]]  # engine chunks -> SSE payloads
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its response."""


def _api_error(exc: Exception) -> APIError:
    """An `EngineError` keeps its status; any other exception is an internal fault (500)."""
    if isinstance(exc, EngineError):
        return APIError(exc.status, exc.message)
    return APIError(500, f"engine error: {exc!r}")


def _validation_message(exc: RequestValidationError) -> str:
    """``field.path: reason`` for the first errors; malformed JSON says so."""
    parts = []
    for err in exc.errors()[:3]:
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


class _Server:
    """Request handling against one `EngineClient` (turns requests into token ids and params)."""

    def __init__(self, engine: EngineClient, served_model_name: str, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.model = served_model_name
        self.lifecycle = lifecycle

    def check(self, fields: SamplingFields) -> None:
        """Draining, health, model name and unsupported fields, before any tokenization."""
        if self.lifecycle.draining:
            raise APIError(503, "the server is shutting down and takes no new requests")
        if not self.engine.is_healthy():
            raise APIError(503, "the engine is not healthy")
        if fields.model is not None and fields.model != self.model:
            raise APIError(404, f"The model `{fields.model}` does not exist; this server serves `{self.model}`")
        unsupported = fields.unsupported_fields()
        if unsupported:
            raise APIError(400, f"not supported: {', '.join(unsupported)}")

    def check_ids(self, ids: list[int], tokenized: bool = False) -> list[int]:
        """``ids`` if not empty and (unless ``tokenized``: from the server's own tokenizer) within
        the vocabulary. (This runs in a worker thread, but holds the GIL: over a long prompt a
        Python loop would stall the event loop and the scheduler.)"""
        if not ids:
            raise APIError(400, "the prompt is empty")
        vocab = self.engine.tokenizer.vocab_size
        if not tokenized and (min(ids) < 0 or max(ids) >= vocab):
            bad = [i for i in ids if not 0 <= i < vocab]
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:8]}")
        return ids

    def completion_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completions ``prompt``: text, token ids, or a one-element batch of either."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batch prompts are not supported")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "the prompt is empty")
            return self.check_ids(self.engine.tokenizer.encode(prompt), tokenized=True)
        return self.check_ids(list(prompt))

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        """Messages rendered by the tokenizer's chat template (with the generation prompt), encoded
        without adding special tokens again (the template already holds them)."""
        if not req.messages:
            raise APIError(400, "messages must not be empty")
        try:
            text = self.engine.tokenizer.apply_chat_template([m.as_dict() for m in req.messages])
        except Exception as exc:  # a template's raise_exception, or no template at all
            raise APIError(400, f"cannot apply the chat template: {exc}") from exc
        return self.check_ids(self.engine.tokenizer.encode(text, add_special_tokens=False), tokenized=True)

    def params(self, fields: SamplingFields, prompt_len: int, max_tokens: Optional[int],
               echo: bool = False) -> SamplingParams:
        """`SamplingParams` within the context: ``max_tokens`` None means all that is left; 0
        only with ``echo`` (the prompt alone, perhaps with its log-probabilities)."""
        if max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)")
        ctx = self.engine.context_length
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context length is {ctx}")
        max_tokens = ctx - prompt_len if max_tokens is None else max_tokens
        if prompt_len + max_tokens > ctx:
            raise APIError(400, f"prompt_tokens ({prompt_len}) + max_tokens ({max_tokens}) = "
                                f"{prompt_len + max_tokens} exceeds the context length {ctx}")
        try:
            return fields.sampling_params(max_tokens, self.engine.tokenizer.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def start(self, ids: list[int], params: SamplingParams) -> Started:
        """Submit and wait for the first chunk, so that an engine failure is still an HTTP error."""
        chunks = None
        try:
            chunks = self.engine.generate(ids, params)
            return await chunks.__anext__(), chunks
        except Exception as exc:
            if chunks is not None:
                await chunks.aclose()
            raise _api_error(exc) from exc

    @staticmethod
    async def collect(started: Started) -> Collected:
        """The whole output."""
        out = Collected()
        try:
            async for chunk in until_finished(*started):
                out.add(chunk)
        except Exception as exc:
            raise _api_error(exc) from exc
        return out

    async def complete(self, ids: list[int], params: SamplingParams) -> Collected:
        """`start`, then `collect`."""
        return await self.collect(await self.start(ids, params))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled when the client disconnects first (cancelling `_Server.collect`
    closes the engine's generator, which aborts the request); `ClientGone` then."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)  # the request is aborted on return


async def _disconnect(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read: ``receive`` waits)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse_events(started: Started, events: Events) -> AsyncGenerator[str, None]:
    """SSE text from ``events(chunks)`` (an async iterator of payloads), an error event if the
    engine fails mid-stream, then ``[DONE]``. Closing this generator closes both inner ones (an
    ``async for`` left at a ``yield`` does not), which aborts the engine request."""
    async with aclosing(until_finished(*started)) as chunks, aclosing(events(chunks)) as payloads:
        try:
            async for payload in payloads:
                yield sse(payload)
        except Exception as exc:
            yield sse(_api_error(exc).body())
    yield SSE_DONE


def _http_error_message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no such endpoint: {request.method} {request.url.path}"
    if exc.status_code == 405:
        return f"method {request.method} is not allowed on {request.url.path}"
    if exc.__cause__ is not None:  # FastAPI could not parse the body (not UTF-8, nested too deep, ...)
        return f"the request body is not valid JSON: {exc.__cause__}"
    return str(exc.detail)


def build_app(engine: EngineClient, served_model_name: str, lifecycle: Optional[Lifecycle] = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``served_model_name``;
    ``lifecycle`` (default: a new one) counts its requests and says when it drains."""
    app = FastAPI(title="arfusion")
    lifecycle = lifecycle or Lifecycle()
    app.add_middleware(InFlightMiddleware, lifecycle=lifecycle)
    server = _Server(engine, served_model_name, lifecycle)

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

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        server.check(req)
        ids = await asyncio.to_thread(server.completion_ids, req.prompt)
        params = server.params(req, len(ids), 16 if req.max_tokens is None else req.max_tokens, bool(req.echo))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        output = CompletionOutput(engine.tokenizer, req.prompt, ids, bool(req.echo), req.logprobs)

        def response(choices: list[CompletionChoice], usage: Optional[Usage] = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=served_model_name, choices=choices, usage=usage)

        if not req.stream:
            out = await _unless_disconnected(request, server.complete(ids, params))
            choice = await asyncio.to_thread(output.whole, out) if output.extra else output.whole(out)
            return response([choice], Usage.of(out.last.prompt_tokens, out.last.completion_tokens))
        started = await server.start(ids, params)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[CompletionResponse]:
            async for chunk in chunks:
                echoed = output.echoed(chunk) if chunk is started[0] else None
                for choice in (echoed, output.chunk(chunk)):
                    if choice is not None:
                        yield response([choice])
            if req.include_usage():
                yield response([], Usage.of(chunk.prompt_tokens, chunk.completion_tokens))

        return ClosingStreamingResponse(_sse_events(started, events), started[1])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        server.check(req)
        ids = await asyncio.to_thread(server.chat_ids, req)
        params = server.params(req, len(ids), req.max_tokens if req.max_completion_tokens is None
                               else req.max_completion_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        texts = TokenTexts(engine.tokenizer)
        if not req.stream:
            out = await _unless_disconnected(request, server.complete(ids, params))
            logprobs = await asyncio.to_thread(chat_logprobs_of, texts, out.logprobs) if req.logprobs else None
            choice = ChatChoice(message=ChatResponseMessage(content=out.text), finish_reason=out.last.finish_reason,
                                logprobs=logprobs)
            return ChatCompletionResponse(id=rid, created=created, model=served_model_name, choices=[choice],
                                          usage=Usage.of(out.last.prompt_tokens, out.last.completion_tokens))
        started = await server.start(ids, params)

        def chunk_of(choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=served_model_name, choices=choices, usage=usage)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[ChatCompletionChunk]:
            yield chunk_of([ChatChunkChoice(delta={"role": "assistant"})])
            async for chunk in chunks:
                if chunk.text or chunk.finish_reason or chunk.logprobs:
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield chunk_of([ChatChunkChoice(delta=delta, finish_reason=chunk.finish_reason,
                                                    logprobs=chat_logprobs_of(texts, chunk.logprobs))])
            if req.include_usage():
                yield chunk_of([], Usage.of(chunk.prompt_tokens, chunk.completion_tokens))

        return ClosingStreamingResponse(_sse_events(started, events), started[1])

    @app.post("/generate", response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Any:
        fields = req.sampling_params.as_fields()
        server.check(fields)
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids")
        ids = await asyncio.to_thread(server.completion_ids, req.text if req.input_ids is None else req.input_ids)
        params = server.params(fields, len(ids), 16 if fields.max_tokens is None else fields.max_tokens)

        def body(text: str, output_ids: list[int], chunk: GenerationChunk) -> dict[str, Any]:
            meta = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
                    "finish_reason": chunk.finish_reason}
            return {"text": text, "output_ids": output_ids, "meta_info": meta}

        if not req.stream:
            out = await _unless_disconnected(request, server.complete(ids, params))
            return body(out.text, out.token_ids, out.last)
        started = await server.start(ids, params)

        async def events(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[dict[str, Any]]:
            text, output_ids = "", []
            async for chunk in chunks:  # SGLang streams the cumulative text and ids
                text, output_ids = text + chunk.text, output_ids + chunk.token_ids
                yield body(text, output_ids, chunk)

        return ClosingStreamingResponse(_sse_events(started, events), started[1])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "arfusion",
                "max_model_len": engine.context_length}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        problem = engine.health_problem()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, str]:
        if not await engine.flush_cache():
            raise APIError(400, "cannot flush the cache while requests are running")
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info()

    add_tokenizer_routes(app, engine, served_model_name)
    return app
