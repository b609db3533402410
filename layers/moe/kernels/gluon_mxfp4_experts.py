"""gpt-oss's MXFP4 experts for decode-sized batches on tensor cores (`Mxfp4MoEConfig.tensor_cores`),
written in Gluon, triton's dialect with explicit layouts. The math is the grouped launches'
(layers/moe/kernels/triton_mxfp4_moe.py, whose combine launch follows these two), rows grouped
by expert (layers/moe/align.py) in blocks of ``block_m`` rows (8 to 64):

    launch 1  block b of expert e, rows r (slots s = sorted_slots[r], token t = s // k):
              gate = round(x[t] . W_gate[e, n] + b_gate[e, n]), up alike     one fp32 accumulator
              act[r, n] = round((clamp(up, -L, L) + 1) * g * sigmoid(alpha * g))  each, rounded to
              with g = clamp(gate, max=L)                                    the dtype
    launch 2  p[s, n] = act[r] . W_down[e, n] (+ b_down[e, n] on rank 0)     fp32, to a scratch row

Each program computes ``W[e, n0 : n0 + BLOCK_N] @ x[rows]^T`` with mma.sync (m16n8k16, bf16
inputs, fp32 accumulation): the weight rows are the A operand (M side), the block's rows of
activations the B operand (N side, eight a tile). The A operand never leaves registers: of each
K step (``BLOCK_K`` = 32 J columns, J = 1 to 16) a thread loads J 32-bit words of a row in runs
of W = min(J, 4) consecutive words (16 bytes at most, each run in one scale group of 32 codes,
four words) and decodes each word into four bf16x2 registers of mma.sync's A-operand layout
(``k_width`` 8):

    pair q of a word w (q = 0..3) = bf16 codes of nibbles q (low half) and q + 4 (high half):
        ((w << (6 - 4q)) & 0x01C001C0) | ((w << (12 - 4q)) & 0x80008000)
    that is the code's magnitude bits at 6..8 and its sign at 15: as a bf16 number the code's
    e2m1 value times 2^-126 (the e2m1 subnormal 0.5 a bf16 subnormal), then one
    ``mul.rn.bf16x2`` by the bf16 2^(scale - 1): the weight code * 2^(scale - 127), exact.

So a thread's eight k of a word arrive in the order q, q + 4 (q = 0..3), and lane p (of the four
that share a row) holds the step's words 16 i + p W .. 16 i + p W + W - 1 (run i = 0 .. J / W - 1)
where the operand layout expects words p, p + 4, .., p + 4 (J - 1): the dot's order of k is a
fixed permutation of the columns, and the activations are loaded in the same permuted order
(16-byte loads, then a register permutation). Long K steps put more bytes in flight per warp
(16 rows x BLOCK_K / 2 bytes a matrix), which the few programs of a decode step need to reach
the memory's bandwidth. Where BLOCK_K does not divide K, the rest follows in a step of each of
its powers of two, largest first (320 at 2880 with steps of 512: 256, then 64): exact steps, no
masks, and no more registers than a whole step (a masked step of 512 took 202 registers a thread
against 166 in the sm90 build, a third fewer programs an SM).
Every output is one fp32 accumulator over K in a fixed order. With `Mxfp4MoEConfig.prefetch` a
K step's words, scales and activations are loaded one step ahead, before the step before is
decoded and multiplied (the same products in the same order: the same bits). Why Gluon: in Triton the
decoded tile's layout is the compiler's choice, and moving it into the dot operand's layout went
through shared memory every K step (a Triton variant of this measured slower than the CUDA-core
launches: docs/notes.md).

Limits (`tensor_core_refusal`): MXFP4 weights; K (hidden, and this rank's intermediate size) a
multiple of 32; every scale at most 2^1 (scale byte <= 128,
`mxfp4.TENSOR_CORE_MAX_SCALE`: the bf16 factor 2^(scale - 1) must exist; the experts' weight
loader refuses larger ones when the experts are marked for these launches, and this module checks
once per experts object, outside CUDA-graph capture, whatever wrote the scales). Output rows past N
load row N - 1 and are not stored. Launch sizes depend on shapes only (CUDA-graph capturable).

Deterministic run to run, and batch-invariant for fixed K steps: an output of row r is the chain
of mma.sync over r's own column of B, K step after K step in order, whatever the other rows of
its block and whatever ``block_m`` (which sets how many eight-row tiles a block has, not what one
tile computes), and launch 3 sums a token's slots in a fixed order. So batch-invariant mode takes
these launches too (`tensor_core_config`: the K steps follow the shapes, the blocks the batch).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from arfusion.layers.moe.align import ExpertBlocks
from arfusion.layers.moe.mxfp4 import SCALE_BIAS, TENSOR_CORE_MAX_SCALE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # triton without Gluon: `tensor_core_refusal` says so
    gluon = None


def tensor_core_refusal(dtype: torch.dtype, experts, cfg) -> Optional[str]:
    """Why these launches cannot run ``experts`` (a `GptOssExperts`) on activations of ``dtype``
    with ``cfg``, or None (module docstring's limits). Reads the scales' maximum back to the host
    once per experts object."""
    if gluon is None:
        return "this triton has no Gluon (triton.experimental.gluon)"
    if not experts.mxfp4:
        return "the tensor-core launches take MXFP4 weights only"
    if dtype != torch.bfloat16:
        return f"the tensor-core launches take bf16 activations, got {dtype}"
    hidden, inter = experts.hidden_size, experts.local
    for name, size in (("hidden size", hidden), ("intermediate size", inter)):
        if size % 32:
            return f"the {name} {size} is not a multiple of 32 (the smallest K step)"
    top = getattr(experts, "_tensor_core_max_scale", None)
    if top is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "the scales' maximum is checked by an eager call before a CUDA graph captures these launches"
        top = int(max(experts.w13_scales.max(), experts.w2_scales.max()))
        experts._tensor_core_max_scale = top
    if top > TENSOR_CORE_MAX_SCALE:
        return f"a scale of 2^{top - SCALE_BIAS} exceeds the decoder's 2^{TENSOR_CORE_MAX_SCALE - SCALE_BIAS}"
    return None


if gluon is not None:
    DECODE = gl.constexpr("""{
    .reg .b32 a, b;
    shl.b32 a, $4, 6; shl.b32 b, $4, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    mul.rn.bf16x2 $0, a, $5;
    shl.b32 a, $4, 2; shl.b32 b, $4, 8; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    mul.rn.bf16x2 $1, a, $5;
    shr.b32 a, $4, 2; shl.b32 b, $4, 4; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    mul.rn.bf16x2 $2, a, $5;
    shr.b32 a, $4, 6; and.b32 a, a, 0x01C001C0; and.b32 b, $4, 0x80008000; or.b32 a, a, b;
    mul.rn.bf16x2 $3, a, $5;
    }""")

    @gluon.constexpr_function
    def _layouts(num_warps, block_n, block_k, block_m):
        """(words ``[BLOCK_N, 4 (p), I, W]``, activations ``[4 (p), J, 8 (k in a word), BLOCK_M (row)]``),
        J = BLOCK_K / 32 = I W, W = min(J, 4): the registers, lanes and warps of mma.sync's operands
        (module docstring)."""
        steps = block_k // 32
        runs, run = max(steps // 4, 1), min(steps, 4)
        words = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 2 ** i] for i in range(run.bit_length() - 1)]
            + [[0, 0, 2 ** i, 0] for i in range(runs.bit_length() - 1)] + [[8, 0, 0, 0]]
            + [[16 * num_warps * 2 ** i, 0, 0, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16 * 2 ** i, 0, 0, 0] for i in range(num_warps.bit_length() - 1)], block_bases=[],
            shape=[block_n, 4, runs, run])
        acts = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]] + [[0, 2 ** i, 0, 0] for i in range(steps.bit_length() - 1)]
            + [[0, 0, 0, 8 * 2 ** i] for i in range((block_m // 8).bit_length() - 1)],
            lane_bases=[[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
            warp_bases=[[0, 0, 0, 0] for _ in range(num_warps.bit_length() - 1)], block_bases=[], shape=[4, steps, 8, block_m])
        return words, acts

    @gluon.jit
    def _as_bf16(pairs):
        """uint32 bf16 pairs ``[...]`` -> bf16 ``[..., 2]``, the low half first (no instruction)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(pairs, pairs)], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _words(w_ptr, s_ptr, rows, k0, stride_wn, stride_sn, WORDS: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr):
        """The 32-bit words of ``rows`` over columns k0 .. k0 + BLOCK_K - 1 (``[BLOCK_N, 4 (p), I, W]``
        in layout WORDS: thread p's run i is the step's words ``16 i + p W .. 16 i + p W + W - 1``)
        and each run's scale byte (``[BLOCK_N, 4, I]``), as loaded."""
        steps: gl.constexpr = BLOCK_K // 32
        RUNS: gl.constexpr = max(steps // 4, 1)
        RUN: gl.constexpr = min(steps, 4)
        p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))
        i = gl.arange(0, RUNS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WORDS))))
        w = gl.arange(0, RUN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))
        first = 16 * i[None, None, :] + RUN * p[None, :, None]  # [1, 4, I]: each run's first word
        run = gl.max_contiguous(gl.multiple_of(first[:, :, :, None] + w[None, None, None, :], [1, 1, 1, RUN]),
                                [1, 1, 1, RUN])
        words = gl.load(w_ptr.to(gl.pointer_type(gl.uint32)) + rows[:, None, None, None] * (stride_wn // 4) + k0 // 8
                        + run)
        # a run of W <= 4 words starting at a multiple of W lies in one scale group of four words
        scale = gl.load(s_ptr + rows[:, None, None] * stride_sn + k0 // 32 + first // 4)
        return words, scale

    @gluon.jit
    def _decoded(words, scale, WORDS: gl.constexpr, A: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """`_words`' words and scales -> the bf16 weights ``[BLOCK_N, BLOCK_K]`` in layout A, k in the
        permuted order (module docstring)."""
        steps: gl.constexpr = BLOCK_K // 32
        RUNS: gl.constexpr = max(steps // 4, 1)
        RUN: gl.constexpr = min(steps, 4)
        factor = ((scale.to(gl.uint32) + 126) << 7) * 0x10001  # bf16 2^(scale - 1), twice
        factor = factor[:, :, :, None] + gl.zeros([BLOCK_N, 4, RUNS, RUN], gl.uint32, WORDS)
        p0, p1, p2, p3 = gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r,r", [words, factor],
                                                   dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True,
                                                   pack=1)
        # [N, p, i, w, h, b, c], then [N, i, w, p, c, b, h]: k = 8 (4 (W i + w) + p) + 2 (2 c + b) + h
        tile = gl.join(gl.join(_as_bf16(p0), _as_bf16(p1)), gl.join(_as_bf16(p2), _as_bf16(p3)))
        tile = gl.permute(tile, [0, 2, 3, 1, 6, 5, 4])
        return gl.convert_layout(gl.reshape(tile, [BLOCK_N, BLOCK_K]), A)

    @gluon.jit
    def _acts_operand(acts, B: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """A K step's activations as loaded (``[4 (p), J, 8 (k in the word: q + 4 h), BLOCK_M]``)
        -> mma.sync's B operand ``[BLOCK_K, BLOCK_M]``, k in the weights' permuted order."""
        steps: gl.constexpr = BLOCK_K // 32
        acts = gl.permute(gl.reshape(acts, [4, steps, 2, 4, BLOCK_M]), [1, 0, 3, 2, 4])  # [j, p, q, h, row]
        return gl.convert_layout(gl.reshape(acts, [BLOCK_K, BLOCK_M]), B)

    @gluon.jit
    def _step_loads(w_e, s_e, x_ptrs, x_mask, rows, k0, N, stride_wn, stride_sn, GATE_UP: gl.constexpr,
                    WORDS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """Everything one K step reads, as loaded: (words and scales of W's rows, of the up rows
        ``rows + N`` with GATE_UP (else the same again, not reloaded), the activations)."""
        words, scale = _words(w_e, s_e, rows, k0, stride_wn, stride_sn, WORDS, BLOCK_N, BLOCK_K)
        up_words, up_scale = words, scale
        if GATE_UP:
            up_words, up_scale = _words(w_e, s_e, rows + N, k0, stride_wn, stride_sn, WORDS, BLOCK_N, BLOCK_K)
        return words, scale, up_words, up_scale, gl.load(x_ptrs + k0, mask=x_mask, other=0.0)

    @gluon.jit
    def _step_mma(words, scale, up_words, up_scale, acts, acc, acc_up, GATE_UP: gl.constexpr, WORDS: gl.constexpr,
                  A: gl.constexpr, B: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr):
        """One K step's products added to ``acc`` (and ``acc_up`` with GATE_UP) from `_step_loads`."""
        acts = _acts_operand(acts, B, BLOCK_M, BLOCK_K)
        acc = mma_v2(_decoded(words, scale, WORDS, A, BLOCK_N, BLOCK_K), acts, acc)
        if GATE_UP:
            acc_up = mma_v2(_decoded(up_words, up_scale, WORDS, A, BLOCK_N, BLOCK_K), acts, acc_up)
        return acc, acc_up

    @gluon.jit
    def _acts_ptrs(x_ptr, sorted_slots_ptr, block, num_slots, stride_x, TOPK: gl.constexpr, GATE_UP: gl.constexpr,
                   ACTS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """Pointers to the activations a K step at column 0 reads (``[4 (p), J, 8 (k in the word),
        BLOCK_M (row of the block)]`` in layout ACTS, 16-byte runs by thread, word j of thread p
        the weights' word of `_words`) and the mask of the block's real rows."""
        steps: gl.constexpr = BLOCK_K // 32
        RUN: gl.constexpr = min(steps, 4)
        xp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, ACTS))))
        xj = gl.arange(0, steps, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, ACTS))))
        xk = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, ACTS))))
        xr = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2,
                                                                                                          ACTS))))
        x_slots = gl.load(sorted_slots_ptr + xr)
        x_rows = x_slots // TOPK if GATE_UP else xr
        word = 16 * (xj[None, :] // RUN) + RUN * xp[:, None] + xj[None, :] % RUN
        run = gl.max_contiguous(gl.multiple_of(8 * word[:, :, None] + xk[None, None, :], [1, 1, 8]), [1, 1, 8])
        x_ptrs = x_ptr + x_rows.to(gl.int64)[None, None, None, :] * stride_x + run[:, :, :, None]
        return x_ptrs, (x_slots < num_slots)[None, None, None, :]

    @gluon.jit
    def _k_range(w_e, s_e, x_ptrs, x_mask, rows, k_start, k_end, N, stride_wn, stride_sn, acc, acc_up,
                 GATE_UP: gl.constexpr, WORDS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """``acc`` (and ``acc_up`` with GATE_UP) plus the K steps k_start, k_start + BLOCK_K, ..
        below k_end in order (`_step_loads`, then `_step_mma`)."""
        for k0 in range(k_start, k_end, BLOCK_K):
            gw, gs, uw, us, xa = _step_loads(w_e, s_e, x_ptrs, x_mask, rows, k0, N, stride_wn, stride_sn, GATE_UP,
                                             WORDS, BLOCK_N, BLOCK_K)
            acc, acc_up = _step_mma(gw, gs, uw, us, xa, acc, acc_up, GATE_UP, WORDS, A, B, BLOCK_M, BLOCK_N, BLOCK_K)
        return acc, acc_up

    @gluon.jit
    def _rest_step(x_ptr, sorted_slots_ptr, w_e, s_e, block, n0, k0, num_slots, N, stride_x, stride_wn, stride_sn,
                   acc, acc_up, TOPK: gl.constexpr, GATE_UP: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                   NUM_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STEP: gl.constexpr,
                   REST_K: gl.constexpr):
        """Where the power of two STEP is part of REST_K (the columns after the last whole step),
        one K step of STEP columns at k0: ``(acc, acc_up, k0 + STEP)``; else them unchanged."""
        if REST_K & STEP:
            WORDS: gl.constexpr = _layouts(NUM_WARPS, BLOCK_N, STEP, BLOCK_M)[0]
            ACTS: gl.constexpr = _layouts(NUM_WARPS, BLOCK_N, STEP, BLOCK_M)[1]
            x_ptrs, x_mask = _acts_ptrs(x_ptr, sorted_slots_ptr, block, num_slots, stride_x, TOPK, GATE_UP, ACTS,
                                        BLOCK_M, STEP)
            acc, acc_up = _k_range(w_e, s_e, x_ptrs, x_mask, _rows(n0, N, WORDS, BLOCK_N), k0, k0 + STEP, N,
                                   stride_wn, stride_sn, acc, acc_up, GATE_UP, WORDS, A, B, BLOCK_M, BLOCK_N, STEP)
            k0 += STEP
        return acc, acc_up, k0

    @gluon.jit
    def _rows(n0, N, WORDS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Output rows n0 .. n0 + BLOCK_N - 1 in the words' row layout, those past N at N - 1."""
        return gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, WORDS)))), N - 1)

    @gluon.jit
    def _experts_kernel(x_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
                        num_slots, K, N, alpha, limit, stride_x, stride_we, stride_wn, stride_se, stride_sn,
                        stride_be, stride_out, TOPK: gl.constexpr, GATE_UP: gl.constexpr, HAS_BIAS: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, REST_K: gl.constexpr,
                        NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr):
        """Program (block of rows, BLOCK_N output rows): GATE_UP, launch 1 (x the activations by
        token, ``out`` act by sorted row); else launch 2 (x act by sorted row, ``out`` fp32 by
        slot, the bias when HAS_BIAS). K steps of BLOCK_K up to the last multiple of BLOCK_K, then
        the rest, REST_K = K % BLOCK_K columns (a multiple of 32), in steps of its powers of two,
        largest first."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        WORDS: gl.constexpr = _layouts(NUM_WARPS, BLOCK_N, BLOCK_K, BLOCK_M)[0]
        ACTS: gl.constexpr = _layouts(NUM_WARPS, BLOCK_N, BLOCK_K, BLOCK_M)[1]
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BLOCK_N)
        block = pid // num_n
        if block * BLOCK_M < gl.load(num_rows_ptr):
            expert = gl.load(block_expert_ptr + block).to(gl.int64)
            w_e = w_ptr + expert * stride_we
            s_e = s_ptr + expert * stride_se
            n0 = (pid % num_n) * BLOCK_N
            rows = _rows(n0, N, WORDS, BLOCK_N)
            x_ptrs, x_mask = _acts_ptrs(x_ptr, sorted_slots_ptr, block, num_slots, stride_x, TOPK, GATE_UP, ACTS,
                                        BLOCK_M, BLOCK_K)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            k_main = (K // BLOCK_K) * BLOCK_K  # a multiple of BLOCK_K to the compiler too: 16-byte loads after it
            if PREFETCH:  # step k + 1 loaded before step k's products
                if k_main > 0:
                    gw, gs, uw, us, xa = _step_loads(w_e, s_e, x_ptrs, x_mask, rows, 0, N, stride_wn, stride_sn,
                                                     GATE_UP, WORDS, BLOCK_N, BLOCK_K)
                    for k0 in range(BLOCK_K, k_main, BLOCK_K):
                        gw1, gs1, uw1, us1, xa1 = _step_loads(w_e, s_e, x_ptrs, x_mask, rows, k0, N, stride_wn,
                                                              stride_sn, GATE_UP, WORDS, BLOCK_N, BLOCK_K)
                        acc, acc_up = _step_mma(gw, gs, uw, us, xa, acc, acc_up, GATE_UP, WORDS, A, B, BLOCK_M,
                                                BLOCK_N, BLOCK_K)
                        gw, gs, uw, us, xa = gw1, gs1, uw1, us1, xa1
                    acc, acc_up = _step_mma(gw, gs, uw, us, xa, acc, acc_up, GATE_UP, WORDS, A, B, BLOCK_M, BLOCK_N,
                                            BLOCK_K)
            else:
                acc, acc_up = _k_range(w_e, s_e, x_ptrs, x_mask, rows, 0, k_main, N, stride_wn, stride_sn, acc,
                                       acc_up, GATE_UP, WORDS, A, B, BLOCK_M, BLOCK_N, BLOCK_K)
            k0 = k_main
            for b in gl.static_range(1, 5):  # the rest of K (< BLOCK_K <= 512): a step of each of its powers of two
                acc, acc_up, k0 = _rest_step(x_ptr, sorted_slots_ptr, w_e, s_e, block, n0, k0, num_slots, N, stride_x,
                                             stride_wn, stride_sn, acc, acc_up, TOPK, GATE_UP, A, B, NUM_WARPS,
                                             BLOCK_M, BLOCK_N, BLOCK_K >> b, REST_K)
            n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
            r = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
            slots = gl.load(sorted_slots_ptr + r)
            store = (n < N)[:, None] & (slots < num_slots)[None, :]
            n_ld = gl.minimum(n, N - 1)
            b_e = b_ptr + expert * stride_be
            if GATE_UP:
                gate = (acc + gl.load(b_e + n_ld).to(gl.float32)[:, None]).to(gl.bfloat16).to(gl.float32)
                up = (acc_up + gl.load(b_e + N + n_ld).to(gl.float32)[:, None]).to(gl.bfloat16).to(gl.float32)
                gate = gl.minimum(gate, limit)
                up = gl.minimum(gl.maximum(up, -limit), limit)
                act = (up + 1.0) * gate / (1.0 + gl.exp(-alpha * gate))
                gl.store(out_ptr + r.to(gl.int64)[None, :] * stride_out + n[:, None], act.to(gl.bfloat16), mask=store)
            else:
                if HAS_BIAS:
                    acc += gl.load(b_e + n_ld).to(gl.float32)[:, None]
                gl.store(out_ptr + slots.to(gl.int64)[None, :] * stride_out + n[:, None], acc, mask=store)


def tensor_core_partials(x: torch.Tensor, experts, topk_ids: torch.Tensor, blocks: ExpertBlocks, cfg) -> torch.Tensor:
    """Launches 1 and 2 (module docstring) on ``blocks`` (rows grouped by expert in blocks of
    ``cfg.block_m``): fp32 ``[1, T * k, H]``, each slot's expert output before the combine. ``x`` bf16
    ``[T, H]``; the caller has checked x, the routing, the config and `tensor_core_refusal`."""
    tokens, top_k = topk_ids.shape
    hidden, inter, num_slots = experts.hidden_size, experts.local, tokens * top_k
    w13, s13, w2, s2 = experts.w13_blocks, experts.w13_scales, experts.w2_blocks, experts.w2_scales
    act = x.new_empty(blocks.sorted_slots.shape[0], inter)
    warps_down = cfg.num_warps_down or cfg.num_warps
    _experts_kernel[(blocks.max_blocks * triton.cdiv(inter, cfg.block_n_gate_up),)](
        x, blocks.sorted_slots, blocks.block_expert, blocks.num_rows, w13, s13, experts.w13_bias, act, num_slots,
        hidden, inter, experts.alpha, experts.limit, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), experts.w13_bias.stride(0), act.stride(0), TOPK=top_k, GATE_UP=True, HAS_BIAS=True,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
        REST_K=hidden % cfg.block_k_gate_up, NUM_WARPS=cfg.num_warps,
        PREFETCH=cfg.prefetch, num_warps=cfg.num_warps)
    partial = torch.empty(1, num_slots, hidden, dtype=torch.float32, device=x.device)
    _experts_kernel[(blocks.max_blocks * triton.cdiv(hidden, cfg.block_n_down),)](
        act, blocks.sorted_slots, blocks.block_expert, blocks.num_rows, w2, s2, experts.w2_bias, partial, num_slots,
        inter, hidden, experts.alpha, experts.limit, act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), experts.w2_bias.stride(0), partial.stride(1), TOPK=top_k, GATE_UP=False,
        HAS_BIAS=experts.tp_rank == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down,
        REST_K=inter % cfg.block_k_down, NUM_WARPS=warps_down, PREFETCH=cfg.prefetch, num_warps=warps_down)
    return partial
