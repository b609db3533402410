"""The residual add + RMSNorm that the MoE routing launch (triton_router.py) runs on its input when
given a `RouteNorm`: at TP1 the decoder layer's post-attention norm, left pending for the MoE
block (layers/pending_norm.py), so that a decode step runs the norm inside the routing launch
instead of as a launch of its own.

For ``x [T, H]`` (the attention's output), ``residual [T, H]`` and the norm's weight ``g [H]``,
per token t:

    s[t, c]   = round(fp32(x[t, c]) + fp32(residual[t, c]))               -> residual_out[t, c]
    inv[t]    = 1 / sqrt(ssq[t] / H + eps),  ssq[t] = sum_c fp32(s[t, c])^2             fp32
    h[t, c]   = round((fp32(s[t, c]) * inv[t]) * fp32(g[c]))              -> normed[t, c]

and the routing of the module docstring of triton_router.py from ``h`` (its dots take these
rounded h). ``round`` is round-to-nearest-even into x's dtype. This is the rounding chain of
`fusion.reference.add_rms_norm`: the sum rounded to the model dtype once and the statistic taken
from the rounded sum; the statistic, ``inv`` and the scaling in fp32, ``s * inv`` first and then
``* g``; h rounded once. ``1 / sqrt`` is two correctly rounded steps (``sqrt_rn``, ``div_rn``)
where the reference has torch's ``rsqrt``, and ``ssq`` is summed in the launch's order (BLOCK_K
columns at a time, then across them) where the reference takes torch's mean: ``inv`` may differ
from the reference's in its last bits, and an element of ``h`` by one ulp of the model dtype.
(flashinfer's ``fused_add_rmsnorm``, today's separate norm on the GPU, stores the same rounded
sum but normalises the unrounded fp32 sum with an approximate reciprocal square root: its ``h``
can differ from this one by an ulp.)

The launch: every routing program (a tile of BLOCK_T tokens x BLOCK_E experts x one split of
SPLIT_WIDTH hidden columns) first sums the squares of its tokens' whole rows of ``s``
(`inv_rms`: it reads H columns of x and of the residual per token, where it read SPLIT_WIDTH of
h), then makes ``s`` and ``h`` of its own split (`summed_rows`) and takes its partial logits from
that ``h`` as it did from a stored one. The programs of expert tile 0 store their split of ``h``
into ``normed`` and of ``s`` into ``residual_out``: one writer per element. No program writes x or
the old residual, so every program reads them whole, whatever the others have done: no race.
Only the one-launch path takes a norm (triton_router.py: `ONE_LAUNCH_MAX_TOKENS` by default, up
to FUSED_MAX_SLOTS slots when asked for).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl


class RouteNorm(NamedTuple):
    """What the routing launch needs to normalise its input x first (module docstring):
    ``residual [T, H]`` and the norm ``weight [H]`` of x's dtype, ``eps``, and the outputs it
    writes, ``normed`` (h) and ``residual_out`` (s): contiguous ``[T, H]`` of x's dtype, each a
    tensor of its own (neither x nor the residual)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor
    residual_out: torch.Tensor


def batch_problem(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """What the launch refuses in the norm's inputs ``x``, ``residual`` and ``weight`` (x ``[T,
    H]`` fp16 / bf16 / fp32 with a contiguous last dimension, checked with the routing's own
    inputs), or None."""
    if x.dim() != 2:
        return f"x must be [T, hidden], got shape {tuple(x.shape)}"
    for name, tensor in (("residual", residual), ("norm weight", weight)):
        if tensor.dtype != x.dtype or tensor.device != x.device:
            return f"the {name} must be {x.dtype} on {x.device} as x, got {tensor.dtype} on {tensor.device}"
        if tensor.stride(-1) != 1:
            return f"the {name} needs a contiguous last dimension"
    if residual.shape != x.shape:
        return f"the residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
    if tuple(weight.shape) != (x.shape[1],):
        return f"the norm weight must be [{x.shape[1]}], got {tuple(weight.shape)}"
    return None


def problem(x: torch.Tensor, norm: RouteNorm) -> Optional[str]:
    """`batch_problem`, and what the launch refuses in the outputs of ``norm``, or None."""
    found = batch_problem(x, norm.residual, norm.weight)
    if found is not None:
        return found
    for name, out in (("normed", norm.normed), ("residual_out", norm.residual_out)):
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            return f"{name} must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}"
        if out.data_ptr() in (x.data_ptr(), norm.residual.data_ptr()):
            return f"{name} must be a tensor of its own, not x or the residual (every program reads them)"
    if norm.normed.data_ptr() == norm.residual_out.data_ptr():
        return "normed and residual_out must be two tensors"
    return None


@triton.jit
def summed_rows(x_ptr, r_ptr, offs_t, offs_k, mask, stride_x, stride_r):
    """``round(fp32(x) + fp32(residual))`` at tokens ``offs_t`` and columns ``offs_k``: a
    ``[tokens, columns]`` tile in x's dtype, zero where ``mask`` is false."""
    x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_x + offs_k[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + offs_t[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def inv_rms(x_ptr, r_ptr, offs_t, t_mask, hidden, eps, stride_x, stride_r, BLOCK_T: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """``inv`` of the module docstring for tokens ``offs_t`` (``[BLOCK_T]`` fp32; padded tokens
    get ``1 / sqrt(eps)``): ``ssq`` over BLOCK_K columns at a time, in increasing columns."""
    ssq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        s = summed_rows(x_ptr, r_ptr, offs_t, offs_k, t_mask[:, None] & (offs_k < hidden)[None, :], stride_x,
                        stride_r).to(tl.float32)
        ssq += tl.sum(s * s, axis=1)
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ssq, hidden.to(tl.float32)) + eps))
