"""The built-in rule: which available strategy runs a batch when no measured table covers it.

The cost model (`fusion.dispatch.cost_model`) prices every strategy it was fitted for at this
world size and picks the cheapest available one; a configured one-shot input-size limit takes
flashinfer one-shot out above it. A world size with no fitted model takes flashinfer's kernel,
one-shot or two-shot by message size (`fusion.dispatch.one_shot`; the other one where the
preferred cannot run the batch), when the workspace holds the batch, else our fused two-shot
(`symm_mem_fused`) where its buffer exists, else NCCL.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from arfusion.fusion.dispatch.cost_model import cheapest
from arfusion.fusion.dispatch.one_shot import choose_one_shot
from arfusion.fusion.strategy import Strategy


def rule_choice(available: Sequence[Strategy], num_tokens: int, hidden: int, dtype: torch.dtype, world_size: int,
                one_shot_max_input_bytes: Optional[int]) -> Strategy:
    """The strategy the built-in rule picks among ``available`` (which holds ``nccl``)."""
    if one_shot_max_input_bytes is not None and num_tokens * hidden * dtype.itemsize > one_shot_max_input_bytes:
        available = [s for s in available if s is not Strategy.FLASHINFER_ONE_SHOT]
    modelled = cheapest(available, num_tokens, hidden, dtype, world_size)
    if modelled is not None:
        return modelled
    one_shot = choose_one_shot(num_tokens, hidden, dtype, world_size, one_shot_max_input_bytes)
    order = (Strategy.FLASHINFER_ONE_SHOT, Strategy.FLASHINFER_TWO_SHOT)
    # then our fused two-shot (deterministic mode, which has no flashinfer strategy)
    preference = (order if one_shot else order[::-1]) + (Strategy.SYMM_MEM_FUSED,)
    return next((s for s in preference if s in available), Strategy.NCCL)
