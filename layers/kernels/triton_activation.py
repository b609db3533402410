"""SiLU-and-multiply (the Llama MLP's gated activation) in one Triton kernel.

``x [T, 2d] -> out [T, d]``, ``out = silu(x[:, :d]) * x[:, d:]``, silu(g) = g / (1 + exp(-g)).

Rounding follows the torch path of layers/activation.py (``F.silu(gate) * up``) step for step:
silu in fp32, rounded to the input dtype (torch's silu kernel returns that dtype), then the
product of the two dtype values in fp32, rounded to the dtype. exp is libdevice's ``__nv_expf``
and the division IEEE round-to-nearest (``tl.div_rn``), as in torch's CUDA silu, rather than
Triton's default ``ex2.approx`` / ``div.full``; so on CUDA the two paths agree bit for bit
(under the CPU interpreter, which has no libdevice, exp is numpy's). FMA contraction is pinned on
(Triton 3.10 turns its default off): the kernel's own math has no multiply-add to contract, and
inside ``__nv_expf`` it matches nvcc's default ``--fmad=true`` that built torch's kernel.

Grid: (T, ceil(d / BLOCK)); a program handles BLOCK columns of one row. Outputs are allocated
from shapes only and nothing is read back to the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024
NUM_WARPS = 4  # 8 contiguous elements (16 B of bf16) per thread


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, d, BLOCK: tl.constexpr,
                         LIBDEVICE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    out_ty = out_ptr.dtype.element_ty
    silu = tl.div_rn(gate, 1.0 + e).to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (silu * up).to(out_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2d]`` (fp32/fp16/bf16, last dim contiguous) -> new ``[..., d]`` of x's dtype:
    ``silu(x[..., :d]) * x[..., d:]``. Launches one kernel; no host sync."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"silu_and_mul supports fp32/fp16/bf16, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs a contiguous last dimension (stride 1), got strides {x.stride()}")
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)  # a view for 2-D x and for contiguous x
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or d == 0:
        return out
    grid = (rows.shape[0], triton.cdiv(d, BLOCK))
    _silu_and_mul_kernel[grid](rows, out, rows.stride(0), d, d, BLOCK=BLOCK,
                               LIBDEVICE_EXP=not triton.knobs.runtime.interpret, num_warps=NUM_WARPS,
                               enable_fp_fusion=True)  # only __nv_expf's inside is contracted, as nvcc does
    return out
