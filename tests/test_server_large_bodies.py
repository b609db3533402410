"""Large request bodies are screened in parser processes (`engine.server.http.parser_pool`,
`engine.server.http.large_bodies`, `engine.server.api.body_screen`).

- Every answer is the one the server gives without them: refused bodies (malformed, not UTF-8,
  invalid, fields over their limits, on every route) and served ones alike.
- A refused large body is never parsed in the server's process (``json.loads`` is counted
  there); a valid one is parsed there once, as before.
- The pool is bounded: with its parsers busy and its queue full, one more body is refused (503
  from the server); a parser that dies is replaced (its job goes to the app), one that cannot
  start fails the start with its traceback; stopping the pool,
  or the server (in-process, and the real one on SIGTERM), ends every parser process.
"""
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from arfusion.engine.common.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from arfusion.engine.server.api.body_screen import build_screen
from arfusion.engine.server.http.parser_pool import ParserPool, ParserStartError, ParserUnavailable
from arfusion.engine.server.http.parser_process import Answer, Job, Screen
from arfusion.engine.server.http.server import BodyParsing, HttpLimits
from tests.fake_engine import FakeEngine
from tests.in_process_server import InProcessServer
from tests.raw_http import exchange, head
from tests.server_process import ServerProcess, child_pids, pid_alive

pytestmark = pytest.mark.timeout(180)
MIN_BYTES = 1024
LIMITS = HttpLimits(4 << 20, head_timeout_s=60, body_timeout_s=60, max_connections=1000)
JSON = "application/json"
SLOW_S = 1.0
HI = [{"role": "user", "content": "hi"}]


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


# (name, path, content-type, body): each over MIN_BYTES
REFUSED = [
    ("40,000 stop strings", "/v1/completions", JSON, _json({"prompt": "hi", "stop": [f"s{i}" for i in range(40_000)]})),
    ("a 500,000-character stop", "/v1/completions", JSON, _json({"prompt": "hi", "stop": "x" * 500_000})),
    ("chat, too many stops", "/v1/chat/completions", JSON,
     _json({"messages": HI, "stop": ["abc"] * (4 * MAX_STOP_STRINGS)})),
    ("generate, too many stops", "/generate", JSON,
     _json({"text": "hi", "sampling_params": {"stop": ["abc"] * (4 * MAX_STOP_STRINGS)}})),
    ("too many stop_token_ids", "/v1/completions", JSON,
     _json({"prompt": "hi", "stop_token_ids": [97] * (MAX_STOP_TOKEN_IDS + 1)})),
    ("malformed JSON", "/v1/completions", JSON, b'{"prompt": "' + b"y" * 5000),
    ("not UTF-8", "/v1/completions", JSON, b'{"prompt": "\xff' + b"y" * 5000 + b'"}'),
    ("a JSON list", "/v1/completions", JSON, _json(["x"] * 2000)),
    ("a string for an integer", "/v1/completions", JSON, _json({"prompt": "x" * 5000, "max_tokens": "3"})),
    ("bad messages", "/v1/chat/completions", JSON, _json({"messages": [{"role": "robot", "content": "x" * 5000}]})),
    ("detokenize, strings", "/detokenize", JSON, _json({"tokens": ["a"] * 2000})),
    ("text/plain", "/v1/completions", "text/plain", _json({"prompt": "x" * 5000, "max_tokens": 2})),
]
SERVED = [  # the app serves these (200, or a refusal after validation)
    ("a long prompt", "/v1/completions", JSON, _json({"prompt": "ab" * 3000, "max_tokens": 3})),
    ("chat", "/v1/chat/completions", JSON, _json({"messages": [{"role": "user", "content": "ab" * 3000}],
                                                  "max_tokens": 3, "stop": ["x"] * MAX_STOP_STRINGS})),
    ("another model", "/v1/completions", JSON, _json({"prompt": "x" * 5000, "model": "other"})),
    ("past the context", "/v1/completions", JSON, _json({"prompt": "x" * 70_000, "max_tokens": 3})),
    ("too deep", "/v1/completions", JSON, b"[" * 5000),
    ("tokenize", "/tokenize", JSON, _json({"prompt": "ab" * 3000})),
    ("no such route", "/v1/nothing", JSON, _json({"prompt": "ab" * 3000})),
]


