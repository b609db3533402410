"""`LayerCommunicator`: where a decoder layer's TP reductions happen, so that fusing them into
the norms is a drop-in.

Per layer i (h_partial: a row-parallel output not yet summed over TP ranks):

    prepare_attn(h, residual)       layer 0 (residual None, h = full embeddings): input_norm(h)
                                    otherwise input_norm(h + residual), taking layer i-1's
                                    deferred all-reduce of h fused into it when there is one
    prepare_mlp(h_partial, res)     all-reduce(o_proj) + add + post_attention_norm, fused when
                                    layer i's strategy says so
    postprocess_layer(h_partial, r) the down_proj all-reduce: deferred into the next norm when
                                    layer i fuses, performed now otherwise
    prepare_final_norm(h, r, norm)  (last layer) the final norm takes the deferred all-reduce

Each is one call into the model's `fusion.AllReduceFusion`, which decides (cached on
(layer_id, tokens), identical on all ranks) and runs; every reduction runs exactly once.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusion import AllReduceFusion
from layers.layernorm import RMSNorm


class LayerCommunicator:
    def __init__(self, layer_id: int, num_layers: int, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm,
                 fusion: AllReduceFusion) -> None:
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"layer_id {layer_id} is outside 0..{num_layers - 1}")
        self.layer_id = layer_id
        self.num_layers = num_layers
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.fusion = fusion

    def prepare_attn(self, hidden_states: torch.Tensor,
                     residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed input for attention, residual)``."""
        norm = self.input_layernorm
        if residual is None:
            self.fusion.begin_forward()
            return norm(hidden_states), hidden_states
        return self.fusion.add_rms_norm(hidden_states, residual, norm.weight, norm.eps, self.layer_id - 1)

    def prepare_mlp(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the attention output (o_proj with ``reduce_results=False``) into the residual
        and normalise: ``(normed input for the MLP, residual)``."""
        norm = self.post_attention_layernorm
        return self.fusion.all_reduce_add_rms_norm(hidden_states, residual, norm.weight, norm.eps, self.layer_id)

    def postprocess_layer(self, hidden_states: torch.Tensor,
                          residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP output (down_proj with ``reduce_results=False``): handed on un-reduced when
        the next norm fuses the all-reduce, reduced here otherwise."""
        return self.fusion.defer_all_reduce(hidden_states, self.layer_id), residual

    def prepare_final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor,
                           final_norm: RMSNorm) -> torch.Tensor:
        """The model's final norm after this (last) layer, taking its deferred all-reduce."""
        if self.layer_id != self.num_layers - 1:
            raise ValueError(f"prepare_final_norm belongs to the last layer, not layer {self.layer_id}")
        normed, _ = self.fusion.add_rms_norm(hidden_states, residual, final_norm.weight, final_norm.eps, self.layer_id)
        return normed
