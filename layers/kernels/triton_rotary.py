"""NeoX (half-split) rotary embedding of q and k in one Triton kernel, optionally writing the KV cache.

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

`rotary_embedding_store_kv` is the same kernel writing the KV cache as well (what an attention
layer does next): the rotated k of token t goes to ``k_cache[slot_mapping[t]]`` and its v,
unrotated, to ``v_cache[slot_mapping[t]]``, so one launch replaces the rotary kernel and the two
``index_copy_`` kernels of the torch path; a program that rotates k heads also copies the same
v heads. The roundings are those above (v is copied bit for bit).

With a `layers.head_norm.HeadNorm` (Qwen3's q_norm/k_norm), `rotary_embedding_store_kv` also
RMS-normalizes every q and k head x (not v) before rotating it, as `layers.layernorm.rms_norm_heads`
followed by the rotation does, so one launch replaces the two norm kernels too:

    ssq     = sum(x**2)                     over the head's whole d (both halves), in fp32
    inv_rms = rsqrt(ssq * (1/d) + eps)      fp32 (ssq * (1/d) is the mean exactly when d is a power of two)
    n       = round((x * inv_rms) * w)      w = q_weight or k_weight ([d], shared by all heads);
                                            each product rounded to fp32, then once to the input dtype
    out     = the rotation above of n       fp32, rounded once to the input dtype

which is the torch path's rounding chain (a normed tensor in the dtype, then rotated in fp32).
The sum of squares is one program's reduction over one head, in an order fixed by d alone, so a
row's bits do not depend on T (batch-invariant); it is not torch's order, and tl.rsqrt is not
torch's rsqrt, so inv_rms can differ from the torch path's by a few fp32 ulps and n by one ulp
of the dtype where x * inv_rms * w lies that close to a rounding boundary. Without a HeadNorm
(the HAS_HEAD_NORM constexpr off) the kernel compiles to the rotation alone, as before.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.kernels import pdl

HEADS_PER_PROGRAM = 4
NUM_WARPS = 1  # one warp per [4, 64] tile pair at d=128: 8 contiguous elements (16 B of bf16) per thread


@triton.jit
def normed_rotation(x1, x2, cos, sin, norm_weight_ptr, cols, eps, in_ty: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HAS_HEAD_NORM: tl.constexpr):
    """The rotation of heads given as fp32 halves ``x1, x2 [R, HALF_PAD]`` (masked lanes 0) by
    ``cos, sin [HALF_PAD]``: ``(out1, out2)`` fp32, not yet rounded (module docstring). With
    HAS_HEAD_NORM every row is first RMS-normalized by the ``[HEAD_DIM]`` weight at
    norm_weight_ptr (lanes ``cols``) and rounded to ``in_ty``, as the torch path's normed tensor."""
    half: tl.constexpr = HEAD_DIM // 2
    if HAS_HEAD_NORM:  # masked lanes hold 0: they add nothing to the sum of squares
        inv_rms = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) * (1.0 / HEAD_DIM) + eps)[:, None]
        w1 = tl.load(norm_weight_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_weight_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * inv_rms * w1).to(in_ty).to(tl.float32)
        x2 = (x2 * inv_rms * w2).to(in_ty).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rotate_heads(src_row, dst_row, first_head, cos, sin, norm_weight_ptr, eps, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_HEAD_NORM: tl.constexpr):
    """Rotates heads [first_head, first_head + BLOCK_H) (those < NUM_HEADS) of one token row; with
    HAS_HEAD_NORM, RMS-normalizes each by the ``[HEAD_DIM]`` weight at norm_weight_ptr first."""
    half: tl.constexpr = HEAD_DIM // 2
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    offs = heads[:, None] * HEAD_DIM + cols[None, :]
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < half)
    x1 = tl.load(src_row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + offs + half, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = normed_rotation(x1, x2, cos, sin, norm_weight_ptr, cols, eps, src_row.dtype.element_ty, HEAD_DIM,
                                 HAS_HEAD_NORM)
    out_ty = dst_row.dtype.element_ty
    tl.store(dst_row + offs, out1.to(out_ty), mask=mask)
    tl.store(dst_row + offs + half, out2.to(out_ty), mask=mask)


@triton.jit
def _copy_heads(src_row, dst_row, first_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Copies heads [first_head, first_head + BLOCK_H) (those < NUM_HEADS) of one token row, in
    the same [BLOCK_H, HALF_PAD] tiles as `_rotate_heads`."""
    half: tl.constexpr = HEAD_DIM // 2
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    offs = heads[:, None] * HEAD_DIM + cols[None, :]
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < half)
    tl.store(dst_row + offs, tl.load(src_row + offs, mask=mask), mask=mask)
    tl.store(dst_row + offs + half, tl.load(src_row + offs + half, mask=mask), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, inv_freq_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                   q_norm_ptr, k_norm_ptr, eps,
                   q_row_stride, k_row_stride, v_row_stride, q_out_row_stride, k_out_row_stride, v_out_row_stride,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, STORE_KV: tl.constexpr,
                   HAS_HEAD_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """Without STORE_KV, k's rotation goes to k_out's row t (slots_ptr, v_ptr and v_out_ptr are
    unused); with it, to k_out's row slots[t], and v's row t is copied to v_out's row slots[t].
    With HAS_HEAD_NORM, q's heads are normed by q_norm and k's by k_norm (with eps) before they
    are rotated; without it q_norm_ptr, k_norm_ptr and eps are unused. With USE_PDL only
    inv_freq is read before the wait for the previous kernel (layers/kernels/pdl.py)."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    cols = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=cols < HEAD_DIM // 2, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if block < q_blocks:
        _rotate_heads(q_ptr + token * q_row_stride, q_out_ptr + token * q_out_row_stride, block * BLOCK_H,
                      cos, sin, q_norm_ptr, eps, NUM_HEADS, HEAD_DIM, HALF_PAD, BLOCK_H, HAS_HEAD_NORM)
    else:
        first_head = (block - q_blocks) * BLOCK_H
        if STORE_KV:
            out_row = tl.load(slots_ptr + token).to(tl.int64)
        else:
            out_row = token
        _rotate_heads(k_ptr + token * k_row_stride, k_out_ptr + out_row * k_out_row_stride, first_head,
                      cos, sin, k_norm_ptr, eps, NUM_KV_HEADS, HEAD_DIM, HALF_PAD, BLOCK_H, HAS_HEAD_NORM)
        if STORE_KV:
            _copy_heads(v_ptr + token * v_row_stride, v_out_ptr + out_row * v_out_row_stride, first_head,
                        NUM_KV_HEADS, HEAD_DIM, HALF_PAD, BLOCK_H)


def _check_rows(name: str, x: torch.Tensor, tokens: int, head_dim: int) -> int:
    """Validates a [T, heads * head_dim] operand with a contiguous last dim; returns its head count."""
    if x.dim() != 2 or x.shape[0] != tokens or x.shape[1] % head_dim:
        raise ValueError(f"{name} must be [T={tokens}, heads * {head_dim}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension (stride 1), got strides {x.stride()}")
    return x.shape[1] // head_dim


def _check_index(name: str, x: torch.Tensor, tokens: int) -> None:
    """Validates a contiguous ``[T]`` int32/int64 operand (the kernel reads it at offset t)."""
    if x.shape != (tokens,) or x.dtype not in (torch.int32, torch.int64) or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D int32 or int64 tensor of T={tokens} entries, "
                         f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")


def _check_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              inv_freq: torch.Tensor) -> tuple[int, int, int, int]:
    """Validates the rotary operands; returns ``(T, head_dim, heads, kv_heads)``."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be a 1-D int32 or int64 tensor, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    _check_index("positions", positions, positions.shape[0])
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq must be a contiguous 1-D fp32 tensor, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q and k must share one dtype of fp32/fp16/bf16, got {q.dtype} and {k.dtype}")
    tokens, head_dim = positions.shape[0], 2 * inv_freq.shape[0]
    return tokens, head_dim, _check_rows("q", q, tokens, head_dim), _check_rows("k", k, tokens, head_dim)


def _output(name: str, out: Optional[torch.Tensor], x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``out`` checked against its input ``x`` (same shape and dtype, contiguous last dim), or a
    new contiguous tensor when None."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"{name} must match its input's shape and dtype {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    _check_rows(name, out, x.shape[0], head_dim)
    return out


def _check_cache(name: str, cache: torch.Tensor, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Validates a ``[num_slots, KVH, d]`` cache of ``dtype`` whose slots are contiguous rows."""
    if cache.dim() != 3 or cache.shape[1:] != (kv_heads, head_dim) or cache.dtype != dtype:
        raise ValueError(f"{name} must be [num_slots, {kv_heads}, {head_dim}] {dtype}, "
                         f"got {tuple(cache.shape)} {cache.dtype}")
    if cache.stride(1) != head_dim or cache.stride(2) != 1:
        raise ValueError(f"{name} needs each slot's heads contiguous (strides [*, {head_dim}, 1]), "
                         f"got strides {cache.stride()}")


def _check_head_norm(head_norm: HeadNorm, q: torch.Tensor, head_dim: int) -> None:
    """Validates the norm weights (``[head_dim]`` of q's dtype or fp32, contiguous, on q's device)
    and eps (finite, >= 0)."""
    for name, weight in (("head_norm.q_weight", head_norm.q_weight), ("head_norm.k_weight", head_norm.k_weight)):
        if weight.shape != (head_dim,) or weight.dtype not in (q.dtype, torch.float32):
            raise ValueError(f"{name} must be [{head_dim}] of q's dtype {q.dtype} or torch.float32, "
                             f"got {tuple(weight.shape)} {weight.dtype}")
        if not weight.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {weight.stride()}")
        if weight.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {weight.device}")
    if not (math.isfinite(head_norm.eps) and head_norm.eps >= 0):
        raise ValueError(f"head_norm.eps must be finite and >= 0, got {head_norm.eps}")


def check_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   inv_freq: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   head_norm: Optional[HeadNorm]) -> tuple[int, int, int, int]:
    """`rotary_embedding_store_kv`'s operands checked (also the checks of the decode attention
    that rotates, layers/kernels/triton_rotary_decode_attention.py): ValueError naming the
    operand; returns ``(T, head_dim, heads, kv_heads)``."""
    tokens, head_dim, heads, kv_heads = _check_qk(positions, q, k, inv_freq)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k's shape and dtype {tuple(k.shape)} {k.dtype}, got {tuple(v.shape)} {v.dtype}")
    _check_rows("v", v, tokens, head_dim)
    _check_index("slot_mapping", slot_mapping, tokens)
    _check_cache("k_cache", k_cache, kv_heads, head_dim, k.dtype)
    _check_cache("v_cache", v_cache, kv_heads, head_dim, k.dtype)
    if head_norm is not None:
        _check_head_norm(head_norm, q, head_dim)
    return tokens, head_dim, heads, kv_heads


