"""gpt-oss's experts for a few tokens as matrix-vector products (`Mxfp4MoEConfig.gemv`), weights
in bf16 or kept in MXFP4: one program per (slot, BLOCK_N output rows), the products on CUDA cores
in fp32, no tensor cores, no grouping of the rows by expert. The math is the grouped launches'
(layers/moe/kernels/triton_mxfp4_moe.py, whose combine launch follows these two):

    launch 1  slot s = t * k + j, e = topk_ids[t, j]:                    fp32 products summed per
              gate = round(x[t] . W_gate[e, n] + b_gate[e, n]), up alike  K step elementwise, then
              act[s, n] = round((clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)),   over the step's
              g = clamp(gate, max=L)                                      columns (tl.sum)
    launch 2  p[s, n] = act[s] . W_down[e, n] (+ b_down[e, n] on rank 0)  fp32, to a scratch row

(round: to the activations' dtype).

Why a separate path: at decode sizes (a handful of slots) the grouped launches give each expert
a 16-row token block of which one row is real, and their tensor-core dots need the decoded
weight tile moved into the MMA's operand layout (through shared memory) every K step, which keeps
them at a small share of the memory bandwidth. Here a weight is decoded in registers and used
where it lands: each program streams its rows' bytes in 16-byte vectors (32-bit words of eight
MXFP4 codes, the word decoder of layers/moe/kernels/mxfp4_decode.py) and multiplies them by the
slot's activations. A weight is read once per slot that uses its expert, so the grouped launches
take over when slots outnumber what this path serves (`mxfp4_moe_config.GEMV_MAX_SLOTS`).

MXFP4: the products ``code * 2^-14 * x[k]`` of a scale group's 32 columns are summed in fp32
(each word's eight, then the group's four words), then scaled by the group's
``2^(scale - 127) * 2^14`` (a power of two: exact) and added to the group's accumulator: one
scale load and multiply per 32 weights.

Deterministic run to run (each output one program, fixed order); a slot's result depends on its
own token and routing only. Launch sizes depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels import pdl
from arfusion.layers.moe.kernels.mxfp4_decode import (expert_weight_operands, fp16_halves, load_words_only,
                                                      scale_factor, word_pairs)
from arfusion.layers.moe.kernels.triton_clamped_swiglu import clamped_swiglu


@triton.jit
def _pair_products(part, words, pair: tl.constexpr, x_low, x_high, ASM: tl.constexpr):
    """``part`` plus code pair ``pair`` of each word times its activations: the pair's low code
    (residue ``pair`` of the word's eight) times ``x_low``, its high code (residue ``pair + 4``)
    times ``x_high``; ``part [N, words]`` fp32, ``x_* [words]``."""
    low, high = fp16_halves(word_pairs(words, pair), ASM)
    return part + low * x_low[None, :] + high * x_high[None, :]


@triton.jit
def _load_step(w_ptr, scales_ptr, rows, row_mask, k0, k_size, stride_wn, stride_sn, BLOCK_K: tl.constexpr,
               MXFP4: tl.constexpr):
    """The weights of one K step (columns k0 .. k0 + BLOCK_K - 1 of ``W[rows]``, zeros where masked):
    MXFP4 ``(words [N, BLOCK_K / 8] uint32, scale factors [N, BLOCK_K / 32])``, bf16 ``(w [N,
    BLOCK_K], w)``."""
    if MXFP4:
        kw = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words, _ = load_words_only(w_ptr, rows, row_mask, kw, (k_size // 32) * 4, stride_wn)
        groups = tl.multiple_of(k0 // 32, BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        factor = scale_factor(scales_ptr, rows[:, None] * stride_sn, groups[None, :],
                              row_mask[:, None] & (groups < k_size // 32)[None, :])
        return words, factor
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=row_mask[:, None] & (k < k_size)[None, :],
                    other=0.0)
        return w, w


@triton.jit
def _apply_step(x_row, words, factor, k0, k_size, acc, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                ASM: tl.constexpr):
    """``acc`` plus one K step of ``W[rows, k] * x[k]`` from the step's weights (`_load_step`):
    MXFP4 ``acc [N, BLOCK_K / 32]`` by scale group (module docstring), bf16 form ``acc [N,
    BLOCK_K]`` by column (``words`` the weights); fp32, masked columns add zeros."""
    if MXFP4:
        kw = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        part = tl.zeros([words.shape[0], BLOCK_K // 8], dtype=tl.float32)
        k8 = 8 * kw[:, None] + tl.arange(0, 8)[None, :]
        x8 = tl.load(x_row + k8, mask=k8 < k_size, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x8, [BLOCK_K // 8, 2, 2, 2]))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        part = _pair_products(part, words, 0, x0, x4, ASM)
        part = _pair_products(part, words, 1, x1, x5, ASM)
        part = _pair_products(part, words, 2, x2, x6, ASM)
        part = _pair_products(part, words, 3, x3, x7, ASM)
        acc += tl.sum(tl.reshape(part, [words.shape[0], BLOCK_K // 32, 4]), axis=2) * factor
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        acc += words.to(tl.float32) * tl.load(x_row + k, mask=k < k_size, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _step(x_row, w_ptr, scales_ptr, rows, row_mask, k0, k_size, stride_wn, stride_sn, acc,
          BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, ASM: tl.constexpr):
    """``acc`` plus one K step (columns k0 .. k0 + BLOCK_K - 1) of ``W[rows, k] * x[k]``
    (`_load_step`, then `_apply_step`)."""
    words, factor = _load_step(w_ptr, scales_ptr, rows, row_mask, k0, k_size, stride_wn, stride_sn, BLOCK_K, MXFP4)
    return _apply_step(x_row, words, factor, k0, k_size, acc, BLOCK_K, MXFP4, ASM)


@triton.jit
def _gemv_kernel(x_ptr, ids_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, k_size, n_size, alpha, limit, stride_x,
                 stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
                 X_ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                 ASM: tl.constexpr, GATE_UP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
                 EARLY_WEIGHTS: tl.constexpr):
    """Program (slot, column tile): GATE_UP, launch 1 (rows n and n_size + n of W; ``out`` the
    activations ``[slots, n_size]``, x's dtype); else launch 2 (``out`` fp32 ``[slots,
    n_size]``, the bias when HAS_BIAS). The slot's input row is ``x[slot // X_ROW_DIV]``. With
    USE_PDL it waits for the previous kernel first (the weights it reads depend on the routing,
    layers/kernels/pdl.py), or, with EARLY_WEIGHTS (launch 2 only), after loading the slot's
    expert id and its first K step of weights (`Mxfp4MoEConfig.early_weights`)."""
    if USE_PDL and not EARLY_WEIGHTS:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // X_ROW_DIV).to(tl.int64) * stride_x
    w_e, s_e, b_e = w_ptr + expert * stride_we, scales_ptr + expert * stride_se, bias_ptr + expert * stride_be
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    rows = offs_n.to(tl.int64)
    width: tl.constexpr = BLOCK_K // 32 if MXFP4 else BLOCK_K
    acc = tl.zeros([BLOCK_N, width], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, width], dtype=tl.float32)
    if GATE_UP:
        for k0 in range(0, k_size, BLOCK_K):
            acc = _step(x_row, w_e, s_e, rows, n_mask, k0, k_size, stride_wn, stride_sn, acc, BLOCK_K, MXFP4, ASM)
            acc_up = _step(x_row, w_e, s_e, rows + n_size, n_mask, k0, k_size, stride_wn, stride_sn, acc_up,
                           BLOCK_K, MXFP4, ASM)
    else:
        first = tl.full((), 0, tl.int32)  # a tensor: the steps' alignment hints take no constant
        words, factor = _load_step(w_e, s_e, rows, n_mask, first, k_size, stride_wn, stride_sn, BLOCK_K, MXFP4)
        if USE_PDL and EARLY_WEIGHTS:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = _apply_step(x_row, words, factor, first, k_size, acc, BLOCK_K, MXFP4, ASM)
        for k0 in range(BLOCK_K, k_size, BLOCK_K):
            acc = _step(x_row, w_e, s_e, rows, n_mask, k0, k_size, stride_wn, stride_sn, acc, BLOCK_K, MXFP4, ASM)
    total = tl.sum(acc, axis=1)
    out_row = out_ptr + slot.to(tl.int64) * stride_out + offs_n
    if GATE_UP:
        dtype = out_ptr.dtype.element_ty
        gate = (total + tl.load(b_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        up = tl.sum(acc_up, axis=1) + tl.load(b_e + n_size + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_row, clamped_swiglu(gate, up.to(dtype).to(tl.float32), alpha, limit).to(dtype), mask=n_mask)
    else:
        if HAS_BIAS:
            total += tl.load(b_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_row, total, mask=n_mask)


def gemv_partials(x: torch.Tensor, experts, topk_ids: torch.Tensor, config) -> torch.Tensor:
    """``x [T, H]``, ``topk_ids [T, k]`` -> fp32 ``[1, T * k, H]``: each slot's expert output before
    the combine (module docstring: launches 1 and 2), with the weights of ``experts`` (a
    `layers.moe.gpt_oss_moe.GptOssExperts`) and the tiles of ``config`` (an `Mxfp4MoEConfig`
    with ``gemv``: ``block_n_*`` rows per program, ``block_k_*`` columns per K step,
    ``num_warps``). The caller has checked x, the routing and the config."""
    tokens, top_k = topk_ids.shape
    hidden, inter, slots = experts.hidden_size, experts.local, tokens * top_k
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    w13, s13, w2, s2 = expert_weight_operands(experts, word_reads=True)
    act = x.new_empty(slots, inter)
    use_pdl = pdl.enabled()
    asm = not triton.knobs.runtime.interpret
    _gemv_kernel[(slots, triton.cdiv(inter, config.block_n_gate_up))](
        x, ids, w13, s13, experts.w13_bias, act, hidden, inter, experts.alpha, experts.limit, x.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), experts.w13_bias.stride(0), act.stride(0),
        X_ROW_DIV=top_k, BLOCK_N=config.block_n_gate_up, BLOCK_K=config.block_k_gate_up, MXFP4=experts.mxfp4, ASM=asm,
        GATE_UP=True, HAS_BIAS=True, USE_PDL=use_pdl, EARLY_WEIGHTS=False, num_warps=config.num_warps,
        launch_pdl=use_pdl)
    partial = torch.empty(1, slots, hidden, dtype=torch.float32, device=x.device)
    _gemv_kernel[(slots, triton.cdiv(hidden, config.block_n_down))](
        act, ids, w2, s2, experts.w2_bias, partial, inter, hidden, experts.alpha, experts.limit, act.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), experts.w2_bias.stride(0), partial.stride(1),
        X_ROW_DIV=1, BLOCK_N=config.block_n_down, BLOCK_K=config.block_k_down, MXFP4=experts.mxfp4, ASM=asm,
        GATE_UP=False, HAS_BIAS=experts.tp_rank == 0, USE_PDL=use_pdl, EARLY_WEIGHTS=config.early_weights,
        num_warps=config.num_warps_down or config.num_warps, launch_pdl=use_pdl)
    return partial