def slow_screen() -> Screen:
    """A screen that answers 418 after ``SLOW_S`` seconds (for the pool's bound)."""
    async def screen(job: Job) -> Optional[Answer]:
        await asyncio.sleep(SLOW_S)
        return Answer(418, [(b"content-length", b"2")], b"{}")

    return screen


def broken_screen() -> Screen:
    """A screen factory that fails (for a parser that cannot start)."""
    raise RuntimeError("this screen cannot be made")


def post(port: int, path: str, content_type: str, body: bytes) -> tuple[int, dict[str, str], Any]:
    request = head("POST", path, {"content-type": content_type, "content-length": str(len(body))})
    ((status, headers, answer),) = asyncio.run(exchange(port, request, [body]))
    return status, headers, answer


def comparable(answer: tuple[int, dict[str, str], Any]) -> tuple[int, str, str, Any]:
    """Status, content type and length and the JSON body, less a completion's id and time."""
    status, headers, body = answer
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    length = headers.get("content-length", "") if status != 200 else ""  # the id's length may differ
    return status, headers.get("content-type", ""), length, body


@pytest.fixture(scope="module")
def servers():
    """(a server without a parser pool, one whose bodies over MIN_BYTES go to one)."""
    plain = InProcessServer(FakeEngine(context_length=32_768), LIMITS)
    pooled = InProcessServer(FakeEngine(context_length=32_768), LIMITS,
                             parsing=BodyParsing(ParserPool(build_screen, 2, 8), MIN_BYTES))
    yield plain, pooled
    plain.stop()
    pooled.stop()


@pytest.mark.parametrize("name, path, content_type, body", REFUSED + SERVED, ids=[c[0] for c in REFUSED + SERVED])
def test_the_answers_are_the_servers_own(servers, name: str, path: str, content_type: str, body: bytes):
    plain, pooled = servers
    assert len(body) > MIN_BYTES
    expected = comparable(post(plain.port, path, content_type, body))
    assert comparable(post(pooled.port, path, content_type, body)) == expected
    assert expected[0] in ((400,) if (name, path, content_type, body) in REFUSED else (200, 400, 404))


