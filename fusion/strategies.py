"""The registry: every strategy's backend class, in one tuple, and the views derived from it.

A backend class is its strategy's declaration (`fusion.backends.base.Backend`: its class
variables and docstring). Every list of strategies (the backends an op builds, the primary and
the on-demand ones, the fallback and the rule's order, the cost model's coefficients, the
tuner's, the benchmark's, deterministic mode's) is derived here from `REGISTRY`. A new strategy
is its backend file, one line in `REGISTRY`, one `fusion.strategy.Strategy` member, and its
tests (docs/how_it_works.md, "Adding a strategy"); nothing else names it.
"""
from __future__ import annotations

from arfusion.fusion.backends.base import Backend, BuildContext, Made
from arfusion.fusion.backends.flashinfer import (
    FlashInferOneShotBackend,
    FlashInferTwoShotBackend,
)
from arfusion.fusion.backends.lamport_one_shot import LamportOneShotBackend
from arfusion.fusion.backends.reduce_then_norm import NcclBackend, TorchBackend
from arfusion.fusion.backends.symm_mem import SymmMemTwoShotBackend
from arfusion.fusion.backends.symm_mem_fused import SymmMemFusedBackend
from arfusion.fusion.config import FusionConfig
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategy import Strategy

REGISTRY: tuple[type[Backend], ...] = (
    NcclBackend,
    FlashInferOneShotBackend,
    FlashInferTwoShotBackend,
    SymmMemTwoShotBackend,
    SymmMemFusedBackend,
    LamportOneShotBackend,
    TorchBackend,
)

BACKENDS: dict[Strategy, type[Backend]] = {cls.strategy: cls for cls in REGISTRY}
# the unfused path: the decision's "do not fuse" (exactly one class declares ``fallback``)
FALLBACK: Strategy = next(cls.strategy for cls in REGISTRY if cls.fallback)
# the fused strategies the rule takes, in this order, where neither a table nor a cost prices one
FALLBACK_ORDER: tuple[Strategy, ...] = tuple(
    cls.strategy for cls in sorted((c for c in REGISTRY if c.fallback_rank is not None), key=lambda c: c.fallback_rank))
ONE_SHOT: frozenset[Strategy] = frozenset(cls.strategy for cls in REGISTRY if cls.one_shot)
MEASURED: tuple[Strategy, ...] = tuple(cls.strategy for cls in REGISTRY if cls.measured)
# world size -> strategy -> the cost model's (a, b, c) (`fusion.dispatch.cost_model`)
COSTS: dict[int, dict[Strategy, tuple[float, float, float]]] = {
    world: {cls.strategy: cls.cost[world] for cls in REGISTRY if world in cls.cost}
    for world in sorted({w for cls in REGISTRY for w in cls.cost})}


def offered(config: FusionConfig, world_size: int) -> list[type[Backend]]:
    """The backend classes an op with ``config`` builds at ``world_size`` ranks: those its
    backend option offers, in deterministic mode only those that follow the canonical recipe there."""
    return [cls for cls in REGISTRY if config.backend in cls.options
            and not (config.deterministic and cls.deterministic_exclusion(world_size))]


def build_backends(group: TensorParallelGroup, config: FusionConfig) -> dict[Strategy, Backend]:
    """Every backend `offered` on ``group``, none ensured yet (no collective); those that share a
    resource (flashinfer's two kernels, one workspace) share one object."""
    context = BuildContext(group, config.deterministic, config.launch_with_pdl)
    return {cls.strategy: cls.for_op(context) for cls in offered(config, group.world_size)}


def with_role(backends: dict[Strategy, Backend], role: Made, deterministic: bool) -> list[Strategy]:
    """The strategies of ``backends`` whose resource is made as ``role`` in this mode."""
    return [s for s in backends if BACKENDS[s].role(deterministic) is role]


def deterministic_exclusions(world_size: int) -> dict[Strategy, str]:
    """The strategies deterministic mode leaves out at ``world_size`` ranks, with why."""
    return {cls.strategy: why for cls in REGISTRY if (why := cls.deterministic_exclusion(world_size))}

