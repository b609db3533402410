"""The measured configs of the batch-invariant matmul (layers/kernels/triton_bi_matmul.py), per
weight shape (N, K), as written by ``python -m arfusion.benchmarks.kernels.tune_bi_matmul``.

A row's bits depend on the order of its sums over K only: BLOCK_K and the split-K plan (S
splits, added in order). So an entry fixes those for its (N, K) and picks the tile (BLOCK_M,
BLOCK_N, warps, stages) per bucket of the row count M, where a larger batch runs faster with
larger tiles; the tuner keeps a tile only if it gives the rows the bits of the smallest bucket's
tile on the GPU it measures. The file (JSON):

    {"hardware": "...", "dtype": "bfloat16", "buckets": [16, 64, 128, 512],
     "configs": {"4096,4096": {"block_k": 128, "splits": 4,
                               "tiles": [[block_m, block_n, warps, stages], ...]}}}

``tiles[i]`` serves M <= buckets[i], the last one (``len(buckets) + 1`` tiles) every larger M.
Without a file, or for a shape it lacks, `triton_bi_matmul.choose_config`'s rule applies.
"""
from __future__ import annotations

import bisect
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

TABLE_PATH = Path(__file__).with_name("bi_matmul_configs.json")


class TableEntry(NamedTuple):
    block_k: int
    splits: int
    buckets: tuple[int, ...]  # M upper bounds of all but the last tile
    tiles: tuple[tuple[int, int, int, int], ...]  # (block_m, block_n, num_warps, num_stages)

    def tile(self, m: int) -> tuple[int, int, int, int]:
        """The tile ``(block_m, block_n, num_warps, num_stages)`` for a call of ``m`` rows."""
        return self.tiles[bisect.bisect_left(self.buckets, m)]


def parse_table(data: dict[str, Any]) -> dict[tuple[int, int], TableEntry]:
    """``{(N, K): TableEntry}`` from the file's JSON; ValueError naming the entry if malformed."""
    buckets = tuple(int(b) for b in data["buckets"])
    if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
        raise ValueError(f"bi-matmul table: buckets must be increasing positive row counts, got {buckets}")
    table = {}
    for key, entry in data["configs"].items():
        n, k = (int(v) for v in key.split(","))
        tiles = tuple(tuple(int(v) for v in t) for t in entry["tiles"])
        if len(tiles) != len(buckets) + 1 or any(len(t) != 4 for t in tiles):
            raise ValueError(f"bi-matmul table entry {key}: need {len(buckets) + 1} tiles of "
                             f"[block_m, block_n, warps, stages], got {entry['tiles']}")
        table[(n, k)] = TableEntry(int(entry["block_k"]), int(entry["splits"]), buckets, tiles)
    return table


@functools.lru_cache(maxsize=None)
def load_table(path: Optional[str] = None) -> dict[tuple[int, int], TableEntry]:
    """The table at ``path`` (default `TABLE_PATH`); empty when there is no file. Cached."""
    file = Path(path) if path else TABLE_PATH
    if not file.exists():
        return {}
    return parse_table(json.loads(file.read_text()))
