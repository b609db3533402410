"""`PendingTokens`: a step's sampled tokens (and log-probabilities) on their way to the host.

The overlap schedule launches step n+1 before it reads step n's tokens: the tokens start an
asynchronous device-to-host copy into pinned memory behind step n's kernels, and an event marks
when they have landed; `get` waits for that event only (not for the steps queued after it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from arfusion.engine.runtime.logprobs import TokenLogprobs


class PendingTokens:
    def __init__(self, tokens: torch.Tensor, logprobs: Sequence[TokenLogprobs] = ()) -> None:
        """Start copying ``tokens`` (int64 ``[B]``) and ``logprobs`` to the host; the device
        tensors may be reused or freed afterwards (the copy is ordered on the current stream)."""
        self.event: Optional[torch.cuda.Event] = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.host_logprobs = [lp.to_host(pinned=True) for lp in logprobs]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens.clone()
            self.host_logprobs = [lp.to_host(pinned=False) for lp in logprobs]

    def get(self) -> list[int]:
        """The tokens, once the copy has finished (waits for it; releases the GIL meanwhile)."""
        self.wait()
        return self.host.tolist()

    def logprobs(self) -> list[TokenLogprobs]:
        """The log-probabilities, in the order given, on the host (waits for the copy)."""
        self.wait()
        return self.host_logprobs

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
