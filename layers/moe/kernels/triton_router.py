"""The routing of a MoE layer in Triton: router logits, softmax, top-k, renormalisation and, for
decode-sized batches, the grouping of slots by expert for the grouped GEMM, in one launch. The
math and its reference are layers/moe/router.py's (`router_logits_torch`, `select_experts`):

    logits[t, e] = sum over splits s (in increasing s) of sum_c h[t, c] * W[e, c] over the split's
                   SPLIT_WIDTH columns c: tensor-core products of the model's dtype, fp32
                   accumulation; kept in fp32 (fp32 inputs: IEEE fp32 dots); then + fp32(b[e]) when
                   a router bias b is given (gpt-oss), one rounding after the sum
    p[t]         = softmax(logits[t])         fp32
    ids[t, j]    = k rounds of: the largest logit not yet taken, the lowest expert index among
                   equal ones (a max, then a min over the experts that reach it): no sort
    w[t, j]      = p[t, ids[t, j]], divided by sum_j w[t, j] when renormalising

One launch (`route_triton` at ONE_LAUNCH_MAX_TOKENS tokens, a decode step at batch 1, or up to
UNGROUPED_ONE_LAUNCH_MAX_TOKENS where the slots are not grouped; any batch of up to
FUSED_MAX_SLOTS slots when the caller asks for it): a grid of
(16 tokens x 16 experts x one split of the hidden size) programs, each writing its partial logits
to an fp32 buffer and then incrementing an arrival counter (release/acquire at GPU scope, after a
CTA barrier). The program that arrives last sums the partials, selects every token's experts,
writes ``weights`` / ``ids``, groups the slots by expert for the grouped GEMM (layers/moe/align.py's
``ExpertBlocks``, from the per-expert counts of the selection and a cumulative sum of the taken
experts down the tokens: no sort) and sets the counter back to zero for the next call: routing and
alignment cost one launch per layer. Larger batches take two launches (the partials over the same
grid, then their sum and the selection by blocks of tokens) and the experts' own grouping launch
(triton_align.py), which together cost less from 2 tokens on for every router timed
(docs/results.md). Given a `RouteNorm` (``norm``), the one-launch path also runs the residual
add + RMSNorm before the routing: its programs make h from x and the residual themselves
(triton_route_norm.py).

Every tile size is fixed (never chosen by the token count), so a token's logits, weights and ids
are the same bits whatever batch it is in and whichever path runs (also what batch-invariant mode,
``--deterministic``, needs; the mode changes nothing here): the logits' dot tile (16 x 16 x 128,
4 warps: mma.sync), the split of the hidden size and the order of the partials' sum depend on
(E, hidden) only; the max and min reductions are exact in any order; the two sums (the softmax's
denominator, the renormalisation) reduce a [SELECT_T, E_POW2] and a [SELECT_T, K_POW2] tile, whose
order is fixed by the tile's layout, and compiled for sm90 by triton 3.9 both kernels give those
tiles one layout at every token count (tests/test_moe_routing_triton.py checks it offline, with
no GPU, at 1 to 512 tokens on both paths). The loops over the k rounds and
the splits are not unrolled, to keep the last program's code short: inside a decode step the
launch took about twice its time alone (measured with the rounds unrolled), which instruction
caches emptied by the kernels between two routing launches would explain (a guess, not measured).

gpt-oss (layers/moe/gpt_oss_moe.py) routes with a bias and a softmax over the k chosen logits
only: w[t, j] = exp(l_j - m) / sum over the chosen i of exp(l_i - m), m the largest chosen logit,
which is the row's max. With p = softmax(l) = exp(l - m) / Z, p_j / sum_i p_i is that same
number (Z cancels), so it is this routing with the bias and renormalisation: the same ids (both
choose by the logits; its reference's stable descending sort also takes equal logits lowest index
first) and weights that differ by fp32 rounding only: the exp of the same fp32 difference l_j - m
(libdevice's exp here, torch's there), then two divisions (by Z, and by the sum of the k
quotients) where the reference has one, and the sums in other orders. Under the interpreter
tests/test_gpt_oss_router_triton.py measured at most 1.8e-7 on weights <= 1 and bounds it at
(1e-6, 1e-6). Z is in [1, E], so dividing by it first underflows nothing but weights below
E * 1.2e-38.

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

from arfusion.layers.kernels import pdl
from arfusion.layers.moe.align import ExpertBlocks, max_padded_rows
from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm, batch_problem, inv_rms, problem, summed_rows

# The batches the one-launch path takes by default: its last program selects every token alone,
# SELECT_ELEMENTS // E_POW2 tokens a step one after another, and groups the slots with one pass down
# the tokens; with the experts' grouping launch (a program per expert), two routing launches and the
# grouping cost less from 2 tokens on at 8, 32 and 128 experts (bench_routing, docs/results.md).
ONE_LAUNCH_MAX_TOKENS = 1
# Where the slots are not grouped (the matrix-vector experts take them as they come), the one launch
# stays ahead up to 4 tokens (3-8 % a launch at qwen3-30b-a3b's and gpt-oss-20b's routers, 2-4 tokens;
# equal at 8: bench_routing --ungrouped, docs/results.md).
UNGROUPED_ONE_LAUNCH_MAX_TOKENS = 4
FUSED_MAX_SLOTS = 2048  # slots the last program groups, at most (batch 256 at top-8; the largest tested)
ONE_LAUNCH_BOUNDS = (f"at most {ONE_LAUNCH_MAX_TOKENS} token(s) and {FUSED_MAX_SLOTS} slots (tokens x top-k) by "
                     "default")  # in words, for refusals
BLOCK_T, BLOCK_E, BLOCK_K = 16, 16, 128  # the logits tile of one program (tl.dot needs >= 16 each way)
SPLIT_WIDTH = 2 * BLOCK_K  # hidden columns per program: many short programs keep many loads in flight
SELECT_ELEMENTS = 1024  # tokens x next_power_of_2(E) logits per selection step: 8 per thread at NUM_WARPS
FILL = 1024  # sentinel rows written per step
BLOCK_ELEMENTS = 8192  # blocks x next_power_of_2(E) comparisons per step of the block -> expert map
NUM_WARPS = 4  # two rows of logits per warp at 128 experts: short chains of in-warp reductions


@triton.jit
def _sum_partials(part_ptr, bias_ptr, logits_ptr, t0, tokens, num_experts, SPLIT_K: tl.constexpr,
                  SELECT_T: tl.constexpr, E_POW2: tl.constexpr, HAS_BIAS: tl.constexpr):
    """logits[t] = sum over splits s, in increasing s, of part[s, t], then + fp32(bias) when
    HAS_BIAS, for t in t0..t0+SELECT_T-1 (stored, fp32), returned with -inf in the columns past
    num_experts."""
    offs_t = t0 + tl.arange(0, SELECT_T)
    experts = tl.arange(0, E_POW2)
    mask = (offs_t < tokens)[:, None] & (experts < num_experts)[None, :]
    offs = offs_t[:, None].to(tl.int64) * num_experts + experts[None, :]
    logits = tl.zeros([SELECT_T, E_POW2], dtype=tl.float32)
    for s in range(SPLIT_K):
        logits += tl.load(part_ptr + s * tokens * num_experts + offs, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        logits += tl.load(bias_ptr + experts, mask=experts < num_experts, other=0.0).to(tl.float32)[None, :]
    tl.store(logits_ptr + offs, logits, mask=mask)
    return tl.where((experts < num_experts)[None, :], logits, float("-inf"))


@triton.jit
def _select_rows(logits, weights_ptr, ids_ptr, t0, tokens, num_experts, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                 RENORMALIZE: tl.constexpr, SELECT_T: tl.constexpr, E_POW2: tl.constexpr,
                 LIBDEVICE_EXP: tl.constexpr):
    """Softmax, top-k and renormalisation (module docstring) of the logits of tokens
    t0..t0+SELECT_T-1; returns the one-hot int32 [SELECT_T, E_POW2] of the experts taken."""
    offs_t = t0 + tl.arange(0, SELECT_T)
    experts = tl.arange(0, E_POW2)
    t_mask = offs_t < tokens
    row_max = tl.max(logits, axis=1)
    if LIBDEVICE_EXP:
        total = tl.sum(libdevice.exp(logits - row_max[:, None]), axis=1)
    else:
        total = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    kk = tl.arange(0, K_POW2)
    sel_w = tl.zeros([SELECT_T, K_POW2], dtype=tl.float32)
    sel_id = tl.zeros([SELECT_T, K_POW2], dtype=tl.int32)
    open_ = (experts < num_experts)[None, :] & (logits == logits)  # not taken yet; a NaN logit never is
    for j in range(TOPK):
        best = tl.max(tl.where(open_, logits, float("-inf")), axis=1)
        idx = tl.min(tl.where(open_ & (logits == best[:, None]), experts[None, :], E_POW2), axis=1)
        if LIBDEVICE_EXP:  # the softmax numerator of the chosen logit: the same op on the same value
            w = libdevice.exp(best - row_max)
        else:
            w = tl.exp(best - row_max)
        sel_w = tl.where(kk[None, :] == j, tl.div_rn(w, total)[:, None], sel_w)
        sel_id = tl.where(kk[None, :] == j, idx[:, None], sel_id)
        open_ = open_ & (experts[None, :] != idx[:, None])
    if RENORMALIZE:
        sel_w = tl.div_rn(sel_w, tl.sum(sel_w, axis=1)[:, None])
    out_mask = t_mask[:, None] & (kk[None, :] < TOPK)
    out = offs_t[:, None].to(tl.int64) * TOPK + kk[None, :]
    tl.store(weights_ptr + out, sel_w, mask=out_mask)
    tl.store(ids_ptr + out, sel_id, mask=out_mask)
    taken = (experts < num_experts)[None, :] & (logits == logits) & ~open_ & t_mask[:, None]
    return taken.to(tl.int32)


@triton.jit
def _group_by_expert(ids_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, counts, tokens, num_experts,
                     max_rows, max_blocks, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, SELECT_T: tl.constexpr,
                     E_POW2: tl.constexpr, FILL: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """layers/moe/align.py's grouping of the slots s = t * TOPK + j by expert, by this program,
    from ``counts[e]`` (slots per expert) and the ids in ids_ptr (written by this program): the
    rows of expert e start at start[e] = sum over e' < e of counts[e'] rounded up to BLOCK_M;
    token t's slot of expert e goes to row start[e] + (slots of e among tokens < t) (a cumulative
    sum down the tokens of the one-hot of the taken experts; a token takes an expert once)."""
    experts = tl.arange(0, E_POW2)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    real = experts < num_experts
    blocks = tl.arange(0, BLOCK_CHUNK)
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        first_rows = (b0 + blocks) * BLOCK_M
        before = tl.sum(((padded_end[None, :] <= first_rows[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b0 + blocks, tl.minimum(before, num_experts - 1), mask=b0 + blocks < max_blocks)
    fill = tl.arange(0, FILL)
    for r0 in range(0, max_rows, FILL):
        tl.store(sorted_slots_ptr + r0 + fill, tl.zeros([FILL], dtype=tl.int32) + tokens * TOPK,
                 mask=r0 + fill < max_rows)
    tl.debug_barrier()  # every sentinel (and every id) is written before the slots are placed
    lanes = tl.arange(0, SELECT_T)
    placed = padded_end - padded  # start[e], then advanced past the tokens already placed
    for t0 in range(0, tokens, SELECT_T):
        offs_t = t0 + lanes
        t_mask = offs_t < tokens
        taken = tl.zeros([SELECT_T, E_POW2], dtype=tl.int32)
        slot = tl.zeros([SELECT_T, E_POW2], dtype=tl.int32)
        for j in range(TOPK):
            ids = tl.load(ids_ptr + offs_t * TOPK + j, mask=t_mask, other=-1)
            hit = experts[None, :] == ids[:, None]
            taken += hit.to(tl.int32)
            slot = tl.where(hit, offs_t[:, None] * TOPK + j, slot)
        rows = placed[None, :] + tl.cumsum(taken, axis=0) - taken
        tl.store(sorted_slots_ptr + rows, slot, mask=taken > 0)
        placed += tl.sum(taken, axis=0)


@triton.jit
def _route_kernel(h_ptr, w_ptr, bias_ptr, part_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, sorted_slots_ptr,
                  block_expert_ptr, num_rows_ptr, tokens, hidden, num_experts, stride_h, stride_w, max_rows, max_blocks,
                  TOPK: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_WIDTH: tl.constexpr,
                  SELECT_T: tl.constexpr, E_POW2: tl.constexpr, FUSED: tl.constexpr, ALIGN: tl.constexpr,
                  ALIGN_BLOCK_M: tl.constexpr, FILL: tl.constexpr, BLOCK_CHUNK: tl.constexpr, FP32_DOT: tl.constexpr,
                  LIBDEVICE_EXP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
                  r_ptr, g_ptr, normed_ptr, sum_ptr, eps, stride_r, NORM: tl.constexpr):
    """With USE_PDL the program loads its first gate-weight tile before the wait for the previous
    kernel (layers/kernels/pdl.py), the hidden states after it (with NORM: x and the residual, and
    it writes h and the sum after it too)."""
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    num_e = tl.cdiv(num_experts, BLOCK_E)
    offs_t = (tile // num_e) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = (tile % num_e) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = split * SPLIT_WIDTH + tl.arange(0, BLOCK_K)
    t_mask = offs_t < tokens
    e_mask = offs_e < num_experts
    h_ptrs = h_ptr + offs_t[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if USE_PDL:
        b_first = tl.load(w_ptrs, mask=(offs_k < hidden)[:, None] & e_mask[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:  # h_ptr holds x: h = rms_norm(round(x + residual)) * g, this split's columns made here
        inv = inv_rms(h_ptr, r_ptr, offs_t, t_mask, hidden, eps, stride_h, stride_r, BLOCK_T, BLOCK_K)
        stored = tl.where(tile % num_e == 0, tokens, 0)  # h and the sum: stored by expert tile 0's programs
    for k0 in tl.static_range(0, SPLIT_WIDTH, BLOCK_K):
        k_mask = offs_k + k0 < hidden
        if NORM:
            mask = t_mask[:, None] & k_mask[None, :]
            s = summed_rows(h_ptr, r_ptr, offs_t, offs_k + k0, mask, stride_h, stride_r)
            g = tl.load(g_ptr + offs_k + k0, mask=k_mask, other=0.0).to(tl.float32)
            a = ((s.to(tl.float32) * inv[:, None]) * g[None, :]).to(s.dtype)
            out = offs_t[:, None].to(tl.int64) * hidden + (offs_k + k0)[None, :]
            out_mask = (offs_t < stored)[:, None] & k_mask[None, :]
            tl.store(normed_ptr + out, a, mask=out_mask)
            tl.store(sum_ptr + out, s, mask=out_mask)
        else:
            a = tl.load(h_ptrs + k0, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_PDL and k0 == 0:
            b = b_first
        else:
            b = tl.load(w_ptrs + k0, mask=k_mask[:, None] & e_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    part_offs = split * tokens * num_experts + offs_t[:, None].to(tl.int64) * num_experts + offs_e[None, :]
    tl.store(part_ptr + part_offs, acc, mask=t_mask[:, None] & e_mask[None, :])
    if FUSED:
        tl.debug_barrier()  # every thread's partial logits are written before the counter announces them
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.debug_barrier()  # the acquire above orders the peers' partials before this CTA's reads
            counts = tl.zeros([E_POW2], dtype=tl.int32)
            for t0 in range(0, tokens, SELECT_T):
                logits = _sum_partials(part_ptr, bias_ptr, logits_ptr, t0, tokens, num_experts, SPLIT_K, SELECT_T,
                                       E_POW2, HAS_BIAS)
                taken = _select_rows(logits, weights_ptr, ids_ptr, t0, tokens, num_experts, TOPK, K_POW2,
                                     RENORMALIZE, SELECT_T, E_POW2, LIBDEVICE_EXP)
                counts += tl.sum(taken, axis=0)
            if ALIGN:
                _group_by_expert(ids_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, counts, tokens,
                                 num_experts, max_rows, max_blocks, TOPK, ALIGN_BLOCK_M, SELECT_T, E_POW2, FILL,
                                 BLOCK_CHUNK)
            tl.store(counter_ptr, 0)  # every program has arrived: zero for the next launch


@triton.jit
def _select_kernel(part_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, tokens, num_experts, TOPK: tl.constexpr,
                   K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, SPLIT_K: tl.constexpr, SELECT_T: tl.constexpr,
                   E_POW2: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, HAS_BIAS: tl.constexpr):
    t0 = tl.program_id(0) * SELECT_T
    logits = _sum_partials(part_ptr, bias_ptr, logits_ptr, t0, tokens, num_experts, SPLIT_K, SELECT_T, E_POW2,
                           HAS_BIAS)
    _select_rows(logits, weights_ptr, ids_ptr, t0, tokens, num_experts, TOPK, K_POW2, RENORMALIZE, SELECT_T, E_POW2,
                 LIBDEVICE_EXP)


def _check_inputs(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, counter: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> None:
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
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous() or not bias.is_floating_point()
                             or bias.device != hidden_states.device):
        raise ValueError(f"the router bias must be a contiguous float [{weight.shape[0]}] on {hidden_states.device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")


def norm_refusal(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, top_k: int) -> Optional[str]:
    """Why a routing launch of ``top_k`` experts a token does not take the norm of ``x`` and
    ``residual`` (weight ``norm_weight``; `RouteNorm`) for this batch, or None: the batch must take
    the one-launch path by default, on CUDA fp16 / bf16 tensors that the launch accepts. The
    reason names no token count of the batch (a caller logs each reason once)."""
    if x.dim() == 2 and not takes_one_launch(x.shape[0], top_k):
        return f"the launch normalises on its one-launch path only: {ONE_LAUNCH_BOUNDS}"
    if not x.is_cuda:
        return "the activations are not on a CUDA device"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"the launch serves fp16 and bf16, not {x.dtype}"
    return batch_problem(x, residual, norm_weight)


def route_triton_with_logits(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                             counter: torch.Tensor, block_m: Optional[int] = None,
                             bias: Optional[torch.Tensor] = None, norm: Optional[RouteNorm] = None,
                             one_launch: Optional[bool] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, Optional[ExpertBlocks], torch.Tensor]:
    """`route_triton` and the fp32 logits ``[T, E]`` it selected from (the module docstring's
    ``logits``, bias included, for tests against the reference)."""
    _check_inputs(hidden_states, weight, top_k, counter, bias)
    if one_launch and hidden_states.shape[0] * top_k > FUSED_MAX_SLOTS:
        raise ValueError(f"the one-launch path groups at most {FUSED_MAX_SLOTS} slots (tokens x top-k), got "
                         f"{hidden_states.shape[0]} x {top_k}")
    tokens, hidden = hidden_states.shape
    num_experts = weight.shape[0]
    device = hidden_states.device
    logits = torch.empty(tokens, num_experts, dtype=torch.float32, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    if tokens == 0:
        return weights, ids, None, logits
    num_slots = tokens * top_k
    fused = takes_one_launch(tokens, top_k, block_m is not None) if one_launch is None else one_launch
    if norm is not None:
        found = problem(hidden_states, norm) or (
            None if fused else f"a norm runs on the one-launch path only ({ONE_LAUNCH_BOUNDS}; up to "
                               f"{UNGROUPED_ONE_LAUNCH_MAX_TOKENS} tokens where the slots are not grouped); got "
                               f"{tokens} tokens and {num_slots} slots")
        if found is not None:
            raise ValueError(found)
    align = fused and block_m is not None
    split_k = triton.cdiv(hidden, SPLIT_WIDTH)
    partials = torch.empty(split_k, tokens, num_experts, dtype=torch.float32, device=device)
    if align:
        max_rows = max_padded_rows(num_slots, num_experts, block_m)
        blocks: Optional[ExpertBlocks] = ExpertBlocks(
            torch.empty(max_rows, dtype=torch.int32, device=device),
            torch.empty(max_rows // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device), block_m)
        slot_args = (blocks.sorted_slots, blocks.block_expert, blocks.num_rows, max_rows, blocks.max_blocks)
    else:
        blocks = None
        slot_args = (ids, ids, ids, 0, 0)  # not touched without ALIGN (nor bias_ptr without a bias)
    interpret = triton.knobs.runtime.interpret
    # Under the interpreter every dot runs in fp32 (its dot multiplies bf16 bit patterns); products
    # of two bf16 / fp16 numbers are exact in fp32, so the math is kept.
    fp32_dot = hidden_states.dtype == torch.float32 or interpret
    grid = triton.cdiv(tokens, BLOCK_T) * triton.cdiv(num_experts, BLOCK_E) * split_k
    use_pdl = pdl.enabled()
    _route_kernel[(grid,)](
        hidden_states, weight, logits if bias is None else bias, partials, logits, counter, weights, ids,
        *slot_args[:3], tokens, hidden, num_experts, hidden_states.stride(0), weight.stride(0), *slot_args[3:],
        TOPK=top_k, K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, SPLIT_K=split_k,
        SPLIT_WIDTH=SPLIT_WIDTH, SELECT_T=_select_tokens(num_experts), E_POW2=triton.next_power_of_2(num_experts),
        FUSED=fused, ALIGN=align, ALIGN_BLOCK_M=block_m or 1, FILL=FILL,
        BLOCK_CHUNK=max(1, BLOCK_ELEMENTS // triton.next_power_of_2(num_experts)), FP32_DOT=fp32_dot,
        LIBDEVICE_EXP=not interpret, HAS_BIAS=bias is not None, USE_PDL=use_pdl, **_norm_args(hidden_states, norm),
        num_warps=NUM_WARPS, num_stages=2, launch_pdl=use_pdl)
    if not fused:
        _launch_select(partials, logits, weights, ids, top_k, renormalize, bias)
    return weights, ids, blocks, logits


def _norm_args(x: torch.Tensor, norm: Optional[RouteNorm]) -> dict:
    """The launch's arguments of the norm (x stands in for its tensors without one: untouched)."""
    if norm is None:
        return dict(r_ptr=x, g_ptr=x, normed_ptr=x, sum_ptr=x, eps=0.0, stride_r=0, NORM=False)
    return dict(r_ptr=norm.residual, g_ptr=norm.weight, normed_ptr=norm.normed, sum_ptr=norm.residual_out,
                eps=float(norm.eps), stride_r=norm.residual.stride(0), NORM=True)


