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

from types import SimpleNamespace
from typing import Optional

import torch

from arfusion.fusion.errors import FusionInputError
from arfusion.fusion.strategy import Strategy


class PartialSum(SimpleNamespace):
    """This rank's partial sum ``pending`` [tokens, hidden] of layer ``layer_id``'s MLP, to be
    reduced by ``strategy`` (looked up once, when the layer deferred it).

    Made with keywords, ``PartialSum(pending=x, layer_id=i, strategy=s)``: SimpleNamespace's
    initialiser is C, so a deferral costs no Python call on the hot path. ``pending`` is the
    tensor until a reduction takes it (`take`), then None. Compared and hashed by identity."""

    pending: Optional[torch.Tensor]
    layer_id: int
    strategy: Strategy

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def take(self) -> torch.Tensor:
        """The partial sum, once: the reduction that takes it consumes it."""
        tensor, self.pending = self.pending, None
        if tensor is None:
            raise self.taken_twice()
        return tensor

    def taken_twice(self) -> FusionInputError:
        return FusionInputError(f"the partial sum of layer {self.layer_id} was already reduced: a deferred "
                                "reduction is taken by exactly one norm")

    def __repr__(self) -> str:
        state = "taken" if self.pending is None else f"{tuple(self.pending.shape)} {self.pending.dtype}"
        return f"PartialSum(layer {self.layer_id}, {self.strategy}, {state})"
