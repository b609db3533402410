"""Start this checkout's server on loopback for a CPU benchmark, and wait until it is healthy."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300


def start_server(port: int, flags: list[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """``python -m arfusion.engine.launch_server`` on 127.0.0.1:``port`` with ``flags`` (output
    discarded, its own session so `os.killpg` ends it), ``env`` added to this process's; returns
    once /health answers 200. RuntimeError if it exits first, TimeoutError (after killing it) if
    it is not healthy within READY_TIMEOUT_S."""
    cmd = [sys.executable, "-m", "arfusion.engine.launch_server", "--port", str(port), "--host", "127.0.0.1", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"the server did not become healthy within {READY_TIMEOUT_S} s")