@pytest.fixture
def large_parses(monkeypatch) -> list[int]:
    """The sizes of the bodies over MIN_BYTES that ``json.loads`` parses in this process (the
    in-process servers' process; the parsers are other processes)."""
    sizes: list[int] = []
    loads = json.loads

    def counting(data: Any, *args: Any, **kwargs: Any) -> Any:
        if len(data) > MIN_BYTES:
            sizes.append(len(data))
        return loads(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    return sizes


def test_a_refused_large_body_is_not_parsed_in_the_servers_process(servers, large_parses: list[int]):
    plain, pooled = servers
    for _, path, content_type, body in REFUSED[:5]:
        assert post(pooled.port, path, content_type, body)[0] == 400
    assert large_parses == []
    for _, path, content_type, body in REFUSED[:5]:  # the control: without the pool each is parsed here
        assert post(plain.port, path, content_type, body)[0] == 400
    assert large_parses == [len(body) for _, _, _, body in REFUSED[:5]]


def test_a_valid_large_body_is_parsed_once_in_the_servers_process(servers, large_parses: list[int]):
    _, path, content_type, body = SERVED[0]
    assert post(servers[1].port, path, content_type, body)[0] == 200
    assert large_parses == [len(body)]


async def _screen_all(pool: ParserPool, count: int) -> list[Any]:
    job = Job("POST", "/v1/completions", b"", [], b"{}")
    return await asyncio.gather(*(pool.screen(job) for _ in range(count)), return_exceptions=True)


def test_the_pool_refuses_a_job_beyond_its_parsers_and_queue():
    async def run() -> list[Any]:
        pool = ParserPool(slow_screen, processes=1, queue=1)
        await pool.start()
        try:
            return await _screen_all(pool, 3)
        finally:
            await pool.stop()

    results = asyncio.run(run())
    assert sorted(type(r).__name__ for r in results) == ["Answer", "Answer", "PoolBusy"]
    assert all(r.status == 418 for r in results if isinstance(r, Answer))


def test_the_server_answers_503_while_the_pool_is_full():
    server = InProcessServer(FakeEngine(), LIMITS, parsing=BodyParsing(ParserPool(slow_screen, 1, 1), MIN_BYTES))
    try:
        _, path, content_type, body = REFUSED[0]

        async def three() -> list[int]:
            request = head("POST", path, {"content-type": content_type, "content-length": str(len(body))})
            answers = await asyncio.gather(*(exchange(server.port, request, [body]) for _ in range(3)))
            return sorted(a[0][0] for a in answers), [a[0][2] for a in answers if a[0][0] == 503]

        statuses, busy = asyncio.run(three())
        assert statuses == [418, 418, 503]
        assert "(--body-parsers, --body-parser-queue)" in busy[0]["error"]["message"]
    finally:
        server.stop()


def test_a_dead_parser_is_replaced_and_its_job_goes_to_the_app():
    async def run() -> tuple[Any, Any, int, list[int], list[int]]:
        pool = ParserPool(build_screen, processes=1, queue=4)
        await pool.start()
        try:
            (first,) = pool.pids()
            os.kill(first, signal.SIGKILL)
            while pid_alive(first):
                await asyncio.sleep(0.01)
            job = Job("POST", "/v1/completions", b"", [], b"[]")
            lost = (await asyncio.gather(pool.screen(job), return_exceptions=True))[0]
            answered = await pool.screen(job)
            return lost, answered, pool.started, [first], pool.pids()
        finally:
            await pool.stop()

    lost, answered, started, before, after = asyncio.run(run())
    assert isinstance(lost, ParserUnavailable)
    assert answered is not None and answered.status == 400
    assert started == 2 and after != before
    assert not any(pid_alive(p) for p in before + after)


def test_stopping_the_pool_ends_its_parsers_and_its_jobs():
    async def run() -> tuple[list[Any], list[int]]:
        pool = ParserPool(slow_screen, processes=2, queue=2)
        await pool.start()
        pids = pool.pids()
        jobs = asyncio.ensure_future(_screen_all(pool, 4))
        await asyncio.sleep(SLOW_S / 4)
        started = time.monotonic()
        await pool.stop()
        assert time.monotonic() - started < SLOW_S * 3
        return await jobs, pids

    results, pids = asyncio.run(run())
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert all(isinstance(r, ParserUnavailable) for r in results), results


def test_a_parser_that_cannot_start_fails_the_pools_start_naming_why():
    async def run() -> None:
        await ParserPool(broken_screen, 2, 1).start()

    with pytest.raises(ParserStartError, match="this screen cannot be made"):
        asyncio.run(run())


def test_the_server_starts_and_stops_its_parsers():
    pool = ParserPool(build_screen, 2, 8)
    server = InProcessServer(FakeEngine(), LIMITS, parsing=BodyParsing(pool, MIN_BYTES))
    pids = pool.pids()
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    server.stop()
    assert not server.thread.is_alive()
    assert not any(pid_alive(p) for p in pids)


def test_the_real_server_screens_in_a_parser_process_and_ends_it_on_sigterm():
    server = ServerProcess("--device", "cpu")
    try:
        parsers = [p for p in child_pids(server.proc.pid)
                   if "parser_process" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(parsers) == 1, "--body-parsers defaults to 1"
        status, body = server.request("/v1/completions", raw=REFUSED[0][3])
        assert (status, body["error"]["message"]) == (400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got 40000")
        status, body = server.request("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 70_000]})
        assert status == 400 and body["error"]["message"].startswith("stop: every stop string must have")
        largest = {"prompt": "hi", "max_tokens": 2, "stop": ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS}
        assert server.request("/v1/completions", largest)[0] == 200  # over 64 KiB: screened, then served
        server.stop(signal.SIGTERM)
        assert server.proc.returncode == 0
        assert not any(pid_alive(p) for p in parsers)
    finally:
        server.kill()
