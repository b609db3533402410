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

One launch (`Mxfp4MoEConfig.one_launch`): launches 1 and 2 as one grid of n1 + n2 programs, n1 =
slots x gate/up tiles, n2 = slots x down tiles, so that a slot's down programs start as soon as
that slot's activations are complete rather than after the whole of launch 1. Three kinds of
int32 counters (`ARRIVALS`, layers/kernels/arrival_counters.py: ticket, finished, then one per
slot), zero before and after each call:

    ticket     each program first takes t = atomic_add(ticket, 1); the program id is not used, as
               the GPU may schedule programs in any order. t < n1: gate/up tile t % tiles of slot
               t // tiles; else down tile (t - n1) % tiles of slot (t - n1) // tiles (slot-major).
    arrival    a gate/up program stores its activations, then (CTA barrier) adds 1 to its slot's
               counter (release, GPU scope); a down program spins until its slot's counter
               reaches the gate/up tiles (atomic add of 0, acquire, GPU scope), then reads the
               slot's activations past L1 (``.cg``).
    finished   every program adds 1 at its end (acq_rel); the one that sees n1 + n2 - 1, the
               last, sets all the counters back to zero, which the next launch on the stream
               (a CUDA-graph replay too) sees.

It cannot deadlock: a program takes its ticket only once it is running, so every lower ticket
belongs to a program already resident on the GPU. A down program (ticket >= n1) waits only for
gate/up programs (tickets < n1, all resident), which never wait and so finish, whatever else is
resident or still queued; with PDL every program takes its ticket after its ``gdc_wait``.

Each program runs the same code (`_tile`) on the same tile as in the two launches, in the same
order within the tile, with the same warps (`check_config` refuses another ``num_warps_down``),
so the outputs have the same bits as the two launches'. Calls that share a device's counters
run one at a time, as on one stream.

Deterministic run to run (each output one program, fixed order); a slot's result depends on its
own token and routing only. Launch sizes depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.arrival_counters import ArrivalCounters
from arfusion.layers.moe.kernels.mxfp4_decode import (expert_weight_operands, fp16_half, load_words_only, scale_factor,
                                                      word_pairs)
from arfusion.layers.moe.kernels.triton_clamped_swiglu import clamped_swiglu


