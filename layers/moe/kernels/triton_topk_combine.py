"""The top-k combine of a MoE layer's expert launches, alone or with the residual add + RMSNorm that
follows it, in one launch: gpt-oss's (launch 3 of layers/moe/kernels/triton_mxfp4_moe.py), or, with
``applied``, the rows of the grouped bf16 launches (layers/moe/kernels/triton_fused_moe.py) that
already hold the routing weights.

    m[t]    = round(sum_j w[t, j] * round(p[0, t*k+j] + ... + p[S-1, t*k+j]))      `combine`
              applied: round(p[0, t*k] + p[0, t*k+1] + ... + p[0, t*k+k-1])     (one split)
    s[t]    = round(m[t] + residual[t])                                         `combine_add_rms_norm`:
    out[t]  = round(s[t] / RMS(s[t]) * weight),  RMS(v) = sqrt(mean(v ** 2) + eps)   both, new tensors

``p [S, T * k, H]`` fp32 is each slot's expert output by split of the down projection's K range,
``w [T, k]`` fp32 the routing weights; round is to the activations' dtype, the splits and the k
rows are summed in order in fp32, the norm in fp32 (`fusion.reference.add_rms_norm`'s roundings:
the sum rounded before it is normalised). Neither launch writes its inputs.

Why the second form: at TP size 1 a MoE layer's output needs no all-reduce, so the norm after it
(the next layer's input norm, or the final norm) can form the output itself from the slots'
rows (`TopKCombine`, the `fusion.UnformedSum` a MoE block hands its layer's fusion op): for
gpt-oss one launch a layer instead of the combine's and the norm's; for the grouped bf16
launches a down launch without its arrival counters (each program writes its rows and is done;
no program waits to sum a token's k rows).

Both launches take part in programmatic dependent launch (layers/kernels/pdl.py): every program
waits before reading anything but the norm weight.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.fusion import UnformedSum
from arfusion.layers.kernels import pdl

COMBINE_BLOCK = 512  # output columns per program of the combine launch
NORM_MAX_HIDDEN = 16384  # a row of the launch with the norm is one program's block (larger: combine, then norm)


@triton.jit
def _weighted_slots(partial_ptr, topk_weights_ptr, token, cols, mask, stride_split, stride_slot, OUT_DTYPE,
                    TOPK: tl.constexpr, SPLIT_K: tl.constexpr, APPLIED: tl.constexpr):
    """``sum_j w[t, j] * round(sum_s p[s, t*k+j, cols])`` in fp32 (the splits and the slots in order);
    with APPLIED ``sum_j (sum_s p[s, t*k+j, cols])``: the weights are in the rows already."""
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOPK):
        slot = token * TOPK + j
        y = tl.load(partial_ptr + slot * stride_slot + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            y += tl.load(partial_ptr + s * stride_split + slot * stride_slot + cols, mask=mask, other=0.0)
        if APPLIED:
            total += y
        else:
            total += tl.load(topk_weights_ptr + slot) * y.to(OUT_DTYPE).to(tl.float32)
    return total


@triton.jit
def _topk_combine_kernel(partial_ptr, topk_weights_ptr, out_ptr, hidden, stride_split, stride_slot, stride_out,
                    TOPK: tl.constexpr, SPLIT_K: tl.constexpr, APPLIED: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """``out[t, cols] = m[t, cols]`` (module docstring); a program per token and BLOCK columns."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    total = _weighted_slots(partial_ptr, topk_weights_ptr, token, cols, mask, stride_split, stride_slot,
                            out_ptr.dtype.element_ty, TOPK, SPLIT_K, APPLIED)
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _topk_combine_norm_kernel(partial_ptr, topk_weights_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                                 hidden, eps, stride_split, stride_slot, stride_res, stride_res_out, stride_out,
                                 TOPK: tl.constexpr, SPLIT_K: tl.constexpr, APPLIED: tl.constexpr,
                                 BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``residual_out[t] = s[t]``, ``out[t]`` its norm (module docstring); a program per token, the
    whole row in one block of BLOCK >= hidden columns. The norm weight (written by no kernel of a
    step) loads before the PDL wait."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    total = _weighted_slots(partial_ptr, topk_weights_ptr, token, cols, mask, stride_split, stride_slot, dtype,
                            TOPK, SPLIT_K, APPLIED)
    residual = tl.load(residual_ptr + token * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (total.to(dtype).to(tl.float32) + residual).to(dtype)
    tl.store(residual_out_ptr + token * stride_res_out + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    tl.store(out_ptr + token * stride_out + cols, (s * inv_rms * weight).to(dtype), mask=mask)


def _check_partials(partial: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if partial.dim() != 3 or partial.dtype != torch.float32 or partial.stride(-1) != 1:
        raise ValueError(f"partial must be fp32 [splits, T * k, H] with a contiguous last dimension, got "
                         f"{partial.dtype} {tuple(partial.shape)}")
    if topk_weights.dim() != 2 or partial.shape[1] != topk_weights.numel():
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must be [T, k] with T * k = {partial.shape[1]} "
                         "(the partial's slots)")


def combine(partial: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype, applied: bool = False) -> torch.Tensor:
    """``m`` (module docstring; ``applied``: its second form) as a new ``[T, H]`` tensor of ``dtype``."""
    _check_partials(partial, topk_weights)
    return _launch_combine(partial, topk_weights.to(torch.float32).contiguous(), dtype, applied)


def combine_add_rms_norm(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, applied: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, s)`` (module docstring; ``applied``: m's second form) as new ``[T, H]`` tensors of
    ``residual``'s dtype (fp16 / bf16 / fp32); ValueError for shapes that do not match or a row
    wider than `NORM_MAX_HIDDEN`."""
    _check_partials(partial, topk_weights)
    tokens, hidden = topk_weights.shape[0], partial.shape[2]
    if residual.shape != (tokens, hidden) or residual.stride(-1) != 1:
        raise ValueError(f"residual must be [{tokens}, {hidden}] with a contiguous last dimension, got "
                         f"{tuple(residual.shape)}")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"the norm weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if hidden > NORM_MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is above the one-launch norm's {NORM_MAX_HIDDEN}")
    return _launch_combine_norm(partial, topk_weights.to(torch.float32).contiguous(), residual, weight, eps, applied)


def _launch_combine(partial: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype,
                    applied: bool) -> torch.Tensor:
    """`combine` on checked inputs (``topk_weights`` fp32, contiguous)."""
    tokens, top_k = topk_weights.shape
    hidden = partial.shape[2]
    out = torch.empty(tokens, hidden, dtype=dtype, device=partial.device)
    use_pdl = pdl.enabled()
    _topk_combine_kernel[(tokens, triton.cdiv(hidden, COMBINE_BLOCK))](
        partial, topk_weights, out, hidden, partial.stride(0), partial.stride(1), out.stride(0), TOPK=top_k,
        SPLIT_K=partial.shape[0], APPLIED=applied, BLOCK=COMBINE_BLOCK, USE_PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl)
    return out


def _launch_combine_norm(partial: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, applied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`combine_add_rms_norm` on checked inputs (``topk_weights`` fp32, contiguous)."""
    tokens, top_k = topk_weights.shape
    hidden = partial.shape[2]
    out = torch.empty_like(residual)
    residual_out = torch.empty_like(residual)
    if tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    use_pdl = pdl.enabled()
    _topk_combine_norm_kernel[(tokens,)](
        partial, topk_weights, residual, weight, out, residual_out, hidden, eps,
        partial.stride(0), partial.stride(1), residual.stride(0), residual_out.stride(0), out.stride(0),
        TOPK=top_k, SPLIT_K=partial.shape[0], APPLIED=applied, BLOCK=block, USE_PDL=use_pdl, num_warps=max(1, min(8, block // 512)),
        launch_pdl=use_pdl)
    return out, residual_out


class TopKCombine(UnformedSum):
    """A MoE layer's output ``m [T, H]`` (module docstring) not yet formed: the slots' expert rows
    ``partial`` and the routing weights, for the norm after the layer to form in its own launch
    (`add_rms_norm`: None, nothing run, for a residual of another dtype or with a strided last
    dimension, a non-contiguous norm weight or a row wider than `NORM_MAX_HIDDEN`), or
    `materialize` for any other reader. ``applied``: the rows hold the routing weights already
    (m's second form; ``topk_weights`` then gives the shape only)."""

    __slots__ = ("partial", "topk_weights", "shape", "dtype", "applied")

    def __init__(self, partial: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype,
                 applied: bool = False) -> None:
        _check_partials(partial, topk_weights)
        self.partial = partial
        self.topk_weights = topk_weights.to(torch.float32).contiguous()
        self.shape = torch.Size((topk_weights.shape[0], partial.shape[2]))
        self.dtype = dtype
        self.applied = applied

    def materialize(self) -> torch.Tensor:
        return _launch_combine(self.partial, self.topk_weights, self.dtype, self.applied)

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The fusion op hands over its trusted residual and weight (shape and dtype checked,
        `fusion.AllReduceFusion._norm_unformed`); what the launch needs beyond that is tested here."""
        if (residual.dtype != self.dtype or self.shape[1] > NORM_MAX_HIDDEN or residual.stride(-1) != 1
                or not weight.is_contiguous()):
            return None
        return _launch_combine_norm(self.partial, self.topk_weights, residual, weight, eps, self.applied)
