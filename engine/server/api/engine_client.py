"""The interface between the HTTP server and the engine (the scheduler thread on TP rank 0).

The server only sees `EngineClient`: it submits token ids with `SamplingParams` and iterates
`GenerationChunk`s; it never touches the model, the KV cache or torch.distributed. A request
that cannot complete raises `EngineError`, whose status is what its client is answered.
"""
from __future__ import annotations

from typing import Any, AsyncGenerator, Optional, Protocol

from arfusion.engine.common.generation import GenerationChunk, TokenizerLike
from arfusion.engine.common.sampling_params import SamplingParams


class EngineClient(Protocol):
    model_name: str
    context_length: int  # prompt + output tokens one request may hold
    tokenizer: TokenizerLike

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationChunk, None]:
        """Submit a request; chunks until one with ``finish_reason`` set, or `EngineError`.
        Cancelling the iteration or calling ``aclose()`` (client disconnect) aborts the request
        and frees its KV slots."""
        ...

    async def flush_cache(self) -> bool:
        """Drop cached state (prefix reuse); False while requests are running."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Server args, fusion status (active, why not, dispatch cache stats), memory, load."""
        ...

    def is_healthy(self) -> bool:
        """False once a TP worker died or the scheduler stopped."""
        ...

    def health_problem(self) -> Optional[str]:
        """Why ``/health`` answers 503, None while it answers 200: every reason `is_healthy` is
        False for, and a TP worker that missed its heartbeat (new requests are still taken: they
        wait for it, and it may recover)."""
        ...
