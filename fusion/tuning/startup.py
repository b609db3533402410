"""Tuning at start-up: a configuration that no strategy table holds (GPU, TP size, hidden size,
dtype) is measured by the server itself before it reports ready, and the result is cached on
disk for the next start.

Collective: every rank measures together (`fusion.tuning.measure`: each timing is the slowest rank's);
rank 0's table is broadcast, so every rank decides alike, and rank 0 alone reads and writes
the cache. The measurement covers the power-of-two token counts up to the op's largest batch;
a measurement that passes its time budget is abandoned (logged) and the built-in rule decides.
The cache file is keyed by the configuration, the table format and the torch and flashinfer
versions.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from arfusion.fusion.backends.base import Backend
from arfusion.fusion.dispatch.table import (TABLE_VERSION, StrategyTable, dtype_name, gpu_name, power_of_two_buckets, read_table,
                                  select_table)
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategy import Strategy
from arfusion.fusion.tuning.measure import table_entry

logger = logging.getLogger(__name__)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "arfusion"
# per bucket: few repeats keep a start-up short (the table needs the ranking, not 1% accuracy)
TIMING = {"ops_per_graph": 10, "warmup": 2, "trials": 5}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_file(group: TensorParallelGroup, hidden: int, dtype: torch.dtype, cache_dir: Optional[str]) -> Path:
    """Where this configuration's measured table is cached."""
    versions = f"table-v{TABLE_VERSION}_torch-{torch.__version__}_flashinfer-{_version('flashinfer-python')}"
    key = f"{gpu_name(group.device)}_tp{group.world_size}_h{hidden}_{dtype_name(dtype)}"
    return Path(cache_dir or DEFAULT_CACHE_DIR) / _safe(versions) / f"{_safe(key)}.json"


def _safe(name: str) -> str:
    """``name`` as one path component (GPU names hold spaces)."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "-", name)


def tune_at_startup(group: TensorParallelGroup, backends: Mapping[Strategy, Backend],
                    on_demand: Sequence[tuple[Backend, int]],
                    hidden: int, dtype: torch.dtype, max_rows: int, cache_dir: Optional[str],
                    budget_s: float) -> Optional[StrategyTable]:
    """Collective: this configuration's table from the cache, else measured now over ``backends``
    up to ``max_rows`` rows and cached; None when the measurement passed ``budget_s`` seconds, or
    when ranks share a GPU (nothing is measured or cached there). The ``on_demand`` backends are
    ensured for the measurement (each for its rows) and destroyed after it (the caller keeps those
    the table picks)."""
    start = time.monotonic()
    path = cache_file(group, hidden, dtype, cache_dir)
    key = (gpu_name(group.device), group.world_size, hidden, dtype_name(dtype))
    if group.shares_gpu:  # identical on every rank: all skip together
        if group.rank == 0:
            logger.warning("all-reduce fusion: no start-up tuning for %s TP%d hidden %d %s: the TP ranks share a "
                           "GPU, where a time-shared measurement would pick wrong strategies; the built-in rule "
                           "decides", *key)
        return None
    cached = select_table(read_table(path), *key) if group.rank == 0 and path.exists() else None
    cached = group.broadcast_object(cached)
    if cached is not None:
        if group.rank == 0:
            logger.info("all-reduce fusion: strategy table for %s TP%d hidden %d %s from %s (%.2f s)", *key, path,
                        time.monotonic() - start)
        return cached
    buckets = power_of_two_buckets(max_rows)
    for backend, rows in on_demand:
        backend.ensure(rows, hidden, dtype)  # voted: ready on every rank or on none
    entry = {"gpu": key[0], "world_size": key[1], "hidden": key[2], "dtype": key[3], "timings_us": {}}
    try:
        for tokens in buckets:
            entry["timings_us"].update(table_entry(group, backends, hidden, dtype, [tokens], **TIMING)["timings_us"])
            if group.broadcast_object(time.monotonic() - start > budget_s) and tokens != buckets[-1]:
                if group.rank == 0:
                    logger.warning("all-reduce fusion: start-up tuning for %s TP%d hidden %d %s passed its %.0f s "
                                   "budget at %d tokens: abandoned, the built-in rule decides", *key, budget_s, tokens)
                return None
    finally:
        for backend, _ in on_demand:  # the caller makes the buffers of the strategies the table picks
            backend.destroy()
    entry = group.broadcast_object(entry)
    if group.rank == 0:
        _write(path, entry)
        logger.info("all-reduce fusion: tuned %s TP%d hidden %d %s at %d token counts in %.1f s; cached at %s", *key,
                    len(buckets), time.monotonic() - start, path)
    return select_table([entry], *key)


def _write(path: Path, entry: dict) -> None:
    """Write the one-entry table atomically (a concurrent start reads the old file or the new)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": TABLE_VERSION, "entries": [entry]}, indent=1))
        tmp.replace(path)
    except OSError as exc:  # an unwritable cache costs the next start a measurement, nothing more
        logger.warning("all-reduce fusion: could not cache the tuned table at %s (%s)", path, exc)