@triton.jit
def _step(x_row, w_ptr, scales_ptr, rows, row_mask, k0, k_size, stride_wn, stride_sn, acc,
          BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, X_CACHE: tl.constexpr):
    """``acc`` plus one K step (columns k0 .. k0 + BLOCK_K - 1) of ``W[rows, k] * x[k]``: MXFP4
    ``acc [N, BLOCK_K / 32]`` by scale group (module docstring), bf16 form ``acc [N, BLOCK_K]`` by
    column; fp32, masked rows and columns past ``k_size`` add zeros. ``X_CACHE``: the cache
    modifier of the loads of x ("" or ".cg", past L1; the same values either way)."""
    if MXFP4:
        kw = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words, _ = load_words_only(w_ptr, rows, row_mask, kw, (k_size // 32) * 4, stride_wn)
        part = tl.zeros([rows.shape[0], BLOCK_K // 8], dtype=tl.float32)
        for q in tl.static_range(4):
            pairs = word_pairs(words, q)
            for high in tl.static_range(2):
                k = 8 * kw + q + 4 * high
                xk = tl.load(x_row + k, mask=k < k_size, other=0.0, cache_modifier=X_CACHE).to(tl.float32)
                part += fp16_half(pairs, high) * xk[None, :]
        groups = tl.multiple_of(k0 // 32, BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        factor = scale_factor(scales_ptr, rows[:, None] * stride_sn, groups[None, :],
                              row_mask[:, None] & (groups < k_size // 32)[None, :])
        acc += tl.sum(tl.reshape(part, [rows.shape[0], BLOCK_K // 32, 4]), axis=2) * factor
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_size
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        xk = tl.load(x_row + k, mask=k_mask, other=0.0, cache_modifier=X_CACHE)
        acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
    return acc


@triton.jit
def _tile(x_ptr, ids_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, slot, tile, k_size, n_size, alpha, limit, stride_x,
          stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
          X_ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
          GATE_UP: tl.constexpr, HAS_BIAS: tl.constexpr, X_CACHE: tl.constexpr):
    """Column tile ``tile`` (BLOCK_N rows) of slot ``slot``: GATE_UP, launch 1 (rows n and
    n_size + n of W; stores the activations into ``out [slots, n_size]``, x's dtype); else launch
    2 (stores fp32 into ``out [slots, n_size]``, the bias added when HAS_BIAS). The slot's input
    row is ``x[slot // X_ROW_DIV]``, loaded with the cache modifier ``X_CACHE`` (`_step`)."""
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // X_ROW_DIV).to(tl.int64) * stride_x
    w_e, s_e, b_e = w_ptr + expert * stride_we, scales_ptr + expert * stride_se, bias_ptr + expert * stride_be
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    rows = offs_n.to(tl.int64)
    width: tl.constexpr = BLOCK_K // 32 if MXFP4 else BLOCK_K
    acc = tl.zeros([BLOCK_N, width], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, width], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        acc = _step(x_row, w_e, s_e, rows, n_mask, k0, k_size, stride_wn, stride_sn, acc, BLOCK_K, MXFP4, X_CACHE)
        if GATE_UP:
            acc_up = _step(x_row, w_e, s_e, rows + n_size, n_mask, k0, k_size, stride_wn, stride_sn, acc_up,
                           BLOCK_K, MXFP4, X_CACHE)
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


@triton.jit
def _gemv_kernel(x_ptr, ids_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, k_size, n_size, alpha, limit, stride_x,
                 stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
                 X_ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                 GATE_UP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (slot, column tile) of launch 1 (GATE_UP) or 2: `_tile`. With USE_PDL it waits for
    the previous kernel first: the weights it reads depend on the routing
    (layers/kernels/pdl.py)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _tile(x_ptr, ids_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, tl.program_id(0), tl.program_id(1), k_size, n_size,
          alpha, limit, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
          X_ROW_DIV, BLOCK_N, BLOCK_K, MXFP4, GATE_UP, HAS_BIAS, "")


@triton.jit
def _wait_for_count(counter_ptr, count):
    """Spins until the int32 ``*counter_ptr`` is at least ``count``, each read an atomic add of 0
    with acquire semantics at GPU scope (for sm90 Triton emits ``ld.global.gpu.acquire``, which
    tests/test_pdl_kernels.py checks): what the arrivals released is visible after it."""
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < count:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _count_finished(counters_ptr, used, programs, RESET_BLOCK: tl.constexpr):
    """Adds 1 to ``counters_ptr[1]`` (finished; acq_rel, GPU scope); the program that sees
    ``programs - 1``, the last to finish, sets ``counters_ptr[0 : used]`` to zero in place."""
    finished = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:
        for c0 in range(0, used, RESET_BLOCK):
            offs = c0 + tl.arange(0, RESET_BLOCK)
            tl.store(counters_ptr + offs, tl.zeros([RESET_BLOCK], dtype=tl.int32), mask=offs < used)


@triton.jit
def _gemv_one_launch_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, b13_ptr, act_ptr, w2_ptr, s2_ptr, b2_ptr, partial_ptr,
                            counters_ptr, hidden, inter, alpha, limit, slots, tiles_gate_up, tiles_down, stride_x,
                            stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_b13e, stride_act,
                            stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_b2e, stride_partial,
                            X_ROW_DIV: tl.constexpr, BLOCK_N_GATE_UP: tl.constexpr, BLOCK_K_GATE_UP: tl.constexpr,
                            BLOCK_N_DOWN: tl.constexpr, BLOCK_K_DOWN: tl.constexpr, MXFP4: tl.constexpr,
                            HAS_DOWN_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """Launches 1 and 2 in one grid of ``slots * (tiles_gate_up + tiles_down)`` programs (module
    docstring): a program's work is its ticket's, not its program id's. ``counters_ptr``: int32
    ``[0]`` ticket, ``[1]`` finished, ``[2 + s]`` slot s's gate/up arrivals; zero on entry, zero
    again once the last program ends. Gate/up tiles store ``act``, down tiles ``partial`` (`_tile`).
    With USE_PDL every program waits for the previous kernel first (layers/kernels/pdl.py): the
    counters, the routing and the weights it selects are read after the wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    gate_up_programs = slots * tiles_gate_up
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
    if ticket < gate_up_programs:
        slot = ticket // tiles_gate_up
        _tile(x_ptr, ids_ptr, w13_ptr, s13_ptr, b13_ptr, act_ptr, slot, ticket % tiles_gate_up, hidden, inter, alpha,
              limit, stride_x, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_b13e, stride_act,
              X_ROW_DIV, BLOCK_N_GATE_UP, BLOCK_K_GATE_UP, MXFP4, True, True, "")
        tl.debug_barrier()  # every thread's activations stored before the arrival (release)
        tl.atomic_add(counters_ptr + 2 + slot, 1, sem="release", scope="gpu")
    else:
        slot = (ticket - gate_up_programs) // tiles_down
        _wait_for_count(counters_ptr + 2 + slot, tiles_gate_up)
        _tile(act_ptr, ids_ptr, w2_ptr, s2_ptr, b2_ptr, partial_ptr, slot, (ticket - gate_up_programs) % tiles_down,
              inter, hidden, alpha, limit, stride_act, stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_b2e,
              stride_partial, 1, BLOCK_N_DOWN, BLOCK_K_DOWN, MXFP4, False, HAS_DOWN_BIAS, ".cg")
    _count_finished(counters_ptr, 2 + slots, slots * (tiles_gate_up + tiles_down), 32)


# the one launch's counters (`_gemv_one_launch_kernel`: ticket, finished, one per slot)
ARRIVALS = ArrivalCounters("MXFP4 matrix-vector experts, one launch")


def gemv_partials(x: torch.Tensor, experts, topk_ids: torch.Tensor, config) -> torch.Tensor:
    """``x [T, H]``, ``topk_ids [T, k]`` -> fp32 ``[1, T * k, H]``: each slot's expert output before
    the combine (module docstring: launches 1 and 2, in one launch with ``config.one_launch``),
    with the weights of ``experts`` (a `layers.moe.gpt_oss_moe.GptOssExperts`) and the tiles of
    ``config`` (an `Mxfp4MoEConfig` with ``gemv``: ``block_n_*`` rows per program, ``block_k_*``
    columns per K step, ``num_warps``). The caller has checked x, the routing and the config."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    act = x.new_empty(ids.numel(), experts.local)
    partial = torch.empty(1, ids.numel(), experts.hidden_size, dtype=torch.float32, device=x.device)
    launch = _one_launch if config.one_launch else _two_launches
    launch(x, experts, ids, top_k, act, partial, config)
    return partial


def _two_launches(x: torch.Tensor, experts, ids: torch.Tensor, top_k: int, act: torch.Tensor, partial: torch.Tensor,
                  config) -> None:
    """Launch 1 writes ``act [slots, inter]``, then launch 2 ``partial [1, slots, H]`` (in place)."""
    hidden, inter, slots = experts.hidden_size, experts.local, ids.numel()
    w13, s13, w2, s2 = expert_weight_operands(experts, word_reads=True)
    use_pdl = pdl.enabled()
    _gemv_kernel[(slots, triton.cdiv(inter, config.block_n_gate_up))](
        x, ids, w13, s13, experts.w13_bias, act, hidden, inter, experts.alpha, experts.limit, x.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), experts.w13_bias.stride(0), act.stride(0),
        X_ROW_DIV=top_k, BLOCK_N=config.block_n_gate_up, BLOCK_K=config.block_k_gate_up, MXFP4=experts.mxfp4,
        GATE_UP=True, HAS_BIAS=True, USE_PDL=use_pdl, num_warps=config.num_warps, launch_pdl=use_pdl)
    _gemv_kernel[(slots, triton.cdiv(hidden, config.block_n_down))](
        act, ids, w2, s2, experts.w2_bias, partial, inter, hidden, experts.alpha, experts.limit, act.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), experts.w2_bias.stride(0), partial.stride(1),
        X_ROW_DIV=1, BLOCK_N=config.block_n_down, BLOCK_K=config.block_k_down, MXFP4=experts.mxfp4,
        GATE_UP=False, HAS_BIAS=experts.tp_rank == 0, USE_PDL=use_pdl,
        num_warps=config.num_warps_down or config.num_warps, launch_pdl=use_pdl)


def _one_launch(x: torch.Tensor, experts, ids: torch.Tensor, top_k: int, act: torch.Tensor, partial: torch.Tensor,
                config) -> None:
    """Launches 1 and 2 as one (`_gemv_one_launch_kernel`): writes ``act`` and ``partial`` in place,
    the same bits as `_two_launches`; uses the device's `ARRIVALS` (zero before and after)."""
    hidden, inter, slots = experts.hidden_size, experts.local, ids.numel()
    w13, s13, w2, s2 = expert_weight_operands(experts, word_reads=True)
    tiles_gate_up, tiles_down = triton.cdiv(inter, config.block_n_gate_up), triton.cdiv(hidden, config.block_n_down)
    counters = ARRIVALS.get(x.device, 2 + slots)
    use_pdl = pdl.enabled()
    _gemv_one_launch_kernel[(slots * (tiles_gate_up + tiles_down),)](
        x, ids, w13, s13, experts.w13_bias, act, w2, s2, experts.w2_bias, partial, counters, hidden, inter,
        experts.alpha, experts.limit, slots, tiles_gate_up, tiles_down, x.stride(0),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), experts.w13_bias.stride(0), act.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), experts.w2_bias.stride(0), partial.stride(1),
        X_ROW_DIV=top_k, BLOCK_N_GATE_UP=config.block_n_gate_up, BLOCK_K_GATE_UP=config.block_k_gate_up,
        BLOCK_N_DOWN=config.block_n_down, BLOCK_K_DOWN=config.block_k_down, MXFP4=experts.mxfp4,
        HAS_DOWN_BIAS=experts.tp_rank == 0, USE_PDL=use_pdl, num_warps=config.num_warps, launch_pdl=use_pdl)
