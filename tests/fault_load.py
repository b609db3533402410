"""Load and assertions for the fault tests of a real server (tests/test_server_faults.py on the
CPU, tests/gpu/test_server_faults_gpu.py on a GPU).

`Load` keeps 6 requests in flight at once: 2 short ones (SHORT_TOKENS) and 4 long ones
(LONG_TOKENS, near the tiny model's context), half of them streamed; one long stream goes to
/generate, whose events count the tokens so far. `stop_then_continue` stops a worker for less
than ``--dist-timeout`` while one greedy request is in flight, and returns what the server did
meanwhile and the request's tokens, to compare with the same request run alone before.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.load_client import Outcome, in_background, post
from tests.server_process import ServerProcess, pid_alive

SHORT_TOKENS, LONG_TOKENS = 100, 1900
KINDS = ("short", "short", "long", "long", "long stream", "long generate")
START_S = 240.0  # a TP2 server's start-up on a loaded machine, generously
WAIT_S = 120.0  # any other wait for something that happens (a first token, an exit, an answer)


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
        return generated(self.probe)

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


def generated(stream: Outcome) -> int:
    """Tokens a /generate stream has received so far."""
    events = [e for e in stream.events if isinstance(e, dict) and "meta_info" in e]
    return events[-1]["meta_info"]["completion_tokens"] if events else 0


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


def assert_failed_together(server: ServerProcess, outcomes: list[Outcome], workers: list[int], reason: str) -> None:
    """The server exited 1 naming ``reason`` in its log; every client got a 500 saying it, or
    (a short request that finished first) its whole answer; no worker is left."""
    assert server.proc.returncode == 1, server.log_tail()
    assert reason in server.log_text()
    for outcome in outcomes:
        if outcome.body is not None and "error" not in outcome.body:
            assert outcome.body["usage"]["completion_tokens"] == SHORT_TOKENS, "only a short one may have finished first"
        else:
            assert_error(outcome, 500, reason)
    assert_no_orphans(workers)


def wait_exit(server: ServerProcess, since: float, timeout_s: float) -> float:
    """Seconds from ``since`` until the server exited (it is killed after ``timeout_s``)."""
    try:
        server.proc.wait(timeout=timeout_s)
    finally:
        server.kill()
    return time.monotonic() - since


def fault_under_load(server: ServerProcess, worker: int, signum: int, exit_timeout_s: float) -> tuple[float, list[Outcome]]:
    """Send ``signum`` to ``worker`` while `Load` is in flight; returns the seconds until the
    server exited (waiting at most ``exit_timeout_s``) and every client's outcome."""
    load = Load(server.url)
    sent = time.monotonic()
    os.kill(worker, signum)
    elapsed = wait_exit(server, sent, exit_timeout_s)
    return elapsed, load.result(WAIT_S)


def clients(outcomes: list[Outcome]) -> list[tuple[int, Any]]:
    """Each client's status and error object, for a test's printed summary."""
    return [(o.status, o.error_object()) for o in outcomes]


@dataclass
class Recovery:
    reference: list[int]  # the request's tokens, run alone before the stop
    recovered: list[int]  # its tokens when the worker was stopped while it ran
    at_stop: int  # tokens it had received when the worker was stopped
    health: list[tuple[int, Any]]  # /health answers during the stop
    health_after: tuple[int, Any]  # /health once the request finished


def stop_then_continue(server: ServerProcess, worker: int, stop_s: float, tokens: int = LONG_TOKENS) -> Recovery:
    """Run one greedy /generate request of ``tokens`` tokens alone; run it again, streamed, and
    SIGSTOP ``worker`` for ``stop_s`` seconds once its first token arrived (asking /health
    meanwhile), then SIGCONT it; return both runs' tokens and the answers."""
    body = {"text": "recover after the stop",
            "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": tokens}}
    status, reference = server.request("/generate", body)
    assert status == 200, (reference, server.log_tail())
    stream = Outcome()

    async def client() -> Outcome:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=stop_s + WAIT_S)) as session:
            return await post(session, server.url + "/generate", {**body, "stream": True}, outcome=stream)

    result = in_background(client)
    deadline = time.monotonic() + WAIT_S
    while generated(stream) < 1:
        assert time.monotonic() < deadline and stream.finished_at is None, f"no first token: {stream}"
        time.sleep(0.005)
    os.kill(worker, signal.SIGSTOP)
    stopped, at_stop, health = time.monotonic(), generated(stream), []
    try:
        while time.monotonic() - stopped < stop_s:
            health.append(server.request("/health"))
            time.sleep(0.2)
    finally:
        os.kill(worker, signal.SIGCONT)
    finished = result(WAIT_S)
    events = [e for e in finished.events if isinstance(e, dict) and "output_ids" in e]
    assert events and finished.events[-1] == "[DONE]", (finished, server.log_tail())
    return Recovery(reference["output_ids"], events[-1]["output_ids"], at_stop, health, server.request("/health"))
