"""`ParserPool`: a few parser processes (`engine.server.http.parser_process`) that screen large
request bodies for the server, and the bounded queue in front of them.

JSON parsing and request validation are C code that holds the GIL for as long as they run: for a
body of 40,000 stop strings, milliseconds of ``json.loads`` alone. In the server's process, a
flood of such bodies, each refused with a 400, takes that time from the scheduler's thread (the
same process at TP1), which wins the GIL back after every torch op. A parser process parses
them instead: the server's process only moves the bytes through a pipe, and reads back the answer.

`screen(job)` queues a job and returns the parser's `Answer` (the app's answer to a body it
refuses without running a route) or None (the server's app serves it, parsing it again: a valid
body costs the server's process what it did before, and a little latency). At most ``processes``
jobs run and ``queue`` wait; one more raises `PoolBusy` (the server answers 503). A parser that
dies is replaced; its job, and any job while no parser runs, raise `ParserUnavailable` (the
server's app parses it). `start` spawns the processes and waits until each has imported its
screen (`ParserStartError` with its stderr's tail, or after ``START_TIMEOUT_S``); `stop` closes
their stdin and waits ``STOP_WAIT_S`` before killing them. Both run on the server's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import sys
from typing import Any, Callable, Optional

from arfusion.engine.server.http.parser_process import (
    FRAME_HEAD, READY, Answer, Job, Screen, factory_name, frame, frame_length,
)

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0
STOP_WAIT_S = 2.0


class PoolBusy(Exception):
    """Every parser is busy and the queue is full."""


class ParserUnavailable(Exception):
    """No parser answered the job (it died, or the pool stopped)."""


class ParserStartError(RuntimeError):
    """A parser process did not start."""


class ParserPool:
    """``processes`` parser processes running ``factory``'s screen, ``queue`` jobs waiting at most."""

    def __init__(self, factory: Callable[[], Screen], processes: int, queue: int) -> None:
        if processes < 1 or queue < 0:
            raise ValueError(f"a parser pool needs processes >= 1 and queue >= 0, got {processes}, {queue}")
        self.factory = factory_name(factory)
        self.processes = processes
        self.queue_size = queue
        self._jobs: Optional[asyncio.Queue[tuple[Job, asyncio.Future[Optional[Answer]]]]] = None
        self._procs: list[Optional[asyncio.subprocess.Process]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        self.pending = 0  # jobs queued or running
        self.started = 0  # parser processes started, replacements included

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None]

    async def start(self) -> None:
        """Spawn the parsers; returns once each is ready to take jobs."""
        spawned = await asyncio.gather(*(self._spawn() for _ in range(self.processes)), return_exceptions=True)
        failed = next((p for p in spawned if isinstance(p, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(_end(p) for p in spawned if not isinstance(p, BaseException)))
            raise failed
        self._jobs = asyncio.Queue()
        self._procs = list(spawned)  # type: ignore[arg-type]
        self._tasks = [asyncio.ensure_future(self._serve(i)) for i in range(self.processes)]

    async def screen(self, job: Job) -> Optional[Answer]:
        """The parser's answer to ``job`` (see the module docstring)."""
        if self._jobs is None:
            raise ParserUnavailable("the parser pool is not running")
        if self.pending >= self.processes + self.queue_size:
            raise PoolBusy
        self.pending += 1
        try:
            answer: asyncio.Future[Optional[Answer]] = asyncio.get_running_loop().create_future()
            self._jobs.put_nowait((job, answer))
            return await answer
        finally:
            self.pending -= 1

    async def stop(self) -> None:
        """End the parsers (the jobs left raise `ParserUnavailable`)."""
        jobs, self._jobs = self._jobs, None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        while jobs is not None and not jobs.empty():
            _, answer = jobs.get_nowait()
            _fail(answer, ParserUnavailable("the parser pool stopped"))
        await asyncio.gather(*(_end(p) for p in self._procs if p is not None))
        self._procs = []

    async def _spawn(self) -> asyncio.subprocess.Process:
        """A parser process, ready; it imports from this process's ``sys.path``."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "arfusion.engine.server.http.parser_process", self.factory, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self.started += 1
        try:
            ready = await asyncio.wait_for(_read(proc), START_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, pickle.UnpicklingError):
            ready = None
        except BaseException:  # cancelled (the pool stops): no process is left behind
            proc.kill()
            raise
        if ready != READY:
            await _end(proc)
            tail = (await proc.stderr.read()).decode(errors="replace")[-2000:] if proc.stderr else ""
            raise ParserStartError(f"a parser process ({self.factory}) did not start: {tail or 'no output'}")
        relay = asyncio.ensure_future(_relay_stderr(proc))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        return proc

    async def _serve(self, index: int) -> None:
        """Parser ``index``'s loop: take a job, have the parser answer it; replace a parser that died."""
        assert self._jobs is not None
        while True:
            job, answer = await self._jobs.get()
            if answer.done():  # its request was cancelled while it waited
                continue
            proc = self._procs[index]
            try:
                if proc is None:
                    raise ParserUnavailable("no parser process")
                assert proc.stdin is not None
                proc.stdin.write(frame(job))
                await proc.stdin.drain()
                _answer(answer, await _read(proc))
            except asyncio.CancelledError:
                _fail(answer, ParserUnavailable("the parser pool stopped"))
                raise
            except (OSError, asyncio.IncompleteReadError, pickle.UnpicklingError, ParserUnavailable) as exc:
                logger.warning("a body parser process failed (%r); starting another", exc)
                _fail(answer, ParserUnavailable(repr(exc)))
                if proc is not None:
                    await _end(proc)
                self._procs[index] = None
                try:
                    self._procs[index] = await self._spawn()
                except ParserStartError as start_error:
                    logger.error("%s", start_error)


async def _read(proc: asyncio.subprocess.Process) -> Any:
    """The next frame from ``proc``'s stdout."""
    assert proc.stdout is not None
    head = await proc.stdout.readexactly(FRAME_HEAD)
    return pickle.loads(await proc.stdout.readexactly(frame_length(head)))


async def _relay_stderr(proc: asyncio.subprocess.Process) -> None:
    """Log what a parser writes to its stderr (a traceback), line by line."""
    assert proc.stderr is not None
    async for line in proc.stderr:
        logger.warning("parser %d: %s", proc.pid, line.decode(errors="replace").rstrip())


async def _end(proc: asyncio.subprocess.Process) -> None:
    """Close ``proc``'s stdin (it exits) and wait for it, killing it after ``STOP_WAIT_S``."""
    if proc.stdin is not None and not proc.stdin.is_closing():
        proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


def _answer(future: asyncio.Future[Optional[Answer]], value: Optional[Answer]) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Optional[Answer]], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
