"""A small async client for an OpenAI-compatible ``/v1/completions`` (and ``/v1/chat/completions``) endpoint.

Shared by the GSM8K and MMLU evals, the accuracy regression runner and the serving benchmark.
One ``aiohttp`` session per client; an ``asyncio.Semaphore`` bounds the requests in flight to
``max_concurrency``. Non-streaming calls return the text and the server's token usage; streaming
calls (Server-Sent Events, ``data: {...}`` lines ending with ``data: [DONE]``) also record the
time to the first chunk that carries text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Iterable, Optional, TypeVar, Union

import aiohttp
from tqdm import tqdm

T = TypeVar("T")


class ServerError(RuntimeError):
    """The server answered with an error status, or with a body that is not a completion."""


def add_eval_client_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every eval shares: concurrency, sampling, the server address, output."""
    p.add_argument("--parallel", type=int, default=64, help="concurrent requests (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed sent with each request (default: none sent)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="the server's port (default: %(default)s)")
    p.add_argument("--result-file", help="append the metrics as one JSON line (default: not written)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def base_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 literal host put in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass
class Completion:
    """One finished request. Token counts come from the server's ``usage`` (None when absent)."""

    text: str
    finish_reason: Optional[str]
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    latency_s: float


@dataclass
class StreamedCompletion(Completion):
    """A streamed request: ``ttft_s`` is the time to the first chunk with non-empty text
    (None when no text arrived), ``text_chunks`` the number of chunks that carried text and
    ``text_times`` the ``time.perf_counter()`` at which each of them arrived."""

    ttft_s: Optional[float]
    text_chunks: int
    text_times: list[float] = field(default_factory=list)


class CompletionClient:
    """Async context manager around one HTTP session to ``url`` (``http://host:port``).

    ``model`` None means: ask ``GET /v1/models`` on entry and use the first id.
    """

    def __init__(self, url: str, model: Optional[str] = None, max_concurrency: int = 1, timeout_s: float = 3600.0):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "CompletionClient":
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        try:
            if self.model is None:
                self.model = await self.fetch_model()
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use CompletionClient as 'async with'"
        return self._session

    async def fetch_model(self) -> str:
        """The first model id listed by ``GET /v1/models``; `ServerError` when unreachable."""
        try:
            async with self.session.get(f"{self.url}/v1/models") as resp:
                body = await _json_or_raise(resp)
        except aiohttp.ClientConnectionError as exc:
            raise ServerError(f"cannot reach the server at {self.url} ({exc}); is it running? check --host/--port") from None
        models = body.get("data") or []
        if not models or "id" not in models[0]:
            raise ServerError(f"{self.url}/v1/models lists no model: {body!r}")
        return str(models[0]["id"])

    async def context_length(self) -> Optional[int]:
        """The served model's context length: ``max_model_len`` of ``GET /v1/models``, else
        ``model.context_length`` of ``GET /get_server_info`` (SGLang, this server), else None."""
        async with self.session.get(f"{self.url}/v1/models") as resp:
            models = (await _json_or_raise(resp)).get("data") or [{}]
        if isinstance(models[0].get("max_model_len"), int):
            return models[0]["max_model_len"]
        async with self.session.get(f"{self.url}/get_server_info") as resp:
            if resp.status != 200:
                return None
            info = await resp.json(content_type=None)
        length = (info.get("model") or {}).get("context_length") if isinstance(info, dict) else None
        return length if isinstance(length, int) else None

    def _payload(self, prompt: Union[str, list[int]], stream: bool, params: dict[str, Any]) -> dict[str, Any]:
        payload = {"model": self.model, "prompt": prompt, "stream": stream}
        payload.update({k: v for k, v in params.items() if v is not None})
        if stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    async def complete(self, prompt: Union[str, list[int]], **params: Any) -> Completion:
        """``POST /v1/completions`` without streaming; ``params`` (max_tokens, temperature,
        stop, seed, ...) go into the body as given, None values left out."""
        async with self._semaphore:
            start = time.perf_counter()
            async with self.session.post(f"{self.url}/v1/completions", json=self._payload(prompt, False, params)) as resp:
                body = await _json_or_raise(resp)
            latency = time.perf_counter() - start
        try:
            choice = body["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"not a completion response: {body!r}") from None
        usage = body.get("usage") or {}
        return Completion(text, choice.get("finish_reason"), usage.get("prompt_tokens"), usage.get("completion_tokens"), latency)

    async def chat(self, content: str, **params: Any) -> Completion:
        """``POST /v1/chat/completions`` with one user message ``content``, without streaming;
        ``params`` as for `complete`. The text is the reply message's content."""
        payload = {"model": self.model, "messages": [{"role": "user", "content": content}], "stream": False}
        payload.update({k: v for k, v in params.items() if v is not None})
        async with self._semaphore:
            start = time.perf_counter()
            async with self.session.post(f"{self.url}/v1/chat/completions", json=payload) as resp:
                body = await _json_or_raise(resp)
            latency = time.perf_counter() - start
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"not a chat completion response: {body!r}") from None
        usage = body.get("usage") or {}
        return Completion(text, choice.get("finish_reason"), usage.get("prompt_tokens"), usage.get("completion_tokens"), latency)

    async def stream(self, prompt: Union[str, list[int]], text_times: Optional[list[float]] = None,
                     **params: Any) -> StreamedCompletion:
        """``POST /v1/completions`` with ``stream: true`` and ``include_usage``; reads the SSE
        stream to ``data: [DONE]`` (or to the end of the body). ``text_times``: a list to which
        each text chunk's arrival time is appended as it arrives (default: a new one)."""
        async with self._semaphore:
            start = time.perf_counter()
            ttft: Optional[float] = None
            pieces: list[str] = []
            times = text_times if text_times is not None else []
            finish_reason: Optional[str] = None
            usage: dict[str, Any] = {}
            async with self.session.post(f"{self.url}/v1/completions", json=self._payload(prompt, True, params)) as resp:
                if resp.status != 200:
                    raise ServerError(f"HTTP {resp.status} from {resp.url}: {(await resp.text())[:500]}")
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ServerError(f"error in stream: {chunk['error']!r}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            times.append(time.perf_counter())
                            if ttft is None:
                                ttft = times[-1] - start
                            pieces.append(choice["text"])
                        finish_reason = choice.get("finish_reason") or finish_reason
            latency = time.perf_counter() - start
        return StreamedCompletion(
            "".join(pieces), finish_reason, usage.get("prompt_tokens"), usage.get("completion_tokens"),
            latency, ttft, len(pieces), times,
        )


async def _json_or_raise(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await resp.text()
    if resp.status != 200:
        raise ServerError(f"HTTP {resp.status} from {resp.url}: {text[:500]}")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ServerError(f"non-JSON body from {resp.url}: {text[:500]}") from None


async def gather_with_progress(coros: Iterable[Awaitable[T]], desc: str, disable: bool = False) -> list[T]:
    """``asyncio.gather`` with a tqdm bar that advances as each awaitable finishes; results keep
    the input order. On the first exception the others are cancelled and it is re-raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    with tqdm(total=len(tasks), desc=desc, disable=disable) as bar:
        for task in tasks:
            task.add_done_callback(lambda _t: bar.update(1))
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
