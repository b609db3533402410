"""Request handling shared by the HTTP route groups: `RequestHandler` turns a request into token
ids and `SamplingParams` and runs it against one `EngineClient`; an engine failure before the
first chunk is still an HTTP error (`api_error`); a client that disconnects cancels its
request (`unless_disconnected`, then `ClientGone`): a non-streaming one at any time, a stream
before its first chunk (`start_stream`; later, closing the stream aborts it); a stream is SSE text ending in
``[DONE]``, with an error event if the engine fails mid-stream (`sse_events`)."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional, TypeVar

from fastapi import Request

from arfusion.engine.common.generation import EngineError, GenerationChunk
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.server.api.engine_client import EngineClient
from arfusion.engine.server.api.openai_outputs import Collected
from arfusion.engine.server.api.protocol import APIError, ChatCompletionRequest, SamplingFields
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.streaming import SSE_DONE, sse, until_finished
from arfusion.engine.tokenizers.chat_encoding import encode_chat

Started = tuple[GenerationChunk, AsyncGenerator[GenerationChunk, None]]
Events = Callable[[AsyncIterator[GenerationChunk]], AsyncIterator[Any]]  # engine chunks -> SSE payloads
T = TypeVar("T")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its response."""


def api_error(exc: Exception) -> APIError:
    """An `EngineError` keeps its status; any other exception is an internal fault (500)."""
    if isinstance(exc, EngineError):
        return APIError(exc.status, exc.message)
    return APIError(500, f"engine error: {exc!r}")


class RequestHandler:
    """Request handling against one `EngineClient` (turns requests into token ids and params)."""

    def __init__(self, engine: EngineClient, served_model_name: str, lifecycle: Lifecycle,
                 allow_special_tokens_in_messages: bool = False) -> None:
        self.engine = engine
        self.model = served_model_name
        self.lifecycle = lifecycle
        self.allow_special_tokens_in_messages = allow_special_tokens_in_messages

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
        without adding special tokens again (the template already holds them); message text is
        tokenized as text (`encode_chat`) unless ``allow_special_tokens_in_messages``."""
        if not req.messages:
            raise APIError(400, "messages must not be empty")
        try:
            ids = encode_chat(self.engine.tokenizer, [m.as_dict() for m in req.messages],
                              allow_special_tokens=self.allow_special_tokens_in_messages)
        except Exception as exc:  # a template's raise_exception, or no template at all
            raise APIError(400, f"cannot apply the chat template: {exc}") from exc
        return self.check_ids(ids, tokenized=True)

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
        except asyncio.CancelledError:  # its client left (`unless_disconnected`): abort the request
            if chunks is not None:
                await chunks.aclose()
            raise
        except Exception as exc:
            if chunks is not None:
                await chunks.aclose()
            raise api_error(exc) from exc

    async def start_stream(self, request: Request, ids: list[int], params: SamplingParams) -> Started:
        """`start` for a stream, cancelled when its client leaves before the first chunk (while
        the request waits or is prefilled): `ClientGone` then, the request aborted."""
        return await unless_disconnected(request, self.start(ids, params))

    @staticmethod
    async def collect(started: Started) -> Collected:
        """The whole output."""
        out = Collected()
        try:
            async for chunk in until_finished(*started):
                out.add(chunk)
        except Exception as exc:
            raise api_error(exc) from exc
        return out

    async def complete(self, ids: list[int], params: SamplingParams) -> Collected:
        """`start`, then `collect`."""
        return await self.collect(await self.start(ids, params))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled when the client disconnects first (cancelling `RequestHandler.collect`
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


async def sse_events(started: Started, events: Events) -> AsyncGenerator[str, None]:
    """SSE text from ``events(chunks)`` (an async iterator of payloads), an error event if the
    engine fails mid-stream, then ``[DONE]``. Closing this generator closes both inner ones (an
    ``async for`` left at a ``yield`` does not), which aborts the engine request."""
    async with aclosing(until_finished(*started)) as chunks, aclosing(events(chunks)) as payloads:
        try:
            async for payload in payloads:
                yield sse(payload)
        except Exception as exc:
            yield sse(api_error(exc).body())
    yield SSE_DONE
