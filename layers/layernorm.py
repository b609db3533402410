"""RMSNorm with the common ``forward(x, residual=None)`` contract and a fused variant.

    forward(x)            -> x / RMS(x) * weight
    forward(x, residual)  -> (rms_norm(x + residual), x + residual)
    RMS(v) = sqrt(mean(v**2) + eps), computed in fp32.

On GPU with flashinfer the residual form runs flashinfer's ``fused_add_rmsnorm`` in place
(``residual`` receives the sum, ``x`` the normed output), as in vLLM and SGLang.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from fusion import reference
from fusion.ops import unfused_allreduce_residual_rmsnorm
from fusion.platform import flashinfer_import_error
from layers.parallel_state import get_tp_group

NormOutput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def _use_flashinfer(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype != torch.float32 and x.dim() == 2 and flashinfer_import_error() is None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOutput:
        if self._use_flashinfer(x):
            from fusion.flashinfer_ops import add_rms_norm_inplace

            if residual is None:
                out = torch.empty_like(x)
                import flashinfer.norm as fi_norm

                fi_norm.rmsnorm(x, self.weight, self.eps, out=out)
                return out
            add_rms_norm_inplace(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return reference.rms_norm(x, self.weight, self.eps)
        return reference.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_with_allreduce_fusion(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], *, layer_id: int = 0
    ) -> NormOutput:
        """``forward(sum over TP ranks of x, residual)``, returning exactly what `forward`
        returns. ``x`` holds this rank's partial sum and is consumed. The TP group's fusion op
        decides, cached on (``layer_id``, tokens), whether one fused kernel does it all; if
        not, the all-reduce runs first and then the norm."""
        group = get_tp_group()
        fusion = group.fusion
        if fusion is None:
            normed, residual_out = unfused_allreduce_residual_rmsnorm(x, residual, self.weight, self.eps, group)
        else:
            strategy = fusion.strategy(layer_id, x.shape[0])
            normed, residual_out = fusion.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, strategy)
        return normed if residual is None else (normed, residual_out)
