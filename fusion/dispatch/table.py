"""Measured strategy tables (written by ``python -m arfusion.engine.tune_fusion``) and their lookup.

File format (JSON):

    {"version": 2,
     "entries": [{"gpu": "NVIDIA H200", "world_size": 2, "hidden": 4096, "dtype": "bfloat16",
                  "timings_us": {"1": {"nccl": 8.7, "flashinfer_one_shot": 4.5, ...},
                                 "128": {...}, ...}}]}

A batch of T tokens uses the smallest measured bucket >= T (the largest bucket beyond it) and
the fastest strategy (`fusion.strategy.Strategy` values) measured there among those this process can run. Every rank uses rank 0's
table (broadcast over the CPU group), so decisions stay identical. A missing or corrupt file
gives one warning and no table: the built-in rule applies (`fusion.dispatch.cost_model`).
"""
from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from arfusion.fusion.strategy import Strategy

logger = logging.getLogger(__name__)
TABLE_VERSION = 2  # 2: strategy names with one_shot / two_shot
# Measured on 2 × H200, NVLink (docs/results.md, "Dispatch") and shipped with the package; used when no table is given.
PACKAGED_TABLE = Path(__file__).parent / "tables" / "strategy_table.json"


def power_of_two_buckets(max_tokens: int) -> list[int]:
    """The token buckets a table is measured at and the rule is priced at: the powers of two up to
    ``max_tokens``, and ``max_tokens`` itself. A batch of T tokens uses the smallest bucket >= T
    (`StrategyTable.fastest`)."""
    return sorted({1 << i for i in range(max_tokens.bit_length())} | {max_tokens})


class TuningTableError(ValueError):
    """A table file that cannot be used; the message says why."""


@dataclass(frozen=True)
class StrategyTable:
    """The rows of one (gpu, world size, hidden, dtype): bucket -> fastest strategy."""

    buckets: tuple[int, ...]  # sorted token counts
    timings_us: tuple[dict[Strategy, float], ...]  # per bucket: strategy -> median µs per op

    def fastest(self, tokens: int, available: Sequence[Strategy]) -> Optional[Strategy]:
        """The fastest available strategy measured for ``tokens`` (None if none was measured)."""
        i = min(bisect.bisect_left(self.buckets, tokens), len(self.buckets) - 1)
        measured = {s: t for s, t in self.timings_us[i].items() if s in available}
        return min(measured, key=measured.__getitem__) if measured else None


def parse_table(data: Any) -> list[dict[str, Any]]:
    """The validated entries of a table document; `TuningTableError` naming the problem."""
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
        raise TuningTableError(f"not a version-{TABLE_VERSION} strategy table (missing or wrong 'version')")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise TuningTableError("'entries' must be a list")
    for n, e in enumerate(entries):
        for key, kind in (("gpu", str), ("world_size", int), ("hidden", int), ("dtype", str), ("timings_us", dict)):
            if not isinstance(e.get(key), kind):
                raise TuningTableError(f"entry {n}: '{key}' missing or not a {kind.__name__}")
        for bucket, row in e["timings_us"].items():
            if not bucket.isdigit() or not isinstance(row, dict):
                raise TuningTableError(f"entry {n}: bucket {bucket!r} must be a token count mapping to timings")
            for strategy, us in row.items():
                if strategy not in Strategy._value2member_map_ or not isinstance(us, (int, float)) or us <= 0:
                    raise TuningTableError(f"entry {n}, bucket {bucket}: bad timing {strategy!r}: {us!r}")
    return entries


def read_table(path: str | Path) -> Optional[list[dict[str, Any]]]:
    """The entries of the table at ``path``; None with one warning if it is missing or corrupt."""
    try:
        return parse_table(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        logger.warning("strategy table %s not found: using the built-in rule", path)
    except (OSError, json.JSONDecodeError, TuningTableError, UnicodeDecodeError) as exc:
        # rank 0 reads alone, before a broadcast: any failure must become "no table", not an exit
        logger.warning("strategy table %s is unusable (%s): using the built-in rule", path, exc)
    return None


def select_table(entries: Optional[list[dict[str, Any]]], gpu: str, world_size: int, hidden: int,
                 dtype: str) -> Optional[StrategyTable]:
    """The table for this configuration, None when the file has no matching entry."""
    for e in entries or []:
        if (e["gpu"], e["world_size"], e["hidden"], e["dtype"]) == (gpu, world_size, hidden, dtype):
            rows = sorted((int(b), {Strategy(s): us for s, us in row.items()}) for b, row in e["timings_us"].items())
            if rows:
                return StrategyTable(tuple(b for b, _ in rows), tuple(r for _, r in rows))
    return None


def gpu_name(device: torch.device) -> str:
    """The table key of ``device``: the CUDA device name, "cpu" elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    """The table key of ``dtype`` ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def merge_entry(entries: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """``entries`` with ``entry`` replacing the one of the same configuration."""
    key = lambda e: (e["gpu"], e["world_size"], e["hidden"], e["dtype"])  # noqa: E731
    return [e for e in entries if key(e) != key(entry)] + [entry]
