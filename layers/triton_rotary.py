"""NeoX (half-split) rotary embedding of q and k in one Triton kernel.

For token t at position p = positions[t], every head x (q's and k's) of head_dim d, with
x1 = x[:d/2], x2 = x[d/2:] and angle_i = p * inv_freq_i:

    out[:d/2] = x1 * cos(angle) - x2 * sin(angle)
    out[d/2:] = x2 * cos(angle) + x1 * sin(angle)

The same math as layers/rotary_embedding.py's torch path, with the same roundings: the angle,
cos, sin, both products and the sum in fp32, each rounded once to fp32 (the kernel is compiled
with FMA contraction off, as torch's separate elementwise kernels are), then the result rounded
once to the input dtype. On NVIDIA GPUs ``tl.cos``/``tl.sin`` lower to libdevice's
``__nv_cosf``/``__nv_sinf``, which torch's CUDA cos/sin also compute, so the two paths agree bit
for bit there.

cos/sin are computed from ``positions`` and ``inv_freq`` inside the kernel: no position table,
so shapes stay static (CUDA-graph capturable, no host sync) and no table bounds the context.
Grid: (T, ceil(H / HEADS_PER_PROGRAM) + ceil(KVH / HEADS_PER_PROGRAM)); a program rotates
HEADS_PER_PROGRAM heads of one token (its q heads, or its k heads), recomputing that token's
d/2 angles (a few hundred flops, against 2 * HEADS_PER_PROGRAM * d elements moved).

q and k may be strided views (rows of a packed [T, (H + 2 KVH) * d] qkv projection): only their
last dimension must be contiguous. Results go to new contiguous tensors, or in place when
``q_out``/``k_out`` are q and k themselves (each program loads a head's both halves before it
stores them, so aliasing an input is safe).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

HEADS_PER_PROGRAM = 4
NUM_WARPS = 1  # one warp per [4, 64] tile pair at d=128: 8 contiguous elements (16 B of bf16) per thread


@triton.jit
def _rotate_heads(src_row, dst_row, first_head, cos, sin, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates heads [first_head, first_head + BLOCK_H) (those < NUM_HEADS) of one token row."""
    half: tl.constexpr = HEAD_DIM // 2
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    offs = heads[:, None] * HEAD_DIM + cols[None, :]
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < half)
    x1 = tl.load(src_row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + offs + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    out_ty = dst_row.dtype.element_ty
    tl.store(dst_row + offs, out1.to(out_ty), mask=mask)
    tl.store(dst_row + offs + half, out2.to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, inv_freq_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
                   q_row_stride, k_row_stride, q_out_row_stride, k_out_row_stride,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    cols = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=cols < HEAD_DIM // 2, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if block < q_blocks:
        _rotate_heads(q_ptr + token * q_row_stride, q_out_ptr + token * q_out_row_stride, block * BLOCK_H,
                      cos, sin, NUM_HEADS, HEAD_DIM, HALF_PAD, BLOCK_H)
    else:
        _rotate_heads(k_ptr + token * k_row_stride, k_out_ptr + token * k_out_row_stride, (block - q_blocks) * BLOCK_H,
                      cos, sin, NUM_KV_HEADS, HEAD_DIM, HALF_PAD, BLOCK_H)


def _check_rows(name: str, x: torch.Tensor, tokens: int, head_dim: int) -> int:
    """Validates a [T, heads * head_dim] operand with a contiguous last dim; returns its head count."""
    if x.dim() != 2 or x.shape[0] != tokens or x.shape[1] % head_dim:
        raise ValueError(f"{name} must be [T={tokens}, heads * {head_dim}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension (stride 1), got strides {x.stride()}")
    return x.shape[1] // head_dim


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     q_out: Optional[torch.Tensor] = None,
                     k_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [T]`` (int32/int64), ``q [T, H*d]``, ``k [T, KVH*d]`` (one float dtype, last
    dim contiguous, rows at any stride), ``inv_freq [d/2]`` fp32 -> rotated ``(q_out, k_out)``.

    ``q_out``/``k_out``: where to write (same shape and dtype; may be q and k for an in-place
    rotation); new contiguous tensors when None. Launches one kernel; no host sync."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a 1-D int32 or int64 tensor, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq must be a contiguous 1-D fp32 tensor, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q and k must share one dtype of fp32/fp16/bf16, got {q.dtype} and {k.dtype}")
    tokens, head_dim = positions.shape[0], 2 * inv_freq.shape[0]
    heads = _check_rows("q", q, tokens, head_dim)
    kv_heads = _check_rows("k", k, tokens, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    for name, out, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"{name} must match its input's shape and dtype {tuple(x.shape)} {x.dtype}, "
                             f"got {tuple(out.shape)} {out.dtype}")
        _check_rows(name, out, tokens, head_dim)
    if tokens == 0:
        return q_out, k_out
    grid = (tokens, triton.cdiv(heads, HEADS_PER_PROGRAM) + triton.cdiv(kv_heads, HEADS_PER_PROGRAM))
    _rotary_kernel[grid](positions, inv_freq, q, k, q_out, k_out,
                         q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0),
                         NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                         HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_H=HEADS_PER_PROGRAM,
                         num_warps=NUM_WARPS, enable_fp_fusion=False)
    return q_out, k_out
