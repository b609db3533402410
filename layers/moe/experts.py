"""`MoEExperts`: E SwiGLU experts, each split over the TP ranks as a dense Llama MLP is.

Rank r of tp holds, for every expert e (I = the expert's intermediate size, I_r = I / tp):

    w13[e] = [gate_proj[e] rows r*I_r..(r+1)*I_r ; up_proj[e] the same rows]     [2 * I_r, H]
    w2[e]  = down_proj[e] columns r*I_r..(r+1)*I_r                               [H, I_r]

so ``forward`` returns this rank's partial sum of the MoE output (``reduce_results=False``): the
sum over ranks of the partials is the full output, and the caller reduces it, fused with the
residual add and the next RMSNorm exactly as a dense MLP's down projection.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from arfusion.fusion import UnformedSum
from arfusion.layers import batch_invariant
from arfusion.layers.linear import check_shape, divide
from arfusion.layers.moe.align import ExpertBlocks
from arfusion.layers.moe.torch_experts import moe_experts_torch
from arfusion.layers.parallel_state import get_tp_group
from arfusion.layers.kernels.triton_support import triton_available

EXPERT_PARTS = ("gate", "up", "down")
ExpertShardId = tuple[int, str]  # (expert, part)


class MoEExperts(nn.Module):
    """``forward(x [T, H], topk_weights fp32 [T, k], topk_ids [T, k]) ->`` this rank's partial
    ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` (a new ``[T, H]``). On GPU with triton: the fused
    MoE (layers/moe/kernels/triton_fused_moe.py) with ``combine`` "folded" (default) or "unfused";
    elsewhere the torch reference (layers/moe/torch_experts.py). Both keep a token's bits its own
    in batch-invariant mode (`layers.batch_invariant`; each module's docstring says how)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_per_partition = divide(intermediate_size, self.tp_size, "expert intermediate size")
        local = self.intermediate_per_partition
        self.w13_weight = self._param((num_experts, 2 * local, hidden_size), dtype, device)
        self.w2_weight = self._param((num_experts, hidden_size, local), dtype, device)
        self.combine = "folded"

    def _param(self, shape: tuple[int, ...], dtype: Optional[torch.dtype], device: Optional[torch.device]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShardId) -> None:
        """Copy this rank's shard of one expert's full checkpoint tensor into ``param``.
        ``shard_id`` = ``(expert, part)``: part "gate" / "up" (full ``[I, H]``) into
        ``w13_weight[expert]``'s first / second half of rows, "down" (full ``[H, I]``) into
        ``w2_weight[expert]``. ValueError with both shapes on a mismatch, or for an unknown part
        or expert."""
        expert, part = shard_id
        if part not in EXPERT_PARTS:
            raise ValueError(f"expert weight part must be one of {EXPERT_PARTS}, got {part!r}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside 0..{self.num_experts - 1}")
        if (part == "down") != (param is self.w2_weight):
            raise ValueError(f"part {part!r} does not load into this parameter")
        local, full, hidden = self.intermediate_per_partition, self.intermediate_size, self.hidden_size
        start = self.tp_rank * local
        if part == "down":
            check_shape(loaded, (hidden, full))
            param.data[expert].copy_(loaded.narrow(1, start, local))
        else:
            check_shape(loaded, (full, hidden))
            param.data[expert].narrow(0, 0 if part == "gate" else local, local).copy_(loaded.narrow(0, start, local))

    def block_m(self, tokens: int, top_k: int) -> Optional[int]:
        """The rows per block that the fused MoE groups ``tokens * top_k`` slots into (for a
        routing that groups them itself), or None where the torch reference runs or the slots
        take the matrix-vector launches, which need no grouping (`triton_fused_moe.uses_gemv`)."""
        if not (self.w13_weight.is_cuda and triton_available()):
            return None
        from arfusion.layers.moe.kernels.triton_fused_moe import block_config, uses_gemv

        if uses_gemv(tokens * top_k, self.num_experts, self.combine):
            return None
        return block_config(tokens * top_k, self.num_experts).block_m

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                blocks: Optional[ExpertBlocks] = None, unformed: bool = False) -> Union[torch.Tensor, UnformedSum]:
        """``blocks``: the slots already grouped by expert in `block_m` rows (or None).
        ``unformed``: on the Triton launches outside batch-invariant mode, the output as a
        `fusion.UnformedSum` of their weighted rows (`triton_fused_moe.fused_moe`), for the norm
        after the layer to form; a tensor everywhere else."""
        if x.is_cuda and triton_available():
            from arfusion.layers.moe.kernels.triton_fused_moe import fused_moe

            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.combine, blocks=blocks,
                             unformed=unformed and not batch_invariant.enabled())
        return moe_experts_torch(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
