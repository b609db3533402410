"""`Backend`: one strategy of the fused all-reduce + residual add + RMSNorm, owning its resource.

A backend class is its strategy's declaration: its class variables say what the rest of the
package asks about the strategy (the registry, `fusion.strategies`, derives every list from
them), its docstring's first line says how it runs, and its methods run it.

    strategy            its name (`fusion.strategy.Strategy`)
    options             the fusion backend options that offer it (`fusion.options`)
    made / made_det     when its resource is made, by default and in deterministic mode (`Made`)
    row_limit           the most rows its resource is made for (None: the configured rows)
    symm_rows           its rows come from ``FusionConfig.symm_max_tokens`` (else ``max_tokens``)
    det_max_world       deterministic mode allows it up to this many ranks (None: any; 0: never),
    det_note              and why not beyond
    cost                world size -> (a µs, b µs per MiB, c µs per row) of the built-in rule's
                        cost model (`fusion.dispatch.cost_model`; absent: not modelled there)
    fallback            it is the unfused path: it runs every batch, and the decision's "do not
                        fuse" is this strategy (exactly one backend declares it)
    fallback_rank       its place among the fused strategies the rule takes when neither a table
                        nor the cost model prices any of them (None: never taken that way)
    one_shot            a one-shot kernel (every rank reads every peer's whole input): the
                        one-shot input-size threshold (`fusion.dispatch.one_shot`) applies to it
    measured            the tuner measures it (`fusion.tuning.measure`)
    tuned_at_startup    its choice needs a measurement on this machine: an op that offers it
                        measures the strategies at start-up when no table holds the configuration

Every backend of an op (`fusion.AllReduceFusion`) is made for one TP group and states its own
constraints, once:

    ensure(max_tokens, hidden, dtype) -> bool   collective (`_ensure`): make (or grow) the resource for
                                                 ``max_tokens`` rows of ``hidden`` ``dtype``;
                                                 every rank's reason not to is voted over the CPU
                                                 group, so it is True on every rank or on none
                                                 (``failure`` then names each rank's reason)
    rows() -> Rows                               local, no collective: the batch sizes it runs now
                                                 (of the ensured hidden size and dtype), a value
    fits(num_tokens) -> bool                     ``rows().holds(num_tokens)``
    run(x, residual, weight, eps, quant)         one reduction: (normed, sum(x) + residual);
                                                 consumes ``x`` and ``residual`` (it may
                                                 overwrite both); needs ``fits(x.shape[0])``
    destroy()                                    free the resource on this rank (idempotent; `_destroy`)
    for_op(context)                              this strategy's backend for an op
    standalone(group, x, workspace, pdl)         a backend that runs ``x`` without an op
                                                 (`fusion.functional`), or `FusionInputError`

``run`` never checks its inputs (the op checks them once, at its entry) and never changes the
strategy: a call that does not fit raises `FusionInputError` before any collective.

Every change of what ``rows`` answers (a resource made, grown or destroyed; a peer timeout that
turns a backend off) calls ``on_change``, the owner's hook: the op rebuilds its dispatch plan
there (`fusion.dispatch.decision.DispatchPlan`, which keeps the ``rows`` values it was built
from), so no cached answer outlives the state it was decided from.
"""
from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from arfusion.fusion import reference
from arfusion.fusion.config import FusionConfig
from arfusion.fusion.errors import FusionInputError, FusionUnsupportedError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy
from arfusion.fusion.voting import voted_failure

logger = logging.getLogger(__name__)
T = TypeVar("T")
# world size -> (a µs, b µs per MiB, c µs per row): a strategy's cost model (``Backend.cost``)
Costs = Mapping[int, tuple[float, float, float]]


class Made(enum.Enum):
    """When a strategy's resource is made."""

    ALWAYS = "always"  # nothing to make (or made on first use)
    PRIMARY = "primary"  # at set-up; it bounds the fusion limit (``reserve`` grows it)
    ON_DEMAND = "on_demand"  # only when the strategy table (or the built-in rule) picks it


class Rows(NamedTuple):
    """The batch sizes a backend runs now: ``least`` to ``most`` rows (``most`` None: any)."""

    least: int
    most: int | None

    def holds(self, num_tokens: int) -> bool:
        return self.least <= num_tokens and (self.most is None or num_tokens <= self.most)


NO_ROWS = Rows(1, 0)  # a backend whose resource is not made runs no batch


@dataclass
class BuildContext:
    """What the backends of one op are made from. ``shared(kind)``: one ``kind(group)`` for every
    backend of the op that asks (flashinfer's two kernels share one workspace)."""

    group: TensorParallelGroup
    deterministic: bool = False
    launch_with_pdl: bool = True
    _shared: dict[type, Any] = field(default_factory=dict)

    def shared(self, kind: type[T]) -> T:
        if kind not in self._shared:
            self._shared[kind] = kind(self.group)
        return self._shared[kind]


