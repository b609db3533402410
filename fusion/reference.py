"""PyTorch reference math for residual add + RMSNorm (and its FP8 output).

These are the definitions every fast path is tested against:

    residual_out = x + residual                       (rounded to x.dtype)
    normed       = residual_out / RMS(residual_out) * weight,
    RMS(v)       = sqrt(mean(v ** 2, dim=-1) + eps)   (computed in fp32, rounded to x.dtype)
    fp8          = float8_e4m3fn(normed / scale)      (normed rounded to x.dtype first)
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_E4M3_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` over the last dimension, in fp32, returned in ``x.dtype``."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; with ``residual=None`` the sum is
    ``x`` itself. Out of place: neither input is written."""
    residual_out = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    return rms_norm(residual_out, weight, eps), residual_out


def quantize_fp8_static(normed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 (e4m3) quantization: ``fp8(clamp(normed / scale))``."""
    q = normed.float() / scale.float()
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
