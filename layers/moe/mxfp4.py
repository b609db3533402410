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

The scale byte 255 is E8M0's NaN. The kernels that keep the weights in MXFP4 build each scale's
power of two from its byte and so have a largest byte they decode exactly: `KEPT_MAX_SCALE`
(the CUDA-core decoders' fp32 factor ``(scale + 14) << 23``, layers/moe/kernels/mxfp4_decode.py)
and `TENSOR_CORE_MAX_SCALE` (the tensor-core decoder's bf16 factor 2^(scale - 1),
layers/moe/kernels/gluon_mxfp4_experts.py). `scale_problem` names a scale tensor that breaks
either rule, so that a checkpoint holding one is refused at load instead of served wrong.
"""
from __future__ import annotations

from typing import Optional

import torch

GROUP = 32  # weights per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
NAN_SCALE = 255  # E8M0's NaN
KEPT_MAX_SCALE = 240  # 2^113: (scale + 14) << 23 is still a finite fp32
TENSOR_CORE_MAX_SCALE = 128  # 2^1: 2^(scale - 1) is still a finite bf16


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


def scale_problem(scales: torch.Tensor, largest: int) -> Optional[str]:
    """Why the scale bytes ``scales`` (uint8) cannot be served, or None: bytes of 255 (NaN), or
    bytes above ``largest`` (the limit of the kernels that will decode them, module docstring).
    Reads two reductions back to the host."""
    top = int(scales.max()) if scales.numel() else 0
    if top == NAN_SCALE:
        return f"{int((scales == NAN_SCALE).sum())} of its {scales.numel()} scale bytes are 255, E8M0's NaN"
    if top > largest:
        return (f"its largest scale, 2^{top - SCALE_BIAS}, exceeds 2^{largest - SCALE_BIAS}, the largest the MXFP4 "
                "kernels that will run it decode exactly")
    return None


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
