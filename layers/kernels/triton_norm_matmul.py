"""``y = rms_norm(x + residual) * g @ W^T (+ b)`` for a few tokens (decode) in one weight-streaming
Triton launch: the residual add + RMSNorm before attention folded into the q/k/v projection
(layers/pending_norm.py), so that a decode step runs one launch where it ran two.

Per token m, for ``x [T, K]``, ``residual [T, K]``, the norm's weight ``g [K]``, ``W [N, K]`` and
an optional bias ``b [N]``:

    s[m, k] = round(fp32(x[m, k]) + fp32(residual[m, k]))            -> residual_out[m, k]
    inv[m]  = 1 / sqrt(ssq[m] / K + eps),  ssq[m] = sum_k fp32(s[m, k])^2        fp32
    h[m, k] = round((fp32(s[m, k]) * inv[m]) * fp32(g[k]))                    not stored
    y[m, n] = round(sum_k fp32(W[n, k]) * fp32(h[m, k]) (+ fp32(b[n])))      fp32 accumulation

``round`` is round-to-nearest-even into x's dtype. These are the roundings of
`fusion.reference.add_rms_norm` followed by a matmul of its output: the sum is rounded to the
model dtype once and its statistic is taken from the rounded sum; the statistic, ``inv`` and
the scaling stay fp32 (``s * inv`` first, then ``* g``, the reference's order) and the normed
value is rounded once, before the matmul. ``1 / sqrt`` here is two correctly rounded steps
(``sqrt_rn``, ``div_rn``); the reference's ``rsqrt`` and its sum of squares run in torch's order,
so ``inv`` may differ from the reference's in its last bits and an element of ``h`` by one ulp.
flashinfer's ``fused_add_rmsnorm``, the separate norm on the GPU, rounds the stored residual as
here but takes the statistic from, and scales, the unrounded fp32 sum, with an approximate
reciprocal square root: its ``h`` can differ from this launch's (and the reference's) by an ulp.

Launch: one program per ``block_n`` output features, as `triton_skinny_matmul` (its tiles,
`SkinnyConfig` by `default_config`, the K step cut by `k_step` where the activations' two tiles
would not fit beside the weight's), the weight tile the dot's left operand and the tokens,
padded to ``BLOCK_M`` (at least 16), its right. Each program first runs over the whole rows of x
and residual for ``ssq`` (K is at most a few thousand: cheap beside the weight it streams), then
streams its weight tiles, recomputing ``s`` and ``h`` tile by tile. So every program reads the
activations twice; at 32 tokens of K 4096 that is 1 MiB per program, read from L2.

In-place effects: none on the inputs. ``x`` and ``residual`` are only read (every program reads
the old residual: it is never written); the sum ``s`` goes to a separate tensor,
``residual_out``, written by program 0 alone (one writer per element), which the caller takes
as the new residual. Every output is one program's fp32 sum in a fixed order
(deterministic run to run; not batch-invariant: the padded token count follows the batch), and
nothing is read back to the host (CUDA-graph capturable).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.triton_launch_cache import CachedLauncher
from arfusion.layers.kernels.triton_skinny_matmul import MAX_TOKENS, SkinnyConfig, default_config

K_ALIGN = 16  # K must be a multiple of this: the smallest K step of a dot, so no step is partial
# shared memory for the K steps in flight: num_stages x (weight + x + residual tiles); H200 has 227 KiB
# a block, and the dot's staging of h and the layout conversions take some of the rest
SMEM_BUDGET = 128 * 1024
SERVED_DTYPES = (torch.float16, torch.bfloat16)  # what `refusal` lets through (fp32 runs, for exact checks)
_DTYPES = SERVED_DTYPES + (torch.float32,)


def _problem(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: Optional[torch.Tensor],
             bias: Optional[torch.Tensor]) -> Optional[str]:
    """What `norm_linear` refuses in these inputs, or None (``weight`` None: x, residual and the
    norm weight only)."""
    if x.dtype not in _DTYPES:
        return f"x must be fp16, bf16 or fp32, got {x.dtype}"
    if x.dim() != 2:
        return f"x must be [T, K], got shape {tuple(x.shape)}"
    t, k = x.shape
    if not 0 < t <= MAX_TOKENS:
        return f"the launch takes 1 to {MAX_TOKENS} tokens, got {t}"
    if k % K_ALIGN:
        return f"K ({k}) must be a multiple of {K_ALIGN}"
    tensors = {"residual": residual, "norm weight": norm_weight}
    if weight is not None:
        tensors["weight"] = weight
    if bias is not None:
        tensors["bias"] = bias
    for name, tensor in tensors.items():
        if tensor.dtype != x.dtype:
            return f"{name} must have x's dtype {x.dtype}, got {tensor.dtype}"
        if tensor.device != x.device:
            return f"{name} is on {tensor.device}, x on {x.device}"
    if residual.shape != x.shape:
        return f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
    if tuple(norm_weight.shape) != (k,):
        return f"norm weight must be [{k}], got {tuple(norm_weight.shape)}"
    if weight is not None and (weight.dim() != 2 or weight.shape[1] != k):
        return f"weight must be [N, {k}], got {tuple(weight.shape)}"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}"
    if any(tensor.stride(-1) != 1 for tensor in tensors.values()) or x.stride(1) != 1:
        return "x, residual, the norm weight, weight and bias need a contiguous last dimension"
    return None


def k_step(config: SkinnyConfig, k: int, block_m: int, itemsize: int) -> int:
    """The K step: ``config.block_k`` cut to the largest power of two dividing ``k`` (so that
    every step is whole) and to what keeps ``config.num_stages`` steps of the weight's, x's and
    the residual's tiles within `SMEM_BUDGET` bytes; at least `K_ALIGN` (``k`` a multiple of it)."""
    step = min(config.block_k, k & -k)
    while step > K_ALIGN and config.num_stages * (config.block_n + 2 * block_m) * step * itemsize > SMEM_BUDGET:
        step //= 2
    return step


