"""gpt-oss's experts in Triton grouped-GEMM launches, with weights in bf16 or kept in MXFP4
(weight-only: the 4-bit codes and their scales are dequantized in registers, the dots run on the
activations' dtype). The math is layers/moe/gpt_oss_moe.py's (`GptOssExperts.forward_torch`,
the reference), rows grouped by expert as in layers/moe/kernels/triton_fused_moe.py:

    launch 1  gate = x[t] @ W_gate[e]^T + b_gate[e], up likewise          two fp32 accumulators,
              act[r] = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)     each rounded to the
              with g = clamp(gate, max=L)                                  dtype, act rounded once
    launch 2  p[s, slot] = act[r] @ W_down[e]^T over split s's K range     fp32, to a scratch row;
              (+ b_down[e] in split 0 on rank 0)                           S splits of the K range
    launch 3  out[t] = sum_j w[t, j] * round(p[0, t*k+j] + ... + p[S-1, t*k+j])
                                                                           fp32 in a fixed order,
                                                                           rounded once
                                                                           (triton_topk_combine.py:
                                                                           at TP1 inside the next
                                                                           norm's launch)

(round: to the activations' dtype, as the reference rounds each expert's output). The split count
S (``split_k_down``) is part of the tiles, so it depends on the shapes only. A configuration with
``gemv`` (MXFP4 at decode sizes, `experts_block_config`) runs launches 1 and 2 as matrix-vector
products by slot instead (layers/moe/kernels/triton_mxfp4_gemv.py: no grouping by expert) and
shares launch 3 with S = 1; one with ``tensor_cores`` runs them on tensor cores with the MXFP4
decoded into the MMA's registers (layers/moe/kernels/gluon_mxfp4_experts.py), also with S = 1.

Two orientations of the dots (`Mxfp4MoEConfig.swap`): ``x @ W^T`` (the weight tile the right
operand; rows of tokens are the MMA's M side, at least 16 rows of which one is real at one token)
or ``(W @ x^T)^T`` (the dequantized weight tile the left operand, which Hopper's MMAs take from
registers, and the few token rows the N side, ``block_m`` as small as 1: Triton pads to the MMA's
8). Either way every output element is one fp32 accumulator over its K range in a fixed order.

MXFP4 in registers, two decoders (`Mxfp4MoEConfig.word_decode`), both exact, each weight the
dot's operand in the activations' dtype: layers/moe/kernels/mxfp4_decode.py (a byte decoder, two
dots per K-tile over the even and odd columns; a 32-bit-word decoder, eight dots over the residues
of k mod 8, the activations loaded at the matching stride). Weight bytes read per expert: half a
byte per weight and a byte per 32, about 3.8x fewer than bf16.
bf16-form weights load as ``[BLOCK_N, BLOCK_K]`` tiles contiguous along k, one dot per K-tile.

Deterministic run to run (fixed tiles and splits per shape, each partial sum in one program in
a fixed order, the splits and the combine summed in a fixed order, no atomics). The default tiles
follow the rows per expert, K steps and decoder included, so the default mode is not
batch-invariant; batch-invariant mode pins what orders an output element's sums
(`mxfp4_moe_config.experts_block_config`).

Why our own kernel and not FlashInfer's ``cutlass_fused_moe`` (bf16 activations x MXFP4
weights, ``use_w4_group_scaling``): flashinfer 0.7.2 has it for sm90 (its JIT module
``fused_moe_90``: TensorRT-LLM's MoE GEMMs with a bf16 x fp4 instantiation among some thirty
hand-written sources and the CUTLASS instantiations it generates), but it is a JIT build that the
GPU bundle's trimmed flashinfer (comm, norm, quant) does not ship, so every fresh machine would
first compile it for many minutes; how fast it runs at these shapes is left to be measured. These
launches depend on triton only.

Nothing is read back to the host and every size is a static bound (layers/moe/align.py): the
launches can be captured in a CUDA graph.
"""
from __future__ import annotations

import logging
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from arfusion.layers import batch_invariant
from arfusion.layers.moe.align import ExpertBlocks, align_by_expert
from arfusion.layers.moe.kernels.mxfp4_decode import (byte_halves, expert_weight_operands, fp16_half, load_words,
                                                      word_pairs)
