"""``y = x @ W^T (+ b)`` for a few rows of x (decode: one to a few dozen tokens) as a
weight-streaming Triton launch: one program per BLOCK_N output features, the weight tile the
dot's left operand and the tokens its right (``y^T = W @ x^T``), so the MMA's M side is the
weight's rows and the tokens, padded to BLOCK_M (at least 16), are its N side:

    acc[n, m] = sum over K steps of  W[n, k0 : k0 + BLOCK_K] . x[m, k0 : k0 + BLOCK_K]     fp32
    y[m, n]   = round(acc[n, m] + b[n])                                                   x's dtype

Why our own launch: at these sizes the step reads each weight byte once and little else, so
its time is the weight's bytes over the memory bandwidth plus the launch's fixed cost. For
outputs no wider than the input (the attention output and MLP down projections) cuBLAS splits K
across programs and adds a reduction launch; this launch keeps one program per output tile and
was faster there, and no faster for wider outputs (q/k/v, gate/up: docs/results.md, decode-sized
matmuls), which therefore stay with cuBLAS (`serves`). The K loop is software-pipelined by
Triton (``num_stages`` weight tiles in flight per program, loaded asynchronously), every output
is one program's fp32 sum in a fixed order (deterministic run to run; not batch-invariant: the
padded token count follows the batch, so batch-invariant mode never takes it), and nothing is
read back to the host (CUDA-graph capturable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.triton_l2_prefetch import bulk_prefetch_l2
from arfusion.layers.kernels.triton_launch_cache import CachedLauncher

MAX_TOKENS = 32  # the most rows of x this launch serves (`skinny_linear`)
# With programmatic dependent launch, the columns of its rows a program asks L2 for before the
# wait (`_skinny_kernel`): four K steps of the default tiles, what the loop reads first; in
# PREFETCH_PARTS bulk requests a row, so that a program's 128 threads issue one each at 32 rows
PDL_PREFETCH_COLS = 1024
PREFETCH_PARTS = tl.constexpr(4)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of `skinny_linear`: ``block_n`` output features per program, ``block_k`` columns a
    K step (powers of two, at least 16), ``num_warps``, ``num_stages`` (K steps in flight)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = SkinnyConfig()
# up to 2048 outputs, narrower tiles give more programs (the sweep of
# benchmarks/kernels/bench_skinny_matmul.py at 2048 x 4096)
NARROW_CONFIG = SkinnyConfig(block_n=16, block_k=512, num_warps=4, num_stages=4)


def default_config(n: int) -> SkinnyConfig:
    """The tiles for ``n`` output features."""
    return NARROW_CONFIG if n <= 2048 else DEFAULT_CONFIG


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes ``x [..., K] @ weight [N, K]^T`` in place of cuBLAS: a CUDA
    fp16 / bf16 x of at most `MAX_TOKENS` rows with a contiguous last dimension, a weight of its
    dtype with N <= K and a contiguous last dimension (module docstring: where it was faster)."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[0] <= weight.shape[1] and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // max(1, x.shape[-1]) <= MAX_TOKENS and x.stride(-1) == 1 and weight.stride(1) == 1)


@triton.jit
def _weight_tile(w_rows, row_mask, k0, k_size, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``W[rows, k0 : k0 + BLOCK_K]`` (``w_rows``: the rows' pointers ``[BLOCK_N, 1]``), zeros
    past ``k_size`` and in masked rows."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None]
    if not EVEN_K:
        mask = mask & (k < k_size)[None, :]
    return tl.load(w_rows + k[None, :], mask=mask, other=0.0)


@triton.jit
def _token_tile(x_cols, token_mask, k0, k_size, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``x[tokens, k0 : k0 + BLOCK_K]^T`` (``x_cols``: the tokens' pointers ``[1, BLOCK_M]``), zeros
    past ``k_size`` and in padded tokens."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = token_mask[None, :]
    if not EVEN_K:
        mask = mask & (k < k_size)[:, None]
    return tl.load(x_cols + k[:, None], mask=mask, other=0.0)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m_size, n_size, k_size, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_COLS: tl.constexpr):
    """Program: output features ``pid * BLOCK_N ..`` for every token (module docstring). With
    USE_PDL it waits for the previous kernel (layers/kernels/pdl.py) before its first load, and
    before that wait asks L2 for the first PREFETCH_COLS columns of its rows (bulk prefetches,
    PREFETCH_PARTS a row; none when 0): the weight does not depend on the previous kernel, so its
    first K steps stream into L2 while that kernel still runs, and the loop's first loads after
    the wait find them there."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_size
    tokens = tl.arange(0, BLOCK_M)
    token_mask = tokens < m_size
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + tokens.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if USE_PDL:
        if PREFETCH_COLS > 0:
            part = tl.arange(0, PREFETCH_PARTS)
            cols: tl.constexpr = PREFETCH_COLS // PREFETCH_PARTS
            row_bytes = tl.where(row_mask, cols * w_ptr.dtype.element_ty.primitive_bitwidth // 8, 0)
            bulk_prefetch_l2(w_rows + (part * cols)[None, :], tl.broadcast_to(row_bytes[:, None],
                                                                              (BLOCK_N, PREFETCH_PARTS)))
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(0, k_size, BLOCK_K):
        w = _weight_tile(w_rows, row_mask, k0, k_size, BLOCK_K, EVEN_K)
        acc = tl.dot(w, _token_tile(x_cols, token_mask, k0, k_size, BLOCK_K, EVEN_K), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + tokens.to(tl.int64)[None, :] * stride_ym + rows[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & token_mask[None, :])


SKINNY_LAUNCHER = CachedLauncher(_skinny_kernel)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` -> a new ``[M, N]`` of x's dtype (module
    docstring), M at most `MAX_TOKENS`; x and weight fp16 or bf16 of one dtype, last dims
    contiguous; ``config`` `default_config` unless given. ValueError naming the problem
    otherwise."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must agree in K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x and weight must both be fp16 or both bf16, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if not 0 < x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"skinny_linear serves 1 to {MAX_TOKENS} rows of x, got {x.shape[0]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(n)
    y = x.new_empty(m, n)
    use_pdl = pdl.enabled()
    SKINNY_LAUNCHER((triton.cdiv(n, cfg.block_n),), x, weight, bias if bias is not None else weight, y, m, n, k,
                    x.stride(0), weight.stride(0), y.stride(0), bias is not None, k % cfg.block_k == 0,
                    max(16, triton.next_power_of_2(m)), cfg.block_n, cfg.block_k, use_pdl,
                    pdl_prefetch_cols(weight) if use_pdl else 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    launch_pdl=use_pdl)
    return y


def pdl_prefetch_cols(weight: torch.Tensor) -> int:
    """The columns of each row `_skinny_kernel` asks L2 for before its wait: `PDL_PREFETCH_COLS`,
    or fewer for a narrower weight (whole 16-byte granules a part), 0 where the bulk prefetch
    cannot take the rows (a row start not 16-byte aligned) or cannot run (triton's interpreter)."""
    row_bytes = weight.stride(0) * weight.element_size()
    if triton.knobs.runtime.interpret or weight.data_ptr() % 16 or row_bytes % 16:
        return 0
    granule = PREFETCH_PARTS.value * 16 // weight.element_size()  # columns: a 16-byte multiple in every part
    return min(PDL_PREFETCH_COLS, weight.shape[1] // granule * granule)
