"""Readiness that tells the truth: the HTTP port is bound before the model loads (a second server
on it fails at once, exit code 2, one line), a client is refused until the server serves, the
"serving" line is logged only once it does, and ``/health`` answers 503 naming the rank while a TP
worker misses its heartbeat (TP2 over gloo: a SIGSTOPped worker), 200 again once it beats.
The heartbeat monitor itself runs in-process against a TCPStore."""
import errno
import os
import random
import signal
import socket
import threading
import time

import pytest
import torch.distributed as dist

from arfusion.engine.supervision.heartbeat import Heartbeat, HeartbeatMonitor, miss_after_s
from tests.server_process import ServerProcess, free_port

pytestmark = pytest.mark.timeout(240)
CPU = ("--device", "cpu")
DIST_TIMEOUT_S = 90  # longer than the worker stays stopped below


def port_is_bound(port: int) -> bool:
    """Whether a socket holds ``port`` exclusively, as a server binds it (a bind with
    SO_REUSEADDR fails; this one, had it succeeded, would not keep the server from binding)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def port_outside_the_ephemeral_range() -> int:
    """A free port below the kernel's ephemeral range: no client connection of another process
    can take it as its source port between this choice and the server's bind (which would make
    the server bind with SO_REUSEADDR, and `port_is_bound` see nothing until it listens)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.Random(os.getpid()).sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port below the ephemeral range")


def connect(port: int) -> str:
    """"refused", "connected" or "timed out" (a listening socket that does not accept)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timed out"


def _wait_for(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def second_server_fails(port: int) -> tuple[int, str, float]:
    start = time.monotonic()
    second = ServerProcess(*CPU, port=port, wait_healthy=False)
    try:
        code = second.proc.wait(timeout=60)
    finally:
        second.kill()
    return code, second.log_text(), time.monotonic() - start


def test_the_port_is_bound_before_the_model_loads_and_serves_only_when_ready():
    """From the moment the first server holds its port, connections are probed every 20 ms (each
    noting whether "serving" was logged before it) until one connects after the log line; a
    second server is started on the port meanwhile, and once more after the first serves."""
    port = port_outside_the_ephemeral_range()
    first = ServerProcess(*CPU, port=port, wait_healthy=False)
    probes: list[tuple[bool, str]] = []

    def probe_until_served() -> None:
        while first.proc.poll() is None and (not probes or probes[-1] != (True, "connected")):
            logged = "serving tiny on http://127.0.0.1:" in first.log_text()
            probes.append((logged, connect(port)))
            time.sleep(0.02)

    try:
        _wait_for(lambda: port_is_bound(port) or first.proc.poll() is not None, 120)
        prober = threading.Thread(target=probe_until_served, daemon=True)
        prober.start()
        loading = "serving" not in first.log_text()
        code, log, took = second_server_fails(port)
        print(f"\nsecond server {'while the first loads' if loading else 'after the first serves'}: exit {code} "
              f"after {took:.1f} s: {log.strip()}")
        expected = f"error: cannot serve on http://127.0.0.1:{port} (--host, --port): address already in use"
        assert code == 2 and log.strip() == expected, log
        prober.join(120)
        assert probes and probes[-1] == (True, "connected"), first.log_tail()
        assert "timed out" not in {result for _, result in probes}, "a connection was queued, not refused"
        assert (True, "refused") not in probes, "'serving' was logged before the port accepted connections"
        refused = sum(result == "refused" for _, result in probes)
        print(f"{refused} of {len(probes)} connections refused before it served")
        assert refused, "the first probe, as soon as the port was bound, connected: the model was not loaded yet"
        first.wait_healthy(60)
        code, log, _ = second_server_fails(port)
        assert code == 2 and log.strip() == expected, log
        assert first.request("/health")[0] == 200
    finally:
        first.kill()


@pytest.mark.parametrize("dist_timeout, miss_after", [(120.0, 5.0), (6.0, 3.0), (1.0, 0.5)])
def test_a_worker_misses_its_heartbeat_after_five_beats_or_half_the_dist_timeout(dist_timeout, miss_after):
    assert miss_after_s(dist_timeout) == miss_after


def test_the_monitor_names_the_rank_that_misses_its_heartbeat_until_it_beats_again():
    """Rank 1 beats (`Heartbeat`), rank 2 does not until this test beats for it."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    init_method, dist_timeout = f"tcp://127.0.0.1:{port}", 2.0
    heartbeat = Heartbeat(init_method, 1, dist_timeout)
    monitor = HeartbeatMonitor(init_method, [1, 2], dist_timeout)
    beating = threading.Event()

    def beat_for_rank_2() -> None:
        while not beating.is_set():
            master.add("arfusion/heartbeat/2", 1)
            time.sleep(monitor.interval_s)

    thread = threading.Thread(target=beat_for_rank_2, daemon=True)
    try:
        took = _wait_for(lambda: monitor.missed() is not None, 30)
        assert monitor.missed().startswith("TP worker rank 2 missed its heartbeat: none for ")
        assert "rank 1" not in monitor.missed() and took >= monitor.miss_after_s
        thread.start()
        _wait_for(lambda: monitor.missed() is None, 30)
    finally:
        beating.set()
        if thread.ident is not None:
            thread.join(5)
        heartbeat.stop()
        monitor.stop()


def test_health_is_503_naming_the_rank_while_a_tp_worker_is_stopped_then_200():
    server = ServerProcess("--tp-size", "2", *CPU, "--dist-timeout", str(DIST_TIMEOUT_S), timeout_s=120)
    (worker,) = server.worker_pids()
    try:
        assert server.request("/health") == (200, {"status": "ok"})
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        answers = []

        def unhealthy() -> bool:
            answers.append(server.request("/health"))
            return answers[-1][0] == 503

        took = _wait_for(unhealthy, 30)
        status, body = answers[-1]
        assert body["status"] == "unhealthy" and body["reason"].startswith("TP worker rank 1 missed its heartbeat")
        print(f"\n/health 503 {took:.1f} s after SIGSTOP: {body['reason']}")
        os.kill(worker, signal.SIGCONT)
        took = _wait_for(lambda: server.request("/health")[0] == 200, 30)
        print(f"/health 200 again {took:.1f} s after SIGCONT (stopped for {time.monotonic() - stopped:.1f} s)")
        status, body = server.request("/v1/completions", {"prompt": "after the stop", "max_tokens": 4})
        assert status == 200 and server.proc.poll() is None, (body, server.log_tail())
    finally:
        os.kill(worker, signal.SIGCONT)
        server.kill()
