"""The routing of a MoE layer in Triton: router logits, softmax, top-k, renormalisation and, for
decode-sized batches, the grouping of slots by expert for the grouped GEMM, in one launch. The
math and its reference are layers/moe/router.py's (`router_logits_torch`, `select_experts`):

    logits[t, e] = sum_c h[t, c] * W[e, c]    tensor-core products of the model's dtype, fp32
                                              accumulation over BLOCK_K-wide steps in a fixed
                                              order; kept in fp32 (fp32 inputs: IEEE fp32 dots)
    p[t]         = softmax(logits[t])         fp32
    ids[t, j]    = k rounds of: the largest logit not yet taken, the lowest expert index among
                   equal ones (a max, then a min over the experts that reach it): no sort
    w[t, j]      = p[t, ids[t, j]], divided by sum_j w[t, j] when renormalising

One launch (`route_triton` up to FUSED_MAX_TOKENS tokens and FUSED_MAX_SLOTS slots): a grid of
(16 tokens x 16 experts) programs, each writing its tile of logits to an fp32 buffer and then
incrementing an arrival counter (release/acquire at GPU scope, after a CTA barrier). The program
that arrives last reads every logit back (past L1), selects every token's experts, writes
``weights`` / ``ids``, groups the slots by expert (`triton_align.align_slots` over the ids it
just wrote, after a CTA barrier) and sets the counter back to zero for the next call: routing and
alignment cost one launch per layer. Larger batches take two launches (the logits over the same
grid, then the selection over blocks of tokens) and fused_moe's own alignment.

Every tile size is fixed (never chosen by the token count), so a token's logits, weights and ids
are the same bits whatever batch it is in and whichever path runs.

Why our own kernel: flashinfer 0.7.2's routing (``trtllm_gen_routing``, the routing inside
``trtllm_bf16_moe``, ``alphamoe_fused_router``) belongs to its trtllm-gen / AlphaMoE fused-MoE
modules, which target Blackwell (sm100 / sm103) and are absent from the GPU bundle (a JIT build of
minutes); triton's wheel ships no routing op (its ``triton_kernels`` package is not part of it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from layers.moe.align import ExpertBlocks, max_padded_rows
from layers.moe.kernels.triton_align import MAX_SLOTS as FUSED_MAX_SLOTS
from layers.moe.kernels.triton_align import align_slots, align_tiles

FUSED_MAX_TOKENS = 256  # the last program selects every token alone: its time grows with tokens x experts
BLOCK_T, BLOCK_E, BLOCK_K = 16, 16, 128  # the logits tile of one program (tl.dot needs >= 16 each way)
SELECT_ELEMENTS = 4096  # tokens x next_power_of_2(E) logits per selection step (32 registers per thread)


@triton.jit
def _select_rows(logits_ptr, weights_ptr, ids_ptr, t0, tokens, num_experts, TOPK: tl.constexpr,
                 K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, SELECT_T: tl.constexpr,
                 E_POW2: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """Softmax, top-k and renormalisation (module docstring) of tokens t0..t0+SELECT_T-1."""
    offs_t = t0 + tl.arange(0, SELECT_T)
    experts = tl.arange(0, E_POW2)
    t_mask = offs_t < tokens
    e_mask = experts < num_experts
    logits = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * num_experts + experts[None, :],
                     mask=t_mask[:, None] & e_mask[None, :], other=0.0, cache_modifier=".cg")
    logits = tl.where(e_mask[None, :], logits, float("-inf"))
    shifted = logits - tl.max(logits, axis=1)[:, None]
    if LIBDEVICE_EXP:
        e = libdevice.exp(shifted)
    else:
        e = tl.exp(shifted)
    probs = tl.div_rn(e, tl.sum(e, axis=1)[:, None])
    kk = tl.arange(0, K_POW2)
    sel_w = tl.zeros([SELECT_T, K_POW2], dtype=tl.float32)
    sel_id = tl.zeros([SELECT_T, K_POW2], dtype=tl.int32)
    open_ = e_mask[None, :] & (logits == logits)  # not taken yet (a NaN logit is never taken)
    for j in tl.static_range(TOPK):
        best = tl.max(tl.where(open_, logits, float("-inf")), axis=1)
        idx = tl.min(tl.where(open_ & (logits == best[:, None]), experts[None, :], E_POW2), axis=1)
        hit = experts[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        sel_w = tl.where(kk[None, :] == j, w[:, None], sel_w)
        sel_id = tl.where(kk[None, :] == j, idx[:, None], sel_id)
        open_ = open_ & ~hit
    if RENORMALIZE:
        sel_w = tl.div_rn(sel_w, tl.sum(sel_w, axis=1)[:, None])
    out_mask = t_mask[:, None] & (kk[None, :] < TOPK)
    out = offs_t[:, None].to(tl.int64) * TOPK + kk[None, :]
    tl.store(weights_ptr + out, sel_w, mask=out_mask)
    tl.store(ids_ptr + out, sel_id, mask=out_mask)


@triton.jit
def _route_kernel(h_ptr, w_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, sorted_slots_ptr, block_expert_ptr,
                  num_rows_ptr, tokens, hidden, num_experts, stride_h, stride_w, max_rows, max_blocks,
                  TOPK: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SELECT_T: tl.constexpr, E_POW2: tl.constexpr,
                  FUSED: tl.constexpr, ALIGN: tl.constexpr, ALIGN_BLOCK_M: tl.constexpr, ALIGN_CHUNK: tl.constexpr,
                  FP32_DOT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    pid = tl.program_id(0)
    num_e = tl.cdiv(num_experts, BLOCK_E)
    offs_t = (pid // num_e) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = (pid % num_e) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < tokens
    e_mask = offs_e < num_experts
    h_ptrs = h_ptr + offs_t[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(h_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & e_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(logits_ptr + offs_t[:, None].to(tl.int64) * num_experts + offs_e[None, :], acc,
             mask=t_mask[:, None] & e_mask[None, :])
    if FUSED:
        tl.debug_barrier()  # every thread's logits are written before the counter announces them
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.debug_barrier()  # the acquire above orders the peers' logits before this CTA's reads
            for t0 in range(0, tokens, SELECT_T):
                _select_rows(logits_ptr, weights_ptr, ids_ptr, t0, tokens, num_experts, TOPK, K_POW2,
                             RENORMALIZE, SELECT_T, E_POW2, LIBDEVICE_EXP)
            if ALIGN:
                tl.debug_barrier()  # every id is written before the grouping reads them
                align_slots(ids_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, tokens * TOPK, num_experts,
                            max_rows, max_blocks, ALIGN_BLOCK_M, E_POW2, ALIGN_CHUNK)
            tl.store(counter_ptr, 0)  # every program has arrived: zero for the next launch


@triton.jit
def _select_kernel(logits_ptr, weights_ptr, ids_ptr, tokens, num_experts, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                   RENORMALIZE: tl.constexpr, SELECT_T: tl.constexpr, E_POW2: tl.constexpr,
                   LIBDEVICE_EXP: tl.constexpr):
    _select_rows(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * SELECT_T, tokens, num_experts, TOPK, K_POW2,
                 RENORMALIZE, SELECT_T, E_POW2, LIBDEVICE_EXP)


def _check_inputs(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, counter: torch.Tensor) -> None:
    if hidden_states.dim() != 2 or weight.dim() != 2 or hidden_states.shape[1] != weight.shape[1]:
        raise ValueError(f"routing needs h [T, hidden] and a gate weight [E, hidden]; got {tuple(hidden_states.shape)} "
                         f"and {tuple(weight.shape)}")
    if not 0 < top_k <= weight.shape[0]:
        raise ValueError(f"top_k must be in 1..{weight.shape[0]} (the number of experts), got {top_k}")
    if hidden_states.dtype != weight.dtype or hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"routing needs h and the gate weight of one dtype among fp32/fp16/bf16; got "
                         f"{hidden_states.dtype} and {weight.dtype}")
    if hidden_states.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("routing needs h with a contiguous last dimension and a contiguous gate weight")
    if counter.dtype != torch.int32 or counter.numel() < 1 or counter.device != hidden_states.device:
        raise ValueError(f"the routing counter must be int32 on {hidden_states.device}, got {counter.dtype} "
                         f"on {counter.device}")


def route_triton_with_logits(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                             counter: torch.Tensor, block_m: Optional[int] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, Optional[ExpertBlocks], torch.Tensor]:
    """`route_triton` and the fp32 logits ``[T, E]`` it selected from (the module docstring's
    ``logits``, for tests against the reference)."""
    _check_inputs(hidden_states, weight, top_k, counter)
    tokens, hidden = hidden_states.shape
    num_experts = weight.shape[0]
    device = hidden_states.device
    logits = torch.empty(tokens, num_experts, dtype=torch.float32, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    if tokens == 0:
        return weights, ids, None, logits
    num_slots = tokens * top_k
    fused = tokens <= FUSED_MAX_TOKENS and num_slots <= FUSED_MAX_SLOTS
    align = fused and block_m is not None
    e_pow2, align_chunk = align_tiles(num_experts)
    select_t = max(1, SELECT_ELEMENTS // e_pow2)
    if align:
        max_rows = max_padded_rows(num_slots, num_experts, block_m)
        blocks: Optional[ExpertBlocks] = ExpertBlocks(
            torch.empty(max_rows, dtype=torch.int32, device=device),
            torch.empty(max_rows // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device), block_m)
        slot_args = (blocks.sorted_slots, blocks.block_expert, blocks.num_rows, max_rows, blocks.max_blocks)
    else:
        blocks = None
        slot_args = (ids, ids, ids, 0, 0)  # not touched without ALIGN
    interpret = triton.knobs.runtime.interpret
    # Under the interpreter every dot runs in fp32 (its dot multiplies bf16 bit patterns); products
    # of two bf16 / fp16 numbers are exact in fp32, so the math is kept.
    fp32_dot = hidden_states.dtype == torch.float32 or interpret
    grid = triton.cdiv(tokens, BLOCK_T) * triton.cdiv(num_experts, BLOCK_E)
    common = dict(TOPK=top_k, K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, SELECT_T=select_t,
                  E_POW2=e_pow2, LIBDEVICE_EXP=not interpret)
    _route_kernel[(grid,)](
        hidden_states, weight, logits, counter, weights, ids, *slot_args[:3], tokens, hidden, num_experts,
        hidden_states.stride(0), weight.stride(0), *slot_args[3:], BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K,
        FUSED=fused, ALIGN=align, ALIGN_BLOCK_M=block_m or 1, ALIGN_CHUNK=align_chunk, FP32_DOT=fp32_dot,
        num_warps=4, num_stages=3, **common)
    if not fused:
        _launch_select(logits, weights, ids, top_k, renormalize)
    return weights, ids, blocks, logits


def select_experts_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.moe.router.select_experts` of fp32 ``logits [T, E]`` in one launch (the selection
    of the module docstring, as the routing launches run it): new ``(weights fp32, ids int32)``."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _launch_select(logits, weights, ids, top_k, renormalize)
    return weights, ids


def _launch_select(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, top_k: int,
                   renormalize: bool) -> None:
    tokens, num_experts = logits.shape
    e_pow2 = triton.next_power_of_2(num_experts)
    select_t = max(1, SELECT_ELEMENTS // e_pow2)
    _select_kernel[(triton.cdiv(tokens, select_t),)](
        logits, weights, ids, tokens, num_experts, TOPK=top_k, K_POW2=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, SELECT_T=select_t, E_POW2=e_pow2, LIBDEVICE_EXP=not triton.knobs.runtime.interpret,
        num_warps=4)


def route_triton(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                 counter: torch.Tensor, block_m: Optional[int] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[ExpertBlocks]]:
    """``h [T, hidden]``, gate ``weight [E, hidden]`` (h's dtype) -> new ``(weights fp32 [T, k],
    ids int32 [T, k], blocks)`` by the module docstring; ``blocks``: the slots grouped by expert
    in ``block_m``-row blocks (equal to `layers.moe.align.align_by_expert`'s) when ``block_m`` is
    given and the batch takes the one-launch path, else None. ``counter``: int32, zero on entry,
    zero again once the launch ends (the caller owns it; one routing at a time per counter). No
    host synchronisation; capturable in a CUDA graph."""
    weights, ids, blocks, _ = route_triton_with_logits(hidden_states, weight, top_k, renormalize, counter, block_m)
    return weights, ids, blocks
