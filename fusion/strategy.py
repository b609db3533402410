"""The ways one reduction point (all-reduce + residual add + RMSNorm) can run, and the values
every way takes and returns.

    s            = sum over TP ranks of x
    residual_out = s + residual        (s when residual is None)
    normed       = residual_out / RMS(residual_out) * weight

Each ``Strategy`` names one backend class (`fusion.backends`), registered in
`fusion.strategies.REGISTRY`; the class is the strategy's declaration, its docstring's first line
says how it runs. Exactly one is the unfused fallback (``nccl``: group all-reduce, then add +
RMSNorm), which runs everywhere. In deterministic mode every strategy the op builds follows one
canonical recipe (fusion/reference.py), so a row's bits do not depend on which one runs; the
classes say which are left out there and why.

An optional ``quant`` asks for quantized normed output: FP8 (static per-tensor e4m3) fuses into
the flashinfer kernel and is a separate cast elsewhere; FP4 exists only as flashinfer's fused
pattern and needs sm100+ (on sm90 the kernel writes zeros, so it is refused there).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from arfusion.fusion.errors import FusionInputError


class Strategy(str, enum.Enum):
    NCCL = "nccl"
    FLASHINFER_ONE_SHOT = "flashinfer_one_shot"
    FLASHINFER_TWO_SHOT = "flashinfer_two_shot"
    SYMM_MEM_TWO_SHOT = "symm_mem_two_shot"
    SYMM_MEM_FUSED = "symm_mem_fused"
    LAMPORT_ONE_SHOT = "lamport_one_shot"
    TORCH = "torch"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Quant:
    """Quantized normed output: ``fp8 = e4m3(normed / scale)``; ``fp4``: NVFP4 with swizzled
    128x4 block scales. ``scale``: a one-element float32 tensor on the input's device (a tensor,
    so that CUDA graphs may update it between replays)."""

    kind: Literal["fp8", "fp4"]
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "fp4"):
            raise FusionInputError(f"quant kind must be 'fp8' or 'fp4', got {self.kind!r}")
        if self.scale.numel() != 1 or self.scale.dtype != torch.float32:
            raise FusionInputError(f"quant scale must be a one-element float32 tensor, got "
                                   f"{self.scale.dtype} x {self.scale.numel()}")


class FusedOutput(NamedTuple):
    """``normed``: [tokens, hidden] in the input dtype (fp8 with FP8 quant; packed uint8
    [tokens, hidden / 2] with FP4, whose swizzled scale factors are ``block_scales``);
    ``residual``: ``sum(x) + residual``, the next layer's residual."""

    normed: torch.Tensor
    residual: torch.Tensor
    block_scales: torch.Tensor | None = None
