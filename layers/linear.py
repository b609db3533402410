"""Tensor-parallel linear layers (the Megatron split, with vLLM's names and semantics).

    ColumnParallelLinear        y_r = x @ W_r^T (+ b_r)      W split by output rows: rank r holds
                                                            rows [r*out/tp, (r+1)*out/tp)
    MergedColumnParallelLinear  several column layers sharing x (gate_up): rank r holds its rows
                                of each part, concatenated part after part
    QKVParallelLinear           q, k, v heads split by rank; with tp > num_kv_heads each KV head
                                is replicated on tp/num_kv_heads ranks
    RowParallelLinear           y = sum_r x_r @ W_r^T (+ b): W split by input columns; the bias
                                is added on rank 0 only, before the sum; with
                                ``reduce_results=False`` the caller receives this rank's partial
                                sum and owes the all-reduce

Every parameter carries ``weight_loader(param, full_tensor, shard_id=None)``: it checks the full
(unsharded) checkpoint tensor's shape, takes this rank's shard and copies it into ``param``
(casting to the parameter's dtype). A shape mismatch raises ValueError with both shapes.
The matmuls are `layers.batch_invariant.linear` (``F.linear`` unless batch-invariant mode is on),
except a row-parallel layer's decode-sized ones that `layers.kernels.triton_skinny_matmul.serves`
(`row_parallel_matmul`), and the q/k/v projection of an input norm left pending
(`layers.pending_norm.PendingNorm`: the norm and the matmul in one launch where it serves).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from arfusion.layers import batch_invariant
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.parallel_state import get_tp_group
from arfusion.layers.pending_norm import AttentionInput, PendingNorm

ShardId = Optional[Union[int, str]]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """ValueError with both shapes unless ``loaded`` has shape ``expected``."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """A replicated parameter: every rank copies the whole tensor (shape checked)."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter takes no shard id, got {shard_id!r}")
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def _new_param(shape: Sequence[int], dtype: Optional[torch.dtype], device: Optional[torch.device], loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r^T + b_r``: this rank's ``output_size / tp`` output features."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.weight = _new_param((self.output_size_per_partition, input_size), dtype, device, self.weight_loader)
        self.bias = _new_param((self.output_size_per_partition,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Rows ``[rank*out/tp, (rank+1)*out/tp)`` of the full ``[out, in]`` weight (or ``[out]`` bias)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        check_shape(loaded, (self.output_size,) + tuple(param.shape[1:]))
        size = self.output_size_per_partition
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel parts stacked on the output dim (gate_proj and up_proj -> gate_up_proj).
    Rank r's weight is ``[part_0 rows of rank r; part_1 rows of rank r; ...]``, so the output
    splits into the parts with ``chunk``. Load each part with ``shard_id`` = its index."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        tp_size = get_tp_group().world_size
        for size in output_sizes:
            divide(size, tp_size, "output size of a merged part (e.g. intermediate_size)")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype, device)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Part ``shard_id`` (full ``[output_sizes[id], in]``): its rank-r rows go to rows
        ``[sum(output_sizes[:id])/tp, ...)`` of this rank's weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged layer shard id must be an int in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        check_shape(loaded, (full,) + tuple(param.shape[1:]))
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


def row_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight^T (+ bias)``, a new tensor: the skinny Triton launch for the decode-sized
    matmuls it serves (outputs no wider than the input, at most 32 rows, CUDA fp16 / bf16) outside
    batch-invariant mode, else `batch_invariant.linear`."""
    if x.is_cuda and not batch_invariant.enabled() and triton_available():
        from arfusion.layers.kernels.triton_skinny_matmul import serves, skinny_linear

        if serves(x, weight):
            flat = x.reshape(-1, x.shape[-1])
            return skinny_linear(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return batch_invariant.linear(x, weight, bias)


def kv_head_range(total_num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(first KV head, count)`` held by ``tp_rank``. With ``tp_size >= total`` each rank holds
    one head, ``tp_rank * total // tp_size`` (replicated on ``tp_size / total`` ranks, which then
    hold exactly the query heads of its group); otherwise ``total / tp_size`` consecutive heads."""
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads, "tensor-parallel size / num_key_value_heads: replicating KV heads needs")
        return tp_rank * total_num_kv_heads // tp_size, 1
    count = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
    return tp_rank * count, count


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one column-parallel matmul: output ``[q | k | v]`` of this
    rank's ``num_heads * head_dim``, ``num_kv_heads * head_dim`` and ``num_kv_heads * head_dim``
    features. Load with ``shard_id`` in ``"q", "k", "v"``."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        group = get_tp_group()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, group.world_size, "num_attention_heads")
        self.kv_head_start, self.num_kv_heads = kv_head_range(total_num_kv_heads, group.rank, group.world_size)
        # output_size = tp * the per-rank size: with replicated KV heads that exceeds the checkpoint's
        # q + k + v rows, so the q/k/v loader below checks each checkpoint tensor's own shape
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * group.world_size, bias, dtype, device)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """q: heads ``[rank*nh/tp, ...)`` of the full ``[total_heads*head_dim, in]`` weight;
        k/v: heads `kv_head_range` of the full ``[total_kv_heads*head_dim, in]`` weight."""
        d = self.head_dim
        if shard_id == "q":
            full, start, offset, size = self.total_num_heads * d, self.tp_rank * self.q_size, 0, self.q_size
        elif shard_id in ("k", "v"):
            full, start, size = self.total_num_kv_heads * d, self.kv_head_start * d, self.kv_size
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded, (full,) + tuple(param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def forward(self, x: AttentionInput) -> torch.Tensor:
        """``x @ W^T (+ b)``; ``x`` may be the layer's input norm left pending (`PendingNorm`),
        which then runs here (`PendingNorm.linear`)."""
        if x.__class__ is PendingNorm:
            return x.linear(self.weight, self.bias)
        return batch_invariant.linear(x, self.weight, self.bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` views of this layer's output."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_r @ W_r^T, + b``: ``x_r`` is this rank's ``input_size / tp``
    input features (a column-parallel output). Rank 0 adds the bias before the reduction, so the
    sum holds it once. ``reduce_results=True`` all-reduces in place (``y`` on every rank);
    ``False`` returns the partial sum, whose all-reduce the caller must perform (the fused
    all-reduce + residual + RMSNorm does)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.weight = _new_param((output_size, self.input_size_per_partition), dtype, device, self.weight_loader)
        self.bias = _new_param((output_size,), dtype, device, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Columns ``[rank*in/tp, (rank+1)*in/tp)`` of the full ``[out, in]`` weight."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard id, got {shard_id!r}")
        check_shape(loaded, (self.output_size, self.input_size))
        size = self.input_size_per_partition
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = row_parallel_matmul(x, self.weight, bias)
        if self.reduce_results:
            get_tp_group().all_reduce(out)
        return out
