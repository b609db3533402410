"""gpt-oss's MoE MLP: a router with a bias choosing top-k on its logits, softmax over the k,
and experts with biases and a clamped SwiGLU, split over the TP ranks; weights in bf16 or kept
in MXFP4 (layers/moe/mxfp4.py).

    logits = h @ W_r^T + b_r                         fp32 [T, E]
    ids    = the top_k largest logits                descending; equal logits: the lower expert first
    w      = softmax(logits[ids])                    over the k chosen only (fp32)

    gate, up = x @ W_gate[e]^T + b_gate[e], x @ W_up[e]^T + b_up[e]
    a        = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g),   g = clamp(gate, max=L)
    y        = a @ W_down[e]^T + b_down[e]
    out[t]   = sum_j w[t, j] * y[t, j]               fp32 products and sum, rounded once

(alpha 1.702, L 7). The checkpoint interleaves gate and up: row 2i of ``gate_up_proj`` is
gate_i, row 2i + 1 up_i (in its out-by-in form). Rank r of tp holds the intermediate features
[r*I/tp, (r+1)*I/tp) of every expert, gate rows then up rows (``w13 [E, 2I_r, H]``, as
`layers.moe.MoEExperts`), and the matching columns of down (``w2 [E, H, I_r]``); gate/up biases
are split the same way, the down bias is added by rank 0 only (a row-parallel bias), so the sum
over ranks of each rank's ``out`` is the full output, which the caller reduces (fused with the
residual add and the next RMSNorm, the combine folded into that reduction's input).

Kept in MXFP4 the experts hold ``w13_blocks [E, 2I_r, H/32, 16]``, ``w13_scales [E, 2I_r,
H/32]``, ``w2_blocks [E, H, I_r/32, 16]``, ``w2_scales [E, H, I_r/32]`` (uint8): 4.25 bits a
weight instead of 16. A scale covers 32 features, so I_r is I/tp rounded up to whole groups of 32
(`rank_share`; gpt-oss at TP4: 2880 / 4 = 720 -> 736): rank r holds features [r*I_r, (r+1)*I_r) of
the checkpoint's I, and the features past I are zeros: zero gate and up rows and biases give
``a = (0 + 1) * 0 * sigmoid(0) = 0``, and zero down columns add nothing, so the sum over the
ranks is unchanged. On a GPU with triton the experts of either form run
layers/moe/kernels/triton_mxfp4_moe.py (MXFP4 dequantized in registers, dots in the
activations' dtype); elsewhere this module's torch code, which dequantizes each MXFP4 expert's
weights as it runs it (the reference).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from arfusion.fusion import UnformedSum
from arfusion.layers import batch_invariant
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.linear import check_shape, divide
from arfusion.layers.moe.align import ExpertBlocks
from arfusion.layers.moe.mxfp4 import (GROUP, KEPT_MAX_SCALE, NAN_SCALE, TENSOR_CORE_MAX_SCALE, dequantize_mxfp4,
                                      scale_problem)
from arfusion.layers.moe.routed_experts import experts_take_pdl, run_routed_experts
from arfusion.layers.moe.router import TopKRouter, router_logits_torch
from arfusion.layers.moe.torch_experts import combine_topk
from arfusion.layers.parallel_state import get_tp_group
from arfusion.layers.pending_norm import MlpInput

# shard ids of the checkpoint's expert tensors, all in their out-by-in form [E, out, in(...)]
EXPERT_TENSORS = ("gate_up", "gate_up_bias", "down", "down_bias", "gate_up_blocks", "gate_up_scales",
                  "down_blocks", "down_scales")


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights fp32 [T, k], ids int32 [T, k])``: the k largest logits (a
    stable descending sort: equal ones in expert order), softmax over them; `GptOssRouter`'s
    reference (its Triton routing equals it up to fp32 rounding: the class docstring)."""
    logits = logits.float()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return torch.softmax(logits.gather(-1, ids), dim=-1), ids.to(torch.int32)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``;
    a new tensor of gate's dtype."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class GptOssRouter(TopKRouter):
    """``forward(h [T, H]) -> (weights fp32 [T, k], ids int32 [T, k])`` (module docstring);
    weight ``[E, H]`` and bias ``[E]`` in the model's dtype, replicated on every rank.

    On a CUDA ``h`` with triton: `TopKRouter`'s one Triton launch with the bias and
    renormalisation (layers/moe/kernels/triton_router.py; its docstring shows that the softmax
    over the k chosen logits is the renormalised top-k of the full softmax, the same ids and
    weights within fp32 rounding). Its dots multiply h and W in the model's dtype (bf16 for the
    checkpoints, as transformers' router's F.linear) with fp32 accumulation: the product of two
    bf16 numbers is exact in fp32, so these are the fp32 logits of the reference up to the order
    of the fp32 sums, with no fp32 copy of W. Elsewhere the reference: fp32 logits
    (`router_logits_torch`, row-invariant in batch-invariant mode), then `route_topk_softmax`.
    transformers rounds its logits to the model's dtype and returns its softmax in it (and its
    ``torch.topk`` states no tie rule); logits and weights stay fp32 here."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device]) -> None:
        super().__init__(hidden_size, num_experts, top_k, renormalize=True, dtype=dtype, device=device, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton(hidden_states):
            return super().forward(hidden_states)
        return route_topk_softmax(router_logits_torch(hidden_states, self.weight, self.bias), self.top_k)


def rank_share(intermediate_size: int, tp_size: int, mxfp4: bool) -> int:
    """Intermediate features of an expert a rank holds (I_r of the module docstring): ``I / tp``;
    kept in MXFP4, rounded up to whole groups of 32 (the last ranks' features past I are zeros).
    ValueError when bf16 features do not divide by tp or MXFP4 ones are not whole groups."""
    if not mxfp4:
        return divide(intermediate_size, tp_size, "expert intermediate size")
    if intermediate_size % GROUP:
        raise ValueError(f"MXFP4 experts need an intermediate size that is a multiple of {GROUP}, got "
                         f"{intermediate_size}")
    return -(-intermediate_size // (GROUP * tp_size)) * GROUP


class GptOssExperts(nn.Module):
    """``forward(x [T, H], weights fp32 [T, k], ids [T, k]) ->`` this rank's partial MoE output
    (a new ``[T, H]``), module docstring. ``mxfp4``: keep the weights in MXFP4; ``tensor_cores``:
    on a GPU, run them on the tensor-core launches at every batch, in batch-invariant mode too
    (`mxfp4_moe_config.tensor_core_config`; MXFP4 only)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 mxfp4: bool, dtype: Optional[torch.dtype], device: Optional[torch.device],
                 tensor_cores: bool = False) -> None:
        super().__init__()
        if tensor_cores and not mxfp4:
            raise ValueError("tensor_cores runs MXFP4 experts only: keep them in MXFP4")
        self.tensor_cores = tensor_cores
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.alpha, self.limit, self.mxfp4 = alpha, limit, mxfp4
        if mxfp4 and hidden_size % GROUP:
            raise ValueError(f"MXFP4 experts need a hidden size that is a multiple of {GROUP}, got {hidden_size}; "
                             "dequantize them at load instead")
        local = self.local = rank_share(intermediate_size, self.tp_size, mxfp4)
        # the checkpoint's features this rank holds; the rest of its share (MXFP4 padding) is zeros
        self.held = max(0, min(local, intermediate_size - self.tp_rank * local))
        e, h = num_experts, hidden_size
        if mxfp4:
            self.w13_blocks = self._param((e, 2 * local, h // GROUP, GROUP // 2), torch.uint8, device)
            self.w13_scales = self._param((e, 2 * local, h // GROUP), torch.uint8, device)
            self.w2_blocks = self._param((e, h, local // GROUP, GROUP // 2), torch.uint8, device)
            self.w2_scales = self._param((e, h, local // GROUP), torch.uint8, device)
        else:
            self.w13_weight = self._param((e, 2 * local, h), dtype, device)
            self.w2_weight = self._param((e, h, local), dtype, device)
        self.w13_bias = self._param((e, 2 * local), dtype, device)
        self.w2_bias = self._param((e, h), dtype, device)

    def _param(self, shape: tuple[int, ...], dtype: Optional[torch.dtype], device: Optional[torch.device]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """This rank's part of a full checkpoint tensor (``shard_id`` in `EXPERT_TENSORS`, each in
        its out-by-in form): gate/up rows de-interleaved (gate_i = row 2i, up_i = row 2i + 1) and
        the rank's intermediate features taken; down's columns (its groups of 32 for blocks and
        scales) taken; down's bias whole. A share padded past the checkpoint's features (MXFP4,
        `rank_share`) gets zeros there. ValueError with both shapes on a mismatch, and for scales
        the kernels would decode wrong (`mxfp4.scale_problem`: NaN bytes, or past the limit of the
        kernels these experts run, the tensor-core one's with ``tensor_cores``)."""
        e, h, full, local, held = self.num_experts, self.hidden_size, self.intermediate_size, self.local, self.held
        start = self.tp_rank * local
        if shard_id not in EXPERT_TENSORS:
            raise ValueError(f"expert tensor must be one of {EXPERT_TENSORS}, got {shard_id!r}")
        if shard_id.endswith("_scales"):
            self._check_scales(loaded)
        if shard_id == "down_bias":
            check_shape(loaded, (e, h))
            param.data.copy_(loaded)
            return
        if held < local:
            param.data.zero_()
        if shard_id.startswith("gate_up"):
            tail = {"gate_up": (h,), "gate_up_bias": (), "gate_up_blocks": (h // GROUP, GROUP // 2),
                    "gate_up_scales": (h // GROUP,)}[shard_id]
            check_shape(loaded, (e, 2 * full) + tail)
            rows = loaded.unflatten(1, (full, 2)).narrow(1, start, held)  # [E, held, 2, ...]
            param.data[:, :held].copy_(rows[:, :, 0])
            param.data[:, local:local + held].copy_(rows[:, :, 1])
        else:
            per = {"down": 1, "down_blocks": GROUP, "down_scales": GROUP}[shard_id]
            tail = {"down": (), "down_blocks": (GROUP // 2,), "down_scales": ()}[shard_id]
            check_shape(loaded, (e, h, full // per) + tail)
            param.data[:, :, :held // per].copy_(loaded.narrow(2, start // per, held // per))

    def _check_scales(self, scales: torch.Tensor) -> None:
        """ValueError when the kernels these experts run would decode ``scales`` wrong
        (`mxfp4.scale_problem`), saying which form can serve them."""
        largest = TENSOR_CORE_MAX_SCALE if self.tensor_cores else KEPT_MAX_SCALE
        problem = scale_problem(scales, largest)
        if problem is None:
            return
        if int(scales.max()) == NAN_SCALE:
            raise ValueError(problem)
        keep = self.tensor_cores and scale_problem(scales, KEPT_MAX_SCALE) is None
        raise ValueError(f"{problem}; " + ("keep the experts in MXFP4 without tensor cores (--mxfp4-experts keep) or "
                                           if keep else "") + "dequantize them at load (--mxfp4-experts dequantize)")

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [2I_r, H], w2 [H, I_r])`` of one expert in ``dtype`` (dequantized when MXFP4)."""
        if self.mxfp4:
            return (dequantize_mxfp4(self.w13_blocks[expert], self.w13_scales[expert], dtype),
                    dequantize_mxfp4(self.w2_blocks[expert], self.w2_scales[expert], dtype))
        return self.w13_weight[expert], self.w2_weight[expert]

    def block_m(self, tokens: int, top_k: int) -> Optional[int]:
        """The rows per block that the Triton launches group ``tokens * top_k`` slots into (for a
        routing that groups them itself), or None where the torch reference runs or the launches
        need no grouping (`triton_mxfp4_moe.grouping_block_m`)."""
        if not (self.w13_bias.is_cuda and triton_available()):
            return None
        from arfusion.layers.moe.kernels.triton_mxfp4_moe import grouping_block_m

        return grouping_block_m(self, tokens * top_k, self.w13_bias.dtype)  # the activations' dtype

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                blocks: Optional[ExpertBlocks] = None, unformed: bool = False) -> Union[torch.Tensor, UnformedSum]:
        """``blocks``: the slots already grouped by expert in `block_m` rows (or None).
        ``unformed``: on the Triton launches outside batch-invariant mode, the output as a
        `fusion.UnformedSum` whose combine the norm after the layer runs in its own launch
        (layers/moe/kernels/triton_topk_combine.py); a tensor elsewhere."""
        if x.is_cuda and triton_available():
            from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

            return gpt_oss_experts_triton(x, self, topk_weights, topk_ids, blocks=blocks,
                                          unformed=unformed and not batch_invariant.enabled())
        return self.forward_torch(x, topk_weights, topk_ids)

    def forward_torch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The reference: one matmul pair per expert that has tokens (reads the per-expert counts
        back to the host), each expert output rounded to x's dtype, then `combine_topk`. In
        batch-invariant mode the matmuls are `batch_invariant.linear` and the combine a fixed
        tree over the k rows: every token's bits are its own on the CPU."""
        tokens, top_k = topk_ids.shape
        if tokens == 0:
            return x.new_empty(0, self.hidden_size)
        flat = topk_ids.flatten().long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y = x.new_empty(tokens * top_k, self.hidden_size)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            slots = order[start:start + count]
            w13, w2 = self.expert_weights(expert, x.dtype)
            gate_up = batch_invariant.linear(x[slots // top_k], w13, self.w13_bias[expert])
            act = clamped_swiglu(gate_up[:, :self.local], gate_up[:, self.local:], self.alpha, self.limit)
            y[slots] = batch_invariant.linear(act, w2, self.w2_bias[expert] if self.tp_rank == 0 else None)
            start += count
        y = y.view(tokens, top_k, -1)
        if batch_invariant.enabled():  # the k rows of a token by a fixed tree: its bits are its own
            return batch_invariant.tree_sum((topk_weights[:, :, None] * y.float()).transpose(1, 2)).to(x.dtype)
        return combine_topk(y, topk_weights)


class GptOssMoeBlock(nn.Module):
    """The MLP of a gpt-oss layer: ``[T, H]`` (reduced, normed; or the norm left pending, which
    the router's Triton launch runs: `TopKRouter.route_normed`) -> this rank's partial output."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, alpha: float,
                 limit: float, mxfp4: bool, dtype: Optional[torch.dtype], device: Optional[torch.device],
                 tensor_cores: bool = False) -> None:
        super().__init__()
        self.router = GptOssRouter(hidden_size, num_experts, top_k, dtype, device)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, alpha, limit, mxfp4, dtype, device,
                                     tensor_cores)

    def forward(self, hidden_states: MlpInput, unformed: bool = False) -> Union[torch.Tensor, UnformedSum]:
        """``unformed``: the output may be left unformed for the norm after the layer (at TP size
        1: `GptOssExperts.forward`)."""
        return run_routed_experts(self.router, self.experts, hidden_states, unformed)

    def takes_pdl(self, tokens: int) -> bool:
        """`routed_experts.experts_take_pdl` of a batch of ``tokens``."""
        return experts_take_pdl(self.router, self.experts, tokens)
