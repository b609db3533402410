"""`PartialSum`: a layer's MLP output not yet summed over the TP ranks, handed to the next norm.

When layer i's strategy fuses (``should_fuse_allreduce_residual_rmsnorm(i, tokens)``), its
``down_proj`` output is not all-reduced where it is made: `LayerCommunicator.postprocess_layer`
returns it wrapped in a `PartialSum`, and the next layer's ``prepare_attn`` (or the final norm)
runs ``rms_norm(sum over ranks + residual)`` as one fused reduction by the recorded strategy.
Nothing is stored on the op between layers: the deferral is this value.

A `PartialSum` is not a tensor: passing it where a reduced tensor is expected fails (torch
raises a TypeError, the fusion op a `FusionInputError`), and it can be reduced exactly once
(`take` raises the second time), so a deferred reduction can neither be skipped nor run twice.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusion.errors import FusionInputError
from fusion.strategy import Strategy


class PartialSum:
    """This rank's partial sum ``tensor`` [tokens, hidden] of layer ``layer_id``'s MLP, to be
    reduced by ``strategy`` (decided, cached, when the layer deferred it)."""

    __slots__ = ("_tensor", "layer_id", "strategy", "num_tokens")

    def __init__(self, tensor: torch.Tensor, layer_id: int, strategy: Strategy) -> None:
        self._tensor: Optional[torch.Tensor] = tensor
        self.layer_id = layer_id
        self.strategy = strategy
        self.num_tokens = tensor.shape[0]

    def take(self) -> torch.Tensor:
        """The partial sum, once: the reduction that takes it consumes it."""
        tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise FusionInputError(f"the partial sum of layer {self.layer_id} was already reduced: a deferred "
                                   "reduction is taken by exactly one norm")
        return tensor

    def __repr__(self) -> str:
        state = "taken" if self._tensor is None else f"{tuple(self._tensor.shape)} {self._tensor.dtype}"
        return f"PartialSum(layer {self.layer_id}, {self.strategy}, {state})"
