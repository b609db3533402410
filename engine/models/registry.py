"""Architecture name (HF ``config.json`` ``architectures[0]``) -> model class."""
from __future__ import annotations

from typing import Optional

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from fusion import AllReduceFusion

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias: config.attention_bias
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing ``architecture``; ValueError listing the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}") from None


def build_model(config: ModelConfig, fusion: AllReduceFusion, dtype: torch.dtype = torch.float32,
                device: Optional[torch.device] = None) -> LlamaForCausalLM:
    """An unloaded model (parameters uninitialised) for this rank of the TP group, whose layers
    reduce through ``fusion``; fill it with ``load_weights``."""
    return model_class(config.architecture)(config, fusion, dtype=dtype, device=device)
