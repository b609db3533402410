"""`PartialSum`: this rank's output of a row-parallel projection, not yet summed over the TP
ranks, handed to the next norm.

A decoder layer wraps its attention output (``o_proj``) and its MLP output (``down_proj``, or
a MoE block's combined experts) in a `PartialSum` instead of all-reducing them. The norm that
takes it (`layers.layernorm.RMSNorm`) calls ``op.reduce_add_rms_norm``, which runs
``rms_norm(sum over ranks + residual)`` as one reduction, by the strategy the op's plan gives
(``layer_id``, tokens). Nothing is stored on the op between layers: the deferral is this value.

A `PartialSum` is not a tensor: passing it where a reduced tensor is expected fails (torch
raises a TypeError, the fusion op a `FusionInputError`), and it can be reduced exactly once
(the second reduction raises `taken_twice`), so a deferred reduction can neither be skipped
nor run twice.

At TP size 1 the sum over the ranks is the partial itself, and a layer may hand over a sum it
has not formed yet: ``pending`` an `UnformedSum` (a MoE layer's slots and routing weights,
layers/moe/kernels/triton_topk_combine.py), which the op asks to form itself inside the norm's
launch (`UnformedSum.add_rms_norm`), or to `materialize` wherever a tensor is needed.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Protocol

import torch

from arfusion.fusion.errors import FusionInputError


class Reducer(Protocol):
    """What reduces a `PartialSum`: `fusion.AllReduceFusion` (named here by its methods, so that
    this module does not import the op's): ``reduce_add_rms_norm``, or at world size 1
    ``take_single_rank`` for a caller that normalises in a launch of its own."""

    def reduce_add_rms_norm(self, partial: "PartialSum", residual: Optional[torch.Tensor], weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def take_single_rank(self, partial: "PartialSum", residual: torch.Tensor,
                         residual_out: torch.Tensor) -> Optional[torch.Tensor]: ...


class UnformedSum:
    """A ``[tokens, hidden]`` tensor of ``dtype`` not yet computed (module docstring): ``shape``,
    ``dtype``, and its two ways to be formed."""

    __slots__ = ()
    shape: torch.Size
    dtype: torch.dtype

    def materialize(self) -> torch.Tensor:
        """The tensor itself, new."""
        raise NotImplementedError

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(rms_norm(x + residual) * weight, x + residual)`` as new tensors, ``x`` this tensor,
        in one launch that forms ``x`` on the way (``residual`` is not written); None, nothing
        run, where that launch does not take these inputs."""
        raise NotImplementedError


class PartialSum(SimpleNamespace):
    """This rank's partial sum ``pending`` [tokens, hidden] of layer ``layer_id``, to be reduced
    by ``op`` (`fusion.AllReduceFusion`).

    Made with keywords, ``PartialSum(pending=x, layer_id=i, op=op)``: SimpleNamespace's
    initialiser is C, so a deferral costs no Python call on the hot path. ``pending`` is the
    tensor (or at TP size 1 an `UnformedSum`) until a reduction takes it, then None. Compared and
    hashed by identity."""

    pending: Optional[torch.Tensor | UnformedSum]
    layer_id: int
    op: Reducer

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def formed(self) -> Optional[torch.Tensor]:
        """``pending`` as a tensor: an `UnformedSum` is materialized (and kept) first."""
        if isinstance(self.pending, UnformedSum):
            self.pending = self.pending.materialize()
        return self.pending

    def taken_twice(self) -> FusionInputError:
        return FusionInputError(f"the partial sum of layer {self.layer_id} was already reduced: a deferred "
                                "reduction is taken by exactly one norm")

    def __repr__(self) -> str:
        state = "taken" if self.pending is None else f"{tuple(self.pending.shape)} {self.pending.dtype}"
        return f"PartialSum(layer {self.layer_id}, {state})"
