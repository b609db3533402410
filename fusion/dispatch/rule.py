"""The built-in rule: which available strategy runs a batch when no measured table covers it.

It names no strategy; the backend classes declare what it reads (`fusion.strategies`):

1. a configured one-shot input-size limit takes the one-shot kernels (``one_shot``) out above it;
2. where the cost model (`fusion.dispatch.cost_model`) prices some fused candidate at this world
   size, the cheapest priced one runs (the fallback, priced too, included);
3. else the first fused candidate in the declared fallback order (``fallback_rank``), the
   one-shot kernels first while the message is under the one-shot/two-shot threshold
   (`fusion.dispatch.one_shot`) and last above it;
4. else the fallback.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from arfusion.fusion.dispatch.cost_model import COEFFICIENTS, cheapest
from arfusion.fusion.dispatch.one_shot import choose_one_shot
from arfusion.fusion.strategies import FALLBACK, FALLBACK_ORDER, ONE_SHOT
from arfusion.fusion.strategy import Strategy


def rule_choice(available: Sequence[Strategy], num_tokens: int, hidden: int, dtype: torch.dtype, world_size: int,
                one_shot_max_input_bytes: int | None) -> Strategy:
    """The strategy the built-in rule picks among ``available`` (which holds the fallback)."""
    if one_shot_max_input_bytes is not None and num_tokens * hidden * dtype.itemsize > one_shot_max_input_bytes:
        available = [s for s in available if s not in ONE_SHOT]
    model = COEFFICIENTS.get(world_size, {})
    if any(s in model for s in available if s is not FALLBACK):
        return cheapest(available, num_tokens, hidden, dtype, world_size)
    one_shot = choose_one_shot(num_tokens, hidden, dtype, world_size, one_shot_max_input_bytes)
    order = sorted((s for s in FALLBACK_ORDER if s in available), key=lambda s: (s in ONE_SHOT) != one_shot)
    return order[0] if order else FALLBACK