class Backend(abc.ABC):
    """One strategy and its resource on one TP group (module docstring)."""

    strategy: ClassVar[Strategy]
    options: ClassVar[tuple[str, ...]]
    made: ClassVar[Made] = Made.ALWAYS
    made_det: ClassVar[Made | None] = None  # None: as ``made``
    row_limit: ClassVar[int | None] = None
    symm_rows: ClassVar[bool] = False
    det_max_world: ClassVar[int | None] = None
    det_note: ClassVar[str] = ""
    cost: ClassVar[Costs] = {}
    fallback: ClassVar[bool] = False
    fallback_rank: ClassVar[int | None] = None
    one_shot: ClassVar[bool] = False
    measured: ClassVar[bool] = True
    tuned_at_startup: ClassVar[bool] = False

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.failure: str | None = None  # every rank's reason the last `ensure` failed
        self.on_change: Callable[[], None] = _nothing  # called after every change of what `rows` answers

    @classmethod
    def role(cls, deterministic: bool) -> Made:
        """When its resource is made, in deterministic mode or not."""
        return cls.made_det if deterministic and cls.made_det is not None else cls.made

    @classmethod
    def rows_to_make(cls, config: FusionConfig, largest: int | None = None) -> int:
        """The rows its resource is made for: ``largest`` (default: the configured rows,
        ``config.symm_max_tokens`` where it declares ``symm_rows`` and that is set, else
        ``config.max_tokens``), within its ``row_limit``."""
        if largest is None:
            largest = (config.symm_max_tokens if cls.symm_rows else None) or config.max_tokens
        return largest if cls.row_limit is None else min(largest, cls.row_limit)

    @classmethod
    def deterministic_exclusion(cls, world_size: int) -> str | None:
        """Why deterministic mode leaves it out at ``world_size`` ranks (None: it follows the
        canonical recipe there, `fusion.reference`)."""
        if cls.det_max_world is not None and world_size > cls.det_max_world:
            return cls.det_note
        return None

    @classmethod
    def for_op(cls, context: BuildContext) -> Backend:
        """This strategy's backend for an op (no resource until ensured)."""
        return cls(context.group)

    @classmethod
    def standalone(cls, group: TensorParallelGroup, x: torch.Tensor, workspace: Any,
                   launch_with_pdl: bool) -> Backend:
        """A backend of this strategy that runs ``x`` on ``group`` without an op; a backend that
        owns a resource made together by every rank runs only through an op."""
        raise FusionInputError(f"{cls.strategy} owns symmetric buffers: run it through AllReduceFusion.run")

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective (module docstring); ``on_change`` after it, whatever its outcome."""
        try:
            return self._ensure(max_tokens, hidden, dtype)
        finally:
            self.on_change()

    def destroy(self) -> None:
        """Free the resource on this rank (idempotent); ``on_change`` after it."""
        self._destroy()
        self.on_change()

    @abc.abstractmethod
    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool: ...

    @abc.abstractmethod
    def rows(self) -> Rows: ...

    def fits(self, num_tokens: int) -> bool:
        return self.rows().holds(num_tokens)

    @abc.abstractmethod
    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput: ...

    def _destroy(self) -> None:
        """Free the resource on this rank; a backend without one has nothing to free."""

    def raise_if_failed(self) -> None:
        """Raise `fusion.errors.FusionTimeoutError` if a kernel of this backend gave up waiting
        for a peer since it was ensured; a backend without bounded device waits never does."""

    @property
    def capacity(self) -> int:
        """Rows one call takes without chunking (0: not ensured); for status reports."""
        return 0

    def vote(self, step: Callable[[], str | None]) -> bool:
        """`fusion.voting.voted_failure` of ``step``: True on every rank when no rank has a
        reason; else ``failure`` names each rank's and rank 0 logs it once."""
        self.failure = voted_failure(self.group, step)
        if self.failure and self.group.rank == 0:
            logger.warning("%s unavailable on every rank: %s", self.strategy, self.failure)
        return self.failure is None


def output_tensors(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)`` of a kernel that works in place: the normed output overwrites ``x``
    and the new residual ``residual``; without a residual, the sum overwrites ``x`` and the normed
    output is new."""
    if residual is None:
        return torch.empty_like(x), x
    return x, residual


def _nothing() -> None:
    """The ``on_change`` of a backend without an owner."""


def quantized(out: FusedOutput, quant: Quant) -> FusedOutput:
    """``out`` of a backend whose kernels do not quantize, with its normed output quantized by
    ``quant``: FP8 as a separate cast. (Backends return ``out`` itself without ``quant``: no call
    on the hot path.)"""
    normed, residual = out.normed, out.residual
    if quant.kind == "fp8":
        return FusedOutput(reference.quantize_fp8_static(normed, quant.scale), residual)
    raise FusionUnsupportedError("FP4 output exists only as flashinfer's fused pattern (flashinfer_one_shot / "
                                 "flashinfer_two_shot on an sm100+ GPU)")
