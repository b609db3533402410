"""gpt-oss (``GptOssForCausalLM``) on the block decoder (engine/models/block_decoder.py): the
same layer, reductions and fusion points as Llama / Qwen3-MoE, with

    attention   q/k/v/o with biases; YaRN rotary (its cos/sin factor squared into the softmax
                scale); a learned sink logit per head in every softmax's denominator; a sliding
                window of ``sliding_window`` keys on the layers ``layer_types`` names
                "sliding_attention" (every other layer), full attention on the rest
    mlp         `layers.moe.gpt_oss_moe.GptOssMoeBlock`: router with bias, top-k on the logits
                then softmax over the k, experts with biases, interleaved gate/up and the
                clamped SwiGLU; this rank's partial sum (the combine inside it) is reduced with
                the residual add and the next RMSNorm, as a dense MLP's down projection

Checkpoint (per layer ``model.layers.{i}.``): ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks [heads]``, ``mlp.router.{weight [E, H], bias [E]}``, the two norms, and the
experts ``mlp.experts.*`` in one of two forms (`ModelConfig.expert_format`):

    bf16   gate_up_proj [E, H, 2I], down_proj [E, I, H] (in-by-out, transformers' parameters)
    mxfp4  gate_up_proj_blocks [E, 2I, H/32, 16], gate_up_proj_scales [E, 2I, H/32],
           down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32] (out-by-in, as published)

with ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` in both. MXFP4 experts are kept
so in memory with ``ModelConfig.keep_mxfp4``, or dequantized to the model's dtype as they load
(each blocks tensor waits for its scales).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from arfusion.engine.models.block_decoder import BlockDecoderForCausalLM
from arfusion.engine.models.checkpoint_tensors import CheckpointTensors
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.hf_layouts import ParamShard, block_decoder_param_target, llama_weight_shapes
from arfusion.engine.models.llama import LlamaAttention
from arfusion.layers.attention import Attention
from arfusion.layers.linear import check_shape
from arfusion.layers.moe.gpt_oss_moe import GptOssMoeBlock
from arfusion.layers.moe.mxfp4 import GROUP, NAN_SCALE, SCALE_BIAS, dequantize_mxfp4, scale_problem

_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<part>gate_up|down)_proj(?P<kind>_bias|_blocks|_scales)?$")


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biases by ``attention_bias``) with a sink per head and the
    layer's sliding window."""

    def make_attention(self, config: ModelConfig, layer_id: int, device: Optional[torch.device]) -> Attention:
        """Softmax scale ``head_dim ** -0.5`` times YaRN's factor; sinks loaded per rank."""
        d = config.head_dim
        attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d,
                         d ** -0.5 * self.rotary_emb.score_factor, sinks=True,
                         sliding_window=config.window_of(layer_id), device=device)
        attn.sinks.weight_loader = self._load_sinks  # type: ignore[union-attr]
        return attn

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ParamShard = None) -> None:
        """This rank's query heads of the full ``[heads]`` sinks."""
        proj = self.qkv_proj
        check_shape(loaded, (proj.total_num_heads,))
        param.data.copy_(loaded.narrow(0, proj.tp_rank * proj.num_heads, proj.num_heads))


def gpt_oss_moe(config: ModelConfig, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    return GptOssMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, config.swiglu_alpha, config.swiglu_limit, config.keep_mxfp4,
                          dtype, device, tensor_cores=config.mxfp4_tensor_cores)


def gpt_oss_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a gpt-oss checkpoint (module docstring): name -> full shape."""
    h, e, inter, heads = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in llama_weight_shapes(config).items():
        if ".mlp." in name:
            continue
        shapes[name] = shape
        if not name.endswith("post_attention_layernorm.weight"):
            continue
        p = name[: -len("post_attention_layernorm.weight")]
        shapes[p + "self_attn.sinks"] = (heads,)
        shapes.update({p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,)})
        x = p + "mlp.experts."
        if config.expert_format == "mxfp4":
            for what, out, k in (("gate_up", 2 * inter, h), ("down", h, inter)):
                shapes.update({f"{x}{what}_proj_blocks": (e, out, k // GROUP, GROUP // 2),
                               f"{x}{what}_proj_scales": (e, out, k // GROUP)})
        else:
            shapes.update({x + "gate_up_proj": (e, h, 2 * inter), x + "down_proj": (e, inter, h)})
        shapes.update({x + "gate_up_proj_bias": (e, 2 * inter), x + "down_proj_bias": (e, h)})
    return shapes


def gpt_oss_param_target(hf_name: str) -> tuple[str, ParamShard]:
    """A checkpoint tensor's (parameter, shard id): experts' tensors to ``w13_*`` / ``w2_*`` with
    the shard ids of `GptOssExperts.weight_loader` (in-by-out bf16 tensors arrive transposed,
    see `GptOssForCausalLM.load_weights`); the rest as the block decoder maps them."""
    if hf_name.endswith("self_attn.sinks"):
        return hf_name[: -len("sinks")] + "attn.sinks", None
    m = _EXPERT.match(hf_name)
    if not m:
        return block_decoder_param_target(hf_name)
    kind = m["kind"] or ""
    param = ("w13" if m["part"] == "gate_up" else "w2") + {"": "_weight", "_bias": "_bias", "_blocks": "_blocks",
                                                          "_scales": "_scales"}[kind]
    return f"{m['layer']}.mlp.experts.{param}", m["part"] + kind


class GptOssForCausalLM(BlockDecoderForCausalLM):
    attention_class = GptOssAttention
    make_mlp = staticmethod(gpt_oss_moe)
    hf_weight_shapes = staticmethod(gpt_oss_weight_shapes)
    param_target = staticmethod(gpt_oss_param_target)

    def _checked_tensors(self, weights: Iterable[tuple[str, torch.Tensor]], check: CheckpointTensors
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, each checked, in the form the parameters take: bf16 experts
        transposed to out-by-in; MXFP4 ones, unless kept, dequantized to the model's dtype once
        their blocks and scales have both come (named then as the bf16 out-by-in tensor, checked by
        `_dequantized`)."""
        waiting: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if not check.take(name, tuple(tensor.shape)):
                continue
            m = _EXPERT.match(name)
            if m and m["kind"] is None:
                yield name, tensor.transpose(1, 2)
            elif m and m["kind"] in ("_blocks", "_scales") and not self.config.keep_mxfp4:
                base = name[: -len(m["kind"])]
                other = waiting.pop(base, None)
                if other is None:
                    waiting[base] = tensor
                    continue
                blocks, scales = (tensor, other) if m["kind"] == "_blocks" else (other, tensor)
                yield base, self._dequantized(base, blocks, scales)
            else:
                yield name, tensor

    def _dequantized(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``name``'s MXFP4 ``blocks`` and ``scales`` dequantized to the model's dtype; ValueError
        naming the tensor for NaN scale bytes or weights past the dtype's range."""
        problem = scale_problem(scales, NAN_SCALE - 1)
        if problem is not None:
            raise ValueError(f"tensor {name + '_scales'!r}: {problem}")
        weights = dequantize_mxfp4(blocks, scales, self.dtype)
        overflow = int((~torch.isfinite(weights)).sum())
        if overflow:
            raise ValueError(f"tensor {name + '_scales'!r}: its scales (largest 2^{int(scales.max()) - SCALE_BIAS}) put "
                             f"{overflow} of the {weights.numel()} MXFP4 weights of {name!r} past the range of "
                             f"{str(self.dtype).removeprefix('torch.')}; load it in a wider --dtype")
        return weights
