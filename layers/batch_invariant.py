"""Batch-invariant mode: the ops of a forward whose row results must not depend on the batch.

Under ``--deterministic`` every op of the forward is row-independent: the bits of a row's output
depend on that row's inputs only, never on how many other rows are in the call or what they
hold. Off (the default) the engine runs its usual kernels, unchanged. The mode is a per-process
switch: the model runner sets it when it starts (`set_enabled`: the sampler's log-probabilities
follow it too) and around each forward and each CUDA-graph capture (`batch_invariant_mode`, so
that runners of either mode can share a process); the ops ask `enabled()` when they run.

    linear(x, W, b)     GPU: the Triton matmul of layers/kernels/triton_bi_matmul.py (tiling and
                        split-K from (N, K) only). CPU: torch's matmul in calls of exactly
                        ROW_TILE rows (the last zero-padded), so every row goes through the
                        same GEMM of the same shape. torch's CPU GEMMs (MKL / oneDNN) pick
                        their kernel by the row count M: a row's bits differ between small M
                        and larger M, and on CPUs with AVX-512-BF16 / AMX also between some
                        multiples of 16 (bf16 with a bias from 48 rows, fp32 at 2048 x 896 from
                        128), so padding M to a multiple of ROW_TILE is not enough.
    tree_sum(x)         sum over the last dim by the fusion recipe's fixed pairwise tree
                        (`fusion.reference.fixed_tree_sum`: the length zero-padded to a power of
                        two, halved by elementwise adds): exactly row-independent on every
                        device, whatever the reduction kernels would choose
    log_softmax(x)      x - m - log(tree_sum(exp(x - m))), m = the row max (exact in any order)

The plain norm layers off flashinfer's path follow the fusion op's canonical add + RMSNorm
(`fusion.reference.canonical_add_rms_norm`, layers/layernorm.py); flashinfer's kernel is
row-invariant (one CTA per row, launched from the hidden size only).

Attention keeps its split sizes fixed in this mode (layers/attention.py), rotary embedding and
the activations are elementwise, the per-head q/k norms that the GPU's rotary kernel fuses
(layers/kernels/triton_rotary.py) reduce one head of one token per program in an order fixed by
head_dim, and greedy sampling is an exact argmax.
"""
from __future__ import annotations

from typing import ContextManager, Optional

import torch
import torch.nn.functional as F

from arfusion.fusion.reference import fixed_tree_sum
from arfusion.layers.kernels.process_switch import ProcessSwitch
from arfusion.layers.kernels.triton_support import triton_available

ROW_TILE = 16  # CPU: rows are computed in a call whose row count is a multiple of this
_MODE = ProcessSwitch()


def enabled() -> bool:
    """Whether batch-invariant mode is on in this process."""
    return _MODE.on


def set_enabled(on: bool) -> None:
    """Batch-invariant mode on or off for this process from now on."""
    _MODE.on = on


def batch_invariant_mode(on: bool) -> ContextManager[None]:
    """Batch-invariant mode on (or off) inside a ``with`` block; the previous setting is restored."""
    return _MODE.scoped(on)


def uses_triton_matmul(x: torch.Tensor) -> bool:
    """The GPU path of `linear`: a CUDA tensor of a float dtype, triton importable."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available()


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` on ``x [M, K]`` in calls of exactly `ROW_TILE` rows each (x zero-padded to a
    multiple of it), cut back to M (the CPU path of `linear`); a new tensor."""
    pad = -x.shape[0] % ROW_TILE
    padded = F.pad(x, (0, 0, 0, pad)) if pad else x
    if padded.shape[0] == ROW_TILE:
        return F.linear(padded, weight, bias)[:x.shape[0]]
    return torch.cat([F.linear(tile, weight, bias) for tile in padded.split(ROW_TILE)])[:x.shape[0]]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight^T + bias`` over the last dim of ``x``: ``F.linear`` when the mode is off,
    else row-invariant (the module docstring). Returns a new tensor."""
    if not enabled():
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if uses_triton_matmul(flat):
        from arfusion.layers.kernels.triton_bi_matmul import matmul

        out = matmul(flat.contiguous(), weight, bias)
    else:
        out = row_tiled_linear(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` of fp32 ``x`` by `fusion.reference.fixed_tree_sum`'s tree: each output
    element's additions and their order depend on the length of the last dim only."""
    return fixed_tree_sum(x)[..., 0]


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-invariant ``log_softmax(x, -1)`` in fp32: ``x - m - log(tree_sum(exp(x - m)))``."""
    x = x.float()
    m = x.amax(dim=-1, keepdim=True)
    shifted = x - m
    return shifted - torch.log(tree_sum(torch.exp(shifted))).unsqueeze(-1)

