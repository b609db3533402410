"""Measure every strategy that runs here for all-reduce + residual + RMSNorm: the rows of a
strategy table (`fusion.dispatch.table`). The command line is `engine.tune_fusion`.

Per token bucket (powers of two up to the op's ``max_tokens`` plus the decode batch sizes of
the CUDA graphs), each strategy whose backend fits the bucket is captured ``ops_per_graph``
times in one CUDA graph, replayed ``warmup`` then ``trials`` times (eagerly, host-timed, on a
device without CUDA graphs); a row keeps the median µs per op of the slowest rank. A strategy that fails on any rank is left out of that row on every
rank. Collective: every rank of the group calls it together, with the same backends.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from arfusion.fusion.backends.base import Backend
from arfusion.fusion.dispatch.table import dtype_name, gpu_name, power_of_two_buckets
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategies import MEASURED
from arfusion.fusion.strategy import Strategy
from arfusion.fusion.tuning.timing import median_us_eager, median_us_per_call

logger = logging.getLogger(__name__)
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def token_buckets(max_tokens: int) -> list[int]:
    """The table's buckets up to ``max_tokens`` (`fusion.dispatch.table.power_of_two_buckets`)
    plus the decode batch sizes."""
    return sorted(set(power_of_two_buckets(max_tokens)) | {b for b in DECODE_BATCH_SIZES if b <= max_tokens})


def measure_bucket(group: TensorParallelGroup, backends: Mapping[Strategy, Backend], hidden: int, dtype: torch.dtype,
                   num_tokens: int, ops_per_graph: int = 20, warmup: int = 3, trials: int = 10) -> dict[Strategy, float]:
    """µs per op (slowest rank) of every measured strategy whose backend fits ``num_tokens`` rows."""
    g = torch.Generator(device=group.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=group.device, dtype=dtype, generator=g)
    residual = torch.randn(num_tokens, hidden, device=group.device, dtype=dtype, generator=g)
    weight = torch.rand(hidden, device=group.device, dtype=dtype, generator=g) + 0.5
    timings: dict[Strategy, float] = {}
    timer = median_us_per_call if group.device.type == "cuda" else median_us_eager
    for strategy in MEASURED:
        backend = backends.get(strategy)
        if backend is None or not backend.fits(num_tokens):  # identical on every rank
            continue

        def calls(backend: Backend = backend) -> None:
            for _ in range(ops_per_graph):
                backend.run(x, residual, weight, 1e-6)

        try:
            us: float | None = timer(calls, ops_per_graph, warmup, trials)
            error = None
        except Exception as exc:  # noqa: BLE001 (a strategy that fails here is left out, on every rank)
            us, error = None, f"{type(exc).__name__}: {exc}"
        results = group.all_gather_object((us, error))
        if all(u is not None for u, _ in results):
            timings[strategy] = max(u for u, _ in results)
        elif group.rank == 0:
            logger.warning("%s at %d tokens left out: %s", strategy, num_tokens, [e for _, e in results if e])
    return timings


def table_entry(group: TensorParallelGroup, backends: Mapping[Strategy, Backend], hidden: int, dtype: torch.dtype,
                buckets: list[int], **timing: Any) -> dict[str, Any]:
    """One strategy-table entry (`fusion.dispatch.table` format) for the group's GPU, world size,
    ``hidden`` and ``dtype``, measured at ``buckets``."""
    rows = {str(t): {s.value: us for s, us in measure_bucket(group, backends, hidden, dtype, t, **timing).items()}
            for t in buckets}
    return {"gpu": gpu_name(group.device), "world_size": group.world_size, "hidden": hidden,
            "dtype": dtype_name(dtype), "timings_us": rows}
