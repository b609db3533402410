"""`LayerCommunicator`: the reduction points of a decoder layer written against SGLang's
communicator, over our norms (`layers.layernorm.RMSNorm`, which take a `fusion.PartialSum`).

Per layer i (h_partial: a row-parallel output not yet summed over TP ranks):

    prepare_attn(h, residual)       layer 0 (residual None, h = full embeddings): input_norm(h);
                                    otherwise input_norm(h + residual), where h is layer i-1's
                                    `fusion.PartialSum` (its all-reduce fused into this norm) or
                                    a reduced tensor; with ``norm_into_qkv`` at TP1, for a batch
                                    the q/k/v launch takes, the norm left pending for the
                                    attention's q/k/v projection (`layers.pending_norm`)
    prepare_mlp(h_partial, res)     all-reduce(o_proj) + add + post_attention_norm, by layer i's
                                    strategy; with ``norm_into_route`` and a ``router`` (a MoE
                                    block's `layers.moe.router.TopKRouter`) at TP1, for a batch its
                                    routing launch takes, the norm left pending for that launch
    postprocess_layer(h_partial, r) the down_proj all-reduce, deferred as a `PartialSum` into
                                    the next norm
    prepare_final_norm(h, r, norm)  (last layer) the final norm, reducing a `PartialSum` into it

Each reduction is one call of the model's `fusion.AllReduceFusion` (``reduce_add_rms_norm``,
made by the norm), which looks layer i's strategy up in its plan (cached on (layer_id, tokens),
identical on all ranks) and runs it; every reduction runs exactly once.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from arfusion.fusion import AllReduceFusion, FusionInputError, PartialSum
from arfusion.layers.layernorm import RMSNorm
from arfusion.layers.moe.router import TopKRouter
from arfusion.layers.pending_norm import ROUTING, AttentionInput, MlpInput, folds, input_norm, post_attention_norm

LayerOutput = Union[torch.Tensor, PartialSum]  # a layer's h: reduced, or its reduction deferred


class LayerCommunicator:
    def __init__(self, layer_id: int, num_layers: int, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm,
                 fusion: AllReduceFusion, norm_into_qkv: bool = False, norm_into_route: bool = False,
                 router: Optional[TopKRouter] = None) -> None:
        """``router``: the layer's MoE router whose routing launch may take the post-attention
        norm (``norm_into_route``); None for a dense MLP, or an MLP that takes tensors only."""
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"layer_id {layer_id} is outside 0..{num_layers - 1}")
        self.layer_id = layer_id
        self.num_layers = num_layers
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.fusion = fusion
        self.norm_into_qkv = folds(norm_into_qkv, fusion.group.world_size)
        folded = router is not None and folds(norm_into_route, fusion.group.world_size, ROUTING)
        self.route_refusal = router.norm_deferral_refusal if folded else None

    def prepare_attn(self, hidden_states: LayerOutput,
                     residual: Optional[torch.Tensor]) -> tuple[AttentionInput, torch.Tensor]:
        """``(normed input for attention, residual)``; the normed input may be a
        `layers.pending_norm.PendingNorm`, which the attention's `QKVParallelLinear` runs (any
        other consumer calls its ``materialize()``)."""
        if residual is None and isinstance(hidden_states, PartialSum):
            raise FusionInputError(f"layer {self.layer_id} got {hidden_states} without a residual: only the "
                                   "embeddings start a forward")
        if residual is not None:
            self._check_from(hidden_states, self.layer_id - 1)
        return input_norm(self.input_layernorm, hidden_states, residual, self.norm_into_qkv)

    def prepare_mlp(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[MlpInput, torch.Tensor]:
        """Reduce the attention output (o_proj with ``reduce_results=False``) into the residual
        and normalise: ``(normed input for the MLP, residual)``; the normed input may be a
        `layers.pending_norm.PendingNorm` (with ``norm_into_route``), which the MoE block's router
        runs inside its routing launch."""
        partial = PartialSum(pending=hidden_states, layer_id=self.layer_id, op=self.fusion)
        return post_attention_norm(self.post_attention_layernorm, partial, residual, self.route_refusal)

    def postprocess_layer(self, hidden_states: torch.Tensor,
                          residual: torch.Tensor) -> tuple[LayerOutput, torch.Tensor]:
        """The MLP output (down_proj with ``reduce_results=False``) as a `PartialSum`, reduced by
        the next norm (``prepare_attn`` of the next layer, or ``prepare_final_norm``)."""
        return PartialSum(pending=hidden_states, layer_id=self.layer_id, op=self.fusion), residual

    def prepare_final_norm(self, hidden_states: LayerOutput, residual: torch.Tensor,
                           final_norm: RMSNorm) -> torch.Tensor:
        """The model's final norm after this (last) layer, reducing its deferred all-reduce into it."""
        if self.layer_id != self.num_layers - 1:
            raise ValueError(f"prepare_final_norm belongs to the last layer, not layer {self.layer_id}")
        self._check_from(hidden_states, self.layer_id)
        return final_norm(hidden_states, residual)[0]

    @staticmethod
    def _check_from(hidden_states: LayerOutput, layer_id: int) -> None:
        """A `PartialSum` reaching a norm must come from the layer just before it."""
        if isinstance(hidden_states, PartialSum) and hidden_states.layer_id != layer_id:
            raise FusionInputError(f"{hidden_states} reached the norm after layer {layer_id}: a deferred reduction "
                                   "is taken by the next layer's input norm or the final norm")
