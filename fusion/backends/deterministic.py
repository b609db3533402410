"""Deterministic mode: the canonical recipe (`fusion.reference`, module docstring) on the
unfused path, on every device, and which strategies may run under it.

    reduce_then_norm(group, x, residual, weight, eps)   the canonical (normed, residual_out) of
                                                          the group's partial sums ``x``
    ordered_all_reduce(group, x)                          the canonical sum, in place
    add_rms_norm(s, residual, weight, eps)                the recipe's add + norm of a reduced ``s``

The reduction: at 2 ranks the group's all-reduce (NCCL, gloo: one addition per element, so the
canonical sum); at N > 2 an all-gather of the partial sums and their rank-order fp32 sum, since a
ring or tree all-reduce adds in a chunk-dependent order with a rounding at every step. The add
+ norm: on a CUDA device with Triton, the row step the fused kernels end with
(`fusion.backends.kernels.reduce_add_rms_norm`), so a row's bits equal theirs; elsewhere the
recipe in torch (`fusion.reference.canonical_add_rms_norm`: the CPU tests).

Strategies (`allowed`): nccl, torch, symm_mem_fused and lamport_one_shot at any world size,
symm_mem_two_shot at 2 ranks (torch's two-shot kernel adds once there, in an order of its own
with bf16 roundings beyond). flashinfer's one-shot and two-shot are never allowed: their
reduction and norm are not ours to fix, and their normed output was measured to depend on the
number of rows (hidden 4096, bf16, TP2 on one H200: 0.01 % of the elements change between
64 and 128 rows in the call).
"""
from __future__ import annotations

from typing import Optional

import torch

from fusion import reference
from fusion.group import TensorParallelGroup
from fusion.strategy import Strategy

NEVER_ALLOWED = {
    Strategy.FLASHINFER_ONE_SHOT: "flashinfer's kernel reduces and normalises in its own order; its normed output "
                                  "changes with the number of rows in the call",
    Strategy.FLASHINFER_TWO_SHOT: "flashinfer's kernel reduces and normalises in its own order; its normed output "
                                  "changes with the number of rows in the call",
}
TWO_RANKS_ONLY = {
    Strategy.SYMM_MEM_TWO_SHOT: "torch's two-shot all-reduce adds more than two ranks in its own order, rounding "
                                "to the model dtype at each step",
}


def excluded(world_size: int) -> dict[Strategy, str]:
    """The strategies deterministic mode leaves out at ``world_size`` ranks, with why."""
    out = dict(NEVER_ALLOWED)
    if world_size > 2:
        out.update(TWO_RANKS_ONLY)
    return out


def allowed(strategy: Strategy, world_size: int) -> bool:
    """Does ``strategy`` follow the canonical recipe at ``world_size`` ranks?"""
    return strategy not in excluded(world_size)


def _uses_triton(x: torch.Tensor) -> bool:
    """The Triton row step takes ``x`` here: a CUDA tensor, Triton importable, a row of at most MAX_HIDDEN."""
    if not x.is_cuda:
        return False
    try:
        from fusion.backends.kernels.reduce_add_rms_norm import MAX_HIDDEN
    except ImportError:
        return False
    return x.shape[-1] <= MAX_HIDDEN


def _outputs(x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as `fusion.norm.add_rms_norm` on the GPU: ``x`` receives the normed output and
    ``residual`` the sum; without a residual ``x`` keeps the sum and the normed output is new."""
    return (torch.empty_like(x), x) if residual is None else (x, residual)


def add_rms_norm(s: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of the recipe from the reduced sum ``s [T, H]``. On the GPU in
    place (see `_outputs`); elsewhere out of place."""
    if not _uses_triton(s):
        return reference.canonical_add_rms_norm(s, residual, weight, eps)
    from fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

    out, residual_out = _outputs(s, residual)
    reduce_add_rms_norm(s.unsqueeze(0), residual, out, residual_out, weight, eps)
    return out, residual_out


def gather_parts(group: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    """Collective: every rank's ``x``, stacked in rank order: ``[N, *x.shape]``."""
    parts = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.all_gather_into(parts, x)
    return parts.view(group.world_size, *x.shape)


def ordered_all_reduce(group: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    """Collective: ``x`` becomes the canonical sum of every rank's ``x`` (in place); returns ``x``."""
    if group.world_size <= 2:
        return group.all_reduce(x)
    x.copy_(reference.rank_order_sum(list(gather_parts(group, x))))
    return x


def reduce_then_norm(group: TensorParallelGroup, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: the recipe's ``(normed, residual_out)`` of the group's partial sums ``x``
    (consumed; on the GPU ``x`` and ``residual`` are overwritten as in `add_rms_norm`)."""
    if group.world_size <= 2:
        return add_rms_norm(group.all_reduce(x), residual, weight, eps)
    parts = gather_parts(group, x)
    if not _uses_triton(x):
        return reference.canonical_all_reduce_add_rms_norm(list(parts), residual, weight, eps)
    from fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

    out, residual_out = _outputs(x, residual)
    reduce_add_rms_norm(parts, residual, out, residual_out, weight, eps)
    return out, residual_out