from arfusion.layers.moe.kernels.mxfp4_moe_config import (TENSOR_CORE_MIN_SLOTS, Mxfp4MoEConfig, check_config,
                                                             experts_block_config, tensor_core_config)
from arfusion.layers.moe.kernels.triton_align import MAX_SLOTS as ALIGN_KERNEL_MAX_SLOTS
from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
from arfusion.layers.moe.kernels.triton_clamped_swiglu import clamped_swiglu
from arfusion.layers.moe.kernels.triton_mxfp4_gemv import gemv_partials
from arfusion.layers.moe.kernels.triton_topk_combine import TopKCombine, combine


@triton.jit
def _load_x(rows_base, rows_valid, k, k_size, SWAP: tl.constexpr):
    """The activations ``x[rows, k]`` for column indices ``k`` (1-D), rows at ``rows_base``
    (pointers, 1-D), invalid rows and k >= k_size as zeros: ``[K, M]`` when SWAP, else ``[M, K]``."""
    if SWAP:
        tile = tl.load(rows_base[None, :] + k[:, None], mask=rows_valid[None, :] & (k < k_size)[:, None], other=0.0)
    else:
        tile = tl.load(rows_base[:, None] + k[None, :], mask=rows_valid[:, None] & (k < k_size)[None, :], other=0.0)
    return tile


@triton.jit
def _mma(w_nk, xk, acc, SWAP: tl.constexpr):
    """``acc + x @ w_nk^T`` for ``w_nk [N, K]`` (any float dtype) and ``xk`` from `_load_x`: SWAP
    ``acc [N, M] + w_nk @ xk`` (xk ``[K, M]``), else ``acc [M, N] + xk @ w_nk^T`` (xk ``[M, K]``).
    The dot in x's dtype (fp32 at IEEE precision), fp32 accumulation."""
    if xk.dtype == tl.float32:
        if SWAP:
            acc = tl.dot(w_nk.to(tl.float32), xk, acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, tl.trans(w_nk).to(tl.float32), acc, input_precision="ieee")
    else:
        if SWAP:
            acc = tl.dot(w_nk.to(xk.dtype), xk, acc)
        else:
            acc = tl.dot(xk, tl.trans(w_nk).to(xk.dtype), acc)
    return acc


