"""`Backend`: one strategy of the fused all-reduce + residual add + RMSNorm, owning its resource.

Every backend of an op (`fusion.AllReduceFusion`) is made for one TP group and states its own
constraints, once:

    ensure(max_tokens, hidden, dtype) -> bool   collective: make (or grow) the resource for
                                                 ``max_tokens`` rows of ``hidden`` ``dtype``;
                                                 every rank's reason not to is voted over the CPU
                                                 group, so it is True on every rank or on none
                                                 (``failure`` then names each rank's reason)
    fits(num_tokens) -> bool                     local, no collective: the resource exists and
                                                 this backend can run ``num_tokens`` rows of the
                                                 ensured hidden size and dtype
    run(x, residual, weight, eps, quant)         one reduction: (normed, sum(x) + residual);
                                                 consumes ``x`` and ``residual`` (it may
                                                 overwrite both); needs ``fits(x.shape[0])``
    destroy()                                    free the resource on this rank (idempotent)

``run`` never checks its inputs (the op checks them once, at its entry) and never changes the
strategy: a call that does not fit raises `FusionInputError` before any collective.
"""
from __future__ import annotations

import abc
import logging
from typing import Callable, ClassVar, Optional

import torch

from fusion import reference
from fusion.errors import FusionUnsupportedError
from fusion.group import TensorParallelGroup
from fusion.strategy import FusedOutput, Quant, Strategy
from fusion.voting import voted_failure

logger = logging.getLogger(__name__)


class Backend(abc.ABC):
    """One strategy and its resource on one TP group (module docstring)."""

    strategy: ClassVar[Strategy]
    row_limit: ClassVar[Optional[int]] = None  # the most rows ``ensure`` takes (None: no bound)

    @classmethod
    def rows_for(cls, max_tokens: int) -> int:
        """``max_tokens`` within this backend's ``row_limit``: what to ensure it for."""
        return max_tokens if cls.row_limit is None else min(max_tokens, cls.row_limit)

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.failure: Optional[str] = None  # every rank's reason the last `ensure` failed

    @abc.abstractmethod
    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool: ...

    @abc.abstractmethod
    def fits(self, num_tokens: int) -> bool: ...

    @abc.abstractmethod
    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
            quant: Optional[Quant] = None) -> FusedOutput: ...

    def destroy(self) -> None:
        """Free the resource on this rank; a backend without one has nothing to free."""

    def raise_if_failed(self) -> None:
        """Raise `fusion.errors.FusionTimeoutError` if a kernel of this backend gave up waiting
        for a peer since it was ensured; a backend without bounded device waits never does."""

    @property
    def capacity(self) -> int:
        """Rows one call takes without chunking (0: not ensured); for status reports."""
        return 0

    def vote(self, step: Callable[[], Optional[str]]) -> bool:
        """`fusion.voting.voted_failure` of ``step``: True on every rank when no rank has a
        reason; else ``failure`` names each rank's and rank 0 logs it once."""
        self.failure = voted_failure(self.group, step)
        if self.failure and self.group.rank == 0:
            logger.warning("%s unavailable on every rank: %s", self.strategy, self.failure)
        return self.failure is None


def quantized(normed: torch.Tensor, residual: torch.Tensor, quant: Optional[Quant]) -> FusedOutput:
    """The output of a backend whose kernels do not quantize: FP8 as a separate cast."""
    if quant is None:
        return FusedOutput(normed, residual)
    if quant.kind == "fp8":
        return FusedOutput(reference.quantize_fp8_static(normed, quant.scale), residual)
    raise FusionUnsupportedError("FP4 output exists only as flashinfer's fused pattern (flashinfer_one_shot / "
                                 "flashinfer_two_shot on an sm100+ GPU)")
