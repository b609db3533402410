"""Request limits and the event loop, in-process: `BodyLimit` (413 before a body is read or
parsed), `LimitedH11Protocol` (431 / 400 / 413 answered in the error format while the client is
still sending, no connection reset) and tokenization in a worker thread, with uvicorn on a
thread and the `FakeEngine` behind it."""
import asyncio
import random
import threading
import time
from typing import Any, Iterator

import pytest

from arfusion.engine.server.http.limits import BodyLimit, max_request_bytes
from arfusion.engine.server.http.protocol import MAX_HEAD_BYTES
from tests.fake_engine import CharTokenizer, FakeEngine
from tests.in_process_server import LIMIT, InProcessServer
from tests.raw_http import chunked, exchange, head

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("given, context_len, expected", [
    (None, 2048, 1 << 20), (None, 131072, 64 * 131072), (5000, 131072, 5000), (1 << 30, 16, 1 << 30)])
def test_the_default_limit_is_64_bytes_per_context_token_at_least_1_mib(given, context_len, expected):
    assert max_request_bytes(given, context_len) == expected


def _body(size: int, seed: int) -> bytes:
    return bytes(random.Random(seed).choices(b"abcdefghij", k=size))


async def _through_limit(body: bytes, declared: bool, chunk_bytes: int) -> tuple[list[dict], list[bytes], int]:
    """``body`` through `BodyLimit(LIMIT)` to an app that records what it receives; returns the
    messages sent, the bodies the app got, and how many receive() calls the limit made."""
    parts = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)] or [b""]
    messages = iter([{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
                    + [{"type": "http.disconnect"}])
    calls, sent, seen = 0, [], []

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        assert (await receive())["type"] == "http.disconnect"  # then the original receive's messages

    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    await BodyLimit(app, LIMIT, timeout_s=60)({"type": "http", "headers": headers}, receive, send)
    return sent, seen, calls


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [0, LIMIT - 1, LIMIT])
def test_a_body_within_the_limit_reaches_the_app_whole(declared: bool, size: int):
    body = _body(size, seed=size)
    sent, seen, _ = asyncio.run(_through_limit(body, declared, chunk_bytes=random.Random(size).randint(100, 9000)))
    assert seen == [body] and sent == []


@pytest.mark.parametrize("size", [LIMIT + 1, 20 * 1024 * 1024])
def test_a_declared_body_over_the_limit_is_refused_before_any_of_it_is_read(size: int):
    sent, seen, calls = asyncio.run(_through_limit(b"x" * size, declared=True, chunk_bytes=1 << 20))
    assert calls == 0 and seen == []
    assert sent[0]["status"] == 413
    assert f"has {size} bytes; the limit is {LIMIT} bytes (--max-request-bytes)" in sent[1]["body"].decode()


@pytest.mark.parametrize("chunk_bytes", [1000, 7777, 65536])
def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(chunk_bytes: int):
    sent, seen, calls = asyncio.run(_through_limit(_body(LIMIT * 10, seed=chunk_bytes), False, chunk_bytes))
    assert seen == [] and sent[0]["status"] == 413
    assert calls == LIMIT // chunk_bytes + 1  # read up to the chunk that passes the limit, no further
    assert f"the limit is {LIMIT} bytes (--max-request-bytes)" in sent[1]["body"].decode()


class BlockingTokenizer(CharTokenizer):
    """`CharTokenizer` whose ``encode`` of a prompt starting with "block" waits for ``release``
    (at most 10 s): a tokenization that takes as long as the test wants."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.blocked = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "block" in text:
            self.blocked.set()
            self.release.wait(10)
        return super().encode(text, add_special_tokens)


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_length=1 << 20)


@pytest.fixture
def server(fake: FakeEngine) -> Iterator[InProcessServer]:
    server = InProcessServer(fake)
    yield server
    server.stop()


def _post(path: str, body: bytes, framing: str = "content-length") -> bytes:
    """The head of a POST of ``body``, with its Content-Length or chunked."""
    length = {"content-length": str(len(body))} if framing == "content-length" else {"transfer-encoding": "chunked"}
    return head("POST", path, {"content-type": "application/json", **length})


def _error(answer: tuple[int, dict[str, str], Any]) -> tuple[int, str]:
    status, headers, body = answer
    assert headers["content-type"] == "application/json" and set(body) == {"error"}, answer
    assert body["error"]["code"] == status
    return status, body["error"]["message"]


HEALTH = head("GET", "/health")


@pytest.mark.parametrize("header_bytes, parts", [(MAX_HEAD_BYTES + 1, 1), (40_000, 7), (200_000, 1), (200_000, 50)])
def test_a_head_over_the_limit_is_answered_431_not_reset(server: InProcessServer, header_bytes: int, parts: int):
    """Whether the head arrives in one piece (h11 would take it) or in many (h11 gives up)."""
    big = head("GET", "/health", {"x-big": "a" * header_bytes})
    step = -(-len(big) // parts)
    (answer,) = asyncio.run(exchange(server.port, big[:step], [big[i:i + step] for i in range(step, len(big), step)]))
    assert _error(answer) == (431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
    assert answer[1]["connection"] == "close"
    assert asyncio.run(exchange(server.port, HEALTH))[0][0] == 200


def test_a_head_within_the_limit_is_served(server: InProcessServer):
    (answer,) = asyncio.run(exchange(server.port, head("GET", "/health", {"x-big": "a" * (MAX_HEAD_BYTES - 200)})))
    assert answer[0] == 200


def test_a_malformed_request_line_is_answered_400_in_the_error_format(server: InProcessServer):
    (answer,) = asyncio.run(exchange(server.port, b"NOT AN HTTP REQUEST LINE\r\n\r\n"))
    assert _error(answer) == (400, "malformed HTTP request")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_answered_413_while_the_client_still_sends_it(server: InProcessServer, framing: str):
    """The client sends all of its 2 MB body before it reads: the answer is there, not a reset,
    and the connection then closes."""
    body = _body(2 * 1024 * 1024, seed=7)
    parts = chunked(body, 50_000) if framing == "chunked" else [body[i:i + 100_000] for i in range(0, len(body), 100_000)]
    (answer,) = asyncio.run(exchange(server.port, _post("/v1/completions", body, framing), parts))
    status, message = _error(answer)
    assert status == 413 and f"the limit is {LIMIT} bytes (--max-request-bytes)" in message
    assert answer[1]["connection"] == "close"
    assert asyncio.run(exchange(server.port, HEALTH))[0][0] == 200


def test_a_body_within_the_limit_is_served(server: InProcessServer):
    body = b'{"prompt": "' + b"ab" * (LIMIT // 4) + b'", "max_tokens": 3}'
    (answer,) = asyncio.run(exchange(server.port, _post("/v1/completions", body), [body]))
    assert answer[0] == 200 and answer[2]["choices"][0]["text"] == "bab"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "block me", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "block me"}], "max_tokens": 2}'),
    ("/generate", b'{"text": "block me", "sampling_params": {"max_new_tokens": 2}}'),
], ids=["completions", "chat", "generate"])
def test_tokenizing_a_prompt_does_not_hold_up_other_requests(fake: FakeEngine, path: str, body: bytes):
    """While one request's tokenization is stuck, /health and another request are answered (on
    the event loop they would wait for it); the stuck request then completes."""
    tokenizer = fake.tokenizer = BlockingTokenizer()
    server = InProcessServer(fake)

    async def scenario() -> tuple[Any, Any, Any, float]:
        stuck = asyncio.ensure_future(exchange(server.port, _post(path, body), [body]))
        assert await asyncio.to_thread(tokenizer.blocked.wait, 10)
        start = time.monotonic()
        health = await exchange(server.port, HEALTH)
        other = b'{"prompt": "abc", "max_tokens": 2}'
        other_answer = await exchange(server.port, _post("/v1/completions", other), [other])
        while_stuck = time.monotonic() - start
        tokenizer.release.set()
        return health, other_answer, await stuck, while_stuck

    try:
        health, other, stuck, while_stuck = asyncio.run(scenario())
    finally:
        tokenizer.release.set()
        server.stop()
    assert health[0][0] == 200 and other[0][0] == 200 and stuck[0][0] == 200, (health, other, stuck)
    assert while_stuck < 5, f"answered after {while_stuck:.1f} s: they waited for the stuck tokenization"