@triton.jit
def _accumulate(x_base, x_valid, w_ptr, scales_ptr, rows, up_rows, row_mask, k0, k_size, stride_wn, stride_sn, acc,
                acc_up, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, WORD: tl.constexpr, SWAP: tl.constexpr,
                PAIR: tl.constexpr):
    """``(acc, acc_up)`` plus one K-tile (columns k0 .. k0 + BLOCK_K - 1) of ``x @ W[rows]^T``
    (transposed when SWAP) and, when PAIR, of ``x @ W[up_rows]^T`` into ``acc_up`` on the same
    activation loads (else acc_up is returned as given): ``x_base`` pointers at the token rows'
    starts, ``x_valid`` which are real; ``w_ptr``, ``scales_ptr`` at one expert (bytes for
    MXFP4); rows int64. MXFP4 by the byte decoder (two dots) or the word decoder (eight),
    layers/moe/kernels/mxfp4_decode.py; bf16 form one dot on the ``[BLOCK_N, BLOCK_K]`` tile."""
    if MXFP4:
        if WORD:
            kw = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            k_words = (k_size // 32) * 4
            words, factor = load_words(w_ptr, scales_ptr, rows, row_mask, kw, k_words, stride_wn, stride_sn)
            if PAIR:
                words_up, factor_up = load_words(w_ptr, scales_ptr, up_rows, row_mask, kw, k_words, stride_wn,
                                                 stride_sn)
            for q in tl.static_range(4):
                pairs = word_pairs(words, q)
                if PAIR:
                    pairs_up = word_pairs(words_up, q)
                for high in tl.static_range(2):
                    xk = _load_x(x_base, x_valid, 8 * kw + q + 4 * high, k_size, SWAP)
                    acc = _mma(fp16_half(pairs, high) * factor, xk, acc, SWAP)
                    if PAIR:
                        acc_up = _mma(fp16_half(pairs_up, high) * factor_up, xk, acc_up, SWAP)
        else:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            even, odd = byte_halves(w_ptr, scales_ptr, rows, row_mask, k0 // 2, k_size, stride_wn, stride_sn, BLOCK_K)
            if PAIR:
                even_up, odd_up = byte_halves(w_ptr, scales_ptr, up_rows, row_mask, k0 // 2, k_size, stride_wn,
                                              stride_sn, BLOCK_K)
            xk = _load_x(x_base, x_valid, 2 * kb, k_size, SWAP)
            acc = _mma(even, xk, acc, SWAP)
            if PAIR:
                acc_up = _mma(even_up, xk, acc_up, SWAP)
            xk = _load_x(x_base, x_valid, 2 * kb + 1, k_size, SWAP)
            acc = _mma(odd, xk, acc, SWAP)
            if PAIR:
                acc_up = _mma(odd_up, xk, acc_up, SWAP)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (k < k_size)[None, :]
        xk = _load_x(x_base, x_valid, k, k_size, SWAP)
        acc = _mma(tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=mask, other=0.0), xk, acc, SWAP)
        if PAIR:
            acc_up = _mma(tl.load(w_ptr + up_rows[:, None] * stride_wn + k[None, :], mask=mask, other=0.0), xk, acc_up,
                          SWAP)
    return acc, acc_up


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scales_ptr, bias_ptr, act_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr,
                    num_slots, hidden, inter, alpha, limit, stride_x, stride_we, stride_wn, stride_se, stride_sn,
                    stride_be, stride_act,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MXFP4: tl.constexpr, WORD: tl.constexpr, SWAP: tl.constexpr):
    """Launch 1 (module docstring): the activations ``act [rows, I]`` by sorted row."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    block = pid // num_n
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    x_base = x_ptr + (slots // TOPK).to(tl.int64) * stride_x
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    w_expert, s_expert = w_ptr + expert * stride_we, scales_ptr + expert * stride_se
    bias_expert = bias_ptr + expert * stride_be
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    gate_rows = offs_n.to(tl.int64)
    up_rows = gate_rows + inter
    if SWAP:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc_gate)
    for k0 in range(0, hidden, BLOCK_K):
        acc_gate, acc_up = _accumulate(x_base, valid, w_expert, s_expert, gate_rows, up_rows, n_mask, k0, hidden,
                                       stride_wn, stride_sn, acc_gate, acc_up, BLOCK_K, MXFP4, WORD, SWAP, True)
    dot_ty = act_ptr.dtype.element_ty
    gate_b = tl.load(bias_expert + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    up_b = tl.load(bias_expert + inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if SWAP:
        gate_b, up_b = gate_b[:, None], up_b[:, None]
        act_ptrs = act_ptr + offs_m[None, :].to(tl.int64) * stride_act + offs_n[:, None]
        store_mask = n_mask[:, None]
    else:
        gate_b, up_b = gate_b[None, :], up_b[None, :]
        act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :]
        store_mask = n_mask[None, :]
    gate = (acc_gate + gate_b).to(dot_ty).to(tl.float32)
    up = (acc_up + up_b).to(dot_ty).to(tl.float32)
    act = clamped_swiglu(gate, up, alpha, limit)
    tl.store(act_ptrs, act.to(dot_ty), mask=store_mask)


@triton.jit
def _down_kernel(act_ptr, w_ptr, scales_ptr, bias_ptr, partial_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr,
                 num_slots, hidden, inter, stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                 stride_split, stride_slot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 MXFP4: tl.constexpr, WORD: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Launch 2 (module docstring): ``act`` is the activations ``[rows, I]`` by sorted row;
    program ``pid`` sums split ``pid % SPLIT_K`` of the K range into ``partial[split, slot]``."""
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    num_n = tl.cdiv(hidden, BLOCK_N)
    block = tile // num_n
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    act_base = act_ptr + offs_m.to(tl.int64) * stride_act
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    w_expert, s_expert = w_ptr + expert * stride_we, scales_ptr + expert * stride_se
    offs_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    rows = offs_n.to(tl.int64)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(inter, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, inter), BLOCK_K):
        acc, _ = _accumulate(act_base, valid, w_expert, s_expert, rows, rows, n_mask, k0, inter, stride_wn, stride_sn,
                             acc, acc, BLOCK_K, MXFP4, WORD, SWAP, False)
    slots64 = slots.to(tl.int64)
    if HAS_BIAS:  # split 0 adds it
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        bias = tl.where(split == 0, bias, 0.0)
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if SWAP:
        acc += bias[:, None]
        ptrs = partial_ptr + split * stride_split + slots64[None, :] * stride_slot + offs_n[:, None]
        mask = valid[None, :] & n_mask[:, None]
    else:
        acc += bias[None, :]
        ptrs = partial_ptr + split * stride_split + slots64[:, None] * stride_slot + offs_n[None, :]
        mask = valid[:, None] & n_mask[None, :]
    tl.store(ptrs, acc, mask=mask)


