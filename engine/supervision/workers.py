"""`WorkerSet`: the TP worker processes a launcher spawns on its node, and what became of them.

A worker exits with 0 only after rank 0's "shutdown" plan; any other exit is a failure, and so
is a worker that is alive but stopped (process state T: SIGSTOP, a debugger).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.load_agreement import REFUSED_EXIT_CODE

POLL_S = 0.1
EXIT_GRACE_S = 5.0  # how long a launcher waits for its workers to exit after "shutdown" before killing them
KILL_WAIT_S = 2.0  # how long `kill` waits for the killed workers to be reaped


class WorkerSet:
    def __init__(self, launch: LaunchConfig, ranks: Sequence[int]) -> None:
        """Spawn ``worker_main(launch, rank)`` for each of ``ranks``."""
        from arfusion.engine.supervision.tp_worker import worker_main

        ctx = mp.get_context("spawn")
        self.procs = {r: ctx.Process(target=worker_main, args=(launch, r), name=f"tp-worker-{r}") for r in ranks}
        self.stopping = False
        for p in self.procs.values():
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    def failure(self) -> Optional[str]:
        """"TP worker rank R exited (code C)" or "TP worker rank R is stopped (...)" for the first
        such worker, else None."""
        for rank, p in self.procs.items():
            if not p.is_alive() and p.exitcode != 0:
                return f"TP worker rank {rank} exited (code {p.exitcode})"
        for rank, p in self.procs.items():
            if p.is_alive() and _process_state(p.pid) in ("T", "t"):
                return f"TP worker rank {rank} is stopped (pid {p.pid}, process state T) and does not respond"
        return None

    def wait_for_failure(self, timeout_s: float) -> Optional[str]:
        """`failure`, waiting up to ``timeout_s`` for one (a peer's socket error can arrive a
        moment before its process is reaped)."""
        deadline = time.monotonic() + timeout_s
        while (found := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return found

    def watch(self, on_failure: Callable[[str], None]) -> threading.Thread:
        """Call ``on_failure(description)`` once, from a daemon thread, when a worker exits with
        a nonzero code other than `REFUSED_EXIT_CODE` (every rank refused the model: rank 0
        reports it), unless `stop` or `kill` began."""
        def loop() -> None:
            while not self.stopping:
                dead = [(r, p.exitcode) for r, p in self.procs.items()
                        if not p.is_alive() and p.exitcode not in (0, REFUSED_EXIT_CODE)]
                if dead and not self.stopping:
                    on_failure(f"TP worker rank {dead[0][0]} exited (code {dead[0][1]})")
                    return
                time.sleep(POLL_S)

        thread = threading.Thread(target=loop, name="worker-monitor", daemon=True)
        thread.start()
        return thread

    def stop(self, grace_s: float) -> dict[int, Optional[int]]:
        """Wait up to ``grace_s`` for the workers to exit (after rank 0's "shutdown"), then kill
        the rest; returns each rank's exit code."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        return {rank: p.exitcode for rank, p in self.procs.items()}

    def kill(self) -> None:
        """SIGKILL every worker still alive (a stopped one, or one stuck in a GPU kernel, too) and
        reap them, waiting up to ``KILL_WAIT_S`` in all."""
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))


def _process_state(pid: Optional[int]) -> str:
    """The state letter of ``/proc/<pid>/stat`` ("R", "S", "T", ...), "" if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
