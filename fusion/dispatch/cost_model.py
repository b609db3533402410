"""The built-in rule: a linear cost model per strategy, fitted to measured strategy tables.

For a reduction of ``num_tokens`` rows of ``hidden`` elements over ``world`` ranks, the time of
strategy s is modelled as

    t_s = a_s + b_s * MiB + c_s * rows,    MiB  = num_tokens * hidden * itemsize / 2**20
                                                  (the message each rank contributes)
                                           rows = num_tokens / world   (rows each rank owns)

``a`` is the launch and synchronisation floor, ``b`` the cost per MiB moved (bandwidth), ``c``
the per-row cost of kernels that give each row its own program or its own norm pass. These
two quantities decide every crossover measured: flashinfer's one-shot Lamport kernel has the
lowest floor but reads every peer's whole message (high ``b``), the fused two-shot kernels
(``symm_mem_fused``) move half as much per rank and win once the message is a few MiB, sooner
for narrow rows (hidden <= 1024) than for wide ones. The rule picks the cheapest strategy that
can run; `benchmarks/fit_cost_model.py` fits the coefficients from tables written by
``engine.tune_fusion`` (derivation and data: docs/results.md, "dispatch"). World sizes with no
fitted model take the declared fallback order (`fusion.dispatch.rule`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from arfusion.fusion.dispatch.table import power_of_two_buckets
from arfusion.fusion.strategies import COSTS
from arfusion.fusion.strategy import Strategy

# world size -> strategy -> (a µs, b µs per MiB per rank, c µs per row per rank): each backend
# class declares its own (``cost``; `fusion.strategies.COSTS`). Fitted by
# benchmarks/fit_cost_model.py to the packaged H200 TP2 bf16 table (hidden 1024, 4096, 8192;
# tokens 1-4096); relative least squares.
COEFFICIENTS: dict[int, dict[Strategy, tuple[float, float, float]]] = COSTS


def predicted_us(strategy: Strategy, num_tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> float:
    """The model's time of one reduction (µs); KeyError for an unfitted world size or strategy."""
    a, b, c = COEFFICIENTS[world_size][strategy]
    return a + b * num_tokens * hidden * dtype.itemsize / 2**20 + c * num_tokens / world_size


def cheapest(available: Iterable[Strategy], num_tokens: int, hidden: int, dtype: torch.dtype,
             world_size: int) -> Strategy | None:
    """The available strategy the model predicts fastest; None when no model covers
    ``world_size`` (or none of ``available``)."""
    model = COEFFICIENTS.get(world_size)
    if model is None:
        return None
    priced = [s for s in available if s in model]
    if not priced:
        return None
    return min(priced, key=lambda s: predicted_us(s, num_tokens, hidden, dtype, world_size))


def rule_picks(max_tokens: int, hidden: int, dtype: torch.dtype, world_size: int,
               among: Iterable[Strategy] | None = None) -> set[Strategy]:
    """The strategies the model picks at some token bucket up to ``max_tokens`` (the table's
    buckets, `fusion.dispatch.table.power_of_two_buckets`) when all of ``among`` (default: every
    modelled one) can run (whose buffers an op must create); empty without a model. The op
    passes only the strategies that fit the largest batch (``among``)."""
    model = COEFFICIENTS.get(world_size)
    if model is None:
        return set()
    priced = [s for s in model if among is None or s in set(among)]
    if not priced:
        return set()
    counts = power_of_two_buckets(max(1, max_tokens))
    return {min(priced, key=lambda s: predicted_us(s, t, hidden, dtype, world_size)) for t in counts}
