"""Start `python -m arfusion.engine.launch_server` in a subprocess for tests, wait until healthy, stop it.

The server's output goes to an anonymous temporary file (no file is left behind); `log_tail`
reads it, also after the server exited.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
# Generous bounds on waits for what does happen: a server's start-up (a TP2 one on a loaded 2-core
# machine spawns, imports and warms up slowly), one small request, a signalled server's exit.
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    """``python -m arfusion.engine.launch_server --port P *args``. A port is free when it is chosen, but
    the server's own rendezvous may take it before the HTTP server binds it: `wait_healthy` then
    starts the server again on another port (unless the port was given)."""

    def __init__(self, *args: str, port: Optional[int] = None, wait_healthy: bool = True,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        self.args = args
        self.fixed_port = port is not None
        self._start(port or free_port())
        if wait_healthy:
            self.wait_healthy(timeout_s)

    def _start(self, port: int) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "arfusion.engine.launch_server", "--port", str(port), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile()
        self._final_log: Optional[str] = None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        """Everything the server printed so far (read without moving the shared file offset)."""
        if self._final_log is not None:
            return self._final_log
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def worker_pids(self) -> list[int]:
        """The spawned TP worker processes (children of the server)."""
        return [p for p in child_pids(self.proc.pid) if "spawn" in Path(f"/proc/{p}/cmdline").read_text()]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        restarts = 2
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if restarts and not self.fixed_port and "address already in use" in self.log_text():
                    restarts -= 1
                    self.kill()
                    self._start(free_port())
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"server not healthy within {timeout_s}s:\n{self.log_tail()}")

    def request(self, path: str, body: Optional[dict] = None, raw: Optional[bytes] = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = EXIT_TIMEOUT_S) -> float:
        """Signal the server; returns seconds until it exited."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        return time.monotonic() - start

    def kill(self) -> None:
        """Kill the server's process group if it still runs; keep its log for `log_text`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self._final_log is None:
            self._final_log = self.log_text()
            self.log.close()
