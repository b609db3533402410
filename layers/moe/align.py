"""Token slots grouped by expert, each expert's group padded to whole blocks of rows: the row
order of the grouped-GEMM launches (layers/moe/kernels/triton_fused_moe.py).

For ``topk_ids [T, k]`` the slots are ``s = t * k + j`` (N = T * k of them). Expert e's slots
(``c_e`` of them, in increasing s) fill rows ``[start_e, start_e + c_e)`` of ``sorted_slots``
with ``start_e = sum over e' < e of ceil(c_e' / block_m) * block_m``; the rows past ``c_e`` up
to the next multiple of block_m hold the sentinel N. Row block b belongs to expert
``block_expert[b]``; ``num_rows[0]`` is the number of rows used (a multiple of block_m).

All sizes are static upper bounds computed from (T, k, E, block_m) alone, so nothing is read back
to the host and the launches can be captured in a CUDA graph: at most ``min(E, N)`` experts have
slots, so at most ``N + min(E, N) * (block_m - 1)`` rows are used. Rows and blocks past
``num_rows`` hold the sentinel N and the last expert's id; the kernels skip those blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    sorted_slots: torch.Tensor  # int32 [max_rows]: the slot of each row, N for a padding row
    block_expert: torch.Tensor  # int32 [max_rows // block_m]: the expert of each block of rows
    num_rows: torch.Tensor  # int32 [1]: rows used
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """The static bound on the rows used (module docstring), rounded up to whole blocks."""
    rows = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``topk_ids [T, k]`` (ids in 0..E-1) -> `ExpertBlocks` (module docstring). New tensors on
    topk_ids' device; a handful of small torch ops, no host synchronisation (the counts by
    ``scatter_add_``: CUDA's ``bincount`` reads its input's maximum back to the host)."""
    device = topk_ids.device
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, increasing within each
    first_of_expert = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rows = start[sorted_experts] + torch.arange(num_slots, device=device) - first_of_expert[sorted_experts]
    max_rows = max_padded_rows(num_slots, num_experts, block_m)
    sorted_slots = torch.full((max_rows,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    num_rows = padded_end[-1:].to(torch.int32)
    return ExpertBlocks(sorted_slots, block_expert.to(torch.int32), num_rows, block_m)
