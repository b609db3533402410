"""Faults of the real server under load (tiny model, TP2 over gloo on the CPU): SIGTERM drains it,
a killed worker and a stopped worker bring it down, and in every case each client gets a
complete answer or an OpenAI error object, and no process is left behind.

Each test keeps 6 requests in flight at once: 2 short ones (SHORT_TOKENS) and 4 long ones
(LONG_TOKENS, near the tiny model's context: about 13 s on an idle 2-core machine), half of them
streamed; one long stream goes to /generate, whose events count the tokens so far. No bound
assumes the machine's speed: the SIGTERM test measures the server's tokens per second under this
load and sends the signal when the short requests need a third of the grace period to finish at
that speed; the other bounds are generous limits on waits for something that does happen. The
timings are printed (``pytest -s``) for the record.
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

pytestmark = pytest.mark.timeout(600)
TP2 = ("--tp-size", "2", "--device", "cpu")
GRACE_S = 5.0
DIST_TIMEOUT_S = 6.0  # the steady state's bound; the rendezvous at start-up waits longer (RENDEZVOUS_TIMEOUT_S)
SHORT_TOKENS, LONG_TOKENS = 100, 1900
KINDS = ("short", "short", "long", "long", "long stream", "long generate")
START_S = 240.0  # a TP2 server's start-up on a loaded machine, generously
WAIT_S = 120.0  # any other wait for something that happens (a first token, an exit, an answer)


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
        self.server.wait_healthy(START_S)
        self.healthy_at = time.monotonic()

    def idled_past_dist_timeout(self) -> ServerProcess:
        self._waiting.join(START_S + 5)
        assert self.healthy_at, f"not healthy:\n{self.server.log_tail()}"
        time.sleep(max(0.0, self.healthy_at + DIST_TIMEOUT_S + 1 - time.monotonic()))
        return self.server


@pytest.fixture(scope="module")
def idling() -> IdlingServer:
    idling = IdlingServer()
    yield idling
    idling.server.kill()


class Load:
    """The 6 requests (module docstring), sent at once; ``outcomes`` fill as the answers arrive."""

    def __init__(self, url: str) -> None:
        self.outcomes = [Outcome() for _ in KINDS]

        async def clients() -> list[Outcome]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=START_S + WAIT_S)) as session:
                return await asyncio.gather(*(post(session, url + self._path(kind), self._body(i, kind), outcome=outcome)
                                              for i, (kind, outcome) in enumerate(zip(KINDS, self.outcomes))))

        self.result = in_background(clients)
        self.wait_for_tokens(1, WAIT_S)

    @staticmethod
    def _path(kind: str) -> str:
        return "/generate" if kind == "long generate" else "/v1/completions"

    @staticmethod
    def _body(i: int, kind: str) -> dict[str, Any]:
        max_tokens = SHORT_TOKENS if kind == "short" else LONG_TOKENS
        if kind == "long generate":
            return {"text": f"client {i}", "stream": True,
                    "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_tokens}}
        return {"prompt": f"client {i}", "temperature": 0, "ignore_eos": True, "max_tokens": max_tokens,
                "stream": kind.endswith("stream")}

    @property
    def probe(self) -> Outcome:
        return self.outcomes[KINDS.index("long generate")]

    def tokens(self) -> int:
        """Tokens the probe stream (/generate) has received: every request's count, give or take
        the step or two between their admissions, since they run in one batch."""
        events = [e for e in self.probe.events if isinstance(e, dict) and "meta_info" in e]
        return events[-1]["meta_info"]["completion_tokens"] if events else 0

    def wait_for_tokens(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens() < count:
            assert time.monotonic() < deadline and self.probe.finished_at is None, \
                f"the probe stream has {self.tokens()} of the {count} tokens waited for: {self.probe}"
            time.sleep(0.005)

    def tokens_per_s(self, min_tokens: int = 10, min_s: float = 0.2) -> float:
        """Each request's decode speed under this load, over the probe's events from its first
        until at least ``min_tokens`` more and ``min_s`` seconds later."""
        first, since = self.tokens(), time.monotonic()
        self.wait_for_tokens(first + min_tokens, WAIT_S)
        while time.monotonic() - since < min_s:
            time.sleep(0.005)
        return (self.tokens() - first) / (time.monotonic() - since)


def assert_no_orphans(workers: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S
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


def wait_draining(server: ServerProcess) -> None:
    """Until /health says the server is shutting down (it drains from the signal on)."""
    deadline = time.monotonic() + WAIT_S
    while server.request("/health")[0] != 503:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)


def test_sigterm_under_load_drains_then_exits_0_on_every_rank(idling: IdlingServer):
    server = ServerProcess(*TP2, "--shutdown-timeout", str(GRACE_S), timeout_s=START_S)
    workers = server.worker_pids()
    load = Load(server.url)
    rate = load.tokens_per_s()
    left = max(5, min(SHORT_TOKENS // 2, int(rate * GRACE_S / 3)))  # the short ones need GRACE_S / 3 at this rate
    load.wait_for_tokens(SHORT_TOKENS - left, WAIT_S)
    sent, at = time.monotonic(), load.tokens()
    server.proc.send_signal(signal.SIGTERM)
    wait_draining(server)
    refused = server.request("/v1/completions", {"prompt": "late", "max_tokens": 2})
    elapsed = wait_exit(server, sent, GRACE_S + WAIT_S)
    outcomes = load.result(WAIT_S)
    log = server.log_text()
    print(f"\nSIGTERM under load ({rate:.0f} tokens/s per request, sent at token {at} of the short ones' "
          f"{SHORT_TOKENS}): exit code {server.proc.returncode} after {elapsed:.2f} s (grace {GRACE_S} s); new request: "
          f"{refused}; clients: {[(k, o.status, o.error_object()) for k, o in zip(KINDS, outcomes)]}")
    assert server.proc.returncode == 0 and elapsed >= GRACE_S, (elapsed, server.log_tail())
    assert refused[0] == 503 and refused[1]["error"]["type"] == "service_unavailable", refused
    for kind, outcome in zip(KINDS, outcomes):
        if kind == "short":
            assert outcome.status == 200 and outcome.body["usage"]["completion_tokens"] == SHORT_TOKENS, outcome
            assert outcome.finished_at > sent, "the short requests were not in flight at the signal"
        else:
            assert_error(outcome, 503, f"shut down before the request finished (--shutdown-timeout {GRACE_S:g} s)")
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
            assert outcome.body["usage"]["completion_tokens"] == SHORT_TOKENS, "only a short one may have finished first"
        else:
            assert_error(outcome, 500, reason)
    assert_no_orphans(workers)


def test_a_worker_killed_under_load_fails_every_client_and_exits_1():
    server = ServerProcess(*TP2, timeout_s=START_S)
    workers = server.worker_pids()
    load = Load(server.url)
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    elapsed = wait_exit(server, killed, WAIT_S)
    outcomes = load.result(WAIT_S)
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
    load = Load(server.url)
    stopped = time.monotonic()
    os.kill(workers[0], signal.SIGSTOP)
    elapsed = wait_exit(server, stopped, DIST_TIMEOUT_S + WAIT_S)
    outcomes = load.result(WAIT_S)
    print(f"\nSIGSTOP of rank 1 under load, --dist-timeout {DIST_TIMEOUT_S:g}: exit code {server.proc.returncode} after "
          f"{elapsed:.2f} s; clients: {[(o.status, o.error_object()) for o in outcomes]}")
    assert_failed_together(server, outcomes, workers, "TP worker rank 1 is stopped")