def _select_tokens(num_experts: int) -> int:
    return max(1, SELECT_ELEMENTS // triton.next_power_of_2(num_experts))


def takes_one_launch(tokens: int, top_k: int, grouped: bool = True) -> bool:
    """Whether `route_triton` routes a batch of ``tokens`` in one launch by default (selection and,
    when ``grouped`` (a ``block_m`` given), grouping by its last program) rather than two (the
    logits' partials, then the selection by blocks of tokens)."""
    bound = ONE_LAUNCH_MAX_TOKENS if grouped else UNGROUPED_ONE_LAUNCH_MAX_TOKENS
    return tokens <= bound and tokens * top_k <= FUSED_MAX_SLOTS


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
        _launch_select(logits[None], torch.empty_like(logits), weights, ids, top_k, renormalize, None)
    return weights, ids


def _launch_select(partials: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   top_k: int, renormalize: bool, bias: Optional[torch.Tensor]) -> None:
    """``logits = partials.sum(0)`` (in order) ``+ bias``, then the selection, by blocks of tokens."""
    split_k, tokens, num_experts = partials.shape
    select_t = _select_tokens(num_experts)
    _select_kernel[(triton.cdiv(tokens, select_t),)](
        partials, logits if bias is None else bias, logits, weights, ids, tokens, num_experts, TOPK=top_k,
        K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, SPLIT_K=split_k, SELECT_T=select_t, E_POW2=triton.next_power_of_2(num_experts),
        LIBDEVICE_EXP=not triton.knobs.runtime.interpret, HAS_BIAS=bias is not None, num_warps=NUM_WARPS)


def route_triton(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                 counter: torch.Tensor, block_m: Optional[int] = None, bias: Optional[torch.Tensor] = None,
                 norm: Optional[RouteNorm] = None, one_launch: Optional[bool] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[ExpertBlocks]]:
    """``h [T, hidden]``, gate ``weight [E, hidden]`` (h's dtype) and optional ``bias [E]`` (any
    float dtype, added to the fp32 logits) -> new ``(weights fp32 [T, k], ids int32 [T, k],
    blocks)`` by the module docstring; ``blocks``: the slots grouped by expert
    in ``block_m``-row blocks (equal to `layers.moe.align.align_by_expert`'s) when ``block_m`` is
    given and the batch takes the one-launch path, else None. ``counter``: int32, zero on entry,
    zero again once the launch ends (the caller owns it; one routing at a time per counter). No
    host synchronisation; capturable in a CUDA graph.

    ``norm``: ``hidden_states`` is x, and the launch first normalises it
    (layers/moe/kernels/triton_route_norm.py: h = rms_norm(round(x + norm.residual)) * norm.weight
    into ``norm.normed``, the rounded sum into ``norm.residual_out``; x and the residual only
    read) and routes h; only on the one-launch path (`norm_refusal`), ValueError elsewhere.

    ``one_launch``: the path, one launch (True; at most FUSED_MAX_SLOTS slots, ValueError beyond)
    or two (False); None: one launch for the batches `takes_one_launch` names. Both paths give the
    same bits (module docstring)."""
    weights, ids, blocks, _ = route_triton_with_logits(hidden_states, weight, top_k, renormalize, counter, block_m,
                                                       bias, norm, one_launch)
    return weights, ids, blocks
