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

MXFP4 in registers: a K-tile of BLOCK_K (a multiple of 32) columns of BLOCK_N output rows reads
each row's ``BLOCK_K / 2`` bytes ``blocks[e, n, k / 32, (k % 32) / 2]`` as one tile contiguous
along k (coalesced, every byte once) and the scales ``scales[e, n, k / 32]`` beside them; the
low nibbles are the even-k weights, the high nibbles the odd-k ones, so the activations' even
and odd columns go into two dots per K-tile. E2M1 by bit operations, no exp2: code c (sign bit
3, exponent bits 2..1, mantissa bit 0) placed as ``(c & 7) << 9 | (c & 8) << 12`` is the fp16
E2M1[c] * 2^-14 (e = 0 lands on fp16's subnormals: m / 2 * 2^-14, exact), and the fp32 whose
bits are ``(scale + 14) << 23`` is 2^(scale - 127) * 2^14; their product (fp32) is the weight,
exact, then cast to the activations' dtype for the dot. Scale bytes up to 240 (2^113), so all
real ones; scale 0 (2^-127) gives subnormal fp32 weights, as the reference does. Weight bytes read per expert: half a byte per
weight and a byte per 32, about 3.8x fewer than bf16. bf16-form weights load as ``[BLOCK_N,
BLOCK_K]`` tiles contiguous along k, one dot per K-tile.

Deterministic run to run (fixed tiles per shape, each output element summed in one program in
a fixed order, the combine a fixed torch reduction, no atomics); not batch-invariant (the tiles
follow the rows per expert, as the README's deterministic section says of the MoE kernels).

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

from arfusion.layers.moe.align import ExpertBlocks, align_by_expert
from arfusion.layers.moe.kernels.triton_align import MAX_SLOTS as ALIGN_KERNEL_MAX_SLOTS
from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
from arfusion.layers.moe.kernels.triton_fused_moe import MoEBlockConfig


def experts_block_config(num_slots: int, num_experts: int) -> MoEBlockConfig:
    """Tiles by the mean rows per expert (``num_slots / num_experts``). Decode-sized groups (at
    most 16): 16-row blocks and 32-column tiles, so that even one token's 4 experts give
    4 * 2880 / 32 = 360 programs streaming weights over 132 SMs; larger groups taller blocks,
    64-column tiles and 8 warps (with 4, gate/up at 32 x 64 x 128 needs 224 registers a thread). block_k 128: 64 bytes of each
    MXFP4 row per step. Register counts checked by compiling for sm90; speeds not yet measured
    on a GPU (benchmarks/kernels/bench_mxfp4_moe.py)."""
    rows_per_expert = num_slots / num_experts
    if rows_per_expert <= 16:
        return MoEBlockConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                              num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoEBlockConfig(block_m=32, block_n_gate_up=64, block_k_gate_up=128, block_n_down=64, block_k_down=128,
                              num_warps=8, num_stages=3)
    return MoEBlockConfig(block_m=64, block_n_gate_up=64, block_k_gate_up=128, block_n_down=64, block_k_down=128,
                          num_warps=8, num_stages=3)


@triton.jit
def _mxfp4_halves(w_ptr, scales_ptr, rows, row_mask, kb0, half_k, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
                  BLOCK_KH: tl.constexpr):
    """The even-k and odd-k weights of output rows ``rows`` (int64, ``BLOCK_N`` of them) over the
    bytes kb0 .. kb0 + BLOCK_KH - 1 of each row (k = 2 * byte, 2 * byte + 1): two ``[BLOCK_N,
    BLOCK_KH]`` fp32 tiles, dequantized as the module docstring says. The bytes load contiguous
    along k; each scale once (``[BLOCK_N, BLOCK_KH / 16]``), broadcast over its 16 bytes."""
    kb = kb0 + tl.arange(0, BLOCK_KH)
    mask = row_mask[:, None] & (kb < half_k)[None, :]
    byte = tl.load(w_ptr + rows[:, None] * stride_wn + kb[None, :], mask=mask, other=0).to(tl.uint16)
    groups = kb0 // 16 + tl.arange(0, BLOCK_KH // 16)
    scale = tl.load(scales_ptr + rows[:, None] * stride_sn + groups[None, :],
                    mask=row_mask[:, None] & (groups < half_k // 16)[None, :], other=0).to(tl.int32)
    factor = ((scale + 14) << 23).to(tl.float32, bitcast=True)  # 2^(scale - 127) * 2^14
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], [BLOCK_N, BLOCK_KH // 16, 16]), [BLOCK_N, BLOCK_KH])
    even = (((byte & 7) << 9) | ((byte & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    odd = (((byte & 0x70) << 5) | ((byte & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return even.to(tl.float32) * factor, odd.to(tl.float32) * factor


@triton.jit
def _dot_nk(a, w_nk, acc):
    """``acc + a @ w_nk^T`` (``a [M, K]`` of the activations' dtype, ``w_nk [N, K]``): the dot in
    a's dtype (fp32 at IEEE precision), fp32 accumulation."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, tl.trans(w_nk).to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w_nk).to(a.dtype), acc)
    return acc


@triton.jit
def _load_act(a_base, a_valid, k0, k_size, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """The activations of one K-tile, rows at ``a_base`` (pointers ``[BLOCK_M, 1]``), invalid rows
    and k >= k_size as zeros. MXFP4: its even and odd columns (``[BLOCK_M, BLOCK_K / 2]`` each,
    matching the low and high nibbles); bf16 form: the whole tile, twice."""
    if MXFP4:
        k_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        mask = a_valid[:, None] & (k_even < k_size)[None, :]
        first = tl.load(a_base + k_even[None, :], mask=mask, other=0.0)
        second = tl.load(a_base + (k_even + 1)[None, :], mask=mask, other=0.0)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        first = tl.load(a_base + k[None, :], mask=a_valid[:, None] & (k < k_size)[None, :], other=0.0)
        second = first
    return first, second


@triton.jit
def _accumulate(a_first, a_second, w_ptr, scales_ptr, rows, row_mask, k0, k_size, stride_wn, stride_sn, acc,
                BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """``acc`` plus one K-tile of ``A @ W[rows]^T`` (``a_first, a_second`` from `_load_act`;
    ``w_ptr``, ``scales_ptr`` at one expert; ``rows`` int64 output rows): MXFP4 two dots, even
    columns against low nibbles and odd against high; bf16 form one dot on the ``[BLOCK_N,
    BLOCK_K]`` tile, loaded contiguous along k."""
    if MXFP4:
        w_even, w_odd = _mxfp4_halves(w_ptr, scales_ptr, rows, row_mask, k0 // 2, k_size // 2, stride_wn, stride_sn,
                                      rows.shape[0], BLOCK_K // 2)
        acc = _dot_nk(a_second, w_odd, _dot_nk(a_first, w_even, acc))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=row_mask[:, None] & (k < k_size)[None, :],
                    other=0.0)
        acc = _dot_nk(a_first, w, acc)
    return acc


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
    x_base = x_ptr + (slots // TOPK).to(tl.int64)[:, None] * stride_x
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    w_expert, s_expert = w_ptr + expert * stride_we, scales_ptr + expert * stride_se
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    gate_rows = offs_n.to(tl.int64)
    up_rows = gate_rows + inter
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a_first, a_second = _load_act(x_base, valid, k0, hidden, BLOCK_K, MXFP4)
        acc_gate = _accumulate(a_first, a_second, w_expert, s_expert, gate_rows, n_mask, k0, hidden, stride_wn,
                               stride_sn, acc_gate, BLOCK_K, MXFP4)
        acc_up = _accumulate(a_first, a_second, w_expert, s_expert, up_rows, n_mask, k0, hidden, stride_wn,
                             stride_sn, acc_up, BLOCK_K, MXFP4)
    dot_ty = act_ptr.dtype.element_ty
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
    act_base = act_ptr + offs_m.to(tl.int64)[:, None] * stride_act
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    w_expert, s_expert = w_ptr + expert * stride_we, scales_ptr + expert * stride_se
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a_first, a_second = _load_act(act_base, valid, k0, inter, BLOCK_K, MXFP4)
        acc = _accumulate(a_first, a_second, w_expert, s_expert, rows, n_mask, k0, inter, stride_wn, stride_sn, acc,
                          BLOCK_K, MXFP4)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)  # the expert's output in the dtype, as the reference rounds it
    slots64 = slots.to(tl.int64)
    routing = tl.load(topk_weights_ptr + slots64, mask=valid, other=0.0)
    tl.store(scratch_ptr + slots64[:, None] * stride_scratch + offs_n[None, :], y * routing[:, None],
             mask=valid[:, None] & n_mask[None, :])


def gpt_oss_experts_triton(x: torch.Tensor, experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           config: Optional[MoEBlockConfig] = None) -> torch.Tensor:
    """``x [T, H]`` (fp32 / fp16 / bf16, last dim contiguous), routing ``[T, k]`` -> this rank's
    partial output, a new ``[T, H]`` of x's dtype (module docstring), with the weights of
    ``experts`` (a `layers.moe.gpt_oss_moe.GptOssExperts`, bf16 or MXFP4). ``config``: tiles
    (`experts_block_config` by default; block_k a multiple of 32, block_n and block_k / 2 at
    least 16)."""
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
    cfg = config or experts_block_config(num_slots, num_experts)
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
