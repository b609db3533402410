"""A tiny random gpt-oss built with transformers (``GptOssForCausalLM``) and saved as the two
checkpoint forms our loader reads: bf16 safetensors (transformers' own ``save_pretrained``) and
MXFP4 experts (our quantizer, the rest bf16, a ``quantization_config`` of mxfp4, tensors named as
the published checkpoints). The transformers model returned holds exactly the weights both files
dequantize to (bf16-rounded, experts MXFP4-rounded), in fp32: the reference of the model tests.

Shapes: hidden 64, 4 layers (sliding, full, sliding, full), 4 query heads of 16 and 2 KV heads,
sliding window 4, 8 experts of intermediate 64 (two groups of 32 per TP2 rank; another size
can be asked for), top 4, vocab 300. Every weight is random, the sinks and all biases non-zero, and the experts' weights large
enough that the clamped SwiGLU's limits are reached.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from arfusion.layers.moe.mxfp4 import quantize_mxfp4, dequantize_mxfp4

HF_CONFIG = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=64, num_local_experts=8, num_experts_per_tok=4, vocab_size=300, sliding_window=4,
                 max_position_embeddings=131072, rms_norm_eps=1e-5)
SEED = 11


def _randomize(model: torch.nn.Module) -> None:
    """Every parameter random (seeded): norms around 1, sinks and biases non-zero, the experts'
    gate/up with a spread that reaches the SwiGLU's clamps."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(0.6 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.08 * noise)


def _round_experts_mxfp4(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize every expert weight (out-by-in) and write its dequantized value back into the
    model; returns name -> (blocks, scales) under the checkpoint's names."""
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))  # [E, out, in] -> per row of in
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
                packed[name] = (blocks, scales)
    return packed


def build_checkpoints(root: Path, intermediate_size: int = HF_CONFIG["intermediate_size"]
                      ) -> tuple[torch.nn.Module, Path, Path]:
    """(the fp32 transformers reference, the bf16 directory, the MXFP4 directory) of the tiny
    model with experts of ``intermediate_size``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**{**HF_CONFIG, "intermediate_size": intermediate_size})
    model = GptOssForCausalLM(config).eval()
    _randomize(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    packed = _round_experts_mxfp4(model)
    bf16_dir, mxfp4_dir = root / "gpt-oss-bf16", root / "gpt-oss-mxfp4"
    model.to(torch.bfloat16).save_pretrained(bf16_dir)
    model.float()
    state = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters() if name not in packed}
    for name, (blocks, scales) in packed.items():
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    mxfp4_dir.mkdir()
    save_file(state, str(mxfp4_dir / "model.safetensors"))
    hf = json.loads((bf16_dir / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(hf))
    return model, bf16_dir, mxfp4_dir
