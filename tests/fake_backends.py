"""Stand-ins for fusion backends where only the decision is under test: each answers ``rows``
from a token capacity, as a real backend does from its buffer."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from arfusion.fusion.backends.base import Rows
from arfusion.fusion.dispatch.decision import DispatchPlan, ModelShape
from arfusion.fusion.dispatch.table import StrategyTable
from arfusion.fusion.strategy import Strategy

UNLIMITED = 1 << 40


class FakeBackend:
    def __init__(self, capacity: int, more_than: int = 0) -> None:
        self.capacity = capacity
        self.more_than = more_than  # two-shot: needs more tokens than ranks

    def rows(self) -> Rows:
        return Rows(self.more_than + 1, self.capacity)


def flashinfer_backends(max_tokens: int = 2048, world_size: int = 2, **more: int) -> dict[Strategy, FakeBackend]:
    """NCCL, both flashinfer kernels over a ``max_tokens`` workspace, and ``more`` (strategy value ->
    capacity; the fused two-shot's buffer runs any batch in chunks: give it UNLIMITED)."""
    backends = {Strategy.NCCL: FakeBackend(UNLIMITED), Strategy.FLASHINFER_ONE_SHOT: FakeBackend(max_tokens),
                Strategy.FLASHINFER_TWO_SHOT: FakeBackend(max_tokens, more_than=world_size)}
    backends.update({Strategy(s): FakeBackend(c) for s, c in more.items()})
    return backends


def make_dispatcher(backends: Mapping[Strategy, FakeBackend], hidden: int = 4096, dtype: torch.dtype = torch.bfloat16,
                    world_size: int = 2, table: StrategyTable | None = None, off_reason: str | None = None,
                    one_shot_max_input_bytes: int | None = None, cache_size: int = 4096) -> DispatchPlan:
    return DispatchPlan(ModelShape(world_size, hidden, dtype, one_shot_max_input_bytes), backends, table, off_reason,
                        cache_size)
