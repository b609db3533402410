"""A batch-invariant ``y = x @ W^T (+ b)`` in Triton: row m of ``y`` has the same bits whatever
the number of rows M in the call and whatever the other rows hold.

    y[m, n] = sum_{s < S} P_s[m, n] (+ b[n]),   P_s[m, n] = sum over K blocks k of split s, in order,
                                                           of x[m, k] . W[n, k]   (fp32 accumulation)

S splits of K (split s takes K columns [s*Ks, (s+1)*Ks), Ks = round_up(ceil(K / S), BLOCK_K)),
each a ``tl.dot`` loop over BLOCK_K-wide blocks in increasing k, one program per (tile, split);
each stores its partial sum P_s (fp32) and counts its arrival on the tile's counter, and the
tile's last program to arrive adds the S partials in the fixed order s = 0, 1, ..., S-1, adds the
bias in fp32 and rounds once to the output dtype (S = 1: the one program does that). Which
program arrives last varies from run to run; the order of the sums does not.

Why it is row-invariant: BLOCK_K and S, which fix the order of the sums over K, are functions of
(N, K) only (`choose_config`), never of M. A row is one row of a BLOCK_M tile; tensor-core
products accumulate each output element over k inside the instruction, with no exchange between
rows; rows past M load zeros and are not stored. So the sequence of additions that yields y[m,
n] is the same for every M. The tile (BLOCK_M, BLOCK_N, warps, stages) may follow M where the
measured table (layers/kernels/bi_matmul_table.py) says so; its tuner keeps only tiles that give
the rows the same bits, and tests check every entry at several M. cuBLAS instead picks its kernel, its tile and its
split-K by M (a decode batch of 1 and of 32 round differently), which is why the default mode's
GEMMs are not batch-invariant.

Why our own kernel: torch (2.11-2.13) has no batch-invariant matmul mode (its deterministic
algorithms are deterministic run to run, not invariant in M), triton ships only tutorials, and
flashinfer has no dense bf16 GEMM with a fixed tiling; vLLM's and SGLang's batch-invariant
GEMMs live inside those engines, not in a library we could depend on.

Why split-K: a decode GEMM (M = 1 ... 128) with tiles over N alone has too few programs for an
H200's 132 SMs at N = 4096 (64 tiles of 64 columns), so it cannot reach the memory-bandwidth
floor; a fixed S reduced in a fixed order keeps the result a function of (N, K) alone.

Effects: reads x, W and b; returns a new ``[M, N]`` tensor of x's dtype; with S > 1 uses an fp32
scratch ``[S, M, N]`` and the device's arrival counters (`ARRIVALS`,
layers/kernels/arrival_counters.py: zero before and after each call; calls that share a device
run one at a time, as on one stream). Launch and
buffers depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels.arrival_counters import ArrivalCounters, last_to_arrive
from arfusion.layers.kernels.bi_matmul_table import load_table
from arfusion.layers.kernels.triton_launch_cache import CachedLauncher

TARGET_PROGRAMS = 256  # about two programs per SM of an H200 at M <= BLOCK_M
MAX_SPLITS = 8
MIN_SPLIT_K = 512  # a split keeps at least this many K columns
GROUP_M = 8  # row tiles per group of the program order (L2 reuse of W in large prefills)


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    splits: int  # S: K splits, reduced in order
    num_warps: int
    num_stages: int


def choose_config(n: int, k: int, m: int = 1) -> MatmulConfig:
    """The tiling for an ``[m, k] x [k, n]`` product: the measured table's entry for (n, k)
    (BLOCK_K and S from (n, k); BLOCK_M, BLOCK_N, warps and stages from m's bucket) when it has
    one, else `default_config`."""
    entry = load_table().get((n, k))
    if entry is None:
        return default_config(n, k)
    block_m, block_n, warps, stages = entry.tile(m)
    return MatmulConfig(block_m, block_n, entry.block_k, entry.splits, warps, stages)


def default_config(n: int, k: int) -> MatmulConfig:
    """The rule for a shape the table lacks, from (n, k) only: 64 x 64 x 128 tiles and the
    fewest K splits (a power of two, at most MAX_SPLITS, each at least MIN_SPLIT_K columns) that
    give TARGET_PROGRAMS programs per BLOCK_M rows."""
    block_m, block_n, block_k = 64, 64, 128
    tiles = triton.cdiv(n, block_n)
    splits = 1
    while tiles * splits < TARGET_PROGRAMS and splits < MAX_SPLITS and k // (2 * splits) >= MIN_SPLIT_K:
        splits *= 2
    return MatmulConfig(block_m, block_n, block_k, splits, num_warps=4, num_stages=4)


@triton.jit
def _matmul_kernel(X, W, Bias, Out, Part, Arrivals, M, N, K, split_k, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr):
    # tiles in groups of GROUP_M row tiles: consecutive programs share W's column tiles and x's
    # row tiles in L2 (a large prefill reads W once per group instead of once per row tile)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum((split + 1) * split_k, K)
    for k0 in range(split * split_k, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        part_ptrs = Part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # split s: s * M * N further
        tl.store(part_ptrs + split.to(tl.int64) * M * N, acc, mask=mask)
        # the last program of the tile reads the others' partials from L2 (.cg), in split order
        if last_to_arrive(Arrivals, pid, SPLITS):
            total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(part_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=mask)


MATMUL_LAUNCHER = CachedLauncher(_matmul_kernel, max_entries=256)
ARRIVALS = ArrivalCounters("batch-invariant matmul")  # the split launches' per-tile counters


class LaunchPlan(NamedTuple):
    config: MatmulConfig
    split_k: int  # K columns per split: Ks = round_up(ceil(K / S), BLOCK_K)
    grid: tuple[int, int]  # (row tiles x column tiles, S)


@functools.lru_cache(maxsize=4096)
def launch_plan(m: int, n: int, k: int, config: Optional[MatmulConfig] = None) -> LaunchPlan:
    """The config (``config`` or `choose_config`), split width and grid of an ``[m, k] x [k, n]``
    product; cached per arguments (the table is read once per process anyway)."""
    cfg = config or choose_config(n, k, m)
    split_k = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    return LaunchPlan(cfg, split_k, (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.splits))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           config: Optional[MatmulConfig] = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N])`` -> new ``[M, N]`` of x's dtype (module
    docstring). ``x`` and ``weight`` need a contiguous last dimension and one dtype; ``config``
    overrides `choose_config` (tests). Both kernels go through `CachedLauncher`s."""
    x_shape, w_shape = x.shape, weight.shape
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x_shape)} and {tuple(w_shape)}")
    dtype, has_bias = x.dtype, bias is not None
    if weight.dtype != dtype or (has_bias and (bias.shape != (w_shape[0],) or bias.dtype != dtype)):
        raise ValueError(f"x, weight and bias must share one dtype and bias must be [N]; got {x.dtype}, "
                         f"{weight.dtype}, {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (has_bias and not bias.is_contiguous()):
        raise ValueError("x and weight need a contiguous last dimension, bias must be contiguous")
    (m, k), n = x_shape, w_shape[0]
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    if m == 0:
        return out
    cfg, split_k, grid = launch_plan(m, n, k, config)
    splits = cfg.splits
    if splits == 1:
        part = arrivals = out
    else:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        arrivals = ARRIVALS.get(x.device, grid[0])
    # out is a new contiguous [m, n]: its row stride is n
    MATMUL_LAUNCHER(grid, x, weight, bias if has_bias else out, out, part, arrivals, m, n, k, split_k, x.stride(0),
                    weight.stride(0), n, cfg.block_m, cfg.block_n, cfg.block_k, splits, has_bias, GROUP_M,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
