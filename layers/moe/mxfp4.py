"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints store their experts.

A row of K weights is cut into groups of 32. Group g holds one shared scale, an E8M0 byte
``scales[g]`` (the power of two 2^(scales[g] - 127)), and 32 E2M1 codes packed two per byte in
``blocks[g, 0..15]``: value 2i is the byte's low nibble, value 2i + 1 its high nibble. A code c
(sign bit 3, exponent bits 2..1, mantissa bit 0) means

    E2M1[c] = +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7], negative when c & 8

    w[32 g + j] = E2M1[code j of group g] * 2^(scales[g] - 127)

so ``blocks [..., K/32, 16]`` uint8 and ``scales [..., K/32]`` uint8 dequantize to ``[..., K]``:
half a byte per weight plus one byte per 32, 4.25 bits. `dequantize_mxfp4` is exact in bf16 and
fp32 (every value is a 2-bit mantissa times a power of two, within range for the scales
checkpoints hold). `quantize_mxfp4` is ours, for tests and dummy weights: the group's scale is
the smallest power of two that brings its largest magnitude to at most 6 (E2M1's largest), and
each value rounds to the nearest E2M1 value (ties to the smaller magnitude).
"""
from __future__ import annotations

import torch

GROUP = 32  # weights per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8, ``scales [..., G]`` uint8 -> a new ``[..., G * 32]`` of
    ``dtype`` (module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"need uint8 blocks [..., G, {GROUP // 2}] and uint8 scales [..., G], got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]: low nibble first
    values = torch.ldexp(table[codes], (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., K]`` (K a multiple of 32, finite) -> ``(blocks [..., K/32, 16], scales
    [..., K/32])`` uint8 (module docstring); an all-zero group gets the scale 2^-127."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"the last dimension ({weight.shape[-1]}) must be a multiple of {GROUP}")
    groups = weight.float().unflatten(-1, (-1, GROUP))  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(-SCALE_BIAS, posinf=SCALE_BIAS, neginf=-SCALE_BIAS)
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)  # |scaled| <= 6
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # the first of equals: the smaller
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
