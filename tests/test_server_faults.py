"""Faults of the real server under load (tiny model, TP2 over gloo on the CPU): SIGTERM drains it,
a killed worker and a stopped worker bring it down, and in every case each client gets a
complete answer or an OpenAI error object, and no process is left behind.

Each test keeps 6 requests in flight: 2 short ones (50 tokens, done within the grace period) and
4 long ones (1500 tokens: about 10 s on this CPU), half of them streamed. The timings are printed
(``pytest -s``) for the record.
"""
import asyncio
import os
import signal
import threading
import time
from typing import Any

import aiohttp
import pytest

from tests.load_client import Outcome, in_background, post
from tests.server_process import ServerProcess, pid_alive

pytestmark = pytest.mark.timeout(120)
TP2 = ("--tp-size", "2", "--device", "cpu")
GRACE_S = 3.0
DIST_TIMEOUT_S = 6.0  # smaller makes the rendezvous at start-up fail on a loaded machine


class IdlingServer:
    """A server with ``--dist-timeout DIST_TIMEOUT_S``, started before the other tests so that
    it has idled longer than that by the time its own test runs; ``healthy_at`` is when it
    answered /health."""

    def __init__(self) -> None:
        self.server = ServerProcess(*TP2, "--dist-timeout", str(DIST_TIMEOUT_S), wait_healthy=False)
        self.healthy_at = 0.0
        self._waiting = threading.Thread(target=self._wait, daemon=True)
        self._waiting.start()

    def _wait(self) -> None:
        self.server.wait_healthy(90)
        self.healthy_at = time.monotonic()

    def idled_past_dist_timeout(self) -> ServerProcess:
        self._waiting.join(95)
        assert self.healthy_at, f"not healthy:\n{self.server.log_tail()}"
        time.sleep(max(0.0, self.healthy_at + DIST_TIMEOUT_S + 1 - time.monotonic()))
        return self.server


@pytest.fixture(scope="module")
def idling() -> IdlingServer:
    idling = IdlingServer()
    yield idling
    idling.server.kill()


def load(url: str) -> tuple[Any, list[str]]:
    """Start the 6 requests; returns ``result(timeout_s)`` (their `Outcome`s) once all streams
    have their first event, and the kind of each request."""
    kinds = ["short", "short", "long", "long", "long stream", "long stream"]
    ready = threading.Event()

    async def clients() -> list[Outcome]:
        firsts = [asyncio.Event() for _ in kinds]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = [asyncio.ensure_future(post(session, url + "/v1/completions", {
                "prompt": f"client {i}", "temperature": 0, "ignore_eos": True,
                "max_tokens": 50 if kind == "short" else 1500, "stream": kind.endswith("stream")}, first))
                for i, (kind, first) in enumerate(zip(kinds, firsts))]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f, k in zip(firsts, kinds) if "stream" in k)), 60)
            ready.set()
            return await asyncio.gather(*tasks)

    result = in_background(clients)
    assert ready.wait(60), "the streams never started"
    return result, kinds


def assert_no_orphans(workers: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if pid_alive(p)], "orphaned worker processes"


def assert_error(outcome: Outcome, status: int, fragment: str) -> None:
    """A non-streaming answer with ``status`` and an error object, or a stream whose last two
    events are an error event with that code, then [DONE]."""
    error = outcome.error_object()
    assert error is not None and error["code"] == status and fragment in error["message"], outcome
    if outcome.events:
        assert outcome.status == 200 and outcome.events[-1] == "[DONE]" and "error" in outcome.events[-2], outcome
    else:
        assert outcome.status == status, outcome


def wait_exit(server: ServerProcess, since: float, timeout_s: float) -> float:
    try:
        server.proc.wait(timeout=timeout_s)
    finally:
        server.kill()
    return time.monotonic() - since


def test_sigterm_under_load_drains_then_exits_0_on_every_rank(idling: IdlingServer):
    server = ServerProcess(*TP2, "--shutdown-timeout", str(GRACE_S))
    workers = server.worker_pids()
    result, kinds = load(server.url)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = server.request("/v1/completions", {"prompt": "late", "max_tokens": 2})
    elapsed = wait_exit(server, sent, GRACE_S + 10)
    outcomes = result(30)
    log = server.log_text()
    print(f"\nSIGTERM under load: exit code {server.proc.returncode} after {elapsed:.2f} s (grace {GRACE_S} s); "
          f"new request: {refused}; clients: {[(k, o.status, o.error_object()) for k, o in zip(kinds, outcomes)]}")
    assert server.proc.returncode == 0 and elapsed < GRACE_S + 5, (elapsed, server.log_tail())
    assert refused[0] == 503 and refused[1]["error"]["type"] == "service_unavailable", refused
    for kind, outcome in zip(kinds, outcomes):
        if kind == "short":
            assert outcome.status == 200 and outcome.body["usage"]["completion_tokens"] == 50, outcome
        else:
            assert_error(outcome, 503, "shut down before the request finished (--shutdown-timeout 3 s)")
    assert "TP workers exited: rank 1 with code 0" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "fusion: fusion" not in log and "all-reduce unfused: fusion is not enabled" in log
    assert_no_orphans(workers)


def assert_failed_together(server, outcomes, workers, reason: str) -> None:
    """The server exited 1 naming ``reason`` in its log; every client got a 500 saying it, or
    (a short request that finished first) its whole answer; no worker is left."""
    assert server.proc.returncode == 1
    assert reason in server.log_text()
    for outcome in outcomes:
        if outcome.body is not None and "error" not in outcome.body:
            assert outcome.body["usage"]["completion_tokens"] == 50, "only a short one may have finished first"
        else:
            assert_error(outcome, 500, reason)
    assert_no_orphans(workers)


def test_a_worker_killed_under_load_fails_every_client_and_exits_1():
    server = ServerProcess(*TP2)
    workers = server.worker_pids()
    result, _ = load(server.url)
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    elapsed = wait_exit(server, killed, 20)
    outcomes = result(30)
    print(f"\nkill -9 of rank 1 under load: exit code {server.proc.returncode} after {elapsed:.2f} s; "
          f"clients: {[(o.status, o.error_object()) for o in outcomes]}")
    assert_failed_together(server, outcomes, workers, "TP worker rank 1 exited (code -9)")


def test_a_stopped_worker_is_found_after_dist_timeout_and_an_idle_server_survives_it(idling: IdlingServer):
    """The server has idled for longer than its --dist-timeout (rank 0's heartbeats keep the
    worker's wait for the next plan from timing out); it serves, then its worker is stopped."""
    server = idling.idled_past_dist_timeout()
    workers = server.worker_pids()
    status, body = server.request("/v1/completions", {"prompt": "after idling", "max_tokens": 4})
    assert status == 200, (body, server.log_tail())
    result, _ = load(server.url)
    stopped = time.monotonic()
    os.kill(workers[0], signal.SIGSTOP)
    elapsed = wait_exit(server, stopped, DIST_TIMEOUT_S + 20)
    outcomes = result(30)
    print(f"\nSIGSTOP of rank 1 under load, --dist-timeout {DIST_TIMEOUT_S:g}: exit code {server.proc.returncode} after "
          f"{elapsed:.2f} s; clients: {[(o.status, o.error_object()) for o in outcomes]}")
    assert_failed_together(server, outcomes, workers, "TP worker rank 1 is stopped")
