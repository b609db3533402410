"""Architecture name (HF ``config.json`` ``architectures[0]``) -> model class, and the HF
checkpoint layout (tensor names and full shapes) of each."""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.engine.models.block_decoder import BlockDecoderForCausalLM
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.gpt_oss import GptOssForCausalLM
from arfusion.engine.models.llama import LlamaForCausalLM
from arfusion.engine.models.mixtral import MixtralForCausalLM
from arfusion.engine.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from arfusion.fusion import AllReduceFusion

MODEL_REGISTRY: dict[str, type[BlockDecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias: config.attention_bias
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def model_class(architecture: str) -> type[BlockDecoderForCausalLM]:
    """The class implementing ``architecture``; ValueError listing the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}") from None


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of ``config``'s architecture holds: name -> full shape."""
    return model_class(config.architecture).hf_weight_shapes(config)


def build_model(config: ModelConfig, fusion: AllReduceFusion, dtype: torch.dtype = torch.float32,
                device: Optional[torch.device] = None) -> BlockDecoderForCausalLM:
    """An unloaded model (parameters uninitialised) for this rank of the TP group, whose layers
    reduce through ``fusion``; fill it with ``load_weights``."""
    return model_class(config.architecture)(config, fusion, dtype=dtype, device=device)
