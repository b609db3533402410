"""HF checkpoint layouts of the block decoders (engine/models/block_decoder.py): which tensors a
checkpoint holds, and which parameter (and shard) each one loads into.

    Llama          embed_tokens, per layer q/k/v/o_proj (q/k/v bias with ``attention_bias``;
                   o_proj bias for Llama only), gate/up/down_proj, the two norms; norm, lm_head
                   (unless tied)

    Qwen3          Llama's tensors + ``self_attn.{q,k}_norm.weight`` [head_dim] per layer
    Qwen3-MoE      Qwen3's attention; ``mlp.gate.weight`` [E, H] (router) and per expert e
                   ``mlp.experts.{e}.{gate,up}_proj.weight`` [I, H], ``down_proj.weight`` [H, I]
    Mixtral        Llama's attention; ``block_sparse_moe.gate.weight`` [E, H] and per expert
                   ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) [I, H], ``w2`` (down) [H, I]

Parameters: q/k/v -> ``qkv_proj`` (shard "q"/"k"/"v"), dense gate/up -> ``gate_up_proj`` (0/1),
the router -> ``mlp.gate.weight``, expert e's gate/up -> ``mlp.experts.w13_weight`` and down ->
``mlp.experts.w2_weight`` with shard ``(e, "gate" | "up" | "down")``.
"""
from __future__ import annotations

import re
from typing import Union

from arfusion.engine.models.config import ModelConfig
from arfusion.layers.linear import ShardId
from arfusion.layers.moe.experts import ExpertShardId

Shapes = dict[str, tuple[int, ...]]
ParamShard = Union[ShardId, ExpertShardId]

_ATTENTION = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_DENSE_MLP = {"gate_proj": 0, "up_proj": 1}
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_LAYER = r"^(?P<layer>model\.layers\.\d+)\."
_EXPERT = re.compile(_LAYER + r"(mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_ROUTER = re.compile(_LAYER + r"(mlp|block_sparse_moe)\.gate\.weight$")
_PROJ = re.compile(_LAYER + r"(?P<block>self_attn|mlp)\.(?P<proj>\w+)\.(?P<kind>weight|bias)$")


def o_proj_has_bias(config: ModelConfig) -> bool:
    """HF Llama and gpt-oss give o_proj a bias with ``attention_bias``; Qwen2 biases q/k/v only."""
    return config.attention_bias and config.architecture in ("LlamaForCausalLM", "GptOssForCausalLM")


def llama_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def _moe_block_name(config: ModelConfig) -> str:
    return "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"


def _expert_names(config: ModelConfig) -> tuple[str, str, str]:
    """The checkpoint's (gate, up, down) projection names of one expert."""
    return ("w1", "w3", "w2") if config.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")


def block_decoder_weight_shapes(config: ModelConfig, qk_norm: bool) -> Shapes:
    """Every tensor of a HF checkpoint (module docstring): name -> full (unsharded) shape, layer
    by layer in Llama's order, a layer's q/k norms and MoE tensors after its post-attention norm."""
    h, d = config.hidden_size, config.head_dim
    shapes: Shapes = {}
    for name, shape in llama_weight_shapes(config).items():
        if config.is_moe and ".mlp." in name:
            continue
        shapes[name] = shape
        if not name.endswith("post_attention_layernorm.weight"):
            continue
        prefix = name[: -len("post_attention_layernorm.weight")]
        if qk_norm:
            shapes.update({prefix + "self_attn.q_norm.weight": (d,), prefix + "self_attn.k_norm.weight": (d,)})
        if config.is_moe:
            block, inter = prefix + _moe_block_name(config), config.moe_intermediate_size
            gate, up, down = _expert_names(config)
            shapes[block + ".gate.weight"] = (config.num_experts, h)
            for e in range(config.num_experts):
                shapes.update({f"{block}.experts.{e}.{gate}.weight": (inter, h), f"{block}.experts.{e}.{up}.weight": (inter, h),
                               f"{block}.experts.{e}.{down}.weight": (h, inter)})
    return shapes


def block_decoder_param_target(hf_name: str) -> tuple[str, ParamShard]:
    """A checkpoint tensor's (parameter name, shard id) in a block decoder (module docstring);
    names outside the table map to themselves with no shard id."""
    m = _EXPERT.match(hf_name)
    if m and m["proj"] in _EXPERT_PARTS:
        part = _EXPERT_PARTS[m["proj"]]
        param = "w2_weight" if part == "down" else "w13_weight"
        return f"{m['layer']}.mlp.experts.{param}", (int(m["expert"]), part)
    m = _ROUTER.match(hf_name)
    if m:
        return f"{m['layer']}.mlp.gate.weight", None
    m = _PROJ.match(hf_name)
    if m and m["block"] == "self_attn" and m["proj"] in _ATTENTION:
        return f"{m['layer']}.self_attn.qkv_proj.{m['kind']}", _ATTENTION[m["proj"]]
    if m and m["block"] == "mlp" and m["proj"] in _DENSE_MLP:
        return f"{m['layer']}.mlp.gate_up_proj.{m['kind']}", _DENSE_MLP[m["proj"]]
    return hf_name, None