def refusal(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
            weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why `norm_linear` does not take this batch in place of the separate norm and matmul, or
    None: the inputs must be CUDA fp16 / bf16 tensors that `norm_linear` accepts (``weight``
    None: the batch alone, before its consumer is known). The reason names no token count (a
    caller logs each reason once)."""
    if x.dim() == 2 and x.shape[0] > MAX_TOKENS:
        return f"the launch takes at most {MAX_TOKENS} tokens"
    if not x.is_cuda:
        return "the activations are not on a CUDA device"
    if x.dtype not in SERVED_DTYPES:
        return f"the launch serves fp16 and bf16, not {x.dtype}"
    return _problem(x, residual, norm_weight, weight, bias)


@triton.jit
def _row_sums(x_cols, r_cols, k, token_mask):
    """``round(fp32(x) + fp32(residual))`` of K columns ``k`` of every token: ``[BLOCK_K, BLOCK_M]``
    in x's dtype (zero for a padded token)."""
    xt = tl.load(x_cols + k[:, None], mask=token_mask[None, :], other=0.0)
    rt = tl.load(r_cols + k[:, None], mask=token_mask[None, :], other=0.0)
    return (xt.to(tl.float32) + rt.to(tl.float32)).to(xt.dtype)


@triton.jit
def _norm_matmul_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, s_ptr, m_size, n_size, k_size, eps, stride_xm,
                        stride_rm, stride_wn, stride_ym, stride_sm, HAS_BIAS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program: output features ``pid * BLOCK_N ..`` for every token (module docstring); K is a
    multiple of BLOCK_K. With USE_PDL it waits for the previous kernel before it reads x or the
    residual (layers/kernels/pdl.py)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_M)
    token_mask = tokens < m_size
    x_cols = x_ptr + tokens.to(tl.int64)[None, :] * stride_xm
    r_cols = r_ptr + tokens.to(tl.int64)[None, :] * stride_rm
    ssq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        s = _row_sums(x_cols, r_cols, k, token_mask)
        sf = s.to(tl.float32)
        ssq += tl.sum(sf * sf, axis=0)
        if pid == 0:
            tl.store(s_ptr + tokens.to(tl.int64)[None, :] * stride_sm + k[:, None], s, mask=token_mask[None, :])
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ssq, k_size.to(tl.float32)) + eps))

    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_size
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None], other=0.0)
        s = _row_sums(x_cols, r_cols, k, token_mask)
        g = tl.load(g_ptr + k).to(tl.float32)
        h = ((s.to(tl.float32) * inv[None, :]) * g[:, None]).to(s.dtype)
        acc = tl.dot(w, h, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + tokens.to(tl.int64)[None, :] * stride_ym + rows[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & token_mask[None, :])


NORM_MATMUL_LAUNCHER = CachedLauncher(_norm_matmul_kernel)


def norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None,
                config: Optional[SkinnyConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, residual_out)``: ``y = rms_norm(x + residual) * norm_weight @ weight^T (+ bias)``, a
    new ``[T, N]``, and ``residual_out = x + residual`` (module docstring: the roundings).

    ``x`` and ``residual`` ``[T, K]``, T at most `MAX_TOKENS`, K a multiple of `K_ALIGN`;
    ``norm_weight [K]``, ``weight [N, K]``, ``bias [N]``; all of one dtype (fp16 or bf16; fp32
    runs too, its dot in IEEE fp32) and device, last dimensions contiguous. ``residual_out``: a
    contiguous ``[T, K]`` tensor of x's dtype that receives the sum (a new one when None; it must
    not overlap x or residual). Neither ``x`` nor ``residual`` is written. ``config``: the tiles,
    `default_config(N)` unless given, its K step cut by `k_step`. ValueError naming the problem
    otherwise."""
    problem = _problem(x, residual, norm_weight, weight, bias)
    if problem is None and residual_out is not None:
        if residual_out.shape != x.shape or residual_out.dtype != x.dtype or not residual_out.is_contiguous():
            problem = f"residual_out must be a contiguous {tuple(x.shape)} {x.dtype} tensor"
        elif residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
            problem = "residual_out must be a tensor of its own, not x or residual (the programs read them)"
    if problem is not None:
        raise ValueError(problem)
    summed = residual_out if residual_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return launch_checked(x, residual, norm_weight, eps, weight, bias, summed, config), summed


def launch_checked(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, bias: Optional[torch.Tensor], residual_out: torch.Tensor,
                   config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """`norm_linear`'s ``y`` for inputs already checked (`refusal` None for them; ``residual_out``
    a new ``[T, K]`` tensor of x's dtype with a contiguous last dimension): the launch alone, for
    a caller that checked the batch when it chose this launch (`layers.pending_norm.PendingNorm`)."""
    t, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(n)
    block_m = max(16, triton.next_power_of_2(t))
    block_k = k_step(cfg, k, block_m, x.element_size())
    out = x.new_empty(t, n)
    use_pdl = pdl.enabled()
    NORM_MATMUL_LAUNCHER((triton.cdiv(n, cfg.block_n),), x, residual, norm_weight, weight,
                         bias if bias is not None else weight, out, residual_out, t, n, k, float(eps), x.stride(0),
                         residual.stride(0), weight.stride(0), out.stride(0), residual_out.stride(0), bias is not None,
                         "ieee" if x.dtype == torch.float32 else "tf32", block_m, cfg.block_n, block_k, use_pdl,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl)
    return out
