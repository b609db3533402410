"""Measure every strategy that runs here for all-reduce + residual + RMSNorm: the rows of a
strategy table (`fusion.dispatch.table`). The command line is `engine.tune_fusion`.

Per token bucket (powers of two up to the op's ``max_tokens`` plus the decode batch sizes of
the CUDA graphs), each strategy whose buffers hold the bucket is captured ``ops_per_graph``
times in one CUDA graph, replayed ``warmup`` then ``trials`` times (eagerly, host-timed, on a
device without CUDA graphs); a row keeps the median µs per op of the slowest rank. A strategy that fails on any rank is left out of that row on every
rank. Collective: every rank of the op's group calls it together.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from fusion.tuning.timing import median_us_eager, median_us_per_call
from fusion.strategies import Strategy
from fusion.dispatch.table import dtype_name, gpu_name

if TYPE_CHECKING:
    from fusion.allreduce_fusion import AllReduceFusion

logger = logging.getLogger(__name__)
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MEASURED = (Strategy.NCCL, Strategy.FLASHINFER_ONE_SHOT, Strategy.FLASHINFER_TWO_SHOT, Strategy.SYMM_MEM_TWO_SHOT,
            Strategy.SYMM_MEM_FUSED)


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to ``max_tokens`` (and ``max_tokens``) plus the decode batch sizes."""
    powers = {1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens}
    return sorted(powers | {max_tokens} | {b for b in DECODE_BATCH_SIZES if b <= max_tokens})


def make_buffers(fusion: "AllReduceFusion", max_tokens: int) -> None:
    """Collective: the symmetric buffers of both symmetric-memory strategies for ``max_tokens``
    rows (each voted: ready on every rank or on none)."""
    fusion.symm_mem.ensure(max_tokens, fusion.hidden_size, fusion.dtype)
    fusion.symm_fused.ensure(max_tokens, fusion.hidden_size, fusion.dtype)


def measure_bucket(fusion: "AllReduceFusion", num_tokens: int, ops_per_graph: int = 20, warmup: int = 3,
                   trials: int = 10) -> dict[Strategy, float]:
    """µs per op (slowest rank) of every strategy that can run ``num_tokens`` rows here."""
    group, hidden, dtype = fusion.group, fusion.hidden_size, fusion.dtype
    g = torch.Generator(device=group.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=group.device, dtype=dtype, generator=g)
    residual = torch.randn(num_tokens, hidden, device=group.device, dtype=dtype, generator=g)
    weight = torch.rand(hidden, device=group.device, dtype=dtype, generator=g) + 0.5
    timings: dict[Strategy, float] = {}
    timer = median_us_per_call if group.device.type == "cuda" else median_us_eager
    for strategy in MEASURED:
        if not _runs(fusion, strategy, x):
            continue

        def calls(strategy: Strategy = strategy) -> None:
            for _ in range(ops_per_graph):
                fusion.run(strategy, x, residual, weight, 1e-6)

        try:
            us: Optional[float] = timer(calls, ops_per_graph, warmup, trials)
            error = None
        except Exception as exc:  # a strategy that fails here is left out, on every rank
            us, error = None, f"{type(exc).__name__}: {exc}"
        results = group.all_gather_object((us, error))
        if all(u is not None for u, _ in results):
            timings[strategy] = max(u for u, _ in results)
        elif group.rank == 0:
            logger.warning("%s at %d tokens left out: %s", strategy, num_tokens, [e for _, e in results if e])
    return timings


def _runs(fusion: "AllReduceFusion", strategy: Strategy, x: torch.Tensor) -> bool:
    """``strategy`` can run ``x`` with the op's buffers (two-shot needs more rows than ranks)."""
    if strategy is Strategy.FLASHINFER_TWO_SHOT and x.shape[0] <= fusion.group.world_size:
        return False
    if strategy is Strategy.NCCL:
        return True
    return fusion.fits(strategy, x)


def table_entry(fusion: "AllReduceFusion", buckets: list[int], **timing: Any) -> dict[str, Any]:
    """One strategy-table entry (`fusion.dispatch.table` format) for the op's GPU, world size,
    hidden size and dtype, measured at ``buckets``."""
    rows = {str(t): {s.value: us for s, us in measure_bucket(fusion, t, **timing).items()} for t in buckets}
    return {"gpu": gpu_name(fusion.group.device), "world_size": fusion.group.world_size,
            "hidden": fusion.hidden_size, "dtype": dtype_name(fusion.dtype), "timings_us": rows}
