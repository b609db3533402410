"""The experts of a MoE layer in two Triton grouped-GEMM launches (the GPU path of
layers/moe/experts.py; the math and its roundings are those of layers/moe/torch_experts.py).

Rows are token slots grouped by expert in blocks of BLOCK_M (layers/moe/align.py: done by the
routing launch of layers/moe/kernels/triton_router.py at decode sizes, else here, by one launch of
layers/moe/kernels/triton_align.py up to its MAX_SLOTS slots); a program owns one block of rows
(one expert) and BLOCK_N output columns:

    launch 1  act[r] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)    r: a sorted row of
              slot s = t * k + j; gate and up are two fp32 accumulators over the same x tile,
              each rounded to the dtype, silu rounded to the dtype, then the product
    launch 2  p[s] = w[s] * (act[r] @ w2[e]^T)                              fp32 accumulator,
              the routing weight applied in the epilogue, and then the combine, by ``combine``:

    "folded"   out[t] = sum_j p[t * k + j] (fp32, slot order, rounded once) inside launch 2: each
               program writes its fp32 rows p to a scratch buffer and counts, per (token, column
               block), the slots that have arrived (an atomic counter, release/acquire at GPU
               scope); the program that brings a token's count to k sums the token's k rows in
               slot order and writes ``out[t]``. No launch and no pass of its own: the rows are
               read back once, from L2 at decode sizes. The counters are zeroed by launch 1.
    "unfused"  launch 2 writes ``y[s] = act[r] @ w2[e]^T`` rounded to the dtype, and the combine
               runs afterwards in torch (`layers.moe.torch_experts.combine_topk`): the reference
               of the folded combine, one rounding more and one pass more.

The folded sum runs in a fixed order whichever program arrives last, so it is deterministic; it
differs from the unfused combine by that combine's rounding of y to the dtype (and the order of an
fp32 sum).

Why not FlashInfer's fused MoE (the library kernel one would prefer): it needs the full flashinfer
wheel and a JIT build of its CUTLASS MoE modules that takes minutes per fresh machine, and its
sm90 support for these shapes (bf16, 128 experts of 768 x 2048 split over TP ranks) is not
verified here. These two launches depend on nothing but triton.

Nothing is read back to the host and every size is a static bound (align.py): the launches can be
captured in a CUDA graph.

Batch-invariant mode (`layers.batch_invariant.enabled()`, ``--deterministic``): a token's output
bits must not depend on the other tokens in the call. What fixes an output element's sums is the
order of its k-chunks: the K loop's BLOCK_K steps, in k order, each a sequence of k16 tensor-core
MMA chunks in k order, with no split-K. The default tiles (`default_block_config`) change BLOCK_K
with the rows per expert; in this mode `block_config` takes the default's tiles for the rows
(BLOCK_M, BLOCK_N, warps, stages) and pins only the K steps to values fixed by the weight's shape
(`BATCH_INVARIANT_BLOCK_K`: 128 for gate/up, 64 for down):

    act[r, n]  = for k0 = 0, 128, 256, ... < H, in order: acc += the k16 MMA chunks of
                 x[t, k0:k0+128] and w13[e, n, k0:k0+128], in k order   (the same k chunks for
                 row r at any position of any block: no exchange between rows; padding rows
                 load zeros and are not stored)
    p[s, n]    = the same for act[r] @ w2[e]^T in steps of 64, times w[s] in fp32
    out[t, n]  = ((0 + p[tk]) + p[tk + 1]) + ... + p[tk + k - 1]   the folded combine, in slot
                 order whichever program arrives last; "unfused": `combine_topk`'s fixed tree

What still follows the rows: the M/N tiles, the warps, the grid, and with them the tensor-core
instruction family: on Hopper Triton compiles ``tl.dot`` to wgmma where BLOCK_M is a multiple of
64 with 4k warps (the default's 64-row tile, from 65 rows per expert: 2048 tokens of
Qwen3-30B-A3B) and to mma.sync below. That wgmma's and mma.sync's fp32 sums over the same k16
chunks round alike is a measured fact, not a guarantee: on 1 × H200 with triton 3.9, fused_moe
at Qwen3-30B-A3B's shapes (2048 tokens, bf16, random inputs) with these K steps gives every row
at 32-row (4 warps), 64-row (4 and 8 warps) and 128-row tiles (8 warps) the bits of 16-row tiles,
column tiles 32 / 64 and 3 stages (neither the column tile nor the stages move a k-chunk).
tests/gpu/test_moe_batch_invariant.py checks it on the GPU at hand (1 to 512 tokens against
2048: 16-, 32- and 64-row tiles, mma.sync and wgmma); tests/test_moe_batch_invariant.py checks
offline that every launch's dots run BLOCK_K steps of the pinned size in k16 chunks at every
batch size, and under the CPU interpreter the bits at one tile (the interpreter has no
tensor-core instructions, and its dot's order of sums follows the tile's shape). A
new triton or GPU must pass the GPU test again. The routing (layers/moe/kernels/triton_router.py)
has fixed tiles in both modes; its grouping takes `block_config`'s BLOCK_M (layers/moe/experts.py).
Up to 16 rows per expert (decode: 256 tokens of Qwen3-30B-A3B, 64 of Mixtral) both modes run the
same tiles; above, this mode differs from the default only in the K steps of the taller tiles.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from arfusion.layers import batch_invariant
from arfusion.layers.moe.align import ExpertBlocks, align_by_expert, max_padded_rows
from arfusion.layers.moe.kernels.triton_align import MAX_SLOTS as ALIGN_KERNEL_MAX_SLOTS
from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
from arfusion.layers.moe.kernels.triton_moe_gemv import moe_gemv
from arfusion.layers.moe.kernels.triton_moe_gemv import serves as gemv_serves
from arfusion.layers.moe.kernels.triton_topk_combine import TopKCombine
from arfusion.layers.moe.torch_experts import combine_topk

COMBINES = ("folded", "unfused")


@dataclass(frozen=True)
class MoEBlockConfig:
    """Tile sizes of the two launches (``block_n_gate_up``: columns of each of gate and up)."""

    block_m: int
    block_n_gate_up: int
    block_k_gate_up: int
    block_n_down: int
    block_k_down: int
    num_warps: int = 4
    num_stages: int = 3


def default_block_config(num_slots: int, num_experts: int) -> MoEBlockConfig:
    """Tiles by the mean number of rows per expert (``num_slots / num_experts``): decode-sized
    groups take 16-row blocks and narrow column tiles (many programs streaming expert weights),
    larger groups taller tiles (chosen by a sweep of each launch at Qwen3-30B-A3B's TP2 shards on
    an H200; the numbers are in docs/notes.md)."""
    rows_per_expert = num_slots / num_experts
    if rows_per_expert <= 16:
        return MoEBlockConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=64, block_k_down=64)
    if rows_per_expert <= 64:
        return MoEBlockConfig(block_m=32, block_n_gate_up=64, block_k_gate_up=64, block_n_down=64, block_k_down=64,
                              num_stages=4)
    return MoEBlockConfig(block_m=64, block_n_gate_up=64, block_k_gate_up=64, block_n_down=64, block_k_down=64)


# The K steps of batch-invariant mode (gate/up, down), fixed by the weight's shape (module docstring).
BATCH_INVARIANT_BLOCK_K = (128, 64)


def uses_gemv(num_slots: int, num_experts: int, combine: str = "folded") -> bool:
    """Whether `fused_moe` (without a config or blocks) runs ``num_slots`` slots over
    ``num_experts`` experts as the matrix-vector launches of layers/moe/kernels/triton_moe_gemv.py:
    where its `serves` holds, with the folded combine, outside batch-invariant mode (there a
    token's bits must not depend on how many slots share its call)."""
    return combine == "folded" and gemv_serves(num_slots, num_experts) and not batch_invariant.enabled()


def block_config(num_slots: int, num_experts: int) -> MoEBlockConfig:
    """The tiles `fused_moe` runs with: `default_block_config`, and in batch-invariant mode the
    same tiles with the K steps set to `BATCH_INVARIANT_BLOCK_K` (module docstring)."""
    config = default_block_config(num_slots, num_experts)
    if batch_invariant.enabled():
        block_k_gate_up, block_k_down = BATCH_INVARIANT_BLOCK_K
        return replace(config, block_k_gate_up=block_k_gate_up, block_k_down=block_k_down)
    return config


@triton.jit
def _gate_up_silu_kernel(x_ptr, w13_ptr, act_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, counters_ptr,
                         num_slots, hidden, inter, num_counters, stride_x, stride_we, stride_wn, stride_act,
                         TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         COUNTERS_PER_PROGRAM: tl.constexpr, FP32_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    pid = tl.program_id(0)
    if COUNTERS_PER_PROGRAM > 0:  # zero the folded combine's counters before launch 2 counts on them
        c = pid * COUNTERS_PER_PROGRAM + tl.arange(0, COUNTERS_PER_PROGRAM)
        tl.store(counters_ptr + c, tl.zeros([COUNTERS_PER_PROGRAM], dtype=tl.int32), mask=c < num_counters)
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
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if FP32_DOT:
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, gate_w.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up_w.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, gate_w, acc_gate)
            acc_up = tl.dot(a, up_w, acc_up)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(out_ty).to(tl.float32)
    act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(act_ptrs, (silu * up).to(out_ty), mask=n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, out_ptr, scratch_ptr, counters_ptr, topk_weights_ptr, sorted_slots_ptr,
                 block_expert_ptr, num_rows_ptr, num_slots, hidden, inter, stride_act, stride_we, stride_wn,
                 stride_out, stride_scratch, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FOLDED: tl.constexpr, ROWS_ONLY: tl.constexpr, FP32_DOT: tl.constexpr):
    """Launch 2 (module docstring); with FOLDED and ROWS_ONLY only the weighted fp32 rows p, to
    ``scratch``: their sum is left to the caller (`fused_moe`'s ``unformed``)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(hidden, BLOCK_N)
    block = pid // num_n
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    col_block = pid % num_n
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_act + offs_k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    slots64 = slots.to(tl.int64)
    if FOLDED:
        routing = tl.load(topk_weights_ptr + slots64, mask=valid, other=0.0)
        rows_mask = valid[:, None] & n_mask[None, :]
        tl.store(scratch_ptr + slots64[:, None] * stride_scratch + offs_n[None, :], acc * routing[:, None], mask=rows_mask)
        if not ROWS_ONLY:
            tl.debug_barrier()  # every thread's rows are written before the counters announce them
            tokens = slots64 // TOPK
            arrived = tl.atomic_add(counters_ptr + tokens * num_n + col_block, 1, mask=valid, sem="acq_rel",
                                    scope="gpu")
            last = valid & (arrived == TOPK - 1)
            tl.debug_barrier()  # the acquire above orders the peers' rows before this CTA's reads below
            last_mask = last[:, None] & n_mask[None, :]
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            token_rows = scratch_ptr + (tokens * TOPK)[:, None] * stride_scratch + offs_n[None, :]
            for j in tl.static_range(TOPK):
                total += tl.load(token_rows + j * stride_scratch, mask=last_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tokens[:, None] * stride_out + offs_n[None, :], total.to(out_ty), mask=last_mask)
    else:
        tl.store(out_ptr + slots64[:, None] * stride_out + offs_n[None, :], acc.to(out_ty),
                 mask=valid[:, None] & n_mask[None, :])


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe needs x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe needs x, w13, w2 of one dtype among fp32/fp16/bf16; got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T, k], T = {x.shape[0]}")
    if x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("fused_moe needs x with a contiguous last dimension and contiguous w13, w2")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, combine: str = "folded", config: Optional[MoEBlockConfig] = None,
              blocks: Optional[ExpertBlocks] = None, unformed: bool = False) -> Union[torch.Tensor, TopKCombine]:
    """``x [T, H]`` with routing ``topk_weights`` (fp32) / ``topk_ids`` (int) ``[T, k]`` -> a new
    ``[T, H]`` of x's dtype: ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` with this rank's
    shards ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (module docstring). ``combine``: "folded" (in
    launch 2's epilogue) or "unfused" (the torch combine after it). ``config``: tile sizes,
    `block_config` by default (a config given in batch-invariant mode is the caller's choice). ``blocks``: the slots of ``topk_ids`` already grouped by
    expert in blocks of the config's ``block_m`` (the routing kernel's, layers/moe/kernels/triton_router.py);
    grouped here when None. With neither a config nor blocks, a call that `uses_gemv` runs the
    matrix-vector launches instead (layers/moe/kernels/triton_moe_gemv.py: the same math, other
    sums). ``unformed`` (with the folded combine): the output as a `TopKCombine` of launch 2's
    weighted fp32 rows (``applied``), for the norm after the layer to form; on the grouped
    launches their sum in slot order gives the folded combine's bits, on the matrix-vector ones
    (a tensor past `triton_moe_gemv.ROWS_MAX_TOKENS` tokens) it reassociates their launch 2's sum
    over the slots (`moe_gemv`). Nothing is written in place; no host synchronisation."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if tokens == 0:
        return x.new_empty(0, hidden)
    num_slots = tokens * top_k
    if config is None and blocks is None and uses_gemv(num_slots, num_experts, combine):
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, unformed=unformed)
    cfg = config or block_config(num_slots, num_experts)
    if blocks is None:
        align = align_by_expert_triton if num_slots <= ALIGN_KERNEL_MAX_SLOTS else align_by_expert
        blocks = align(topk_ids, num_experts, cfg.block_m)
    elif blocks.block_m != cfg.block_m or blocks.sorted_slots.numel() != max_padded_rows(num_slots, num_experts,
                                                                                          cfg.block_m):
        raise ValueError(f"blocks of {blocks.block_m} rows ({blocks.sorted_slots.numel()} in all) do not fit "
                         f"{num_slots} slots at the config's block_m {cfg.block_m}")
    folded = combine == "folded"
    rows_only = folded and unformed
    # fp32 operands: IEEE fp32 products, not TF32. Under the interpreter every dot runs in fp32: its
    # dot multiplies bf16 bit patterns (it stores bf16 as uint16); bf16/fp16 products are exact in
    # fp32, so upcasting keeps the math (fp32 products, fp32 accumulation).
    fp32_dot = x.dtype == torch.float32 or triton.knobs.runtime.interpret
    act = x.new_empty(blocks.sorted_slots.shape[0], inter)
    n_down = triton.cdiv(hidden, cfg.block_n_down)
    if folded:
        scratch = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
        out = scratch if rows_only else x.new_empty(tokens, hidden)  # rows only: launch 2 writes no out
        counters = torch.empty(1 if rows_only else tokens * n_down, dtype=torch.int32, device=x.device)
    else:
        out = x.new_empty(num_slots, hidden)
        scratch, counters = out, torch.empty(1, dtype=torch.int32, device=x.device)  # unused by launch 2
    grid_gate_up = blocks.max_blocks * triton.cdiv(inter, cfg.block_n_gate_up)
    counters_per_program = 0
    if folded and not rows_only:
        counters_per_program = triton.next_power_of_2(triton.cdiv(counters.numel(), grid_gate_up))
    _gate_up_silu_kernel[(grid_gate_up,)](
        x, w13, act, blocks.sorted_slots, blocks.block_expert, blocks.num_rows, counters,
        num_slots, hidden, inter, counters.numel(), x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
        COUNTERS_PER_PROGRAM=counters_per_program, FP32_DOT=fp32_dot,
        LIBDEVICE_EXP=not triton.knobs.runtime.interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    weights = topk_weights.to(torch.float32).contiguous()
    _down_kernel[(blocks.max_blocks * n_down,)](
        act, w2, out, scratch, counters, weights, blocks.sorted_slots, blocks.block_expert, blocks.num_rows,
        num_slots, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), scratch.stride(0),
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down, FOLDED=folded,
        ROWS_ONLY=rows_only, FP32_DOT=fp32_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if rows_only:
        return TopKCombine(scratch.view(1, num_slots, hidden), weights, x.dtype, applied=True)
    if folded:
        return out
    return combine_topk(out.view(tokens, top_k, hidden), topk_weights)
