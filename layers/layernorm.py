"""RMSNorm with the common ``forward(x, residual=None)`` contract and a fused variant.

    forward(x)            -> x / RMS(x) * weight
    forward(x, residual)  -> (rms_norm(x + residual), x + residual)
    RMS(v) = sqrt(mean(v**2) + eps), computed in fp32.

On GPU with flashinfer the residual form runs flashinfer's ``fused_add_rmsnorm`` in place
(``residual`` receives the sum, ``x`` the normed output), as in vLLM and SGLang
(`fusion.norm`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from fusion import AllReduceFusion, norm

NormOutput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOutput:
        if residual is None:
            return norm.rms_norm(x, self.weight, self.eps)
        return norm.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_with_allreduce_fusion(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                                      fusion: AllReduceFusion, layer_id: int) -> NormOutput:
        """``forward(sum over TP ranks of x, residual)``, returning exactly what `forward`
        returns: ``x`` holds this rank's partial sum and is consumed; ``fusion`` runs it by layer
        ``layer_id``'s cached strategy (one fused kernel, or the all-reduce and then this norm)."""
        normed, residual_out = fusion.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, layer_id)
        return normed if residual is None else (normed, residual_out)
