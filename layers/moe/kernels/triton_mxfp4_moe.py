"""gpt-oss's experts in two Triton grouped-GEMM launches, with weights in bf16 or kept in MXFP4
(weight-only: the 4-bit codes and their scales are dequantized in registers, the dots run on the
activations' dtype). The math is layers/moe/gpt_oss_moe.py's (`GptOssExperts.forward_torch`,
the reference), rows grouped by expert as in layers/moe/kernels/triton_fused_moe.py:

    launch 1  gate = x[t] @ W_gate[e]^T + b_gate[e], up likewise          two fp32 accumulators,
              act[r] = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)     each rounded to the
              with g = clamp(gate, max=L)                                  dtype, act rounded once
    launch 2  p[s] = w[s] * (act[r] @ W_down[e]^T (+ b_down[e] on rank 0)) fp32, to a scratch row
              per slot s = t * k + j
    combine   out[t] = sum_j p[t * k + j]                                  fp32 in slot order (one
              torch reduction over [T, k, H]), rounded once: deterministic

MXFP4 in registers: a K-tile of BLOCK_K (a multiple of 32) weights of output row n reads the
bytes ``blocks[e, n, k / 32, (k % 32) / 2]`` and the scales ``scales[e, n, k / 32]``; code =
the low nibble for even k, the high one for odd k; E2M1 by arithmetic (sign bit 3, exponent
bits 2..1, mantissa bit 0: e = 0 gives m / 2, else (1 + m / 2) * 2^(e - 1)), times
2^(scale - 127), in fp32, then cast to the activations' dtype for the dot. Weight bytes read
per expert: half a byte per weight and a byte per 32, about 3.8x fewer than bf16.

Why our own kernel and not FlashInfer's ``cutlass_fused_moe`` (bf16 activations x MXFP4
weights): it is a JIT-built CUTLASS module that the GPU bundle's trimmed flashinfer (comm, norm,
quant) does not ship, so every fresh machine would first build it for minutes; whether 0.7.2
runs it on sm90 at these shapes is left to be measured. These launches depend on triton only.

Nothing is read back to the host and every size is a static bound (layers/moe/align.py): the
launches can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from layers.moe.align import ExpertBlocks, align_by_expert
from layers.moe.kernels.triton_align import MAX_SLOTS as ALIGN_KERNEL_MAX_SLOTS
from layers.moe.kernels.triton_align import align_by_expert_triton
from layers.moe.kernels.triton_fused_moe import MoEBlockConfig, default_block_config


@triton.jit
def _weight_tile(w_ptr, scales_ptr, expert, rows, offs_k, k0, row_mask, k_limit, stride_we, stride_wn,
                 stride_se, stride_sn, MXFP4: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile of weight rows ``rows`` (output features), columns
    k0 + offs_k, in fp32: loaded (bf16 weights) or dequantized from MXFP4 (module docstring)."""
    k = k0 + offs_k
    mask = (k < k_limit)[:, None] & row_mask[None, :]
    if MXFP4:
        byte = tl.load(w_ptr + expert * stride_we + rows[None, :].to(tl.int64) * stride_wn + (k // 2)[:, None],
                       mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
        value = tl.where(code >= 8, -magnitude, magnitude)
        scale = tl.load(scales_ptr + expert * stride_se + rows[None, :].to(tl.int64) * stride_sn + (k // 32)[:, None],
                        mask=mask, other=127)
        return value * tl.exp2(scale.to(tl.float32) - 127.0)
    return tl.load(w_ptr + expert * stride_we + rows[None, :].to(tl.int64) * stride_wn + k[:, None], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scales_ptr, bias_ptr, act_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr,
                    num_slots, hidden, inter, alpha, limit, stride_x, stride_we, stride_wn, stride_se, stride_sn,
                    stride_be, stride_act,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MXFP4: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    block = pid // num_n
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    tokens = (slots // TOPK).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dot_ty = act_ptr.dtype.element_ty
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(x_ptr + tokens[:, None] * stride_x + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & (k0 + offs_k < hidden)[None, :], other=0.0)
        gate_w = _weight_tile(w_ptr, scales_ptr, expert, offs_n, offs_k, k0, n_mask, hidden, stride_we, stride_wn,
                              stride_se, stride_sn, MXFP4)
        up_w = _weight_tile(w_ptr, scales_ptr, expert, inter + offs_n, offs_k, k0, n_mask, hidden, stride_we,
                            stride_wn, stride_se, stride_sn, MXFP4)
        if dot_ty == tl.float32:
            acc_gate = tl.dot(a, gate_w, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up_w, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, gate_w.to(dot_ty), acc_gate)
            acc_up = tl.dot(a, up_w.to(dot_ty), acc_up)
    gate_b = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    up_b = tl.load(bias_ptr + expert * stride_be + inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    gate = (acc_gate + gate_b[None, :]).to(dot_ty).to(tl.float32)
    up = (acc_up + up_b[None, :]).to(dot_ty).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :], act.to(dot_ty),
             mask=n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, scales_ptr, bias_ptr, scratch_ptr, topk_weights_ptr, sorted_slots_ptr,
                 block_expert_ptr, num_rows_ptr, num_slots, hidden, inter, stride_act, stride_we, stride_wn,
                 stride_se, stride_sn, stride_be, stride_scratch,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(hidden, BLOCK_N)
    block = pid // num_n
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dot_ty = act_ptr.dtype.element_ty
    for k0 in range(0, inter, BLOCK_K):
        a = tl.load(act_ptr + offs_m[:, None].to(tl.int64) * stride_act + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & (k0 + offs_k < inter)[None, :], other=0.0)
        w = _weight_tile(w_ptr, scales_ptr, expert, offs_n, offs_k, k0, n_mask, inter, stride_we, stride_wn,
                         stride_se, stride_sn, MXFP4)
        if dot_ty == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(dot_ty), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dot_ty).to(tl.float32)  # the expert's output in the dtype, as the reference rounds it
    slots64 = slots.to(tl.int64)
    routing = tl.load(topk_weights_ptr + slots64, mask=valid, other=0.0)
    tl.store(scratch_ptr + slots64[:, None] * stride_scratch + offs_n[None, :], y * routing[:, None],
             mask=valid[:, None] & n_mask[None, :])


def gpt_oss_experts_triton(x: torch.Tensor, experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           config: Optional[MoEBlockConfig] = None) -> torch.Tensor:
    """``x [T, H]`` (fp32 / fp16 / bf16, last dim contiguous), routing ``[T, k]`` -> this rank's
    partial output, a new ``[T, H]`` of x's dtype (module docstring), with the weights of
    ``experts`` (a `layers.moe.gpt_oss_moe.GptOssExperts`, bf16 or MXFP4). ``config``: tiles
    (`triton_fused_moe.default_block_config` by default; block_k a multiple of 32)."""
    tokens, top_k = topk_ids.shape
    hidden, inter = experts.hidden_size, experts.local
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, {hidden}] with a contiguous last dimension, got {tuple(x.shape)}")
    if topk_weights.shape != topk_ids.shape or tokens != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[T, k], T = {x.shape[0]}")
    if tokens == 0:
        return x.new_empty(0, hidden)
    num_slots, num_experts = tokens * top_k, experts.num_experts
    cfg = config or default_block_config(num_slots, num_experts)
    if experts.mxfp4 and (cfg.block_k_gate_up % 32 or cfg.block_k_down % 32):
        raise ValueError(f"MXFP4 tiles need block_k multiples of 32, got {cfg.block_k_gate_up}, {cfg.block_k_down}")
    align = align_by_expert_triton if num_slots <= ALIGN_KERNEL_MAX_SLOTS else align_by_expert
    blocks: ExpertBlocks = align(topk_ids, num_experts, cfg.block_m)
    if experts.mxfp4:
        w13, s13, w2, s2 = experts.w13_blocks, experts.w13_scales, experts.w2_blocks, experts.w2_scales
        # a row's bytes are contiguous ([..., K/32, 16] flattened): stride over rows, bytes at k / 2
        w13_strides, s13_strides = (w13.stride(0), w13.stride(1)), (s13.stride(0), s13.stride(1))
        w2_strides, s2_strides = (w2.stride(0), w2.stride(1)), (s2.stride(0), s2.stride(1))
    else:
        w13, w2 = experts.w13_weight, experts.w2_weight
        s13, s2 = w13, w2  # unused
        w13_strides = s13_strides = (w13.stride(0), w13.stride(1))
        w2_strides = s2_strides = (w2.stride(0), w2.stride(1))
    act = x.new_empty(blocks.sorted_slots.shape[0], inter)
    _gate_up_kernel[(blocks.max_blocks * triton.cdiv(inter, cfg.block_n_gate_up),)](
        x, w13, s13, experts.w13_bias, act, blocks.sorted_slots, blocks.block_expert, blocks.num_rows,
        num_slots, hidden, inter, experts.alpha, experts.limit, x.stride(0), *w13_strides, *s13_strides,
        experts.w13_bias.stride(0), act.stride(0),
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
        MXFP4=experts.mxfp4, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    scratch = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.to(torch.float32).contiguous()
    _down_kernel[(blocks.max_blocks * triton.cdiv(hidden, cfg.block_n_down),)](
        act, w2, s2, experts.w2_bias, scratch, weights, blocks.sorted_slots, blocks.block_expert, blocks.num_rows,
        num_slots, hidden, inter, act.stride(0), *w2_strides, *s2_strides, experts.w2_bias.stride(0),
        scratch.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down, MXFP4=experts.mxfp4,
        HAS_BIAS=experts.tp_rank == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return scratch.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
