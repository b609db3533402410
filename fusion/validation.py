"""Checks on the inputs of the fused op, shared by every backend."""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.fusion.errors import FusionInputError
from arfusion.fusion.platform import SUPPORTED_DTYPES


def check_fusion_inputs(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    """Raise `FusionInputError` naming the problem unless ``x`` is a contiguous
    [tokens, hidden] tensor of a supported dtype, ``residual`` (if given) matches it exactly,
    and ``weight`` is [hidden] of the same dtype and device."""
    if not isinstance(x, torch.Tensor) or not (residual is None or isinstance(residual, torch.Tensor)):
        raise FusionInputError(f"input and residual must be tensors, got {type(x).__name__} and "
                               f"{type(residual).__name__} (a PartialSum is reduced by the norm that "
                               "takes it: RMSNorm(partial, residual))")
    if x.dim() != 2:
        raise FusionInputError(f"input must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise FusionInputError(f"input dtype {x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not x.is_contiguous():
        raise FusionInputError("input must be contiguous (call .contiguous() first)")
    hidden = x.shape[1]
    if residual is not None:
        if residual.shape != x.shape:
            raise FusionInputError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise FusionInputError(f"residual dtype {residual.dtype} != input dtype {x.dtype}")
        if residual.device != x.device:
            raise FusionInputError(f"residual is on {residual.device}, input on {x.device}")
        if not residual.is_contiguous():
            raise FusionInputError("residual must be contiguous")
    if weight.shape != (hidden,):
        raise FusionInputError(f"norm weight shape {tuple(weight.shape)} != ({hidden},), the input's hidden size")
    if weight.dtype != x.dtype:
        raise FusionInputError(f"norm weight dtype {weight.dtype} != input dtype {x.dtype}")
    if weight.device != x.device:
        raise FusionInputError(f"norm weight is on {weight.device}, input on {x.device}")


class CheckedInputs:
    """Which inputs of an op have passed `check_fusion_inputs`, so that a decoder layer pays the
    full check once per forward instead of at each of its reduction points.

    A reduction's ``residual`` is trusted when it is the ``residual_out`` the op's previous
    reduction returned (the op sets ``residual`` after each reduction): its shape, dtype, device and layout were checked or made by
    the op. Its ``x`` then only needs the same shape and dtype and to be contiguous (``x`` comes
    from the same device as the residual in any model that reaches the op). A norm ``weight``
    is trusted after one full check (kept by identity; a replaced weight is checked again).
    Anything else (the first reduction of a forward, a residual from elsewhere, a mismatch)
    takes the full check, which raises `FusionInputError` naming the problem."""

    MAX_WEIGHTS = 4096  # distinct norm weights kept (two per layer and the final norm); then forgotten

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None
        self.weights: dict[int, torch.Tensor] = {}

    def check(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> None:
        """The full check (`check_fusion_inputs`); then ``weight`` is trusted. The op calls it
        only when the inputs are not trusted: it tests that inline, one Python call fewer per
        reduction point (the class docstring states the test)."""
        check_fusion_inputs(x, residual, weight)
        if len(self.weights) >= self.MAX_WEIGHTS:
            self.weights.clear()
        self.weights[id(weight)] = weight

    def forget(self) -> None:
        self.residual = None
        self.weights.clear()
