"""Slow clients and many connections, in-process (`InProcessServer`, the `FakeEngine` behind it):
a request head or body that does not arrive within its timeout (``--request-head-timeout``,
``--request-body-timeout``) is answered 408 and logged, a connection beyond
``--max-connections`` is answered 503 at once and logged, and a shutdown with bodies still
arriving answers them 503 and logs no error or traceback (in-process, and the real server under
SIGTERM). The timeouts are short here (1-1.5 s); every time bound is derived from them."""
import asyncio
import logging
import signal
import time
from typing import Any, Iterator, Optional

import pytest

from arfusion.engine.server.http.server import GRACEFUL_SHUTDOWN_S, HttpLimits
from tests.fake_engine import FakeEngine
from tests.in_process_server import LIMIT, InProcessServer
from tests.raw_http import HOST, exchange, head, read_answer
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(60)
HEAD_S, BODY_S, CONNECTIONS = 1.0, 1.5, 4
LIMITS = HttpLimits(LIMIT, head_timeout_s=HEAD_S, body_timeout_s=BODY_S, max_connections=CONNECTIONS)
SLACK = 3.0  # an answer due at a timeout T comes before SLACK x T (not at some other, longer timer)
POST = head("POST", "/v1/completions", {"content-type": "application/json", "content-length": "1000"})
HEALTH = head("GET", "/health")


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    server = InProcessServer(FakeEngine(context_length=1024), LIMITS)
    yield server
    server.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` with uvicorn's records too (its loggers do not propagate to the root)."""
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    uvicorn_logger.removeHandler(caplog.handler)


async def dribble(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """Write ``data`` a byte at a time, the first at once, then one every ``every_s`` seconds."""
    for byte in data:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(every_s)


async def timed(port: int, first: bytes, trickle: Optional[bytes] = None, every_s: float = 0.2,
                timeout_s: float = 30) -> tuple[tuple[int, dict[str, str], Any], float]:
    """Send ``first`` on a new connection, then ``trickle`` a byte every ``every_s`` seconds
    until the answer comes; returns the answer and the seconds from the connection to it."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(first)
    sender = asyncio.ensure_future(dribble(writer, trickle or b"", every_s))
    try:
        answer = await asyncio.wait_for(read_answer(reader), timeout_s)
        return answer, time.monotonic() - start
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()


def _error(answer: tuple[int, dict[str, str], Any]) -> tuple[int, str]:
    status, headers, body = answer
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", answer
    assert body["error"]["code"] == status
    return status, body["error"]["message"]


def _logged(logs: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    return [r.getMessage() for r in logs.records if fragment in r.getMessage()]


@pytest.mark.parametrize("trickle", [None, b"x" * 1000], ids=["short-body", "trickled-body"])
def test_a_body_that_does_not_arrive_in_time_is_answered_408(server: InProcessServer, logs, trickle):
    """A Content-Length of 1000 with 2 bytes sent, or the rest a byte every 0.2 s (1000 bytes
    would take 200 s): 408 once the body timeout has passed, not before."""
    answer, elapsed = asyncio.run(timed(server.port, POST + b"{}", trickle))
    status, message = _error(answer)
    assert status == 408 and f"within {BODY_S:g} s" in message and "--request-body-timeout" in message
    assert BODY_S <= elapsed < SLACK * BODY_S
    assert _logged(logs, "(--request-body-timeout)"), "the 408 is logged"
    assert asyncio.run(exchange(server.port, HEALTH))[0][0] == 200


@pytest.mark.parametrize("first, trickle", [
    (b"", None), (b"POST /v1/completions HTTP/1.1\r\nHo", b"st: x\r\ncontent-length: 2\r\n\r\n{}" * 50),
], ids=["silent", "trickled-head"])
def test_a_head_that_does_not_arrive_in_time_is_answered_408(server: InProcessServer, logs, first, trickle):
    answer, elapsed = asyncio.run(timed(server.port, first, trickle, every_s=HEAD_S / 10))
    status, message = _error(answer)
    assert status == 408 and f"within {HEAD_S:g} s" in message and "--request-head-timeout" in message
    assert HEAD_S <= elapsed < SLACK * HEAD_S
    assert _logged(logs, "(--request-head-timeout)"), "the 408 is logged"


def test_the_head_timeout_of_a_later_request_counts_from_its_first_byte(server: InProcessServer):
    """On a kept-alive connection: a first request served, a pause (shorter than uvicorn's
    keep-alive), then a second head trickled: 408 a head timeout after its first byte."""
    async def scenario() -> tuple[int, tuple[int, dict[str, str], Any], float]:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        trickle = None
        try:
            writer.write(HEALTH)
            first = (await read_answer(reader))[0]
            await asyncio.sleep(HEAD_S / 2)
            start = time.monotonic()
            trickle = asyncio.ensure_future(dribble(writer, b"GET /health HTTP/1.1\r\nhost: x\r\n" * 20, HEAD_S / 10))
            answer = await asyncio.wait_for(read_answer(reader), 30)
            return first, answer, time.monotonic() - start
        finally:
            if trickle is not None:
                trickle.cancel()
                await asyncio.gather(trickle, return_exceptions=True)
            writer.close()

    first, answer, elapsed = asyncio.run(scenario())
    assert first == 200 and _error(answer)[0] == 408
    assert HEAD_S <= elapsed < SLACK * HEAD_S


def test_a_body_within_its_timeout_is_served(server: InProcessServer):
    body = b'{"prompt": "abc", "max_tokens": 3}'
    post = head("POST", "/v1/completions", {"content-type": "application/json", "content-length": str(len(body))})
    (answer,) = asyncio.run(exchange(server.port, post, [body[:10], body[10:]], bytes_per_s=len(body) / (BODY_S / 2)))
    assert answer[0] == 200 and answer[2]["choices"][0]["text"] == "cba"


def test_connections_beyond_the_limit_are_answered_503_at_once(logs):
    """``CONNECTIONS`` silent connections held open (a head timeout longer than the test), then
    three more: each is answered 503 at once (no timeout elapses); once they close, served."""
    server = InProcessServer(FakeEngine(), HttpLimits(LIMIT, 60, 60, CONNECTIONS))

    async def scenario() -> tuple[list[tuple[tuple[int, str], float]], int]:
        held = [await asyncio.open_connection(HOST, server.port) for _ in range(CONNECTIONS)]
        await asyncio.sleep(0.1)
        refused = []
        for _ in range(3):
            answer, elapsed = await timed(server.port, HEALTH)
            refused.append((_error(answer), elapsed))
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)
        return refused, (await exchange(server.port, HEALTH))[0][0]

    try:
        refused, after = asyncio.run(scenario())
    finally:
        server.stop()
    for (status, message), elapsed in refused:
        assert status == 503 and "--max-connections" in message and elapsed < 60, (status, message)
    assert len(_logged(logs, "(--max-connections)")) == 3
    assert after == 200, "served again once the connections closed"


def test_a_shutdown_with_bodies_still_arriving_answers_503_without_a_traceback(logs):
    """Three requests whose bodies will never come (a body timeout far longer than the shutdown
    takes), then SIGTERM: each is answered 503, the server stops within uvicorn's graceful
    shutdown time, and nothing is logged at ERROR or with a traceback."""
    server = InProcessServer(FakeEngine(), HttpLimits(LIMIT, 60, 60, 100), grace_s=0.5)
    try:
        async def scenario() -> tuple[list[tuple[int, dict[str, str], Any]], float]:
            waiting = [asyncio.ensure_future(timed(server.port, POST + b"{}")) for _ in range(3)]
            await asyncio.sleep(0.5)
            start = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)
            answers = [(await w)[0] for w in waiting]
            await asyncio.to_thread(server.thread.join, 30)
            return answers, time.monotonic() - start

        answers, elapsed = asyncio.run(scenario())
    finally:
        server.stop()
    assert [_error(a) for a in answers] == [(503, "the server is shutting down and takes no new requests")] * 3
    assert not server.thread.is_alive() and elapsed < GRACEFUL_SHUTDOWN_S
    bad = [r for r in logs.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def test_sigterm_with_slow_clients_connected_exits_0_without_a_traceback():
    """The real server (TP1, CPU) with 20 requests whose bodies never come and 5 half-sent heads:
    SIGTERM answers the bodies 503, and the server exits 0 with no traceback or error logged."""
    server = ServerProcess("--device", "cpu", "--skip-server-warmup", "--request-body-timeout", "120",
                           "--request-head-timeout", "120", "--shutdown-timeout", "1")

    async def scenario() -> tuple[list[Any], float]:
        bodies = [asyncio.ensure_future(timed(server.port, POST + b"{}", timeout_s=60)) for _ in range(20)]
        heads = [await asyncio.open_connection(HOST, server.port) for _ in range(5)]
        for _, writer in heads:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHo")
        await asyncio.sleep(1.0)
        seconds = await asyncio.to_thread(server.stop)
        answers = await asyncio.gather(*bodies, return_exceptions=True)
        for _, writer in heads:
            writer.close()
        return answers, seconds

    try:
        answers, _ = asyncio.run(scenario())
    finally:
        server.kill()
    log = server.log_text()
    assert server.proc.returncode == 0, log
    assert all(not isinstance(a, BaseException) and a[0][0] == 503 for a in answers), answers
    assert "Traceback" not in log and "ERROR" not in log, log


def test_a_connection_answered_408_frees_its_slot_at_once(logs):
    """``CONNECTIONS`` silent connections, each answered 408 after the head timeout and then kept
    open by its client: a new connection is served right after (once lingering for its client's
    input, a refused connection holds no slot of --max-connections; it held one 5 s more)."""
    server = InProcessServer(FakeEngine(), LIMITS)

    async def scenario() -> tuple[list[int], int, float]:
        held = [await asyncio.open_connection(HOST, server.port) for _ in range(CONNECTIONS)]
        answers = [(await asyncio.wait_for(read_answer(reader), SLACK * HEAD_S))[0] for reader, _ in held]
        start = time.monotonic()
        status = (await exchange(server.port, HEALTH))[0][0]
        for _, writer in held:
            writer.close()
        return answers, status, time.monotonic() - start

    try:
        answers, status, elapsed = asyncio.run(scenario())
    finally:
        server.stop()
    assert answers == [408] * CONNECTIONS
    assert status == 200 and elapsed < 1.0, (status, elapsed)
