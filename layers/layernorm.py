"""RMSNorm with the common ``forward(x, residual=None)`` contract.

    forward(x)            -> x / RMS(x) * weight
    forward(x, residual)  -> (rms_norm(x + residual), x + residual)
    RMS(v) = sqrt(mean(v**2) + eps), computed in fp32.

`rms_norm` is the first form on a plain tensor, as a function; `rms_norm_heads` applies it to
every head of a ``[T, heads * head_dim]`` tensor (the torch path of Qwen3's q/k norms,
layers/head_norm.py).

``x`` may be a `fusion.PartialSum` (a row-parallel output not yet summed over the TP ranks):
then ``x`` above is its sum over the ranks, and the norm is one call of the partial's op,
``op.reduce_add_rms_norm(x, residual, weight, eps)``, which all-reduces it fused into this norm
(or reduces, then normalises) by the strategy the op's plan gives the layer at this many tokens.

On GPU with flashinfer the residual form runs flashinfer's ``fused_add_rmsnorm`` in place
(``residual`` receives the sum, ``x`` the normed output), as in vLLM and SGLang
(`fusion.norm`).

Batch-invariant mode (`layers.batch_invariant`), for a reduced tensor, keeps flashinfer's kernels where they run (one
CTA per row, launched from the hidden size alone: row-invariant); elsewhere it follows the
fusion op's canonical add + RMSNorm (`fusion.reference.canonical_add_rms_norm`: the sum of
squares by a fixed tree), so that no reduction kernel can split a row by the number of rows.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from arfusion.fusion import PartialSum, norm, reference
from arfusion.layers import batch_invariant

NormInput = Union[torch.Tensor, PartialSum]
NormOutput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: NormInput, residual: Optional[torch.Tensor] = None) -> NormOutput:
        if x.__class__ is PartialSum:
            # the weight read from the parameter table: nn.Module's attribute lookup is slow
            normed, summed = x.op.reduce_add_rms_norm(x, residual, self._parameters["weight"], self.eps)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        if batch_invariant.enabled() and not norm.uses_flashinfer(x):
            return reference.canonical_add_rms_norm(x, residual, self.weight, self.eps)
        return norm.add_rms_norm(x, residual, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` over the last dimension of a plain tensor, as a new tensor: what
    `RMSNorm` computes without a residual (flashinfer's kernel, the canonical recipe in
    batch-invariant mode, else `fusion.reference.rms_norm`)."""
    if batch_invariant.enabled() and not norm.uses_flashinfer(x):
        return reference.canonical_add_rms_norm(x, None, weight, eps)[0]
    return norm.rms_norm(x, weight, eps)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of every head of ``x [T, heads * d]`` (rows at any stride) by ``weight [d]``:
    a new ``[T, heads * d]`` tensor; ``x`` is not written."""
    return rms_norm(x.reshape(-1, weight.shape[0]), weight, eps).view(x.shape)
