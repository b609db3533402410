"""The decoder every model shares, with its attention and MLP blocks chosen by the architecture:
Llama / Qwen2 / Mistral (engine/models/llama.py), Qwen3 (q/k RMSNorm per head), Qwen3-MoE and
Mixtral (a sparse MoE MLP).

A layer (``h`` a `fusion.PartialSum` between the blocks and the norms):

    h, residual = input_layernorm(h, residual)           layer 0: input_layernorm(h), h; with
                                                         ``config.norm_into_qkv`` at TP1, for a
                                                         batch of at most 32 tokens that the
                                                         q/k/v launch takes, h is the norm left
                                                         pending, which the attention's
                                                         qkv_proj runs inside its matmul
                                                         (`layers.pending_norm`)
    h = PartialSum(self_attn(h))                         o_proj: reduce_results=False
    h, residual = post_attention_layernorm(h, residual)  all-reduce + add + RMSNorm; with
                                                         ``config.norm_into_route`` at TP1, in a
                                                         MoE layer, for a batch that the routing
                                                         launch's one-launch path takes, h is the
                                                         norm left pending, which the MoE block's
                                                         routing launch runs
    h = PartialSum(mlp(h))                               dense: down_proj's partial sum; MoE: the
                                                         partial sum of the combined experts; at
                                                         TP1 (``config.combine_into_norm``): the
                                                         experts' rows and weights, which the next
                                                         norm combines in its own launch
                                                         (`fusion.UnformedSum`), where the experts'
                                                         launches leave them so
and after the last layer ``norm(h, residual)``. Each norm given a `PartialSum` is one reduction
of the model's fusion op (`layers.layernorm`), by the strategy of the layer that made it, so a
MoE layer's expert output takes the same fused all-reduce + residual + RMSNorm as a dense MLP's.

A subclass of `BlockDecoderForCausalLM` names its blocks (``attention_class``, ``make_mlp``) and
its checkpoint layout (``hf_weight_shapes``, ``param_target``).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from arfusion.engine.models.checkpoint_tensors import CheckpointTensors
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.engine.models.hf_layouts import ParamShard
from arfusion.fusion import AllReduceFusion, PartialSum
from arfusion.layers.layernorm import NormInput, RMSNorm
from arfusion.layers.linear import default_weight_loader
from arfusion.layers.moe import SparseMoeBlock
from arfusion.layers.moe.gpt_oss_moe import GptOssMoeBlock
from arfusion.layers.moe.router import TopKRouter
from arfusion.layers.pending_norm import ROUTING, folds, input_norm, post_attention_norm
from arfusion.layers.sharded_logits import ShardedLogits
from arfusion.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

MlpFactory = Callable[[ModelConfig, torch.dtype, Optional[torch.device]], nn.Module]


def sparse_moe_block(config: ModelConfig, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    """The MoE MLP of a MoE ``config``: a `SparseMoeBlock` of its experts and routing."""
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, config.norm_topk_prob, dtype, device)


def norm_router(mlp: nn.Module) -> Optional[TopKRouter]:
    """The router of an MLP whose routing launch can take the post-attention norm (a
    `SparseMoeBlock`'s gate, a `GptOssMoeBlock`'s router), or None (a dense MLP)."""
    if isinstance(mlp, SparseMoeBlock):
        return mlp.gate
    if isinstance(mlp, GptOssMoeBlock):
        return mlp.router
    return None


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fusion: AllReduceFusion, self_attn: nn.Module,
                 mlp: nn.Module, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.layer_id = layer_id
        self.fusion = fusion
        self.norm_into_qkv = folds(config.norm_into_qkv, fusion.group.world_size)
        # where the post-attention norm folds into the MoE routing launch: which batches it leaves pending
        router = norm_router(mlp)
        folded = router is not None and folds(config.norm_into_route, fusion.group.world_size, ROUTING)
        self.route_refusal = router.norm_deferral_refusal if folded else None
        # at TP1 a MoE block leaves its combine to the next norm's launch (`fusion.UnformedSum`)
        self.unformed_mlp = (config.combine_into_norm and isinstance(mlp, (GptOssMoeBlock, SparseMoeBlock))
                             and fusion.group.world_size == 1)

    def forward(self, positions: torch.Tensor, hidden_states: NormInput, residual: Optional[torch.Tensor],
                batch: ForwardBatch, kv_cache: KVCache) -> tuple[NormInput, torch.Tensor]:
        """``(h, residual)`` in, ``(h, residual)`` out; h may be a `fusion.PartialSum` (module docstring)."""
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual, self.norm_into_qkv)
        hidden_states = PartialSum(pending=self.self_attn(positions, hidden_states, batch, kv_cache),
                                   layer_id=self.layer_id, op=self.fusion)
        hidden_states, residual = post_attention_norm(self.post_attention_layernorm, hidden_states, residual,
                                                      self.route_refusal)
        out = self.mlp(hidden_states, unformed=True) if self.unformed_mlp else self.mlp(hidden_states)
        return PartialSum(pending=out, layer_id=self.layer_id, op=self.fusion), residual


class BlockDecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: Iterable[BlockDecoderLayer], dtype: torch.dtype,
                 device: Optional[torch.device]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]``: the final-normed hidden state of every new token."""
        hidden_states: NormInput = self.embed_tokens(batch.input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            hidden_states, residual = layer(batch.positions, hidden_states, residual, batch, kv_cache)
        assert residual is not None
        return self.norm(hidden_states, residual)[0]


class BlockDecoderForCausalLM(nn.Module):
    """``forward(batch, kv_cache) ->`` the logits of each sequence's last new token, as
    `ShardedLogits` (``LlamaForCausalLM``'s contract). ``fusion``: the model's fused all-reduce
    op, shared by every layer. Subclasses set the class attributes below."""

    attention_class: type[nn.Module]  # (config, layer_id, dtype, device) -> the attention block of a layer
    make_mlp: MlpFactory  # (config, dtype, device) -> the MLP block of a layer
    hf_weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # every checkpoint tensor
    param_target: Callable[[str], tuple[str, ParamShard]]  # checkpoint name -> (parameter, shard id)

    def __init__(self, config: ModelConfig, fusion: AllReduceFusion, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        cls = type(self)
        layers = (
            BlockDecoderLayer(config, i, fusion, cls.attention_class(config, i, dtype, self.device),
                              cls.make_mlp(config, dtype, self.device), dtype, self.device)
            for i in range(config.num_hidden_layers)
        )
        self.model = BlockDecoderModel(config, layers, dtype, self.device)
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
        return self.last_token_logits(batch, self.hidden_states(batch, kv_cache))

    @torch.no_grad()
    def hidden_states(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]``: the final-normed hidden state of every new token (writes the KV cache)."""
        return self.model(batch, kv_cache)

    @torch.no_grad()
    def last_token_logits(self, batch: ForwardBatch, hidden_states: torch.Tensor) -> ShardedLogits:
        """Collective: the logits of each sequence's last new token, from `hidden_states`."""
        last = hidden_states if batch.is_decode else hidden_states[batch.last_token_indices()]
        return self.lm_head(last)

    def _checked_tensors(self, weights: Iterable[tuple[str, torch.Tensor]], check: CheckpointTensors
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors that ``check`` takes (it raises on an unexpected or repeated
        name), in the form the parameters' loaders take them."""
        for name, tensor in weights:
            if check.take(name, tuple(tensor.shape)):
                yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) HF-named tensors, each rank taking its shard (of every expert,
        for MoE). Skips rotary ``inv_freq`` buffers, and ``lm_head.weight`` when the embeddings
        are tied. Raises ValueError naming the tensor for an unexpected or repeated name, a shape
        mismatch, or (after all tensors) any expected tensor that never came."""
        check = CheckpointTensors(type(self).hf_weight_shapes(self.config), self.config)
        params = dict(self.named_parameters())
        for name, tensor in self._checked_tensors(weights, check):
            param_name, shard_id = type(self).param_target(name)
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
        check.finish()
