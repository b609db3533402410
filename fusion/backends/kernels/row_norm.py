"""The last step of every fused kernel here: one reduced row's residual add and RMSNorm, in one
program, and the launch shape every kernel that calls it uses.

    res = round(fp32(y) + fp32(residual[row]))      (res = y without a residual)
    ssq = tl.sum(fp32(res) ** 2)                     over BLOCK = next_power_of_2(H) lanes
    out = round(fp32(res) * (1 / sqrt(ssq / H + eps)) * fp32(weight))

the reference math of fusion/reference.py, the same roundings. The order in which ``tl.sum``
adds the squares is Triton's reduction tree for the row's layout: each thread's elements, then
the lanes of a warp, then the warps. That layout is fixed by BLOCK (`row_block`), num_warps
(`row_num_warps`), both functions of the hidden size alone, and the 16-byte accesses of a
contiguous row whose size is a multiple of 16 bytes (the aligned rows every fused strategy
requires). It does not depend on the number of rows, the grid, or which rank's data arrived
first, so every kernel that finishes with this step (the fused two-shot, the Lamport one-shot,
the deterministic add + norm after a reduction) gives a row the same bits: the deterministic
mode's norm on the GPU (tests/gpu/test_deterministic_fusion.py checks it bit for bit).
"""
from __future__ import annotations

import triton
import triton.language as tl

MAX_HIDDEN = 16384  # one row of fp32 per program: 64 KiB of registers over 16 warps


def row_block(hidden: int) -> int:
    """Lanes of a row program: the row's H elements in one block."""
    return triton.next_power_of_2(hidden)


def row_num_warps(hidden: int) -> int:
    """Warps per row program: ~16 elements per thread, 4..16 warps."""
    return max(4, min(16, triton.next_power_of_2(hidden) // 512))


@triton.jit
def add_rms_norm_row(y, row, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, cols, mask, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr):
    """Stores ``residual_out[row] = round(y + residual[row])`` and ``out[row] = rmsnorm(...)``
    (``y``: the reduced row, already in the output dtype)."""
    out_ty = out_ptr.dtype.element_ty
    offs = row * hidden + cols
    if HAS_RESIDUAL:
        res = (y.to(tl.float32) + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(out_ty)
    else:
        res = y
    tl.store(residual_out_ptr + offs, res, mask=mask)
    resf = res.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(resf * resf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (resf * inv_rms * w).to(out_ty), mask=mask)
