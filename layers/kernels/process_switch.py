"""A process-wide on/off setting that launches read when they are made (batch-invariant mode,
`layers.batch_invariant`; programmatic dependent launch, `layers.kernels.pdl`): off until set,
and settable for a block, the previous setting restored after it."""
from __future__ import annotations

import contextlib
from typing import Iterator


class ProcessSwitch:
    """``on``: the setting now; `scoped`: on (or off) inside a ``with`` block."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    @contextlib.contextmanager
    def scoped(self, on: bool) -> Iterator[None]:
        """The setting ``on`` inside the block; the previous one is restored after it."""
        previous, self.on = self.on, on
        try:
            yield
        finally:
            self.on = previous