logger = logging.getLogger(__name__)
_REFUSALS_LOGGED: set[str] = set()  # the tensor-core launches' refusals logged so far (each once a process)


def default_config(experts, num_slots: int, dtype: torch.dtype) -> Mxfp4MoEConfig:
    """The launches' tiles and variant for ``num_slots`` slots of activations of ``dtype`` when the
    caller gives none. MXFP4 weights take the tensor-core launches (`tensor_core_config`) from
    `TENSOR_CORE_MIN_SLOTS` slots, and at every batch in batch-invariant mode (the
    launches are batch-invariant by construction) or for experts marked ``tensor_cores``, wherever
    `tensor_core_refusal` allows (experts marked ``tensor_cores`` take them regardless, and a
    refusal is then an error; otherwise each refusal's reason is logged once, as a warning); else
    `experts_block_config` (batch-invariant mode's when it is on).
    Measured in docs/results.md (gpt-oss)."""
    deterministic = batch_invariant.enabled()
    if experts.mxfp4 and (experts.tensor_cores or deterministic or num_slots >= TENSOR_CORE_MIN_SLOTS):
        tensor = tensor_core_config(num_slots, experts.num_experts, experts.hidden_size, experts.local, deterministic)
        if experts.tensor_cores:
            return tensor
        refusal = _tensor_core_refusal(dtype, experts, tensor)
        if refusal is None:
            return tensor
        if refusal not in _REFUSALS_LOGGED:
            _REFUSALS_LOGGED.add(refusal)
            logger.warning("MXFP4 experts: the tensor-core launches refused (%s); the slower launches of "
                           "experts_block_config run instead", refusal)
    return experts_block_config(num_slots, experts.num_experts, experts.mxfp4, deterministic)


def grouping_block_m(experts, num_slots: int, dtype: torch.dtype) -> Optional[int]:
    """The rows per block that `default_config`'s launches group ``num_slots`` slots into, or None
    for the matrix-vector launches (no grouping): what a routing that groups the slots itself
    needs to know (`layers.moe.router.TopKRouter.route`)."""
    cfg = default_config(experts, num_slots, dtype)
    return None if cfg.gemv else cfg.block_m


def _tensor_core_refusal(dtype: torch.dtype, experts, cfg: Mxfp4MoEConfig) -> Optional[str]:
    """`gluon_mxfp4_experts.tensor_core_refusal` (imported on first use: Gluon loads with it)."""
    from arfusion.layers.moe.kernels.gluon_mxfp4_experts import tensor_core_refusal

    return tensor_core_refusal(dtype, experts, cfg)


def gpt_oss_experts_triton(x: torch.Tensor, experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           config: Optional[Mxfp4MoEConfig] = None, blocks: Optional[ExpertBlocks] = None,
                           unformed: bool = False) -> Union[torch.Tensor, TopKCombine]:
    """``x [T, H]`` (fp32 / fp16 / bf16, last dim contiguous), routing ``[T, k]`` -> this rank's
    partial output, a new ``[T, H]`` of x's dtype (module docstring), with the weights of
    ``experts`` (a `layers.moe.gpt_oss_moe.GptOssExperts`, bf16 or MXFP4). ``config``: tiles and
    variant (`default_config` by default; limits in `Mxfp4MoEConfig`, checked). ``blocks``: the
    slots already grouped by expert (by the routing launch) in the config's ``block_m`` rows, used
    by the launches that group them instead of grouping them again (ValueError for another
    ``block_m``); None: they group them themselves. ``unformed``: launch 3 is left to the norm
    after the layer, the output returned as a `TopKCombine` (layers/moe/kernels/triton_topk_combine.py)."""
    tokens, top_k = topk_ids.shape
    hidden = experts.hidden_size
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, {hidden}] with a contiguous last dimension, got {tuple(x.shape)}")
    if topk_weights.shape != topk_ids.shape or tokens != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[T, k], T = {x.shape[0]}")
    if tokens == 0:
        return x.new_empty(0, hidden)
    cfg = config or default_config(experts, tokens * top_k, x.dtype)
    check_config(cfg, experts.mxfp4)
    if blocks is not None and not cfg.gemv and blocks.block_m != cfg.block_m:
        raise ValueError(f"the slots were grouped in blocks of {blocks.block_m} rows, the launches take {cfg.block_m}")
    if cfg.gemv:
        partial = gemv_partials(x, experts, topk_ids, cfg)
    else:
        if blocks is None:
            blocks = _expert_blocks(topk_ids, experts.num_experts, cfg.block_m)
        grouped = _tensor_core_partials if cfg.tensor_cores else _grouped_partials
        partial = grouped(x, experts, topk_ids, blocks, cfg)
    if unformed:
        return TopKCombine(partial, topk_weights, x.dtype)
    return combine(partial, topk_weights, x.dtype)


