"""A parser process: parses and validates large request bodies away from the server's process.

    python -m arfusion.engine.server.http.parser_process MODULE:FACTORY

``FACTORY()`` returns a `Screen`: given a request (`Job`: method, path, query, headers and the
whole body), the answer the server's app would give it without running any of its routes (a
body it refuses as malformed or invalid: the app's own answer), or None (the app must serve it:
the server's process then parses it as it would have anyway). The process reads jobs from its
stdin and writes answers to its stdout, each a length-prefixed pickle (`write_frame`), one job
at a time, in order; after the factory has run it writes one ``READY`` frame. It exits at the end
of its stdin (the server closed it, or died). A job the screen fails on is answered None. It
ignores SIGINT and SIGTERM (a Ctrl-C, or a signal to the process group, reaches it too: the
server drains and then ends it by closing its stdin) and runs at
``NICENESS``: under a flood of refused bodies its parsing takes the CPU time the server's
scheduler leaves. Its stdout carries frames only: what code in it prints goes to stderr.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import pickle
import signal
import struct
import sys
from dataclasses import dataclass
from typing import IO, Any, Awaitable, Callable, Optional

logger = logging.getLogger(__name__)
NICENESS = 10
READY = "ready"
_LENGTH = struct.Struct("!Q")
FRAME_HEAD = _LENGTH.size  # bytes of a frame's length


@dataclass(frozen=True)
class Job:
    """One request, its body whole."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, headers, body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


Screen = Callable[[Job], Awaitable[Optional[Answer]]]


def factory_name(factory: Callable[[], Screen]) -> str:
    """``MODULE:NAME`` of a module-level ``factory`` (what this process's command line takes)."""
    name = f"{factory.__module__}:{factory.__qualname__}"
    if "<" in name or "." in factory.__qualname__:
        raise ValueError(f"{name} is not a module-level function")
    return name


def frame(value: Any) -> bytes:
    """``value`` pickled, after its length (8 bytes, big-endian)."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def frame_length(head: bytes) -> int:
    """The length of a frame's pickle from its first ``FRAME_HEAD`` bytes."""
    return _LENGTH.unpack(head)[0]


def _read_frame(stream: IO[bytes]) -> Optional[Any]:
    """The next frame's value; None at the end of ``stream``."""
    head = stream.read(FRAME_HEAD)
    if len(head) < FRAME_HEAD:
        return None
    data = stream.read(frame_length(head))
    return pickle.loads(data) if data else None


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    os.nice(NICENESS)
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # print() in this process goes to stderr
    module, name = argv[0].split(":")
    screen: Screen = getattr(importlib.import_module(module), name)()
    loop = asyncio.new_event_loop()
    frames.write(frame(READY))
    frames.flush()
    while (job := _read_frame(sys.stdin.buffer)) is not None:
        try:
            answer = loop.run_until_complete(screen(job))
        except Exception:  # the server's process parses it, and answers what it finds
            logger.exception("screening %s %s (%d bytes) failed", job.method, job.path, len(job.body))
            answer = None
        frames.write(frame(answer))
        frames.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
