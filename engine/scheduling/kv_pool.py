"""Bookkeeping of the KV cache on TP rank 0: which token slots and request rows are free.

Slot 0 is reserved as scratch: padded rows of a CUDA-graph decode batch write their dummy key
and value there. Row ``num_rows`` of the request table is the padding row (all slot 0).
"""
from __future__ import annotations

from typing import Optional


class SlotAllocator:
    """Free list of token slots ``1..num_slots-1``."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the KV cache needs at least 2 slots (one is scratch), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` free slots, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def reset(self) -> None:
        self._free = list(range(self.num_slots - 1, 0, -1))


class RowAllocator:
    """Rows of the request-to-token table: one per running request."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)
