"""Seeded random weights for a `ModelConfig` (``--load-format dummy``), in HF names.

Tensor k (in `hf_weight_shapes` order) is drawn from its own generator seeded with
``seed * 1_000_003 + k``, in full (unsharded) shape, so every rank draws the same tensor and
TP1 and TPn models built from the same seed are the same model (for a given device type:
CPU and CUDA generators differ). Values:

    norm weights   1 + 0.1 * N(0, 1)          (around 1, never exactly 1)
    MXFP4 blocks   uniform bytes              (drawn as uint8: never materialized in a wider type)
    MXFP4 scales   uniform in 2^-8 .. 2^-6    (E8M0 bytes 119..121: weights of std about 0.02)
    everything else  std * N(0, 1)            (std 0.02: activations stay small and finite)
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.registry import hf_weight_shapes

DUMMY_STD = 0.02
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # gpt-oss's MXFP4 expert tensors (uint8)


def dummy_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: Optional[torch.device] = None, std: float = DUMMY_STD) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every weight of ``config``, one tensor at a time."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    for k, (name, shape) in enumerate(hf_weight_shapes(config).items()):
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + k)
        if name.endswith(MXFP4_BLOCKS):
            yield name, torch.randint(0, 256, shape, generator=generator, device=device, dtype=torch.uint8)
            continue
        if name.endswith(MXFP4_SCALES):
            yield name, torch.randint(119, 122, shape, generator=generator, device=device, dtype=torch.uint8)
            continue
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * values
        else:
            values = values * std
        yield name, values.to(dtype)
