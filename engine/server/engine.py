"""`Engine`: the `EngineClient` the HTTP server talks to, bridging asyncio and the scheduler
thread of TP rank 0.

Each request's chunks (or its `EngineError`) travel from the scheduler thread to the request's
event loop through a queue; a delivery after that loop has closed (the server is exiting) is
dropped, never raised in the scheduler thread. `fail_all` ends every request in flight from any
thread, without the scheduler: the launcher uses it when a TP worker died or the scheduler
failed, so that every client gets an error before the process exits.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncGenerator, Callable, Optional, Union

from arfusion.engine.common.generation import EngineError, GenerationChunk, TokenizerLike
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler

Delivery = Union[GenerationChunk, EngineError]


class Engine:
    def __init__(self, scheduler: Scheduler, tokenizer: TokenizerLike, model_name: str, context_length: int,
                 clear_fusion_cache: Callable[[], None], info: Callable[[], dict[str, Any]],
                 workers_alive: Callable[[], bool] = lambda: True,
                 heartbeat_missed: Callable[[], Optional[str]] = lambda: None) -> None:
        """``scheduler`` runs the requests of a model of ``context_length`` tokens;
        ``clear_fusion_cache()`` drops its fusion op's cached decisions (the runner's);
        ``info()`` is /get_server_info's answer; ``workers_alive()`` and ``heartbeat_missed()`` report the TP workers (`EngineClient.health_problem`)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self._clear_fusion_cache = clear_fusion_cache
        self._info = info
        self._workers_alive = workers_alive
        self._heartbeat_missed = heartbeat_missed  # which TP workers missed their heartbeat, or None
        self._lock = threading.Lock()
        self._live: dict[int, Callable[[Delivery], None]] = {}  # rid -> thread-safe delivery
        self._refusal: Optional[EngineError] = None  # set by fail_all: the answer to every later request

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationChunk, None]:
        """See `EngineClient.generate`. `EngineError` 400 for a request that can never fit, 503
        once the scheduler has stopped, or the error a failure delivered."""
        deliver, inbox = _delivery_to_this_loop()
        req = Request(list(prompt_ids), params, emit=deliver)
        with self._lock:
            if self._refusal is not None:
                raise EngineError(self._refusal.status, self._refusal.message)
            self._live[req.rid] = deliver
        finished = False
        try:
            try:
                self.scheduler.submit(req)
            except ValueError as exc:
                raise EngineError(400, str(exc)) from None
            except RuntimeError as exc:
                raise EngineError(503, str(exc)) from None
            while not finished:
                item = await inbox.get()
                if isinstance(item, EngineError):
                    raise EngineError(item.status, item.message)
                finished = item.finish_reason is not None
                yield item
        finally:
            with self._lock:
                self._live.pop(req.rid, None)
            if not finished:
                self.scheduler.abort(req.rid)

    def fail_all(self, error: EngineError) -> int:
        """End every request in flight with ``error`` and answer every later one with it (thread
        safe; the scheduler need not respond). Returns the number of requests ended."""
        with self._lock:
            self._refusal = error
            deliveries = list(self._live.values())
        for deliver in deliveries:
            deliver(error)
        return len(deliveries)

    async def flush_cache(self) -> bool:
        """There is no prefix cache to drop; succeeds when idle, and clears the fusion
        decision cache (rebuilt on the next steps)."""
        load = self.scheduler.load()
        if load["running"] or load["waiting"]:
            return False
        self._clear_fusion_cache()
        return True

    def server_info(self) -> dict[str, Any]:
        return self._info()

    def is_healthy(self) -> bool:
        return self._failure() is None

    def health_problem(self) -> Optional[str]:
        return self._failure() or self._heartbeat_missed()

    def _failure(self) -> Optional[str]:
        """Why this engine cannot serve any more, or None."""
        if self._refusal is not None:
            return self._refusal.message
        if not self.scheduler.alive:
            return f"the scheduler has stopped{': ' + self.scheduler.failure if self.scheduler.failure else ''}"
        if not self._workers_alive():
            return "a TP worker has exited"
        return None


def _delivery_to_this_loop() -> tuple[Callable[[Delivery], None], "asyncio.Queue[Delivery]"]:
    """A queue on the running loop and a thread-safe ``deliver(item)`` into it that drops the
    item once the loop has closed."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Delivery] = asyncio.Queue()

    def deliver(item: Delivery) -> None:
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # the loop is closed: no one is waiting any more
            pass

    return deliver, inbox
