"""One declaration per strategy: everything the rest of the package asks about a strategy.

    strategy            its name (`fusion.strategy.Strategy`)
    summary             how it runs, in one line
    backend             its backend class (`fusion.backends`); the class names the strategy and
                        makes the backend for an op (``for_op``) or for one call (``standalone``)
    options             the fusion backend options that offer it (``FusionConfig.backend``)
    made / made_det     when its resource is made, by default and in deterministic mode:
                          ALWAYS     nothing to make (or made on first use)
                          PRIMARY    at set-up; it bounds the fusion limit (``reserve`` grows it)
                          ON_DEMAND  only when the strategy table (or the built-in rule) picks it
    row_limit           the most rows its resource is made for (None: the configured rows)
    symm_rows           its rows come from ``FusionConfig.symm_max_tokens`` (else ``max_tokens``)
    det_max_world       deterministic mode allows it up to this many ranks (None: any; 0: never),
    det_note              and why not beyond
    cost                its place in the built-in rule: world size -> (a µs, b µs per MiB, c µs
                        per row) of `fusion.dispatch.cost_model` (absent: not modelled there)
    measured            the tuner measures it (`fusion.tuning.measure`)

Every list of strategies (the backends an op builds, the on-demand ones, the primary one, the
fusion backend option names, the cost model, the tuner's, the benchmark's, deterministic mode's)
is derived from `DECLARATIONS`. A new strategy is its backend file, one `Strategy` member, one
declaration here, and its tests (docs/how_it_works.md, "Adding a strategy").
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol

from arfusion.fusion.backends.base import Backend, BuildContext
from arfusion.fusion.backends.flashinfer import FlashInferOneShotBackend, FlashInferTwoShotBackend
from arfusion.fusion.backends.lamport_one_shot import MAX_TOKENS as LAMPORT_MAX_TOKENS, LamportOneShotBackend
from arfusion.fusion.backends.reduce_then_norm import NcclBackend, TorchBackend
from arfusion.fusion.backends.symm_mem import SymmMemTwoShotBackend
from arfusion.fusion.backends.symm_mem_fused import SymmMemFusedBackend
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategy import Strategy



class FusionConfig(Protocol):
    """What the declarations read of `fusion.config.FusionConfig` (which imports this module)."""

    backend: str
    deterministic: bool
    launch_with_pdl: bool
    max_tokens: int
    symm_max_tokens: Optional[int]


class Made(enum.Enum):
    ALWAYS = "always"
    PRIMARY = "primary"
    ON_DEMAND = "on_demand"


@dataclass(frozen=True)
class Declaration:
    backend: type[Backend]  # its name is the class's ``strategy``; ``for_op`` makes it for an op
    summary: str
    options: tuple[str, ...]
    made: Made = Made.ALWAYS
    made_det: Optional[Made] = None  # None: as ``made``
    row_limit: Optional[int] = None
    symm_rows: bool = False
    det_max_world: Optional[int] = None
    det_note: str = ""
    cost: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    measured: bool = True

    @property
    def strategy(self) -> Strategy:
        return self.backend.strategy

    def role(self, deterministic: bool) -> Made:
        return self.made_det if deterministic and self.made_det is not None else self.made

    def rows(self, config: FusionConfig, largest: Optional[int] = None) -> int:
        """The rows its resource is made for: ``largest`` (default: the configured rows), within
        its ``row_limit``."""
        if largest is None:
            largest = (config.symm_max_tokens if self.symm_rows else None) or config.max_tokens
        return largest if self.row_limit is None else min(largest, self.row_limit)

    def deterministic_exclusion(self, world_size: int) -> Optional[str]:
        """Why deterministic mode leaves it out at ``world_size`` ranks (None: it follows the
        canonical recipe there, `fusion.reference`)."""
        if self.det_max_world is not None and world_size > self.det_max_world:
            return self.det_note
        return None


_FLASHINFER_NOT_DETERMINISTIC = ("flashinfer's kernel reduces and normalises in its own order; its normed output "
                                 "changes with the number of rows in the call")
DECLARATIONS: dict[Strategy, Declaration] = {d.strategy: d for d in (
    Declaration(NcclBackend, "group all-reduce (NCCL on GPU), then add + RMSNorm: the unfused reference",
                ("flashinfer", "torch"), cost={2: (9.555, 5.937, 0.001959)}),
    Declaration(FlashInferOneShotBackend, "flashinfer's trtllm Lamport kernel, one-shot: every rank reads all peers",
                ("flashinfer",), made=Made.PRIMARY, det_max_world=0, det_note=_FLASHINFER_NOT_DETERMINISTIC,
                cost={2: (4.328, 4.268, 0.003254)}),
    Declaration(FlashInferTwoShotBackend, "the same kernel, two-shot (reduce-scatter + all-gather; tokens > ranks)",
                ("flashinfer",), det_max_world=0, det_note=_FLASHINFER_NOT_DETERMINISTIC,
                cost={2: (9.333, 4.487, 0.004395)}),
    Declaration(SymmMemTwoShotBackend, "torch symmetric-memory two-shot all-reduce, then add + RMSNorm",
                ("flashinfer",), made=Made.ON_DEMAND, det_max_world=2,
                det_note="torch's two-shot all-reduce adds more than two ranks in its own order, rounding to the "
                         "model dtype at each step",
                cost={2: (12.002, 5.074, -0.001805)}),
    Declaration(SymmMemFusedBackend, "our Triton two-shot over symmetric memory with add + RMSNorm fused",
                ("flashinfer",), made=Made.ON_DEMAND, made_det=Made.PRIMARY, symm_rows=True,
                cost={2: (9.243, 3.606, -0.000408)}),
    Declaration(LamportOneShotBackend, "our Triton one-shot Lamport kernel over symmetric memory, norm fused",
                ("flashinfer",), made=Made.ON_DEMAND, row_limit=LAMPORT_MAX_TOKENS),
    Declaration(TorchBackend, "the same math in one function on any device (CPU tests, no flashinfer)", ("torch",),
                made=Made.PRIMARY, measured=False),
)}
# the fusion backend options (``FusionConfig.backend``), in declaration order
FUSION_BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(o for d in DECLARATIONS.values() for o in d.options))


def offered(config: FusionConfig, world_size: int) -> list[Declaration]:
    """The declarations an op with ``config`` builds at ``world_size`` ranks: those its backend
    option offers, in deterministic mode only those that follow the canonical recipe there."""
    return [d for d in DECLARATIONS.values() if config.backend in d.options
            and not (config.deterministic and d.deterministic_exclusion(world_size))]


def build_backends(group: TensorParallelGroup, config: FusionConfig) -> dict[Strategy, Backend]:
    """Every backend `offered` on ``group``, none ensured yet (no collective); those that share a
    resource (flashinfer's two kernels, one workspace) share one object."""
    context = BuildContext(group, config.deterministic, config.launch_with_pdl)
    return {d.strategy: d.backend.for_op(context) for d in offered(config, group.world_size)}


def deterministic_exclusions(world_size: int) -> dict[Strategy, str]:
    """The strategies deterministic mode leaves out at ``world_size`` ranks, with why."""
    return {s: why for s, d in DECLARATIONS.items() if (why := d.deterministic_exclusion(world_size))}


def cost_coefficients() -> dict[int, dict[Strategy, tuple[float, float, float]]]:
    """world size -> strategy -> the cost model's (a, b, c) (`fusion.dispatch.cost_model`)."""
    out: dict[int, dict[Strategy, tuple[float, float, float]]] = {}
    for d in DECLARATIONS.values():
        for world, abc in d.cost.items():
            out.setdefault(world, {})[d.strategy] = abc
    return out
