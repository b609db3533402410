"""``y = x @ W^T (+ b)`` for decode-sized batches (M <= MAX_M rows) in Triton.

At decode a linear layer is a weight stream: x is [M, K] with M of 1-64, W is [N, K] (torch's
Linear layout) and the time is bytes of W over HBM bandwidth. cuBLAS picks split-K kernels for
the row-parallel shapes of llama3-8b TP2 (o_proj [4096, 2048], down_proj [4096, 7168]) plus a
separate reduce kernel, and reaches well under the bandwidth there (results in docs/results.md,
section 9). This kernel gives each program BLOCK_N output columns and the whole K loop:

    y[m, n] = sum_k x[m, k] * W[n, k]       (fp32 accumulation, tensor-core tl.dot; + b[n])

with x's rows padded to BLOCK_M >= 16 (tl.dot needs M >= 16; the padding costs flops, not
bytes). No split-K, so no partial buffer and no second launch: N / BLOCK_N programs stream W
once, and BLOCK_K x BLOCK_N tiles pipelined NUM_STAGES deep keep each SM's loads in flight.
Launch parameters come from `choose_config` (measured per shape class on an H200).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

MAX_M = 64  # rows this kernel takes (layers.linear.SKINNY_MAX_M); larger batches use F.linear
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _skinny_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def choose_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Launch parameters for an [m, k] x [n, k]^T product (see the module docstring)."""
    block_n = 32 if n <= 8192 else 64  # >= ~128 programs for every llama3-8b TP2 shape
    return SkinnyConfig(block_n=block_n, block_k=256 if m <= 32 else 128, num_warps=4, num_stages=4)


def skinny_gemm_unavailable_reason(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """None when `skinny_linear` takes ``x @ weight^T``; else why not (shape, dtype, device)."""
    if not (x.is_cuda and weight.is_cuda):
        return "needs CUDA tensors"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return f"needs x and weight of one dtype of {_DTYPES}, got {x.dtype} and {weight.dtype}"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}"
    if x.numel() // max(x.shape[-1], 1) > MAX_M:
        return f"more than {MAX_M} rows"
    if x.stride(-1) != 1 or weight.stride(1) != 1:
        return "the last dimension of x and weight must be contiguous"
    return None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """``x @ weight^T + bias`` as F.linear computes it (a new tensor of x's dtype, leading dims
    kept) for at most MAX_M rows of x. Reads its inputs only. ValueError when
    `skinny_gemm_unavailable_reason` names a reason."""
    reason = skinny_gemm_unavailable_reason(x, weight)
    if reason is not None:
        raise ValueError(f"skinny_linear: {reason}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] of {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = config or choose_config(m, n, k)
        _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], n)


def time_linear(m: int, n: int, k: int, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                dtype: torch.dtype = torch.bfloat16, calls_per_graph: int = 32, repeats: int = 10) -> float:
    """Microseconds per ``fn(x, weight)`` call for x [m, k] and weight [n, k] on the current CUDA
    device: one CUDA graph of ``calls_per_graph`` calls cycling over weight copies that together
    exceed the L2 cache (as a model's layers do), median over ``repeats`` replays."""
    from fusion.cuda_graph_timing import median_us_per_call

    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(1, min(calls_per_graph, -(-256 * 2**20 // (n * k * 2))))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=dtype) for _ in range(copies)]
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)

    def calls() -> None:
        for i in range(calls_per_graph):
            fn(x, weights[i % copies])

    return median_us_per_call(calls, calls_per_graph, warmup=1, trials=repeats)
