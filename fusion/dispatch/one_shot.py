"""One-shot vs two-shot choice of the trtllm fused all-reduce.

One-shot: every rank reads all peers' full inputs (latency-bound, best for small messages).
Two-shot: reduce-scatter then all-gather (bandwidth-bound; needs tokens > world size, which its
backend states).
The choice depends on the bytes moved and the world size, not on the token count alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.fusion.backends.flashinfer_workspace import lamport_element_size

# Largest per-rank input (tokens * hidden * itemsize) for which one-shot is used, per world
# size. TP2 on H200: one-shot is faster than two-shot at every measured size up to 4096 x 8192
# bf16 (docs/results.md, "Kernel"), so no limit. TP4/TP8: flashinfer's B200 crossovers
# (64 MiB and 42 MiB of Lamport traffic = 2 * world * input bytes), until measured here.
ONE_SHOT_MAX_INPUT_BYTES: dict[int, Optional[int]] = {
    2: None,
    4: 64 * 2**20 // (2 * 4),
    8: 42 * 2**20 // (2 * 8),
    16: 42 * 2**20 // (2 * 16),
}
# The Lamport buffer size flashinfer caps at: INT32_MAX rounded down to 2 MiB.
MAX_LAMPORT_COMM_BYTES = 2147483647 & ~((1 << 21) - 1)


def choose_one_shot(
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    world_size: int,
    one_shot_max_input_bytes: Optional[int] = None,
) -> bool:
    """True for one-shot. ``one_shot_max_input_bytes`` overrides the per-world-size threshold.
    Whether two-shot can run the batch at all is its backend's to say (`fits`)."""
    itemsize = dtype.itemsize
    input_bytes = num_tokens * hidden * itemsize
    lamport_bytes = num_tokens * hidden * world_size * lamport_element_size(dtype)
    if lamport_bytes > MAX_LAMPORT_COMM_BYTES:
        return False
    limit = one_shot_max_input_bytes if one_shot_max_input_bytes is not None else ONE_SHOT_MAX_INPUT_BYTES.get(world_size)
    return limit is None or input_bytes <= limit
