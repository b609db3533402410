"""`Engine`: the `EngineClient` the HTTP server talks to, bridging asyncio and the scheduler
thread of TP rank 0."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Callable

from engine.server.engine_client import GenerationChunk, TokenizerLike
from engine.scheduling.request import Request
from engine.scheduling.sampling_params import SamplingParams
from engine.scheduling.scheduler import Scheduler


class Engine:
    def __init__(self, scheduler: Scheduler, tokenizer: TokenizerLike, model_name: str,
                 info: Callable[[], dict[str, Any]], workers_alive: Callable[[], bool] = lambda: True) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = scheduler.runner.context_len
        self._info = info
        self._workers_alive = workers_alive

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationChunk, None]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[GenerationChunk] = asyncio.Queue()
        req = Request(list(prompt_ids), params, emit=lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c))
        self.scheduler.submit(req)
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self.scheduler.abort(req.rid)

    async def flush_cache(self) -> bool:
        """There is no prefix cache to drop; succeeds when idle, and clears the fusion
        decision cache (rebuilt on the next steps)."""
        load = self.scheduler.load()
        if load["running"] or load["waiting"]:
            return False
        self.scheduler.runner.fusion.dispatcher.cache_clear()
        return True

    def server_info(self) -> dict[str, Any]:
        return self._info()

    def is_healthy(self) -> bool:
        return self.scheduler.alive and self._workers_alive()