def _tensor_core_partials(x: torch.Tensor, experts, topk_ids: torch.Tensor, blocks: ExpertBlocks,
                          cfg: Mxfp4MoEConfig) -> torch.Tensor:
    """Launches 1 and 2 on tensor cores (layers/moe/kernels/gluon_mxfp4_experts.py) over ``blocks``:
    fp32 ``[1, T * k, H]``; ValueError naming what they cannot take."""
    from arfusion.layers.moe.kernels.gluon_mxfp4_experts import tensor_core_partials

    refusal = _tensor_core_refusal(x.dtype, experts, cfg)
    if refusal is not None:
        raise ValueError(f"Mxfp4MoEConfig.tensor_cores: {refusal}")
    return tensor_core_partials(x, experts, topk_ids, blocks, cfg)


def _expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The slots grouped by expert in blocks of ``block_m`` rows (layers/moe/align.py): the
    Triton alignment launch up to its slot bound, the torch ops past it."""
    align = align_by_expert_triton if topk_ids.numel() <= ALIGN_KERNEL_MAX_SLOTS else align_by_expert
    return align(topk_ids, num_experts, block_m)


def _grouped_partials(x: torch.Tensor, experts, topk_ids: torch.Tensor, blocks: ExpertBlocks,
                      cfg: Mxfp4MoEConfig) -> torch.Tensor:
    """Launches 1 and 2 (module docstring) on the rows of ``blocks`` (grouped by expert): fp32
    ``[S, T * k, H]``, each slot's expert output by K split of the down projection, before the
    combine."""
    tokens, top_k = topk_ids.shape
    hidden, inter = experts.hidden_size, experts.local
    num_slots = tokens * top_k
    w13, s13, w2, s2 = expert_weight_operands(experts, word_reads=cfg.word_decode)
    w13_strides, s13_strides = (w13.stride(0), w13.stride(1)), (s13.stride(0), s13.stride(1))
    w2_strides, s2_strides = (w2.stride(0), w2.stride(1)), (s2.stride(0), s2.stride(1))
    variant = dict(MXFP4=experts.mxfp4, WORD=cfg.word_decode, SWAP=cfg.swap)
    act = x.new_empty(blocks.sorted_slots.shape[0], inter)
    _gate_up_kernel[(blocks.max_blocks * triton.cdiv(inter, cfg.block_n_gate_up),)](
        x, w13, s13, experts.w13_bias, act, blocks.sorted_slots, blocks.block_expert, blocks.num_rows,
        num_slots, hidden, inter, experts.alpha, experts.limit, x.stride(0), *w13_strides, *s13_strides,
        experts.w13_bias.stride(0), act.stride(0),
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **variant)
    partial = torch.empty(cfg.split_k_down, num_slots, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(blocks.max_blocks * triton.cdiv(hidden, cfg.block_n_down) * cfg.split_k_down,)](
        act, w2, s2, experts.w2_bias, partial, blocks.sorted_slots, blocks.block_expert, blocks.num_rows,
        num_slots, hidden, inter, act.stride(0), *w2_strides, *s2_strides, experts.w2_bias.stride(0),
        partial.stride(0), partial.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down, SPLIT_K=cfg.split_k_down,
        HAS_BIAS=experts.tp_rank == 0,
        num_warps=cfg.num_warps_down or cfg.num_warps, num_stages=cfg.num_stages_down or cfg.num_stages, **variant)
    return partial
