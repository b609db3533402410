"""Deterministic mode: the canonical recipe (`fusion.reference`, module docstring) on the
unfused path, on every device, and which strategies may run under it.

    reduce_then_norm(group, x, residual, weight, eps)   the canonical (normed, residual_out) of
                                                          the group's partial sums ``x``
    add_rms_norm(s, residual, weight, eps)                the recipe's add + norm of a reduced ``s``

The reduction: at 2 ranks the group's all-reduce (NCCL, gloo: one addition per element, so the
canonical sum); at N > 2 an all-gather of the partial sums and their rank-order fp32 sum, since a
ring or tree all-reduce adds in a chunk-dependent order with a rounding at every step. The add
+ norm: on a CUDA device with Triton, the row step the fused kernels end with
(`fusion.backends.kernels.reduce_add_rms_norm`), so a row's bits equal theirs; elsewhere the
recipe in torch (`fusion.reference.canonical_add_rms_norm`: the CPU tests).

Which strategies follow the recipe at which world size, and why the others do not, each
strategy's backend class declares (``det_max_world``, ``det_note``); flashinfer's
normed output was measured to depend on the number of rows (hidden 4096, bf16, TP2 on one H200:
0.01 % of the elements change between 64 and 128 rows in the call).
"""
from __future__ import annotations

import torch
from arfusion.fusion import reference
from arfusion.fusion.backends.base import output_tensors
from arfusion.fusion.group import TensorParallelGroup


def _uses_triton(x: torch.Tensor) -> bool:
    """The Triton row step takes ``x`` here: a CUDA tensor, Triton importable, a row of at most MAX_HIDDEN."""
    if not x.is_cuda:
        return False
    try:
        from arfusion.fusion.backends.kernels.row_norm import MAX_HIDDEN
    except ImportError:
        return False
    return x.shape[-1] <= MAX_HIDDEN


def add_rms_norm(s: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of the recipe from the reduced sum ``s [T, H]``. On the GPU in
    place (see `fusion.backends.base.output_tensors`); elsewhere out of place."""
    if not _uses_triton(s):
        return reference.canonical_add_rms_norm(s, residual, weight, eps)
    from arfusion.fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

    out, residual_out = output_tensors(s, residual)
    reduce_add_rms_norm(s.unsqueeze(0), residual, out, residual_out, weight, eps)
    return out, residual_out


def gather_parts(group: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    """Collective: every rank's ``x``, stacked in rank order: ``[N, *x.shape]``."""
    parts = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.all_gather_into(parts, x)
    return parts.view(group.world_size, *x.shape)


def reduce_then_norm(group: TensorParallelGroup, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: the recipe's ``(normed, residual_out)`` of the group's partial sums ``x``
    (consumed; on the GPU ``x`` and ``residual`` are overwritten as in `add_rms_norm`)."""
    if group.world_size <= 2:
        return add_rms_norm(group.all_reduce(x), residual, weight, eps)
    parts = gather_parts(group, x)
    if not _uses_triton(x):
        return reference.canonical_all_reduce_add_rms_norm(list(parts), residual, weight, eps)
    from arfusion.fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

    out, residual_out = output_tensors(x, residual)
    reduce_add_rms_norm(parts, residual, out, residual_out, weight, eps)
    return out, residual_out
