"""PyTorch reference math for residual add + RMSNorm (and its FP8 output), and the canonical
recipe of deterministic mode.

The plain reference, every fast path's test oracle (default mode):

    residual_out = x + residual                       (rounded to x.dtype)
    normed       = residual_out / RMS(residual_out) * weight,
    RMS(v)       = sqrt(mean(v ** 2, dim=-1) + eps)   (computed in fp32, rounded to x.dtype)
    fp8          = float8_e4m3fn(normed * (1 / scale))  (normed rounded to x.dtype first; the
                                                       reciprocal in fp32, as flashinfer's kernel)

The canonical recipe (deterministic mode), for N ranks' partial sums x_0 .. x_{N-1} of row r:

    s            = round(((0 + fp32(x_0[r])) + fp32(x_1[r])) + ... + fp32(x_{N-1}[r]))
                   fp32 accumulation in rank order 0, 1, ..., from +0.0, one rounding
    residual_out = round(fp32(s) + fp32(residual[r]))          (s without a residual)
    ssq          = fixed_tree_sum(fp32(residual_out) ** 2)     (`fixed_tree_sum`)
    normed       = round(fp32(residual_out) * (1 / sqrt(ssq / H + eps)) * fp32(weight))

Every value of row r depends only on row r's inputs, so a row's bits do not depend on how many
other rows share the call. ``round`` is round-to-nearest-even into the model dtype. Facts the
strategies rely on:

* At N = 2 the sum is one IEEE addition: fp32(a) + fp32(b) commutes, and rounding it into
  bf16/fp16 equals rounding the exact a + b once (with 8 or 11 significand bits per operand the
  fp32 sum is exact whenever it could matter). NCCL's, gloo's and torch symmetric memory's
  all-reduce at N = 2 add each element once, so their result is ``s`` (up to the sign of an
  exact zero: -0 + -0 is -0 there and +0 here; the recipe's consumers normalise it). At N > 2
  a ring or tree all-reduce adds in an order that depends on the chunk, with a rounding after
  each step: not ``s``. A deterministic reduce-then-norm path therefore gathers the partial
  sums and adds them in rank order (`rank_order_sum`) at N > 2.
* torch's ``sum`` / ``mean`` over a row pick their order by the tensor's shape and the thread
  count (a reduction with few output rows may split one row across threads), so ``ssq`` here
  is an explicit tree of elementwise additions, whose order torch cannot change.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

FP8_E4M3_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` over the last dimension, in fp32, returned in ``x.dtype``."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; with ``residual=None`` the sum is
    ``x`` itself. Out of place: neither input is written. The torch strategy's one-call path
    (`fusion.backends.reduce_then_norm.TorchBackend.run`) writes these ops out; a change here is
    a change there (tests/test_fusion_ops.py holds the two bit-equal)."""
    residual_out = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    return rms_norm(residual_out, weight, eps), residual_out


def quantize_fp8_static(normed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 (e4m3) quantization: ``fp8(clamp(normed * (1 / scale)))``, the
    reciprocal rounded to fp32 first, as flashinfer's fused kernel quantizes (so every strategy
    gives the same bits)."""
    q = normed.float() * scale.float().reciprocal()
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ---- the canonical recipe (deterministic mode)

def rank_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``round(((0 + fp32(parts[0])) + fp32(parts[1])) + ...)`` elementwise, in the dtype of
    ``parts[0]``: every rank's partial sum added in rank order in fp32, rounded once."""
    if not parts:
        raise ValueError("rank_order_sum needs at least one partial sum")
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        acc += part.float()
    return acc.to(parts[0].dtype)


def fixed_tree_sum(v: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension of fp32 ``v [..., H]`` by a fixed pairwise tree, shape
    ``[..., 1]``: pad the row with zeros to P = the next power of two of H, then halve P times,
    ``v[..., :P/2] + v[..., P/2:]`` (elementwise, so element i of level k is the sum of the same
    elements in the same order whatever the number of rows or threads). Depends only on H."""
    if v.dtype != torch.float32:
        raise ValueError(f"fixed_tree_sum takes fp32, got {v.dtype}")
    width = v.shape[-1]
    padded = 1 << max(0, width - 1).bit_length()
    if padded != width:
        v = torch.nn.functional.pad(v, (0, padded - width))
    while padded > 1:
        padded //= 2
        v = v[..., :padded] + v[..., padded:]
    return v


def canonical_add_rms_norm(s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of the canonical recipe (module docstring) from the reduced
    sum ``s [T, H]`` (already ``round(...)`` in the model dtype). Out of place. An exact zero
    of ``s`` counts as +0 (the recipe's sum starts from +0.0)."""
    sf = s.float() + 0.0  # -0 + +0 = +0: the recipe's zero, whatever the reduction returned
    residual_out = sf.to(s.dtype) if residual is None else (sf + residual.float()).to(s.dtype)
    rf = residual_out.float()
    ssq = fixed_tree_sum(rf * rf)
    inv_rms = 1.0 / torch.sqrt(ssq / s.shape[-1] + eps)  # two correctly rounded steps, on any path
    return (rf * inv_rms * weight.float()).to(s.dtype), residual_out


def canonical_all_reduce_add_rms_norm(parts: Sequence[torch.Tensor], residual: torch.Tensor | None,
                                      weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole recipe from every rank's partial sum (in rank order): ``(normed, residual_out)``."""
    return canonical_add_rms_norm(rank_order_sum(parts), residual, weight, eps)
