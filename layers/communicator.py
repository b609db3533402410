"""`LayerCommunicator`: where a decoder layer's TP reductions happen, so that fusing them into
the norms is a drop-in.

Per layer i (h_partial: a row-parallel output not yet summed over TP ranks):

    prepare_attn(h, residual)       layer 0 (residual None, h = full embeddings): input_norm(h)
                                    layer i-1 deferred its MLP reduction: fused AR+add+norm
                                    otherwise: input_norm(h, residual)
    prepare_mlp(h_partial, res)     AR(o_proj) + add + post_attention_norm, fused when decided
    postprocess_layer(h_partial, r) defer the down_proj AR to the next norm when decided,
                                    otherwise perform it now
    prepare_final_norm(h, r, norm)  (last layer) the final norm takes the deferred AR

The decision is ``fusion.should_fuse(layer_id, tokens)`` (cached, identical on all ranks), so a
deferral and the norm that performs it always agree, and every reduction runs exactly once.
"""
from __future__ import annotations

from typing import Optional

import torch

from layers.layernorm import RMSNorm
from layers.parallel_state import get_tp_group


class LayerCommunicator:
    def __init__(self, layer_id: int, num_layers: int, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm) -> None:
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"layer_id {layer_id} is outside 0..{num_layers - 1}")
        self.layer_id = layer_id
        self.num_layers = num_layers
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    @staticmethod
    def _deferred(layer_id: int, num_tokens: int) -> bool:
        """Did (or will) layer ``layer_id`` leave its MLP all-reduce to the next norm?"""
        fusion = get_tp_group().fusion
        return fusion is not None and fusion.should_fuse(layer_id, num_tokens)

    def prepare_attn(
        self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed input for attention, residual)``."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        previous = self.layer_id - 1
        if self._deferred(previous, hidden_states.shape[0]):
            return self.input_layernorm.forward_with_allreduce_fusion(hidden_states, residual, layer_id=previous)
        return self.input_layernorm(hidden_states, residual)

    def prepare_mlp(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the attention output (o_proj with ``reduce_results=False``) into the residual
        and normalise: ``(normed input for the MLP, residual)``."""
        return self.post_attention_layernorm.forward_with_allreduce_fusion(hidden_states, residual, layer_id=self.layer_id)

    def postprocess_layer(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP output (down_proj with ``reduce_results=False``): handed on un-reduced when
        the next norm fuses the all-reduce, reduced here otherwise."""
        if not self._deferred(self.layer_id, hidden_states.shape[0]):
            get_tp_group().all_reduce(hidden_states)
        return hidden_states, residual

    def prepare_final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
        """The model's final norm after this (last) layer, taking its deferred all-reduce."""
        if self.layer_id != self.num_layers - 1:
            raise ValueError(f"prepare_final_norm belongs to the last layer, not layer {self.layer_id}")
        if self._deferred(self.layer_id, hidden_states.shape[0]):
            normed, _ = final_norm.forward_with_allreduce_fusion(hidden_states, residual, layer_id=self.layer_id)
        else:
            normed, _ = final_norm(hidden_states, residual)
        return normed
