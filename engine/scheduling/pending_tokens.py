"""`PendingTokens`: a step's sampled tokens on their way to the host.

The overlap schedule launches step n+1 before it reads step n's tokens: the tokens start an
asynchronous device-to-host copy into pinned memory behind step n's kernels, and an event marks
when they have landed; `get` waits for that event only (not for the steps queued after it).
"""
from __future__ import annotations

from typing import Optional

import torch


class PendingTokens:
    def __init__(self, tokens: torch.Tensor) -> None:
        """Start copying ``tokens`` (int64 ``[B]``) to the host; the device tensor may be reused
        or freed afterwards (the copy is ordered on the current stream)."""
        self.event: Optional[torch.cuda.Event] = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens.clone()

    def get(self) -> list[int]:
        """The tokens, once the copy has finished (waits for it; releases the GIL meanwhile)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
