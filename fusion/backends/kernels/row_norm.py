"""The last step of every fused kernel here: one reduced row's residual add and RMSNorm, in one
program (the reference math of fusion/reference.py, the same roundings)."""
from __future__ import annotations

import triton
import triton.language as tl


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
