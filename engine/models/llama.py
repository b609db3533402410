"""The tensor-parallel Llama-family decoder: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
MistralForCausalLM share it.

One decoder layer (h_partial: a row-parallel output not yet summed over TP ranks):

    h, residual = comm.prepare_attn(h, residual)        input RMSNorm (takes the previous
                                                         layer's deferred all-reduce)
    h_partial   = o_proj(attn(rope(qkv_proj(h))))       o_proj: reduce_results=False; rope
                                                         also writes k, v into the KV cache
    h, residual = comm.prepare_mlp(h_partial, residual) all-reduce + add + post-attention RMSNorm
    h_partial   = down_proj(silu(gate) * up)            down_proj: reduce_results=False
    h, residual = comm.postprocess_layer(h_partial, r)  reduce now, or defer to the next norm

and after the last layer ``comm.prepare_final_norm(h, residual, norm)``. Which of these
reductions fuse with their norm is `layers.communicator.LayerCommunicator`'s business; every
one of them runs exactly once.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.runtime.forward_batch import ForwardBatch, KVCache
from fusion import AllReduceFusion
from layers.activation import SiluAndMul
from layers.attention import Attention
from layers.communicator import LayerCommunicator
from layers.layernorm import RMSNorm
from layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    default_weight_loader,
)
from layers.rotary_embedding import RotaryEmbedding
from layers.sharded_logits import ShardedLogits
from layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

# checkpoint projection name -> (this model's merged parameter, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def o_proj_has_bias(config: ModelConfig) -> bool:
    """HF Llama gives o_proj a bias with ``attention_bias``; Qwen2 biases q/k/v only."""
    return config.attention_bias and config.architecture == "LlamaForCausalLM"


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this model holds: name -> full (unsharded) shape."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_size, h),
            p + "self_attn.k_proj.weight": (kv_size, h),
            p + "self_attn.v_proj.weight": (kv_size, h),
            p + "self_attn.o_proj.weight": (h, q_size),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_size,), p + "self_attn.k_proj.bias": (kv_size,),
                           p + "self_attn.v_proj.bias": (kv_size,)})
        if o_proj_has_bias(config):
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _param_name(hf_name: str) -> tuple[str, ShardId]:
    """HF tensor name -> (this model's parameter name, shard id)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in _STACKED:
            merged, shard = _STACKED[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard
    return hf_name, None


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__()
        d = config.head_dim
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads,
                                          bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=o_proj_has_bias(config),
                                        reduce_results=False, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(d, config.rope_theta, config.rope_scaling, device=device)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d, d ** -0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch,
                kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]`` (reduced, normed) -> this rank's partial o_proj output ``[T, hidden]``."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        k_cache, v_cache = kv_cache.k[self.layer_id], kv_cache.v[self.layer_id]
        q = self.rotary_emb.forward_store_kv(positions, q, k, v, batch.slot_mapping, k_cache, v_cache)
        return self.o_proj(self.attn.attend(q, k_cache, v_cache, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], dtype=dtype, device=device)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, reduce_results=False, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> `` this rank's partial down_proj output ``[T, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden_states)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fusion: AllReduceFusion, dtype: torch.dtype,
                 device: Optional[torch.device]) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.comm = LayerCommunicator(layer_id, config.num_hidden_layers, self.input_layernorm,
                                      self.post_attention_layernorm, fusion)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                batch: ForwardBatch, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` in, ``(h, residual)`` out; h may be un-reduced (see the module docstring)."""
        hidden_states, residual = self.comm.prepare_attn(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, batch, kv_cache)
        hidden_states, residual = self.comm.prepare_mlp(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.comm.postprocess_layer(hidden_states, residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, fusion: AllReduceFusion, dtype: torch.dtype,
                 device: Optional[torch.device]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, fusion, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]``: the final-normed hidden state of every new token."""
        hidden_states = self.embed_tokens(batch.input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            hidden_states, residual = layer(batch.positions, hidden_states, residual, batch, kv_cache)
        assert residual is not None
        return self.layers[-1].comm.prepare_final_norm(hidden_states, residual, self.norm)


class LlamaForCausalLM(nn.Module):
    """``forward(batch, kv_cache) ->`` the logits of each sequence's last new token, as
    `ShardedLogits` (this rank's vocabulary slice and the greedy tokens; ``.gather()``: fp32
    ``[B, vocab]``). ``fusion``: the model's fused all-reduce op, shared by every layer's
    communicator (the engine builds it before the model)."""

    def __init__(self, config: ModelConfig, fusion: AllReduceFusion, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model = LlamaModel(config, fusion, dtype, self.device)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied=tied, dtype=dtype, device=self.device)

    @property
    def num_kv_heads_local(self) -> int:
        return self.model.layers[0].self_attn.qkv_proj.num_kv_heads

    def allocate_kv_cache(self, num_slots: int) -> KVCache:
        """A KV cache of ``num_slots`` token slots for this rank's KV heads."""
        return KVCache.allocate(num_slots, self.config.num_hidden_layers, self.num_kv_heads_local,
                                self.config.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> ShardedLogits:
        hidden_states = self.model(batch, kv_cache)
        last = hidden_states if batch.is_decode else hidden_states[batch.last_token_indices()]  # decode: one token each
        return self.lm_head(last)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) HF-named tensors, each rank taking its shard. Skips rotary
        ``inv_freq`` buffers, and ``lm_head.weight`` when the embeddings are tied. Raises
        ValueError naming the tensor for an unexpected or repeated name, a shape mismatch, or
        (after all tensors) any expected tensor that never came."""
        expected = hf_weight_shapes(self.config)
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in expected:
                raise ValueError(f"unexpected tensor {name!r} in the checkpoint: {self.config.architecture} has no such weight")
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {expected[name]}")
            param_name, shard_id = _param_name(name)
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            seen.add(name)
        missing = [n for n in expected if n not in seen]
        if missing:
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint is missing {len(missing)} tensor(s): {shown}")
