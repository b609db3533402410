"""Faults of the real server on a GPU at TP2 (one GPU per rank, or both ranks sharing one under
MPS), fusion off and on, ``--dist-timeout`` DIST_TIMEOUT_S, the clients of
`tests.fault_load.Load` in flight:

- rank 1 stopped (SIGSTOP) for less than the timeout, while a greedy request runs: /health names
  the rank meanwhile, the server recovers, and the request's tokens are those it has alone;
- then rank 1 stopped for good: the server exits 1 within the timeout + EXIT_MARGIN_S (rank 0 may
  sit in a fused kernel that spins on rank 1's flags for ever: the watchdog ends it), every
  client is answered with an error naming the rank, no process is left;
- rank 1 killed (kill -9): the server exits 1 within EXIT_MARGIN_S, the same answers.

With fusion on, a strategy table (written here) makes flashinfer's one-shot kernel the fastest
strategy at every size, so the decode steps run it; the test checks that it ran. The model is the
built-in tiny one (dummy weights) or ARFUSION_MODEL_PATH (a real checkpoint).

Under MPS a killed rank can leave the daemon refusing the next client ("CUDA-capable device(s)
is/are busy or unavailable"): `benchmarks/gpu/run.sh tests` runs each test of this file in its
own pytest after the other GPU tests, with a fresh MPS daemon before each.
"""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from arfusion.engine.supervision.heartbeat import miss_after_s
from arfusion.fusion.dispatch.table import TABLE_VERSION
from tests.fault_load import (LONG_TOKENS, START_S, WAIT_S, assert_failed_together, clients, fault_under_load,
                              stop_then_continue)
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.tp_ranks(2), pytest.mark.timeout(START_S + 6 * WAIT_S)]
MODEL = os.environ.get("ARFUSION_MODEL_PATH", "tiny")
DIST_TIMEOUT_S = 20.0
EXIT_MARGIN_S = 2.0  # the target: a stopped rank ends the server within --dist-timeout + 2 s
STOP_S = (miss_after_s(DIST_TIMEOUT_S) + DIST_TIMEOUT_S) / 2  # /health reports it; well before the timeout
# hidden sizes the forcing table covers: the tiny model's and those of common checkpoints
HIDDEN_SIZES = (256, 896, 1024, 1536, 2048, 2560, 2880, 3584, 4096, 5120, 7168, 8192)


@pytest.fixture(scope="module")
def one_shot_table(tmp_path_factory) -> Path:
    """A strategy table in which flashinfer's one-shot kernel is fastest at every size, for
    this GPU (its name from nvidia-smi: this process creates no CUDA context) at TP2, bf16."""
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout.strip()
    rows = {str(t): {"flashinfer_one_shot": 1.0, "nccl": 100.0} for t in (1, 8, 64, 256, 512, 2048)}
    entries = [{"gpu": gpu, "world_size": 2, "hidden": h, "dtype": "bfloat16", "timings_us": rows} for h in HIDDEN_SIZES]
    path = tmp_path_factory.mktemp("table") / "one_shot.json"
    path.write_text(json.dumps({"version": TABLE_VERSION, "entries": entries}))
    return path


def start(fusion: str, table: Path) -> ServerProcess:
    flags = ("--enable-flashinfer-allreduce-fusion", "--allreduce-fusion-table", str(table)) if fusion == "on" else ()
    server = ServerProcess("--model-path", MODEL, "--tp-size", "2", "--dist-timeout", str(DIST_TIMEOUT_S), *flags,
                           timeout_s=START_S)
    log = server.log_text()
    assert ("all-reduce fusion active" in log) == (fusion == "on"), server.log_tail()
    return server


def fused_reductions(server: ServerProcess) -> int:
    status, info = server.request("/get_server_info")
    assert status == 200, info
    return info["fusion"]["reductions"].get("flashinfer_one_shot", 0)


@pytest.mark.parametrize("fusion", ["off", "on"])
def test_a_stopped_rank_recovers_before_the_dist_timeout_and_ends_the_server_after_it(fusion, one_shot_table):
    server = start(fusion, one_shot_table)
    try:
        workers = server.worker_pids()
        run = stop_then_continue(server, workers[0], STOP_S)
        unhealthy = [body for status, body in run.health if status == 503]
        print(f"\nfusion {fusion}: SIGSTOP of rank 1 for {STOP_S:g} s at token {run.at_stop} of {LONG_TOKENS}: "
              f"/health {[status for status, _ in run.health]}, then {run.health_after}; flashinfer one-shot "
              f"reductions {fused_reductions(server)}")
        assert server.proc.poll() is None, server.log_tail()
        assert 0 < run.at_stop < LONG_TOKENS, "the request was not in flight at the stop"
        assert unhealthy and unhealthy[-1]["reason"].startswith("TP worker rank 1 missed its heartbeat"), run.health
        assert run.recovered == run.reference and len(run.reference) == LONG_TOKENS
        assert run.health_after == (200, {"status": "ok"})
        assert (fused_reductions(server) > 0) == (fusion == "on"), "the fused kernel ran only with fusion on"

        elapsed, outcomes = fault_under_load(server, workers[0], signal.SIGSTOP, DIST_TIMEOUT_S + WAIT_S)
        print(f"fusion {fusion}: SIGSTOP of rank 1 under load, --dist-timeout {DIST_TIMEOUT_S:g} s: exit code "
              f"{server.proc.returncode} after {elapsed:.2f} s; clients: {clients(outcomes)}")
        assert_failed_together(server, outcomes, workers, "TP worker rank 1 is stopped")
        assert elapsed <= DIST_TIMEOUT_S + EXIT_MARGIN_S, server.log_tail()
    finally:
        server.kill()


@pytest.mark.parametrize("fusion", ["off", "on"])
def test_a_killed_rank_ends_the_server_at_once(fusion, one_shot_table):
    server = start(fusion, one_shot_table)
    try:
        workers = server.worker_pids()
        elapsed, outcomes = fault_under_load(server, workers[0], signal.SIGKILL, WAIT_S)
        print(f"\nfusion {fusion}: kill -9 of rank 1 under load: exit code {server.proc.returncode} after {elapsed:.2f} s; "
              f"clients: {clients(outcomes)}")
        assert_failed_together(server, outcomes, workers, "TP worker rank 1 exited (code -9)")
        assert elapsed <= EXIT_MARGIN_S, server.log_tail()
    finally:
        server.kill()
