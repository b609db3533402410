"""Triton kernel of deterministic mode's unfused tail: the rank-order sum of P partial rows,
then the shared row step (`fusion.backends.kernels.row_norm`).

    y   = round(0 + fp32(parts[0][row]) + ... + fp32(parts[P-1][row]))   (rank order, one rounding)
    residual_out[row], out[row] = add_rms_norm_row(y, residual[row])

P = 1 after an all-reduce that already holds the canonical sum (NCCL or torch symmetric memory
at 2 ranks: the sum starts from +0.0, so an exact zero comes out +0 as in the fused kernels);
P = N when the partial sums were all-gathered (N > 2 ranks). One program per row, launched with
the row step's `row_block` and `row_num_warps`, like the fused kernels: a row's bits equal the
fused strategies' for the same inputs.

Why our own kernel: after the reduction the unfused path must finish with the same norm code
as the fused kernels (flashinfer's ``fused_add_rmsnorm`` reduces the row in its own order).
In place or not: ``out`` may be ``parts[0]`` and ``residual_out`` may be ``residual`` or
``parts[0]`` (a program reads its row of every input before it writes).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.fusion.backends.kernels.row_norm import add_rms_norm_row, row_block, row_num_warps


@triton.jit(do_not_specialize=["tokens"])  # one compile per (dtype, hidden, PARTS, residual): every T alike
def reduce_add_rms_norm_kernel(parts_ptr, tokens, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, hidden,
                               eps, PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row``: the rank-order sum of the row's ``PARTS`` partials (``parts`` is
    ``[PARTS, tokens, hidden]``), then residual add + RMSNorm. Offsets in int64 (``row`` is);
    every row starts on a multiple of ``hidden``, so the loads are as wide as the row step's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        acc += tl.load(parts_ptr + (p * tokens + row) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    add_rms_norm_row(y, row, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, cols, mask, hidden, eps,
                     HAS_RESIDUAL)


def reduce_add_rms_norm(parts: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                        residual_out: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """One launch on the current stream (capturable): ``parts [P, T, H]`` contiguous, the other
    tensors ``[T, H]`` contiguous (``weight [H]``); writes ``out`` and ``residual_out``."""
    num_parts, tokens, hidden = parts.shape
    if tokens == 0:
        return
    reduce_add_rms_norm_kernel[(tokens,)](
        parts, tokens, residual if residual is not None else parts, out, residual_out, weight, hidden, eps,
        PARTS=num_parts, HAS_RESIDUAL=residual is not None, BLOCK=row_block(hidden), num_warps=row_num_warps(hidden))
