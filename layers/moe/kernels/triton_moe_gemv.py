"""The SwiGLU experts of a MoE layer for a few tokens as matrix-vector products: two Triton
launches, products on CUDA cores in fp32, no tensor cores, no grouping of the slots by expert.
The math and its roundings are the grouped launches' (layers/moe/kernels/triton_fused_moe.py,
combine "folded"):

    launch 1  program (slot s = t * k + j, BLOCK_N columns n), e = ids[t, j]:
              gate = round(sum_c W13[e, n, c] * x[t, c]),  up = round(sum_c W13[e, I + n, c] * x[t, c])
              act[s, n] = round(round(silu(gate)) * up)
    launch 2  program (token t, BLOCK_N columns n):
              out[t, n] = round(sum_j w[t, j] * (sum_c W2[e_j, n, c] * act[t * k + j, c]))
              or, unformed (`moe_gemv`'s ``unformed``), program (slot s = t * k + j, BLOCK_N columns):
              p[s, n] = w[t, j] * (sum_c W2[e_j, n, c] * act[s, c])   fp32, summed in the next norm

(round: to x's dtype; every product and sum in fp32). The sums over c run per K step: each
step's BLOCK_K products are added elementwise into an fp32 accumulator of the step's shape, and
the accumulator is summed once at the end (``tl.sum`` over its columns); or, in launch 1 with
`MoEGemvConfig.sum_each_step`, each step's products are summed at once into one fp32
accumulator per output (a register or a few per thread whatever the K step, so more programs fit
on an SM; another order of sums, so other bits); launch 2 then adds the k weighted expert rows of
its token (``tl.sum`` over the slots). Each output is one program's, in
a fixed order: deterministic run to run, and a token's result depends on its own row and routing
only (but not the grouped launches' bits: other sums, other order).

Why a separate path: at decode sizes the grouped launches give each expert a 16-row block of
which one row is real (a tensor-core dot needs 16 rows), and move every weight tile into the
MMA's operand layout through shared memory; here each weight is loaded in 16-byte vectors
straight into registers and used where it lands, and launch 2 sums its token's k expert rows
itself (no scratch rows, no arrival counters, no grouping pass before launch 1), or, unformed,
leaves them to the norm after the layer with k times the programs. A weight is
read once per slot that uses its expert, so the grouped launches take over when the slots
outnumber what this path serves (`serves`). Launch sizes depend on shapes only: a call
can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from arfusion.layers.kernels import pdl
from arfusion.layers.moe.kernels.triton_topk_combine import TopKCombine

GEMV_MAX_SLOTS = 32  # tokens x top-k served here (at most; the grouped launches above)
# Launch 2's per-slot form (``unformed``) serves calls of at most this many tokens, larger ones keep
# the per-token combine: in qwen3-30b-a3b's decode step it was faster at 1 token (8 slots: 8 times
# the programs of the per-token launch) and slower at 4 (not examined; there the per-token launch
# already has 1,024 programs); measured at 1 and 4 tokens only (docs/results.md)
ROWS_MAX_TOKENS = 1


@dataclass(frozen=True)
class MoEGemvConfig:
    """Tiles of the two launches: output columns per program and columns per K step (the
    defaults: the fastest of a sweep at Qwen3-30B-A3B's expert shapes, 1 to 4 tokens; the
    numbers are in docs/results.md); a size that is no power of two is a ValueError naming it.
    ``sum_each_step``: launch 1's accumulators one per output instead of one per output and
    column of a K step (module docstring); on by default, faster at 1 to 8 tokens in the same
    sweep. ``early_weights``: where the launches take PDL, the per-slot down launch (``unformed``)
    loads its slot's expert id and first K step of weights before its wait on launch 1
    (layers/kernels/pdl.py), so they arrive while launch 1 still runs; the per-token down launch
    has no such variant (PDL runs at batch 1 by default, where the per-slot form serves)."""

    block_n_gate_up: int = 8
    block_k_gate_up: int = 512
    block_n_down: int = 8
    block_k_down: int = 256
    num_warps_gate_up: int = 2
    num_warps_down: int = 4
    sum_each_step: bool = True
    block_n_rows: int = 8
    block_k_rows: int = 256
    num_warps_rows: int = 2
    early_weights: bool = True

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, bool) and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= 1 (tl.arange, warps), got {value}")


DEFAULT_GEMV_CONFIG = MoEGemvConfig()


@triton.jit
def _gate_up_silu_gemv_kernel(x_ptr, ids_ptr, w13_ptr, act_ptr, hidden, inter, stride_x, stride_we, stride_wn,
                              stride_act, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              LIBDEVICE_EXP: tl.constexpr, SUM_EACH_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the weights read depend on the routing: nothing before the wait (layers/kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOPK).to(tl.int64) * stride_x
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    gate_rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter * stride_wn
    if SUM_EACH_STEP:
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < hidden
        xk = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        gate_products = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32) * xk
        up_products = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32) * xk
        if SUM_EACH_STEP:
            acc_gate += tl.sum(gate_products, axis=1)
            acc_up += tl.sum(up_products, axis=1)
        else:
            acc_gate += gate_products
            acc_up += up_products
    if not SUM_EACH_STEP:
        acc_gate = tl.sum(acc_gate, axis=1)
        acc_up = tl.sum(acc_up, axis=1)
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(out_ty).to(tl.float32)
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + offs_n, (silu * up).to(out_ty), mask=n_mask)


@triton.jit
def token_slots(ids_ptr, token, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr):
    """``(slots, mask, experts)`` of ``token``: its slots ``token * TOPK + j`` for j < TOPK_POW2
    (int64), which of them are real (j < TOPK), and their experts from ``ids_ptr`` (int64; expert
    0 for the padding)."""
    offs_j = tl.arange(0, TOPK_POW2)
    j_mask = offs_j < TOPK
    slots = token * TOPK + offs_j
    return slots, j_mask, tl.load(ids_ptr + slots, mask=j_mask, other=0).to(tl.int64)


@triton.jit
def _down_products(w_rows, w_mask, act_rows, j_mask, inter, BLOCK_K: tl.constexpr):
    """fp32 ``sum_c W2[e_j, n, c] * act[slot j, c]`` for the tile of row pointers ``w_rows [J, N]``
    (masked by ``w_mask``) and the slots' activation rows ``act_rows [J, 1]``: each K step's
    products summed over its columns."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros(w_rows.shape, dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < inter
        a = tl.load(act_rows + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, :, None] + k[None, None, :], mask=w_mask[:, :, None] & k_mask[None, None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
    return acc


@triton.jit
def _down_combine_gemv_kernel(act_ptr, ids_ptr, topk_weights_ptr, w2_ptr, out_ptr, hidden, inter, stride_act,
                              stride_we, stride_wn, stride_out, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the weights read depend on the routing: nothing before the wait (layers/kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    slots, j_mask, experts = token_slots(ids_ptr, token, TOPK, TOPK_POW2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    routing = tl.load(topk_weights_ptr + slots, mask=j_mask, other=0.0)
    act_rows = act_ptr + slots[:, None] * stride_act  # [J, 1]
    rows = offs_n.to(tl.int64) * stride_wn
    w_rows = w2_ptr + experts[:, None] * stride_we + rows[None, :]  # tile [J, N, K]
    acc = _down_products(w_rows, j_mask[:, None] & n_mask[None, :], act_rows, j_mask, inter, BLOCK_K)
    total = tl.sum(acc * routing[:, None], axis=0)
    tl.store(out_ptr + token * stride_out + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_rows_gemv_kernel(act_ptr, ids_ptr, topk_weights_ptr, w2_ptr, rows_ptr, hidden, inter, stride_act,
                           stride_we, stride_wn, stride_rows, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           USE_PDL: tl.constexpr, EARLY_WEIGHTS: tl.constexpr):
    """Launch 2 unformed (module docstring): ``rows[s, n] = p[s, n]``, a program per slot and BLOCK_N
    columns, each K step's products summed over its columns. With USE_PDL and EARLY_WEIGHTS the
    slot's expert id and its first K step of weights are loaded before the wait (`early_weights`)."""
    if USE_PDL and not EARLY_WEIGHTS:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    w_rows = w2_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    act_row = act_ptr + slot * stride_act
    offs_k = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < inter)[None, :], other=0.0)
    if USE_PDL and EARLY_WEIGHTS:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a = tl.load(act_row + offs_k, mask=offs_k < inter, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc += tl.sum(w_first.to(tl.float32) * a[None, :], axis=1)
    for k0 in range(BLOCK_K, inter, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < inter
        a = tl.load(act_row + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
    routing = tl.load(topk_weights_ptr + slot)
    tl.store(rows_ptr + slot * stride_rows + offs_n, acc * routing, mask=n_mask)


def serves(num_slots: int, num_experts: int) -> bool:
    """Whether ``num_slots`` (tokens x top-k) slots over ``num_experts`` experts take this path:
    1 to `GEMV_MAX_SLOTS` slots, and at most a quarter as many as the experts. A weight is read
    once per slot that uses its expert; s slots spread over E experts repeat an expert about
    s^2 / (2E) times, an eighth of the slots at s = E/4, beyond which the grouped launches (an
    expert read once for all its rows) read fewer bytes."""
    return 0 < num_slots <= min(GEMV_MAX_SLOTS, num_experts // 4)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, config: MoEGemvConfig = DEFAULT_GEMV_CONFIG,
             unformed: bool = False) -> Union[torch.Tensor, TopKCombine]:
    """``x [T, H]``, this rank's shards ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (x's dtype), routing
    ``topk_weights`` (float) / ``topk_ids`` (int) ``[T, k]`` -> a new ``[T, H]`` of x's dtype: the
    module docstring's two launches (the caller has checked the shapes, dtypes and layouts as
    `fused_moe` does); ``unformed``: up to `ROWS_MAX_TOKENS` tokens launch 2's per-slot form, the
    output a `TopKCombine` of its weighted fp32 rows (``applied``) for the norm after the layer to
    sum (a tensor for more tokens). Nothing is written in place; no host synchronisation."""
    tokens, top_k = topk_ids.shape
    _, two_inter, hidden = w13.shape
    inter = two_inter // 2
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    act = x.new_empty(tokens * top_k, inter)
    use_pdl = pdl.enabled()
    _gate_up_silu_gemv_kernel[(tokens * top_k, triton.cdiv(inter, config.block_n_gate_up))](
        x, ids, w13, act, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOPK=top_k, BLOCK_N=config.block_n_gate_up, BLOCK_K=config.block_k_gate_up,
        LIBDEVICE_EXP=not triton.knobs.runtime.interpret, SUM_EACH_STEP=config.sum_each_step, USE_PDL=use_pdl,
        num_warps=config.num_warps_gate_up, launch_pdl=use_pdl)
    if unformed and tokens <= ROWS_MAX_TOKENS:
        rows = torch.empty(1, tokens * top_k, hidden, dtype=torch.float32, device=x.device)
        _down_rows_gemv_kernel[(tokens * top_k, triton.cdiv(hidden, config.block_n_rows))](
            act, ids, weights, w2, rows, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), rows.stride(1),
            BLOCK_N=config.block_n_rows, BLOCK_K=config.block_k_rows, USE_PDL=use_pdl,
            EARLY_WEIGHTS=config.early_weights, num_warps=config.num_warps_rows, launch_pdl=use_pdl)
        return TopKCombine(rows, topk_weights, x.dtype, applied=True)
    out = x.new_empty(tokens, hidden)
    _down_combine_gemv_kernel[(tokens, triton.cdiv(hidden, config.block_n_down))](
        act, ids, weights, w2, out, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOPK=top_k, TOPK_POW2=triton.next_power_of_2(top_k), BLOCK_N=config.block_n_down,
        BLOCK_K=config.block_k_down, USE_PDL=use_pdl, num_warps=config.num_warps_down, launch_pdl=use_pdl)
    return out