def _launch(positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, heads: int, kv_heads: int,
            head_dim: int, store_kv: bool, head_norm: Optional[HeadNorm] = None) -> None:
    """One `_rotary_kernel` launch over the T = len(positions) tokens (see its docstring); the
    norm pointers and eps are inv_freq and 0 (unused) without a head_norm."""
    grid = (positions.shape[0], triton.cdiv(heads, HEADS_PER_PROGRAM) + triton.cdiv(kv_heads, HEADS_PER_PROGRAM))
    q_norm, k_norm, eps = head_norm if head_norm is not None else (inv_freq, inv_freq, 0.0)
    use_pdl = pdl.enabled()
    _rotary_kernel[grid](positions, inv_freq, slots, q, k, v, q_out, k_out, v_out, q_norm, k_norm, float(eps),
                         q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), k_out.stride(0), v_out.stride(0),
                         NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                         HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_H=HEADS_PER_PROGRAM, STORE_KV=store_kv,
                         HAS_HEAD_NORM=head_norm is not None, USE_PDL=use_pdl, num_warps=NUM_WARPS,
                         enable_fp_fusion=False, launch_pdl=use_pdl)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     q_out: Optional[torch.Tensor] = None,
                     k_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [T]`` (int32/int64), ``q [T, H*d]``, ``k [T, KVH*d]`` (one float dtype, last
    dim contiguous, rows at any stride), ``inv_freq [d/2]`` fp32 -> rotated ``(q_out, k_out)``.

    ``q_out``/``k_out``: where to write (same shape and dtype; may be q and k for an in-place
    rotation); new contiguous tensors when None. Launches one kernel; no host sync."""
    tokens, head_dim, heads, kv_heads = _check_qk(positions, q, k, inv_freq)
    q_out, k_out = _output("q_out", q_out, q, head_dim), _output("k_out", k_out, k, head_dim)
    if tokens:
        _launch(positions, inv_freq, positions, q, k, k, q_out, k_out, k_out, heads, kv_heads, head_dim, store_kv=False)
    return q_out, k_out


def rotary_embedding_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              inv_freq: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, q_out: Optional[torch.Tensor] = None,
                              head_norm: Optional[HeadNorm] = None) -> torch.Tensor:
    """Rotates q and k as `rotary_embedding` (same operands; ``v [T, KVH*d]`` like k) and writes
    the KV cache instead of returning k: in place, for every token t,

        k_cache[slot_mapping[t]] = rotary(k[t]),   v_cache[slot_mapping[t]] = v[t]

    With ``head_norm`` (weights ``[d]`` of q's dtype or fp32, contiguous, on q's device; eps >= 0)
    every head of q and k is RMS-normalized before its rotation (the module docstring): q_out gets
    rotary(norm(q[t])) and the cache rotary(norm(k[t])); v is not normed.

    (``k_cache``/``v_cache [num_slots, KVH, d]`` of q's dtype, each slot's heads contiguous;
    ``slot_mapping [T]`` int32/int64, contiguous; other slots are not touched, and a slot named
    twice, such as a padding slot, ends up with one of its tokens' values, as with index_copy_).
    Returns the rotated q: ``q_out`` (may be q itself for an in-place rotation), or a new
    contiguous tensor when None. Launches one kernel; no host sync."""
    tokens, head_dim, heads, kv_heads = check_store_kv(positions, q, k, v, inv_freq, slot_mapping, k_cache, v_cache,
                                                       head_norm)
    q_out = _output("q_out", q_out, q, head_dim)
    if tokens:
        _launch(positions, inv_freq, slot_mapping, q, k, v, q_out, k_cache, v_cache, heads, kv_heads, head_dim,
                store_kv=True, head_norm=head_norm)
    return q_out
