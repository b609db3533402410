"""Built-in crossover points: the largest token count at which the fused op is still faster
than NCCL all-reduce + fused_add_rmsnorm, per world size and hidden size.

Measured on 2 x H200 (NVLink), bf16, CUDA graphs (docs/results.md, section 1): at hidden
1024 the fused kernel wins at 2048 tokens (29.0 vs 35.8 µs) and loses at 4096 (68.8 vs 52.8);
at hidden 4096 and 8192 it wins up to 4096 tokens. Hidden sizes between rows use the next
larger row; world sizes not listed use the most conservative (smallest) limits of those listed.
A measured strategy table (`fusion.tuning_table`) overrides these where it has an entry.
"""
from __future__ import annotations

from typing import Optional

# world_size -> ((max hidden, max fused tokens), ...) in increasing hidden order.
# None = fused is faster at every token count the workspace can hold.
MAX_FUSED_TOKENS: dict[int, tuple[tuple[int, Optional[int]], ...]] = {
    2: ((1024, 2048), (2**31, None)),
}


def max_fused_tokens(world_size: int, hidden: int) -> Optional[int]:
    """The token count above which the unfused path is faster (None: no such count)."""
    table = MAX_FUSED_TOKENS.get(world_size)
    if table is None:  # unmeasured world size: the smallest limit measured anywhere
        limits = [lim for rows in MAX_FUSED_TOKENS.values() for h, lim in rows if h >= hidden]
        finite = [lim for lim in limits if lim is not None]
        return min(finite) if finite else None
    for max_hidden, limit in table:
        if hidden <= max_hidden:
            return limit
    return table[-1][1]
