"""Residual add + RMSNorm after a reduction: flashinfer's kernels on GPU, torch elsewhere.

    rms_norm(x)              = x / RMS(x) * weight,   RMS(v) = sqrt(mean(v ** 2) + eps)
    add_rms_norm(x, residual) = (rms_norm(x + residual), x + residual)

On a GPU with flashinfer (fp16/bf16, 2-D) these are flashinfer's ``rmsnorm`` and in-place
``fused_add_rmsnorm`` as vLLM and SGLang run them; elsewhere `fusion.reference`.
"""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.fusion import reference
from arfusion.fusion.platform import flashinfer_import_error


def uses_flashinfer(x: torch.Tensor) -> bool:
    """flashinfer's norm kernels take ``x``: a 2-D fp16/bf16 CUDA tensor, flashinfer importable."""
    return x.is_cuda and x.dtype != torch.float32 and x.dim() == 2 and flashinfer_import_error() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` as a new tensor (``x`` is not written)."""
    if uses_flashinfer(x):
        import flashinfer.norm as fi_norm

        out = torch.empty_like(x)
        fi_norm.rmsnorm(x, weight, eps, out=out)
        return out
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; ``residual=None``: ``(rms_norm(x), x)``. On
    flashinfer's path in place: ``residual`` receives the sum and ``x`` the normed output
    (without a residual, ``x`` keeps the sum and the normed output is new); elsewhere out of place."""
    if not uses_flashinfer(x):
        return reference.add_rms_norm(x, residual, weight, eps)
    if residual is None:
        return rms_norm(x, weight, eps), x
    import flashinfer.norm as fi_norm

    fi_norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual
