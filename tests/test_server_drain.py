"""`DrainingServer` in-process (uvicorn on a thread, the `FakeEngine` behind it): the first
SIGINT/SIGTERM stops admissions (503) while the requests in flight may finish, ends the rest
with an error after the grace period and then stops the server; a second signal ends the grace
period at once. (The real server under SIGTERM: test_server_faults.py.)"""
import asyncio
import signal
import threading
import time

import aiohttp
import pytest
import uvicorn

from arfusion.engine.common.generation import EngineError
from arfusion.engine.server.api import build_app
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.server import DrainingServer
from tests.fake_engine import FakeEngine
from tests.load_client import Outcome, post
from tests.server_process import free_port

pytestmark = pytest.mark.timeout(60)
ENDED = EngineError(503, "the server shut down before the request finished")


def start(fake: FakeEngine, grace_s: float) -> tuple[DrainingServer, threading.Thread, str]:
    lifecycle, port = Lifecycle(), free_port()
    config = uvicorn.Config(build_app(fake, "m", lifecycle), host="127.0.0.1", port=port, log_level="warning")
    server = DrainingServer(config, lifecycle, grace_s, lambda: fake.fail_all(ENDED))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}/v1/completions"


async def drain_under_load(server: DrainingServer, url: str, signals: int) -> tuple[list[Outcome], Outcome, float]:
    """A short request, a long one and a long stream in flight, then ``signals`` SIGINTs; returns
    their outcomes, the answer to a request sent after the signal, and when the signal was sent."""
    async with aiohttp.ClientSession() as session:
        first = asyncio.Event()
        bodies = [{"prompt": "abc", "max_tokens": 3},
                  {"prompt": "abcdef", "max_tokens": 60, "ignore_eos": True},
                  {"prompt": "abcdef", "max_tokens": 60, "ignore_eos": True, "stream": True}]
        tasks = [asyncio.ensure_future(post(session, url, b, first if b.get("stream") else None)) for b in bodies]
        await first.wait()
        signalled = time.monotonic()
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.1)
        late = await post(session, url, {"prompt": "late", "max_tokens": 2})
        for _ in range(signals - 1):
            server.handle_exit(signal.SIGINT, None)
        return list(await asyncio.gather(*tasks)), late, signalled


@pytest.mark.parametrize("signals, grace_s", [(1, 0.5), (2, 30.0)])
def test_signals_drain_then_end_the_rest_with_errors(signals: int, grace_s: float) -> None:
    """One signal: the short request finishes, the long ones (60 tokens of 20 ms) outlive the
    0.5 s grace period. Two: the 30 s grace period ends at once (the bound on the exit, 10 s
    past the first signal's grace, is a generous wait, far below 30 s)."""
    fake = FakeEngine(context_length=128, token_delay_s=0.02)
    server, thread, url = start(fake, grace_s)
    (short, long, stream), late, signalled = asyncio.run(drain_under_load(server, url, signals))
    thread.join(timeout=60)
    stopped_after = time.monotonic() - signalled
    assert not thread.is_alive() and stopped_after < min(grace_s, 0.5) + 10, stopped_after
    assert late.status == 503 and late.body["error"]["type"] == "service_unavailable", late
    if signals == 1:  # the short one (3 tokens) finishes within the grace period
        assert short.status == 200 and short.body["choices"][0]["text"] == "cba", short
    assert long.status == 503 and long.body["error"]["message"] == ENDED.message, long
    assert stream.status == 200 and stream.events[-1] == "[DONE]", stream
    assert stream.events[-2]["error"] == {"message": ENDED.message, "type": "service_unavailable", "code": 503}
    assert fake.running == 0
