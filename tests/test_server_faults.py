"""Faults of the real server under load (tiny model, TP2 over gloo on the CPU): SIGTERM drains it,
a killed worker and a worker stopped for ``--dist-timeout`` bring it down, a worker stopped for
less does not (its greedy output is the same as without the stop), and in every case each
client gets a complete answer or an OpenAI error object, and no process is left behind.

Each load test keeps the 6 requests of `tests.fault_load.Load` in flight (the long ones take
about 13 s on an idle 2-core machine). No bound assumes the machine's speed: the SIGTERM test
measures the server's tokens per second under this load and sends the signal when the short
requests need a third of the grace period to finish at that speed; the stopped worker's exit
bound is the timeout plus what the watchdog and the supervisor add by design (EXIT_BOUND_S);
the other bounds are generous limits on waits for something that does happen. The timings are
printed (``pytest -s``) for the record.
"""
import os
import signal
import threading
import time

import pytest

from arfusion.engine.scheduling.scheduler import idle_plan_interval_s
from arfusion.engine.supervision.heartbeat import miss_after_s
from arfusion.engine.supervision.watchdog import detection_bound_s
from arfusion.engine.supervision.supervisor import SHUTDOWN_BOUND_S
from tests.fault_load import (KINDS, LONG_TOKENS, SHORT_TOKENS, START_S, WAIT_S, Load, assert_error,
                              assert_failed_together, assert_no_orphans, clients, fault_under_load, stop_then_continue,
                              wait_exit)
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
TP2 = ("--tp-size", "2", "--device", "cpu")
GRACE_S = 5.0
DIST_TIMEOUT_S = 10.0  # the steady state's bound; the rendezvous at start-up waits longer (RENDEZVOUS_TIMEOUT_S)
# a stop that /health reports (after miss_after_s) and that ends well before --dist-timeout
STOP_S = (miss_after_s(DIST_TIMEOUT_S) + DIST_TIMEOUT_S) / 2
# from a worker's stop to the server's exit: the timeout, the watchdog's detection (a few reads
# of the heartbeats, each a fraction of the beat interval) and the supervisor's bounded waits
EXIT_BOUND_S = DIST_TIMEOUT_S + detection_bound_s(DIST_TIMEOUT_S) + SHUTDOWN_BOUND_S
# an idle server: the first idle plan after the stop (at most one interval later) fails after the
# timeout unless the watchdog ends the server first
IDLE_EXIT_BOUND_S = DIST_TIMEOUT_S + max(detection_bound_s(DIST_TIMEOUT_S),
                                         idle_plan_interval_s(DIST_TIMEOUT_S)) + SHUTDOWN_BOUND_S


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


def test_a_worker_killed_under_load_fails_every_client_and_exits_1():
    server = ServerProcess(*TP2, timeout_s=START_S)
    workers = server.worker_pids()
    elapsed, outcomes = fault_under_load(server, workers[0], signal.SIGKILL, WAIT_S)
    print(f"\nkill -9 of rank 1 under load: exit code {server.proc.returncode} after {elapsed:.2f} s; "
          f"clients: {clients(outcomes)}")
    assert_failed_together(server, outcomes, workers, "TP worker rank 1 exited (code -9)")
    errors = [line for line in server.log_text().splitlines() if " ERROR " in line]
    assert errors and "TP worker rank 1 exited (code -9)" in errors[0], errors  # the line naming the rank first
    assert "Traceback" not in server.log_text(), "the collective's traceback is logged at debug level only"


def test_a_worker_stopped_for_less_than_dist_timeout_recovers_with_the_same_greedy_output(idling: IdlingServer):
    """The server has idled for longer than its --dist-timeout (rank 0's heartbeats keep the
    worker's wait for the next plan from timing out); it serves, then its worker is stopped for
    STOP_S while a greedy request runs: /health names the rank meanwhile, the request finishes
    with the tokens it has when run alone, and /health is 200 again."""
    server = idling.idled_past_dist_timeout()
    (worker,) = server.worker_pids()
    run = stop_then_continue(server, worker, STOP_S)
    unhealthy = [body for status, body in run.health if status == 503]
    print(f"\nSIGSTOP of rank 1 for {STOP_S:g} s (--dist-timeout {DIST_TIMEOUT_S:g} s) at token {run.at_stop} of "
          f"{LONG_TOKENS}: /health {[status for status, _ in run.health]}, then {run.health_after}")
    assert server.proc.poll() is None, server.log_tail()
    assert 0 < run.at_stop < LONG_TOKENS, "the request was not in flight at the stop"
    assert unhealthy and unhealthy[-1]["reason"].startswith("TP worker rank 1 missed its heartbeat"), run.health
    assert run.recovered == run.reference and len(run.reference) == LONG_TOKENS
    assert run.health_after == (200, {"status": "ok"})


def test_a_stopped_worker_is_found_after_dist_timeout_and_an_idle_server_survives_it(idling: IdlingServer):
    """The same server (it has idled past its --dist-timeout and recovered from a shorter stop)
    serves, then its worker is stopped for good under load."""
    server = idling.idled_past_dist_timeout()
    workers = server.worker_pids()
    status, body = server.request("/v1/completions", {"prompt": "after idling", "max_tokens": 4})
    assert status == 200, (body, server.log_tail())
    elapsed, outcomes = fault_under_load(server, workers[0], signal.SIGSTOP, DIST_TIMEOUT_S + WAIT_S)
    print(f"\nSIGSTOP of rank 1 under load, --dist-timeout {DIST_TIMEOUT_S:g}: exit code {server.proc.returncode} after "
          f"{elapsed:.2f} s (bound {EXIT_BOUND_S:.2f} s); clients: {clients(outcomes)}")
    assert_failed_together(server, outcomes, workers, "TP worker rank 1 is stopped")
    assert elapsed <= EXIT_BOUND_S, server.log_tail()


def test_an_idle_server_whose_worker_stops_is_ended_naming_the_stopped_rank():
    """No request runs; rank 0's idle plans go out to the stopped worker. The server ends through
    whichever designed rule comes first: the watchdog's (no heartbeat for ``--dist-timeout``) or
    an idle plan's send failing after ``--dist-timeout`` (gloo's send waits for the peer's
    receive). Either way it exits 1 within IDLE_EXIT_BOUND_S and names the stopped rank."""
    server = ServerProcess(*TP2, "--dist-timeout", str(DIST_TIMEOUT_S), timeout_s=START_S)
    workers = server.worker_pids()
    stopped = time.monotonic()
    os.kill(workers[0], signal.SIGSTOP)
    elapsed = wait_exit(server, stopped, DIST_TIMEOUT_S + WAIT_S)
    log = server.log_text()
    heartbeat_rule = "TP worker rank 1 sent no heartbeat for " in log
    print(f"\nSIGSTOP of rank 1 of an idle server, --dist-timeout {DIST_TIMEOUT_S:g}: exit code {server.proc.returncode} "
          f"after {elapsed:.2f} s (bound {IDLE_EXIT_BOUND_S:.2f} s), ended by "
          f"{'the watchdog' if heartbeat_rule else 'an idle plan'}")
    assert server.proc.returncode == 1 and elapsed <= IDLE_EXIT_BOUND_S, log
    assert "TP worker rank 1 is stopped" in log, log
    assert heartbeat_rule or "the scheduler failed: " in log, log
    assert_no_orphans(workers)
